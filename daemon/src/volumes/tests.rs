#![allow(clippy::unwrap_used)]

use super::*;

fn volumes(tag: &str) -> (Arc<Volumes>, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "airlock-volumes-{tag}-{}-{}",
        std::process::id(),
        ids::now_ms()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let store = Arc::new(Store::open(&dir.join("db")).unwrap());
    let v = Volumes::load(dir.join("volumes"), store, None, 4, 1024).unwrap();
    (Arc::new(v), dir)
}

fn attach(name: &str, path: &str, read_only: bool) -> VolumeAttachment {
    VolumeAttachment {
        name: name.into(),
        mount_path: path.into(),
        read_only,
    }
}

#[tokio::test]
async fn a_volume_is_a_formatted_sparse_file_of_its_tenant_kept_in_the_store() {
    let (v, dir) = volumes("create");
    let q = Quota::default();
    let made = v.create("acme", &q, "work", 64).await.unwrap();
    assert_eq!((made.name.as_str(), made.size_mib), ("work", 64));
    let file = v.file(&v.find("acme", "work").unwrap().id);
    let meta = std::fs::metadata(&file).unwrap();
    assert_eq!(meta.len(), 64 << 20);
    assert!(
        made.used_bytes < 16 << 20,
        "sparse: {} bytes",
        made.used_bytes
    );
    let magic = {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 2];
        std::fs::File::open(&file)
            .unwrap()
            .read_exact_at(&mut b, 1080)
            .unwrap();
        b
    };
    assert_eq!(magic, [0x53, 0xef], "an ext4 superblock");
    // Names are per tenant; another tenant sees nothing of it.
    assert!(matches!(
        v.create("acme", &q, "work", 64).await,
        Err(ApiError::VolumeExists(_))
    ));
    assert!(v.create("other", &q, "work", 32).await.is_ok());
    assert_eq!(v.list("acme").len(), 1);
    assert!(v.delete("nobody", "work").is_ok_and(|d| !d));
    // A reload from the store finds them again.
    let again = Volumes::load(dir.join("volumes"), v.store.clone(), None, 4, 1024).unwrap();
    assert_eq!(again.list("acme")[0].name, "work");
    assert!(v.delete("acme", "work").unwrap());
    assert!(!file.exists(), "deleting frees the space");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn names_sizes_and_the_tenants_quota_are_checked_before_anything_is_made() {
    let (v, dir) = volumes("checks");
    let q = Quota {
        max_volumes: 2,
        max_volume_mib: 100,
        ..Quota::default()
    };
    for bad in ["", "Work", "-x", "a/b", "..", &"x".repeat(64)] {
        assert!(
            matches!(
                v.create("t", &q, bad, 16).await,
                Err(ApiError::InvalidArgument(_))
            ),
            "{bad:?}"
        );
    }
    for size in [0, 15, 1025] {
        assert!(matches!(
            v.create("t", &q, "a", size).await,
            Err(ApiError::InvalidArgument(_))
        ));
    }
    v.create("t", &q, "a", 64).await.unwrap();
    let over = v.create("t", &q, "b", 40).await.unwrap_err();
    assert!(
        matches!(
            over,
            ApiError::Quota {
                what: "volume_mib",
                ..
            }
        ),
        "{over:?}"
    );
    v.create("t", &q, "b", 36).await.unwrap();
    let count = v.create("t", &q, "c", 16).await.unwrap_err();
    assert!(
        matches!(
            count,
            ApiError::Quota {
                what: "volumes",
                ..
            }
        ),
        "{count:?}"
    );
    assert_eq!(std::fs::read_dir(dir.join("volumes")).unwrap().count(), 2);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn one_writer_or_many_readers_and_a_mounted_volume_is_not_deleted() {
    let (v, dir) = volumes("claims");
    let q = Quota::default();
    v.create("t", &q, "data", 32).await.unwrap();
    // A writer: nobody else.
    let w = v
        .claim("t", "sb-a", &[attach("data", "/data", false)])
        .unwrap();
    assert_eq!(w.media.len(), 1);
    let w = w.keep();
    assert!(!w[0].1, "read-write");
    for (who, ro) in [("sb-b", true), ("sb-b", false)] {
        let e = v
            .claim("t", who, &[attach("data", "/data", ro)])
            .unwrap_err();
        assert!(
            matches!(e, ApiError::VolumeInUse { ref by, .. } if by == "sb-a"),
            "{e:?}"
        );
    }
    assert_eq!(v.list("t")[0].attached_to, ["sb-a"]);
    assert!(matches!(
        v.delete("t", "data"),
        Err(ApiError::VolumeInUse { .. })
    ));
    v.release("sb-a");
    // Readers: many, and no writer meanwhile.
    let r1 = v
        .claim("t", "sb-c", &[attach("data", "/d", true)])
        .unwrap()
        .keep();
    let _r2 = v
        .claim("t", "sb-d", &[attach("data", "/d", true)])
        .unwrap()
        .keep();
    assert!(r1[0].1, "read-only");
    assert!(matches!(
        v.claim("t", "sb-e", &[attach("data", "/d", false)]),
        Err(ApiError::VolumeInUse { .. })
    ));
    v.release("sb-c");
    v.release("sb-d");
    // A claim dropped before it was kept (a create that failed) frees the volume.
    drop(
        v.claim("t", "sb-f", &[attach("data", "/d", false)])
            .unwrap(),
    );
    assert!(v.list("t")[0].attached_to.is_empty());
    // Another tenant's name is not found; an unknown name neither.
    assert!(matches!(
        v.claim("u", "sb-g", &[attach("data", "/d", false)]),
        Err(ApiError::VolumeNotFound(_))
    ));
    assert!(v.delete("t", "data").unwrap());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn attachments_name_distinct_volumes_at_distinct_normal_paths_within_the_slots() {
    let (v, dir) = volumes("attach");
    assert!(v.check_attachments(&[attach("a", "/data", false)]).is_ok());
    for bad in [
        vec![attach("a", "/", false)],
        vec![attach("a", "data", false)],
        vec![attach("a", "/proc/x", false)],
        vec![attach("a", "/data/../etc", false)],
        vec![attach("a", "/data/./x", false)],
        vec![attach("a", "/data/", false)],
        vec![attach("a", "//data", false)],
        vec![attach("a", "/x", false), attach("a", "/y", false)],
        vec![attach("a", "/x", false), attach("b", "/x", false)],
        (0..5)
            .map(|i| attach(&format!("v{i}"), &format!("/m{i}"), true))
            .collect(),
    ] {
        assert!(v.check_attachments(&bad).is_err(), "{bad:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn concurrent_creates_cannot_both_pass_the_quota() {
    // Each create checks the quota, then formats for a while: the check and the
    // reservation are one step, so a quota of 2 lets exactly 2 of 6 racing creates through.
    let (v, dir) = volumes("race");
    let q = Quota {
        max_volumes: 2,
        max_volume_mib: 1024,
        ..Quota::default()
    };
    let names = ["r0", "r1", "r2", "r3", "r4", "r5"];
    let creates = names.iter().map(|n| v.create("t", &q, n, 16));
    let results = futures_util::future::join_all(creates).await;
    let made = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(made, 2, "{results:?}");
    assert!(results.iter().all(|r| match r {
        Ok(_) => true,
        Err(e) => matches!(
            e,
            ApiError::Quota {
                what: "volumes",
                ..
            }
        ),
    }));
    assert_eq!(v.list("t").len(), 2);
    assert_eq!(std::fs::read_dir(dir.join("volumes")).unwrap().count(), 2);
    // The MiB quota is reserved the same way; a failed create gives its reservation back.
    let q = Quota {
        max_volumes: 10,
        max_volume_mib: 64,
        ..Quota::default()
    };
    let creates = ["m0", "m1", "m2"].map(|n| v.create("u", &q, n, 32));
    let made = futures_util::future::join_all(creates).await;
    assert_eq!(made.iter().filter(|r| r.is_ok()).count(), 2, "{made:?}");
    let _ = std::fs::remove_dir_all(dir);
}
