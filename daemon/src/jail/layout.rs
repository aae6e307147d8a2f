//! Where each host path goes in a jail (the same path inside), and the libraries the VMM binary
//! needs there.

use std::collections::BTreeSet;
use std::io;
use std::path::{Component, Path, PathBuf};

use tracing::warn;

/// Where each host path goes in the jail: the directories and mount-point files to create in
/// the tmpfs, and the bind mounts (source, target, remount flags).
#[derive(Debug, Default)]
pub(super) struct JailLayout {
    pub(super) dirs: BTreeSet<PathBuf>,
    pub(super) files: BTreeSet<PathBuf>,
    pub(super) binds: Vec<(PathBuf, PathBuf, libc::c_ulong)>,
}

impl JailLayout {
    pub(super) fn new(root: &Path, mounts: &[(&Path, libc::c_ulong)]) -> io::Result<Self> {
        let mut layout = Self::default();
        let mut targets: Vec<PathBuf> = Vec::new();
        for (host, flags) in mounts {
            let rel = jail_relative(host)?;
            let target = root.join(&rel);
            if targets.contains(&target) {
                continue;
            }
            let source = std::fs::canonicalize(host)
                .map_err(|e| io::Error::new(e.kind(), format!("jail: {}: {e}", host.display())))?;
            let mut parent = target.parent();
            while let Some(p) = parent.filter(|p| *p != root) {
                layout.dirs.insert(p.to_path_buf());
                parent = p.parent();
            }
            if source.is_dir() {
                layout.dirs.insert(target.clone());
            } else {
                layout.files.insert(target.clone());
            }
            layout.binds.push((source, target.clone(), *flags));
            targets.push(target);
        }
        // A mount point inside another bind would be created in the host's directory.
        for a in &targets {
            if let Some(b) = targets.iter().find(|b| *b != a && b.starts_with(a)) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "jail: {} lies inside {}; give the VMM paths that do not nest",
                        b.display(),
                        a.display()
                    ),
                ));
            }
        }
        Ok(layout)
    }
}

/// `host` (absolute, without `.` or `..`) relative to `/`.
fn jail_relative(host: &Path) -> io::Result<PathBuf> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("jail: {} is not a plain absolute path", host.display()),
        )
    };
    let mut rel = PathBuf::new();
    let mut comps = host.components();
    if comps.next() != Some(Component::RootDir) {
        return Err(bad());
    }
    for c in comps {
        match c {
            Component::Normal(n) => rel.push(n),
            _ => return Err(bad()),
        }
    }
    if rel.as_os_str().is_empty() {
        return Err(bad());
    }
    Ok(rel)
}

/// The shared libraries `binary` loads (with the dynamic loader), from `ldd`; none for a static
/// binary.
pub(super) fn shared_libraries(binary: &Path) -> Vec<PathBuf> {
    let out = match std::process::Command::new("ldd").arg(binary).output() {
        Ok(o) if o.status.success() => o,
        Ok(_) => return Vec::new(), // "not a dynamic executable"
        Err(e) => {
            warn!(
                "ldd {}: {e}; the jail holds no shared libraries",
                binary.display()
            );
            return Vec::new();
        }
    };
    parse_ldd(&String::from_utf8_lossy(&out.stdout))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.trim().split(' ').next()?,
                None => l.split(' ').next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ldd_output_gives_the_library_paths() {
        let text = "\tlinux-vdso.so.1 (0x00007ffc)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n\
                    \tlibmissing.so => not found\n";
        assert_eq!(
            parse_ldd(text),
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn paths_in_the_jail_mirror_the_host_and_must_not_nest() {
        let dir = std::env::temp_dir().join(format!("airlock-jail-layout-{}", std::process::id()));
        let run = dir.join("run/vm-1");
        let tpl = dir.join("templates/tpl-1");
        std::fs::create_dir_all(&run).unwrap();
        std::fs::create_dir_all(&tpl).unwrap();
        std::fs::write(dir.join("image.ext4"), b"x").unwrap();
        let root = Path::new("/jail");
        let img = dir.join("image.ext4");
        let layout =
            JailLayout::new(root, &[(&run, 0), (&tpl, libc::MS_RDONLY), (&img, 0)]).unwrap();
        let inside = |p: &Path| root.join(p.strip_prefix("/").unwrap());
        assert!(layout.dirs.contains(&inside(&run)));
        assert!(layout.dirs.contains(&inside(&dir.join("run"))));
        assert!(layout.files.contains(&inside(&img)));
        assert_eq!(layout.binds.len(), 3);
        assert_eq!(layout.binds[1].1, inside(&tpl));
        assert_eq!(layout.binds[1].2, libc::MS_RDONLY);
        let nested = JailLayout::new(root, &[(&dir, 0), (&run, 0)]);
        assert!(nested.is_err(), "a bind inside another bind is refused");
        assert!(jail_relative(Path::new("relative/path")).is_err());
        assert!(jail_relative(Path::new("/a/../etc")).is_err());
        assert!(jail_relative(Path::new("/")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
