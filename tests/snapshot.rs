//! System test of snapshots in real VMs: one cold boot; pause/resume in the middle of a running
//! execution; a snapshot through the control socket; three clones restored concurrently, each
//! with its own identity, the state from before the snapshot, and a working agent.
//!
//! Guest-side steps cost seconds on the nested-KVM build machines (the guest kernel is
//! emulated); restores themselves take milliseconds.

use airlock_proto::Requests;
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use airlock_proto::pb::{self, StreamKind};
use airlock_system_tests::{Client, TempDir, VmProcess, exit_code, sh, step};

const CLONES: usize = 3;
const LINES: usize = 150;

/// Runs an execution that prints `LINES` lines over several seconds (builtins only: a counting
/// loop paces it, no process is forked), pauses the VM through the control socket
/// as soon as the first output arrives, keeps it paused for a second, resumes it, and checks
/// that every line arrives, in order.
fn pause_and_resume_in_the_middle_of_an_execution(vm: &VmProcess, c: &mut Client) {
    let script = format!(
        "i=0; while [ $i -lt {LINES} ]; do echo line $i; i=$((i+1)); \
         j=0; while [ $j -lt 20000 ]; do j=$((j+1)); done; done; echo done"
    );
    let exec = pb::Exec {
        command: Some(pb::exec::Command::Shell(script)),
        stdin_open: true,
        timeout_ms: 600_000,
        ..Default::default()
    };
    let (first_tx, first_rx) = channel();
    std::thread::scope(|s| {
        let pauser = s.spawn(move || {
            first_rx
                .recv_timeout(Duration::from_secs(300))
                .expect("first output");
            vm.control("pause");
            let at = Instant::now();
            std::thread::sleep(Duration::from_secs(1));
            vm.control("resume");
            at
        });
        let mut out = Vec::new();
        let exit = c
            .exec_collect(exec, |stream, data| {
                if stream == StreamKind::Stdout {
                    if out.is_empty() {
                        let _ = first_tx.send(());
                    }
                    out.extend_from_slice(data);
                }
            })
            .expect("exec");
        let ended = Instant::now();
        let paused_at = pauser.join().expect("pauser");
        assert!(
            paused_at < ended,
            "the pause came after the execution ended"
        );
        assert_eq!(exit_code(&exit), Some(0), "{exit:?}");
        let text = String::from_utf8_lossy(&out);
        let mut expected: Vec<String> = (0..LINES).map(|i| format!("line {i}")).collect();
        expected.push("done".into());
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            expected,
            "output lost or reordered across pause/resume"
        );
    });
}

#[test]
fn clones_of_a_snapshot_continue_its_state_with_their_own_identity() {
    let mut t = Instant::now();
    let vm = VmProcess::boot("snap-origin", &["--mem-mib", "256"]);
    let mut c = vm.connect();
    step("boot to agent ready", &mut t);
    assert!(
        c.ready().capabilities.iter().any(|cap| cap == "reseed"),
        "the agent in the image cannot reseed: {:?}",
        c.ready()
    );

    pause_and_resume_in_the_middle_of_an_execution(&vm, &mut c);
    step("pause/resume during an execution", &mut t);

    // State the clones must inherit: a file, and a process that outlives this connection.
    c.write_file("/tmp/before-snapshot.txt", b"written before the snapshot\n")
        .expect("write file");
    let keeper = pb::Exec {
        command: Some(pb::exec::Command::Argv(pb::Argv {
            args: vec!["sleep".into(), "100000".into()],
        })),
        keep_on_disconnect: true,
        ..Default::default()
    };
    let (_, started) = c
        .start_exec(keeper)
        .expect("start the long-running process");
    let pid = started.pid;
    assert!(pid > 1, "{started:?}");
    drop(c);
    step("state before the snapshot", &mut t);

    let snap = TempDir::new("snap-dir");
    // The VMM creates no files once it runs: its caller prepares the snapshot's.
    airlock_control::snapshot_dir::prepare(&snap.0, None).expect("prepare the snapshot dir");
    vm.control("pause");
    let answer = vm.control(&format!("snapshot {}", snap.0.display()));
    eprintln!("snapshot: {answer}");
    vm.control("stop");
    assert!(vm.wait().success());
    step("snapshot", &mut t);

    // The clones at once.
    let clones: Vec<VmProcess> = (0..CLONES)
        .map(|i| VmProcess::restore(&format!("snap-clone{i}"), &snap.0))
        .collect();
    let results: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = clones
            .iter()
            .enumerate()
            .map(|(i, clone)| s.spawn(move || check_clone(i, clone, pid)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("clone check"))
            .collect()
    });
    step(&format!("{CLONES} clones restored and checked"), &mut t);
    let randoms: std::collections::HashSet<_> = results.iter().map(|r| &r.0).collect();
    let boot_ids: std::collections::HashSet<_> = results.iter().map(|r| &r.1).collect();
    assert_eq!(boot_ids.len(), CLONES, "boot ids repeat: {results:?}");
    assert_eq!(randoms.len(), CLONES, "$RANDOM repeats: {results:?}");
    for clone in clones {
        assert!(clone.wait().success());
    }
}

/// Checks one clone and returns its ($RANDOM, boot_id).
fn check_clone(i: usize, clone: &VmProcess, pid: u32) -> (String, String) {
    let mut c = clone.connect();
    let mut entropy = [0u8; 32];
    for (k, b) in entropy.iter_mut().enumerate() {
        // Distinct per clone and per run; the point is that each clone gets its own.
        *b = (k as u8).wrapping_mul(31) ^ (i as u8) ^ (std::process::id() as u8);
    }
    let name = format!("clone-{i}");
    let done = c.reseed(&entropy, &name, &name).expect("reseed");
    assert!(done.rng_reseeded && done.hostname_set, "{done:?}");

    let (out, err, exit) = sh(
        &mut c,
        "echo $RANDOM; cat /proc/sys/kernel/random/boot_id; hostname; \
         cat /tmp/before-snapshot.txt",
        Duration::from_secs(300),
    );
    assert_eq!(
        exit_code(&exit),
        Some(0),
        "clone {i}: {}\n{}",
        String::from_utf8_lossy(&err),
        clone.diagnostics()
    );
    let text = String::from_utf8_lossy(&out).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "clone {i}: {text}");
    assert!(lines[0].parse::<u16>().is_ok(), "clone {i}: $RANDOM {text}");
    assert_eq!(lines[1].len(), 36, "clone {i}: boot_id {text}");
    assert_eq!(lines[2], name);
    assert_eq!(lines[3], "written before the snapshot");

    // The process started before the snapshot still runs in the clone.
    let (out, _, exit) = sh(
        &mut c,
        &format!("kill -0 {pid} && cat /proc/{pid}/comm"),
        Duration::from_secs(300),
    );
    assert_eq!(
        exit_code(&exit),
        Some(0),
        "clone {i}: process {pid} is gone"
    );
    assert_eq!(String::from_utf8_lossy(&out).trim(), "sleep");
    c.power_off().expect("power off");
    (lines[0].to_owned(), lines[1].to_owned())
}
