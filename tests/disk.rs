//! System tests of writable roots through airlockd, in real VMs: every sandbox's root is a
//! copy-on-write disk over the read-only base image (the VMM's overlay in its run directory,
//! bounded by the sandbox's `disk_mib`), so programs write wherever root may on a normal
//! Linux box; nothing one sandbox writes is seen by another; a full layer gives programs ENOSPC
//! and WriteFile DISK_QUOTA_EXCEEDED while the host file stays within the quota; a snapshot of
//! a sandbox keeps what it wrote, and each clone of it writes into its own overlay.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::PathBuf;

use airlock_api::v1::{
    CreateSandboxRequest, CreateVolumeRequest, DeleteTemplateRequest, DeleteVolumeRequest,
    DestroySandboxRequest, FilePolicy, ListFilesRequest, ListVolumesRequest, MakeDirRequest,
    ReadFileRequest, RemoveFileRequest, RenameFileRequest, Sandbox, SnapshotSandboxRequest,
    StatFileRequest, VolumeAttachment, WriteFileHeader, WriteFileRequest, write_file_request,
};
use airlock_system_tests::harness::{Client, reason, run_as};
use airlock_system_tests::shared::{Shared, scenario};

const TENANT_TOKEN: &str = "token-of-acme";
const CONFIG: &str = "pool_size = 1\n[tenants.acme]\ntokens = [\"token-of-acme\"]\n";

/// The shared daemon, with what an earlier (failed) scenario left destroyed: the overlay
/// checks count every VMM's overlay on the host.
async fn clean_scenario() -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    let (serial, s) = scenario(CONFIG).await;
    s.clean(&[TENANT_TOKEN]).await;
    (serial, s)
}

async fn create(c: &mut Client, s: &Shared, req: CreateSandboxRequest) -> Sandbox {
    c.create_sandbox(req)
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner()
}

async fn destroy(c: &mut Client, id: &str) {
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap();
}

/// Runs a shell script in the sandbox as `user`; its stdout, with the exit code checked.
async fn sh(c: &mut Client, s: &Shared, id: &str, user: &str, script: &str) -> String {
    let (out, err, rec) = run_as(c, id, user, &["sh", "-c", script]).await;
    assert_eq!(
        rec.exit_code,
        0,
        "{script}\nstdout: {out}\nstderr: {err}\n{}",
        s.log_tail()
    );
    out
}

/// Every VMM overlay file under the daemon's run directory, with its size.
fn overlays(s: &Shared) -> Vec<(PathBuf, u64)> {
    let run = s.data_dir.join("run");
    let mut out = Vec::new();
    for vm in std::fs::read_dir(&run).into_iter().flatten().flatten() {
        let f = vm.path().join("root.overlay");
        if let Ok(m) = std::fs::metadata(&f) {
            out.push((f, m.len()));
        }
    }
    out
}

fn write_request(id: &str, path: &str, data: Vec<u8>) -> Vec<WriteFileRequest> {
    write_as(id, path, "", data)
}

fn write_as(id: &str, path: &str, user: &str, data: Vec<u8>) -> Vec<WriteFileRequest> {
    vec![
        WriteFileRequest {
            part: Some(write_file_request::Part::Header(WriteFileHeader {
                sandbox_id: id.into(),
                path: path.into(),
                user: user.into(),
                ..Default::default()
            })),
        },
        WriteFileRequest {
            part: Some(write_file_request::Part::Data(data)),
        },
    ]
}

