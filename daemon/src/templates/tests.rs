//! The registry's names, owners, versions and visibility.

#![allow(clippy::unwrap_used)]
use super::*;

fn registry(tag: &str) -> (Templates, PathBuf) {
    let dir = std::env::temp_dir().join(format!("airlock-tpl-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(Store::open(&dir.join("db")).unwrap());
    (
        Templates::load(store, dir.join("t"), "default").unwrap(),
        dir,
    )
}

fn record(name: &str, tenant: &str, id: &str) -> Template {
    Template {
        name: name.into(),
        tenant: tenant.into(),
        id: id.into(),
        ..Default::default()
    }
}

#[test]
fn tenants_see_their_own_and_the_shared_templates() {
    let (t, dir) = registry("see");
    t.add(record("base", "", "tpl-1"), dir.join("1"), false)
        .unwrap();
    t.add(record("base", "acme", "tpl-2"), dir.join("2"), false)
        .unwrap();
    t.add(record("mine", "other", "tpl-3"), dir.join("3"), false)
        .unwrap();
    assert_eq!(t.find("acme", "base").unwrap().record.id, "tpl-2");
    assert_eq!(t.find("zed", "base").unwrap().record.id, "tpl-1");
    assert!(t.find("acme", "mine").is_err());
    assert_eq!(t.for_tenant("acme").len(), 2);
    assert_eq!(t.owner_for("default"), "");
    assert!(matches!(
        t.check_new("default", "base", false),
        Err(ApiError::TemplateExists(_))
    ));
    assert_eq!(t.check_new("acme", "new", false).unwrap(), "acme");
    assert!(t.check_new("acme", "Bad", false).is_err());
    assert!(t.own("acme", "mine").is_err(), "not acme's");
    let mine = t.own("other", "mine").unwrap();
    assert_eq!(t.remove_id(&mine.record.id).unwrap().record.id, "tpl-3");
    assert!(t.by_id("tpl-3").is_none());
    let _ = std::fs::remove_dir_all(&dir);
}

fn at(mut r: Template, ms: i64) -> Template {
    r.created_unix_ms = ms;
    r
}

#[test]
fn versions_are_named_by_tag_and_a_bare_name_is_latest_or_the_newest() {
    let (t, dir) = registry("tags");
    let add = |r: Template, replace| t.add(r, dir.join("x"), replace);
    add(at(record("py:v1", "acme", "tpl-1"), 1), false).unwrap();
    add(at(record("py:v2", "acme", "tpl-2"), 2), false).unwrap();
    // No `latest`: the bare name is the newest version, and cannot be deleted unnamed.
    assert_eq!(t.find("acme", "py").unwrap().record.id, "tpl-2");
    assert_eq!(t.find("acme", "py:v1").unwrap().record.id, "tpl-1");
    assert_eq!(t.find("acme", "py:v1").unwrap().record.name, "py");
    assert_eq!(reference(&t.find("acme", "py:v1").unwrap().record), "py:v1");
    let err = t.own("acme", "py").unwrap_err().to_string();
    assert!(err.contains("v1, v2") || err.contains("v2, v1"), "{err}");
    assert!(matches!(
        t.find("acme", "py:v3"),
        Err(ApiError::TemplateNotFound(_))
    ));
    assert!(matches!(
        t.check_new("acme", "py:v1", false),
        Err(ApiError::TemplateExists(_))
    ));
    assert!(t.check_new("acme", "py:v1", true).is_ok());
    for bad in ["py:", "py:-x", "py:a/b", "Py:v1", "py:v:1"] {
        assert!(TemplateRef::parse(bad).is_err(), "{bad}");
    }
    // An untagged one is `latest`, and the bare name's from then on.
    add(at(record("py", "acme", "tpl-3"), 0), false).unwrap();
    assert_eq!(t.find("acme", "py").unwrap().record.id, "tpl-3");
    assert_eq!(t.find("acme", "py:latest").unwrap().record.id, "tpl-3");
    assert_eq!(t.own("acme", "py").unwrap().record.id, "tpl-3");
    assert_eq!(reference(&t.find("acme", "py").unwrap().record), "py");
    // Replacing moves the tag; the old version keeps its id as its tag.
    assert!(matches!(
        add(at(record("py:v1", "acme", "tpl-4"), 4), false),
        Err(ApiError::TemplateExists(_))
    ));
    add(at(record("py:v1", "acme", "tpl-4"), 4), true).unwrap();
    assert_eq!(t.find("acme", "py:v1").unwrap().record.id, "tpl-4");
    assert_eq!(t.find("acme", "py:tpl-1").unwrap().record.id, "tpl-1");
    // The store has the same after a reload.
    let again = Templates::load(t.store.clone(), dir.join("t"), "default").unwrap();
    assert_eq!(again.find("acme", "py:tpl-1").unwrap().record.id, "tpl-1");
    assert_eq!(again.find("acme", "py:v1").unwrap().record.id, "tpl-4");
    // Another tenant's versions are not seen; shared ones are, after one's own.
    assert!(t.find("zed", "py").is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_template_of_another_snapshot_format_or_agent_protocol_is_outdated() {
    let rt = |format, protocol| TemplateRt {
        record: Template {
            snapshot_format: format,
            agent_protocol: protocol,
            ..record("old", "", "tpl-1")
        },
        dir: PathBuf::from("/nonexistent"),
    };
    assert!(
        rt(STATE_VERSION, airlock_proto::PROTOCOL_VERSION)
            .check_restorable()
            .is_ok()
    );
    assert!(rt(STATE_VERSION, 0).check_restorable().is_ok());
    assert!(
        rt(0, 0).check_restorable().is_ok(),
        "unknown: the VMM decides"
    );
    for (f, p) in [
        (STATE_VERSION - 1, 0),
        (STATE_VERSION + 1, 0),
        (STATE_VERSION, 99),
    ] {
        let err = rt(f, p).check_restorable().unwrap_err();
        assert_eq!(err.reason(), "TEMPLATE_OUTDATED");
        assert!(
            err.to_string().contains("airlock template rebuild old"),
            "{err}"
        );
    }
}

/// Exports `t` as an exporter (the system tests' harness) does.
fn export(t: &TemplateRt, to: &Path) {
    use prost::Message as _;
    import::import(&t.dir, to).unwrap();
    std::fs::write(to.join(EXPORT_RECORD), t.record.encode_to_vec()).unwrap();
}

#[test]
fn an_exported_template_is_imported_once_with_new_files_and_only_on_its_own_files() {
    let (t, dir) = registry("export");
    std::fs::create_dir_all(dir.join("t")).unwrap();
    let (kernel, rootfs) = (dir.join("vmlinux"), dir.join("base.ext4"));
    std::fs::write(&kernel, b"kernel").unwrap();
    std::fs::write(&rootfs, b"rootfs").unwrap();
    let snap = dir.join("snap");
    std::fs::create_dir_all(&snap).unwrap();
    for (name, data) in [("state", &b"state"[..]), ("memory", &b"memory"[..])] {
        std::fs::write(snap.join(name), data).unwrap();
    }
    let built = TemplateRt {
        record: Template {
            kernel_path: kernel.display().to_string(),
            kernel_version: file_version(&kernel),
            rootfs_path: rootfs.display().to_string(),
            rootfs_version: file_version(&rootfs),
            vcpus: 1,
            memory_mib: 256,
            ..record("base", "", "tpl-old")
        },
        dir: snap,
    };
    let exported = dir.join("exported");
    export(&built, &exported);
    let got = t.import_exported(&exported).unwrap().expect("imported");
    assert_ne!(got.record.id, "tpl-old");
    assert_eq!((got.record.vcpus, got.record.memory_mib), (1, 256));
    assert_eq!(std::fs::read(got.dir.join("memory")).unwrap(), b"memory");
    assert_eq!(t.find("acme", "base").unwrap().record.id, got.record.id);
    // Its name is taken now: nothing more.
    assert!(t.import_exported(&exported).unwrap().is_none());
    // Another base image under the same path: refused.
    let (t2, dir2) = registry("export-2");
    std::fs::create_dir_all(dir2.join("t")).unwrap();
    std::fs::write(&rootfs, b"another rootfs").unwrap();
    let err = t2.import_exported(&exported).unwrap_err();
    assert!(
        matches!(
            err,
            ImportError::Stale {
                what: "base image",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("base image"), "{err}");
    assert!(t2.list().is_empty());
    assert!(t2.import_exported(&dir.join("missing")).is_err());
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

/// A failed build says why: the VMM's error line leads the log's end, which is the guest's
/// console after it.
#[test]
fn a_failed_build_shows_the_vmms_error_before_the_console() {
    let dir = std::env::temp_dir().join(format!("airlock-tpl-tail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("vmm.log");
    std::fs::write(
        &log,
        "[1.000000 INFO  airlock-vmm] agent ready\n\
         [2.000000 ERROR airlock-vmm] snapshot failed: warm-up failed after 780 ms\n\
         [2.100000 INFO  airlock-vmm] vm ended: stopped by the host (exit code 0)\n\
         --- guest console (last 47 bytes) ---\nairlock: userspace up\nairlock: cpus online 0\n",
    )
    .unwrap();
    let tail = super::build::failure_tail(&log);
    assert!(
        tail.starts_with("[2.000000 ERROR airlock-vmm] snapshot failed: warm-up failed"),
        "{tail}"
    );
    assert!(tail.ends_with("airlock: cpus online 0"), "{tail}");
    // An error line already in the end is not repeated.
    std::fs::write(&log, "[2.0 ERROR airlock-vmm] boot failed\n").unwrap();
    assert_eq!(
        super::build::failure_tail(&log),
        "[2.0 ERROR airlock-vmm] boot failed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
