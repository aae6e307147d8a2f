use std::os::unix::fs::{MetadataExt, PermissionsExt};

use super::*;

const LIMITS: Limits = Limits {
    max_unpacked_bytes: 64 << 20,
    max_entries: 10_000,
};

/// One entry of a test layer.
enum E<'a> {
    File(&'a str, &'a [u8], u32),
    Dir(&'a str),
    Link(&'a str, &'a str),
    Hard(&'a str, &'a str),
    Dev(&'a str),
}

/// A tar whose names are written byte for byte (the tar crate's own builder refuses `..`).
fn layer(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_old();
        let (name, ty, data, mode, link): (&str, _, &[u8], u32, Option<&str>) = match e {
            E::File(n, d, m) => (n, tar::EntryType::Regular, d, *m, None),
            E::Dir(n) => (n, tar::EntryType::Directory, b"", 0o755, None),
            E::Link(n, t) => (n, tar::EntryType::Symlink, b"", 0o777, Some(t)),
            E::Hard(n, t) => (n, tar::EntryType::Link, b"", 0o644, Some(t)),
            E::Dev(n) => (n, tar::EntryType::Char, b"", 0o600, None),
        };
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        if let Some(t) = link {
            h.as_old_mut().linkname[..t.len()].copy_from_slice(t.as_bytes());
        }
        h.set_entry_type(ty);
        h.set_mode(mode);
        h.set_uid(if name.contains("owned") { 1234 } else { 0 });
        h.set_gid(0);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        h.set_cksum();
        b.append(&h, data).unwrap();
    }
    b.into_inner().unwrap()
}