/// Writes in one sandbox (as root: under /usr/local, /etc, /root; as `user`: its home and
/// /tmp), then looks for each in both.
const WRITE: &str = "set -e
mkdir -p /usr/local/lib/airlock-test
echo lib > /usr/local/lib/airlock-test/x
echo etc > /etc/airlock-test
echo root > /root/airlock-test
echo hello > /usr/local/airlock-test
sync
";
const WRITE_AS_USER: &str = "set -e
echo home > $HOME/airlock-test
echo tmp > /tmp/airlock-test
cat /usr/local/airlock-test
";
const LOOK: &str = "for f in /usr/local/lib/airlock-test/x /etc/airlock-test /root/airlock-test \
    /home/user/airlock-test /tmp/airlock-test; do
  if [ -e $f ]; then echo \"$f $(cat $f)\"; else echo \"$f -\"; fi
done";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_writes_wherever_root_may_and_no_other_sandbox_sees_it() {
    let (_serial, s) = clean_scenario().await;
    let mut c = s.client(None).await;
    let a = create(&mut c, s, CreateSandboxRequest::default()).await;
    let b = create(&mut c, s, CreateSandboxRequest::default()).await;
    sh(&mut c, s, &a.id, "root", WRITE).await;
    assert_eq!(sh(&mut c, s, &a.id, "", WRITE_AS_USER).await, "hello\n");
    let seen_a = sh(&mut c, s, &a.id, "root", LOOK).await;
    assert_eq!(
        seen_a,
        "/usr/local/lib/airlock-test/x lib\n/etc/airlock-test etc\n/root/airlock-test root\n\
         /home/user/airlock-test home\n/tmp/airlock-test tmp\n"
    );
    let seen_b = sh(&mut c, s, &b.id, "root", LOOK).await;
    assert_eq!(
        seen_b,
        "/usr/local/lib/airlock-test/x -\n/etc/airlock-test -\n/root/airlock-test -\n\
         /home/user/airlock-test -\n/tmp/airlock-test -\n",
        "another sandbox of the template sees none of it"
    );
    // The writes went into a's overlay on the host (synced out of its page cache above), not
    // into the base image.
    let mine: Vec<_> = overlays(s)
        .into_iter()
        .filter(|(_, len)| *len > 0)
        .collect();
    assert!(!mine.is_empty(), "no overlay holds a's writes");
    for id in [&a.id, &b.id] {
        destroy(&mut c, id).await;
    }
    // Destroyed sandboxes leave no overlay: what is left is the warm pool's (empty: restored
    // by nobody yet).
    let left = overlays(s);
    assert!(left.len() <= 1, "{left:?}");
    assert!(left.iter().all(|(_, len)| *len == 0), "{left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_layer_gives_enospc_and_disk_quota_exceeded_within_the_quota_on_the_host() {
    let (_serial, s) = clean_scenario().await;
    let mut c = s.client(None).await;
    // Small: every byte the guest kernel copies is emulated on the nested build machines
    // (well under 1 MiB/s), and filling 64 MiB came close to the execution's 300 s timeout.
    let quota_mib = 16u64;
    let a = create(
        &mut c,
        s,
        CreateSandboxRequest {
            disk_mib: quota_mib as u32,
            ..Default::default()
        },
    )
    .await;
    // Space left for the sandbox, then a file written until the disk is full.
    let script = "df -k --output=avail / | tail -n1
dd if=/dev/zero of=$HOME/fill bs=1M count=200 2>&1 | grep -o 'No space left on device' | head -n1
sync
ls -s --block-size=1M $HOME/fill | cut -d' ' -f1";
    let out = sh(&mut c, s, &a.id, "", script).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    let avail_kib: u64 = lines[0].trim().parse().unwrap();
    assert!(
        avail_kib <= quota_mib << 10 && avail_kib > (quota_mib << 10) / 2,
        "available at start: {avail_kib} KiB for a {quota_mib} MiB sandbox"
    );
    assert_eq!(lines[1], "No space left on device", "{out}");
    let written: u64 = lines[2].trim().parse().unwrap();
    assert!(
        written > quota_mib / 2 && written <= quota_mib,
        "{written} MiB written"
    );
    // WriteFile into a full sandbox: DISK_QUOTA_EXCEEDED.
    let err = c
        .write_file(tokio_stream::iter(write_request(
            &a.id,
            "/tmp/more",
            vec![1u8; 1 << 20],
        )))
        .await
        .expect_err("a write into a full disk");
    assert_eq!(reason(&err).0, "DISK_QUOTA_EXCEEDED", "{err:?}");
    // The host file never grew past the quota.
    let biggest = overlays(s).into_iter().map(|(_, l)| l).max().unwrap();
    assert!(
        biggest <= quota_mib << 20,
        "the overlay holds {biggest} bytes, over the {quota_mib} MiB quota"
    );
    // Freed space can be written again.
    sh(
        &mut c,
        s,
        &a.id,
        "",
        "rm $HOME/fill && echo again > $HOME/x && sync",
    )
    .await;
    destroy(&mut c, &a.id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_keeps_the_written_root_and_each_clone_writes_its_own() {
    let (_serial, s) = clean_scenario().await;
    let mut c = s.client(None).await;
    let a = create(&mut c, s, CreateSandboxRequest::default()).await;
    sh(
        &mut c,
        s,
        &a.id,
        "root",
        "mkdir -p /opt/app && echo v1 > /opt/app/version && echo data > /opt/app/data",
    )
    .await;
    let snap = c
        .snapshot_sandbox(SnapshotSandboxRequest {
            sandbox_id: a.id.clone(),
            template_name: "with-root".into(),
            shared: false,
        })
        .await
        .unwrap_or_else(|e| panic!("snapshot: {e:?}\n{}", s.log_tail()))
        .into_inner();
    // The source goes on writing after its snapshot: no clone sees that.
    sh(&mut c, s, &a.id, "root", "echo after > /opt/app/after").await;
    let from = |t: &str| CreateSandboxRequest {
        template: t.into(),
        ..Default::default()
    };
    let c1 = create(&mut c, s, from("with-root")).await;
    let c2 = create(&mut c, s, from("with-root")).await;
    assert_eq!(c1.template_id, snap.id);
    let look = "cat /opt/app/version /opt/app/data; ls /opt/app";
    assert_eq!(
        sh(&mut c, s, &c1.id, "root", look).await,
        "v1\ndata\ndata\nversion\n"
    );
    sh(
        &mut c,
        s,
        &c1.id,
        "root",
        "echo v2 > /opt/app/version && echo c1 > /opt/app/c1",
    )
    .await;
    assert_eq!(
        sh(&mut c, s, &c2.id, "root", look).await,
        "v1\ndata\ndata\nversion\n",
        "a clone's writes stay its own"
    );
    assert_eq!(
        sh(&mut c, s, &a.id, "root", look).await,
        "v1\ndata\nafter\ndata\nversion\n",
        "nor does the source see them"
    );
    for id in [&c1.id, &c2.id, &a.id] {
        destroy(&mut c, id).await;
    }
    c.delete_template(DeleteTemplateRequest {
        name: "with-root".into(),
    })
    .await
    .unwrap();
}

fn mount(name: &str, path: &str, read_only: bool) -> CreateSandboxRequest {
    CreateSandboxRequest {
        volumes: vec![VolumeAttachment {
            name: name.into(),
            mount_path: path.into(),
            read_only,
        }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_outlives_its_sandbox_with_one_writer_or_many_readers() {
    let (_serial, s) = clean_scenario().await;
    let mut c = s.client(None).await;
    let v = c
        .create_volume(CreateVolumeRequest {
            name: "work".into(),
            size_mib: 64,
        })
        .await
        .unwrap_or_else(|e| panic!("create volume: {e:?}\n{}", s.log_tail()))
        .into_inner();
    assert_eq!((v.name.as_str(), v.size_mib), ("work", 64));
    // Written by the guest's user in one sandbox...
    let a = create(&mut c, s, mount("work", "/data", false)).await;
    assert_eq!(a.volumes.len(), 1);
    let out = sh(
        &mut c,
        s,
        &a.id,
        "",
        "echo kept > /data/notes && cat /data/notes && stat -c %U /data && \
         df -k --output=size /data | tail -n1",
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["kept", "user"], "{out}");
    let size_kib: u64 = lines[2].trim().parse().unwrap();
    assert!(
        size_kib > 40 << 10 && size_kib <= 64 << 10,
        "{size_kib} KiB"
    );
    // ... and while it has it read-write, nobody else mounts it, and it is not deleted.
    let listed = c
        .list_volumes(ListVolumesRequest {})
        .await
        .unwrap()
        .into_inner()
        .volumes;
    assert_eq!(listed[0].attached_to, std::slice::from_ref(&a.id));
    for ro in [true, false] {
        let err = c
            .create_sandbox(mount("work", "/data", ro))
            .await
            .expect_err("a volume mounted read-write elsewhere");
        assert_eq!(reason(&err).0, "VOLUME_IN_USE", "{err:?}");
    }
    let err = c
        .delete_volume(DeleteVolumeRequest {
            name: "work".into(),
        })
        .await
        .expect_err("a mounted volume");
    assert_eq!(reason(&err).0, "VOLUME_IN_USE");
    let err = c
        .snapshot_sandbox(SnapshotSandboxRequest {
            sandbox_id: a.id.clone(),
            template_name: "with-volume".into(),
            shared: false,
        })
        .await
        .expect_err("a sandbox with a volume is not snapshotted");
    assert_eq!(reason(&err).0, "VOLUME_IN_USE");
    destroy(&mut c, &a.id).await;
    // Read back in two later sandboxes at once, read-only; a writer waits for them.
    let b = create(&mut c, s, mount("work", "/mnt/work", true)).await;
    let b2 = create(&mut c, s, mount("work", "/mnt/work", true)).await;
    let out = sh(
        &mut c,
        s,
        &b.id,
        "",
        "cat /mnt/work/notes; echo more > /mnt/work/x 2>/dev/null || echo read-only",
    )
    .await;
    assert_eq!(out, "kept\nread-only\n");
    let err = c
        .create_sandbox(mount("work", "/data", false))
        .await
        .expect_err("read-only users hold it");
    assert_eq!(reason(&err).0, "VOLUME_IN_USE");
    // Another tenant has no such volume.
    let mut acme = s.client(Some(TENANT_TOKEN)).await;
    let err = acme
        .create_sandbox(mount("work", "/data", true))
        .await
        .expect_err("another tenant's volume");
    assert_eq!(reason(&err).0, "VOLUME_NOT_FOUND");
    assert!(
        acme.list_volumes(ListVolumesRequest {})
            .await
            .unwrap()
            .into_inner()
            .volumes
            .is_empty()
    );
    for id in [&b.id, &b2.id] {
        destroy(&mut c, id).await;
    }
    // Deleting frees its file.
    let files = || {
        std::fs::read_dir(s.data_dir.join("volumes"))
            .unwrap()
            .count()
    };
    assert_eq!(files(), 1);
    let deleted = c
        .delete_volume(DeleteVolumeRequest {
            name: "work".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(deleted.deleted);
    assert_eq!(files(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_go_anywhere_the_account_may_write_and_the_export_policy_holds() {
    let (_serial, s) = clean_scenario().await;
    let mut c = s.client(None).await;
    let everywhere = FilePolicy {
        writable: vec!["/".into()],
        exportable: vec!["/".into()],
        ..Default::default()
    };
    let a = create(
        &mut c,
        s,
        CreateSandboxRequest {
            file_policy: Some(everywhere),
            ..Default::default()
        },
    )
    .await;
    // An upload into a system path, as root; the same as `user` is the guest's refusal.
    let up = |path: &str, user: &str| write_as(&a.id, path, user, b"payload".to_vec());
    c.write_file(tokio_stream::iter(up("/usr/local/share/up.txt", "root")))
        .await
        .unwrap();
    let err = c
        .write_file(tokio_stream::iter(up("/usr/local/share/no.txt", "")))
        .await
        .expect_err("user may not write there");
    assert_eq!(reason(&err).0, "GUEST_PERMISSION_DENIED", "{err:?}");
    let st = c
        .stat_file(StatFileRequest {
            sandbox_id: a.id.clone(),
            path: "/usr/local/share/up.txt".into(),
            user: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((st.size, st.uid, st.is_dir), (7, 0, false));
    // A tree: made, listed recursively up to a cap, renamed, removed.
    c.make_dir(MakeDirRequest {
        sandbox_id: a.id.clone(),
        path: "/home/user/w/a/b".into(),
        parents: true,
        ..Default::default()
    })
    .await
    .unwrap();
    sh(
        &mut c,
        s,
        &a.id,
        "",
        "for i in $(seq 1 30); do echo $i > /home/user/w/a/b/f$i; done",
    )
    .await;
    let list = |max: u32| ListFilesRequest {
        sandbox_id: a.id.clone(),
        path: "/home/user/w".into(),
        recursive: true,
        max_entries: max,
        ..Default::default()
    };
    let all = c.list_files(list(0)).await.unwrap().into_inner();
    assert_eq!(all.entries.len(), 32, "a, a/b and 30 files");
    assert!(!all.truncated);
    assert!(
        all.entries
            .iter()
            .any(|e| e.name == "a/b/f17" && e.size == 3)
    );
    let capped = c.list_files(list(10)).await.unwrap().into_inner();
    assert_eq!(capped.entries.len(), 10);
    assert!(capped.truncated);
    c.rename_file(RenameFileRequest {
        sandbox_id: a.id.clone(),
        from: "/home/user/w/a".into(),
        to: "/home/user/w/moved".into(),
        user: String::new(),
    })
    .await
    .unwrap();
    let out = sh(
        &mut c,
        s,
        &a.id,
        "",
        "cat /home/user/w/moved/b/f30; ls /home/user/w",
    )
    .await;
    assert_eq!(out, "30\nmoved\n");
    let err = c
        .remove_file(RemoveFileRequest {
            sandbox_id: a.id.clone(),
            path: "/home/user/w/moved".into(),
            recursive: false,
            user: String::new(),
        })
        .await
        .expect_err("a non-empty directory without recursive");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    c.remove_file(RemoveFileRequest {
        sandbox_id: a.id.clone(),
        path: "/home/user/w".into(),
        recursive: true,
        user: String::new(),
    })
    .await
    .unwrap();
    let gone = c
        .stat_file(StatFileRequest {
            sandbox_id: a.id.clone(),
            path: "/home/user/w".into(),
            user: String::new(),
        })
        .await
        .expect_err("removed");
    assert_eq!(reason(&gone).0, "FILE_NOT_FOUND");
    // The operator's denied patterns hold whatever the prefixes allow.
    sh(
        &mut c,
        s,
        &a.id,
        "",
        "mkdir -p ~/.ssh && echo k > ~/.ssh/id_rsa && echo s > ~/.env",
    )
    .await;
    for path in ["/home/user/.ssh/id_rsa", "/home/user/.env"] {
        let mut chunks = c
            .read_file(ReadFileRequest {
                sandbox_id: a.id.clone(),
                path: path.into(),
                user: String::new(),
            })
            .await;
        let err = match &mut chunks {
            Err(e) => e.clone(),
            Ok(stream) => stream.get_mut().message().await.expect_err("denied"),
        };
        let (code, meta) = reason(&err);
        assert_eq!(code, "EXPORT_DENIED", "{path}: {err:?}");
        assert!(meta["rule"].contains("denied pattern"), "{meta:?}");
    }
    destroy(&mut c, &a.id).await;
}
