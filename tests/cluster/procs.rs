//! The processes of the cluster test (etcd members, airlockd nodes): spawned from one thread
//! that lives as long as the test process, so that each gets SIGTERM (its parent-death signal)
//! only when the process dies, not when the test thread that started it ends; signalled and
//! reaped by their pids only (other people's processes run on the same machine).

use std::process::Command;
use std::sync::Mutex;
use std::sync::mpsc::{Sender, channel};
use std::time::{Duration, Instant};

type Spawn = (Command, Sender<Result<i32, String>>);

static SPAWNER: Mutex<Option<Sender<Spawn>>> = Mutex::new(None);

/// Spawns `cmd` (from the spawner thread) and returns its pid; the child is never waited for
/// by anyone but [`wait_exit`].
pub fn spawn(cmd: Command) -> i32 {
    let (tx, rx) = channel();
    {
        let mut spawner = SPAWNER.lock().unwrap_or_else(|e| e.into_inner());
        let sender = spawner.get_or_insert_with(|| {
            let (tx, rx) = channel::<Spawn>();
            std::thread::spawn(move || {
                for (mut cmd, answer) in rx {
                    let _ = answer.send(spawn_here(&mut cmd));
                }
                // The test process holds the sender in a static: never reached, and the thread
                // (whose end would send the children their parent-death signal) never ends.
                loop {
                    std::thread::park();
                }
            });
            tx
        });
        sender.send((cmd, tx)).expect("the spawner thread runs");
    }
    rx.recv()
        .expect("the spawner thread answers")
        .unwrap_or_else(|e| panic!("{e}"))
}

fn spawn_here(cmd: &mut Command) -> Result<i32, String> {
    use std::os::unix::process::CommandExt;
    let set_death_signal = || {
        // SAFETY: prctl(2) is async-signal-safe; it only sets this child's parent-death signal.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
        Ok(())
    };
    // SAFETY: the closure runs between fork and exec and only calls prctl (above).
    unsafe { cmd.pre_exec(set_death_signal) };
    let child = cmd
        .spawn()
        .map_err(|e| format!("spawn {:?}: {e}", cmd.get_program()))?;
    Ok(child.id() as i32)
}

/// Sends `signal` to `pid` (one of ours).
pub fn signal(pid: i32, signal: i32) {
    // SAFETY: kill(2) on a child of this process, by its pid.
    unsafe { libc::kill(pid, signal) };
}

/// Waits up to `within` for our child `pid` to exit and reaps it; whether it did.
pub fn wait_exit(pid: i32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        let mut status = 0;
        // SAFETY: waitpid(2) on a child of this process; `status` is a live local.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r != 0 {
            // Reaped (r == pid), or not our child / gone already (r < 0).
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILL and reap.
pub fn kill(pid: i32) {
    signal(pid, libc::SIGKILL);
    wait_exit(pid, Duration::from_secs(30));
}

/// SIGTERM, up to `grace` for it to exit, then SIGKILL; reaped either way.
pub fn stop(pid: i32, grace: Duration) {
    signal(pid, libc::SIGTERM);
    if !wait_exit(pid, grace) {
        kill(pid);
    }
}

/// Whether our child `pid` still runs (not exited, not a zombie).
pub fn running(pid: i32) -> bool {
    airlock_system_tests::harness::alive(pid as u32)
}

/// A free TCP port on loopback (bound once and released: `n` of them, distinct).
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("bound address").port())
        .collect()
}