fn scratch(tag: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("airlock-tree-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tree(dir: &Path) -> Tree {
    Tree::new(&dir.join("spool"), LIMITS).unwrap()
}

fn refused(entries: &[E]) -> String {
    let d = scratch("refused");
    let mut t = tree(&d);
    let e = match t.apply_layer("sha256:bad", layer(entries).as_slice()) {
        Ok(()) => format!("accepted: {:?}", t.root),
        Err(e) => e.to_string(),
    };
    let _ = std::fs::remove_dir_all(&d);
    e
}

#[test]
fn layers_apply_in_order_with_whiteouts_and_opaque_directories() {
    let d = scratch("order");
    let mut t = tree(&d);
    let lower = layer(&[
        E::Dir("etc/"),
        E::File("etc/a", b"a", 0o644),
        E::File("etc/b", b"b", 0o644),
        E::File("opt/x/1", b"1", 0o644),
        E::File("opt/x/sub/2", b"2", 0o644),
    ]);
    t.apply_layer("sha256:lower", lower.as_slice()).unwrap();
    // The opaque marker comes after an entry of its own layer in the directory: that entry
    // stays, everything from below goes (in subdirectories too).
    let upper = layer(&[
        E::File("etc/.wh.a", b"", 0o644),
        E::File("opt/x/new", b"n", 0o644),
        E::File("opt/x/sub/3", b"3", 0o644),
        E::File("opt/x/.wh..wh..opq", b"", 0o644),
        E::File("etc/b", b"bb", 0o600),
    ]);
    t.apply_layer("sha256:upper", upper.as_slice()).unwrap();
    let root = d.join("root");
    std::fs::create_dir(&root).unwrap();
    t.write_to(&root).unwrap();
    assert!(
        !root.join("etc/a").exists(),
        "a whiteout removes the lower file"
    );
    assert_eq!(std::fs::read(root.join("etc/b")).unwrap(), b"bb");
    let b = std::fs::metadata(root.join("etc/b")).unwrap();
    assert_eq!(b.permissions().mode() & 0o7777, 0o600);
    assert!(root.join("opt/x/new").exists());
    assert!(root.join("opt/x/sub/3").exists());
    assert!(
        !root.join("opt/x/1").exists(),
        "the opaque directory hides lower files"
    );
    assert!(
        !root.join("opt/x/sub/2").exists(),
        "and lower files in its subdirectories"
    );
    assert!(!root.join("opt/x/.wh..wh..opq").exists() && !root.join("etc/.wh.a").exists());
    assert_eq!(std::fs::read_dir(d.join("spool")).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn hostile_names_and_links_are_refused_naming_layer_and_entry() {
    for (entries, entry, why) in [
        (
            vec![E::File("../escape", b"x", 0o644)],
            "../escape",
            "path traversal",
        ),
        (
            vec![E::File("a/../../b", b"x", 0o644)],
            "a/../../b",
            "path traversal",
        ),
        (
            vec![E::File("/etc/evil", b"x", 0o644)],
            "/etc/evil",
            "absolute",
        ),
        (
            vec![E::Link("usr/lib/x", "../../../..")],
            "usr/lib/x",
            "out of the image",
        ),
        (
            vec![E::Link("evil", "/etc"), E::File("evil/passwd", b"x", 0o644)],
            "evil/passwd",
            "symlink earlier",
        ),
        (vec![E::Hard("h", "/etc/shadow")], "h", "absolute"),
        (vec![E::Hard("h", "../outside")], "h", "path traversal"),
        (vec![E::Hard("h", "etc/missing")], "h", "not a regular file"),
        (
            vec![E::Link("l", "/etc/shadow"), E::Hard("h", "l")],
            "h",
            "not a regular file",
        ),
        (vec![E::Dev("dev/sda")], "dev/sda", "device node"),
        (
            vec![E::File(".airlock/agent", b"x", 0o755)],
            ".airlock/agent",
            "reserved",
        ),
        (
            vec![E::File(".airlock", b"x", 0o755)],
            ".airlock",
            "reserved",
        ),
    ] {
        let e = refused(&entries);
        assert!(e.contains("sha256:bad"), "{e}");
        assert!(e.contains(&format!("{entry:?}")), "{entry}: {e}");
        assert!(e.contains(why), "{entry}: {e}");
    }
}

#[test]
fn a_decompression_bomb_stops_at_the_cap() {
    let d = scratch("bomb");
    let mut t = Tree::new(
        &d.join("spool"),
        Limits {
            max_unpacked_bytes: 1 << 20,
            max_entries: 100,
        },
    )
    .unwrap();
    let big = vec![0u8; 2 << 20];
    let gz = {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut e, &layer(&[E::File("zeros", &big, 0o644)])).unwrap();
        e.finish().unwrap()
    };
    assert!(gz.len() < 64 << 10, "the bomb is small: {}", gz.len());
    let e = t
        .apply_layer("sha256:bomb", flate2::read::GzDecoder::new(gz.as_slice()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sha256:bomb") && e.contains("cap"), "{e}");
    let mut t = Tree::new(
        &d.join("spool2"),
        Limits {
            max_unpacked_bytes: 1 << 30,
            max_entries: 100,
        },
    )
    .unwrap();
    let many: Vec<E> = (0..200).map(|_| E::Dir("d/")).collect();
    let e = t
        .apply_layer("sha256:many", layer(&many).as_slice())
        .unwrap_err()
        .to_string();
    assert!(e.contains("more than 100 entries"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_written_tree_keeps_owners_modes_links_and_never_follows_a_symlink() {
    let d = scratch("write");
    let host_file = d.join("host-file");
    std::fs::write(&host_file, b"host").unwrap();
    let mut t = tree(&d);
    let host = host_file
        .to_str()
        .unwrap()
        .trim_start_matches('/')
        .to_string();
    let l = layer(&[
        E::File("bin/busybox", b"#!", 0o755),
        E::Link("bin/sh", "busybox"),
        E::File("usr/bin/owned-setuid", b"s", 0o4755),
        E::Hard("usr/bin/again", "usr/bin/owned-setuid"),
        E::Link("host", &format!("/{host}")),
        E::Link("sbin", "bin"),
    ]);
    t.apply_layer("sha256:one", l.as_slice()).unwrap();
    assert!(t.is_executable("/bin/sh"), "follows the tree's own symlink");
    assert!(t.is_executable("/sbin/sh"), "and a symlinked directory");
    assert!(!t.is_executable("/host"));
    let root = d.join("root");
    std::fs::create_dir(&root).unwrap();
    t.write_to(&root).unwrap();
    let s = std::fs::metadata(root.join("usr/bin/owned-setuid")).unwrap();
    assert_eq!(s.mode() & 0o7777, 0o4755, "setuid kept, after chown");
    assert_eq!(s.uid(), 1234);
    let again = std::fs::metadata(root.join("usr/bin/again")).unwrap();
    assert_eq!(
        (again.ino(), again.nlink()),
        (s.ino(), 2),
        "a hard link, no spool link left"
    );
    let link = std::fs::symlink_metadata(root.join("host")).unwrap();
    assert!(link.file_type().is_symlink());
    assert_eq!(std::fs::read(&host_file).unwrap(), b"host");
    assert_eq!(
        std::fs::read_link(root.join("bin/sh")).unwrap(),
        Path::new("busybox")
    );
    let _ = std::fs::remove_dir_all(&d);
}
