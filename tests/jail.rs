//! System test of the VMM jail through a live `airlockd` with real VMs.
//!
//! - From the host: each sandbox's VMM runs as a non-root uid of its own with an empty
//!   capability set, `no_new_privs` and a seccomp filter on every thread, in namespaces of its
//!   own, in its cgroup, with the jail's limits, a cleared environment and no inherited
//!   descriptors (all read from `/proc/PID`).
//! - From inside (the VMMs run with `--test-hooks`, whose `probe` commands make the VMM itself
//!   try): opening host files outside the jail fails, and two sandboxes' VMMs can neither see
//!   nor signal each other.
//! - A system call outside the filter kills the VMM and the daemon reports
//!   `SECCOMP_VIOLATION`; what the VMM had on the host is cleaned up.
//! - After `AIRLOCK_TEST_JAIL_CYCLES` (default 100; `./tests/run.sh --soak` runs 1,000)
//!   create/destroy cycles no jail directory, mount, cgroup, uid or process remains beyond the
//!   warm pool, and nothing once the daemon stopped.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use airlock_api::v1::*;
use airlock_system_tests::harness::{
    Client, alive, cgroups_left, client, http_get, reason, run, start_daemon, tail,
};
use airlock_system_tests::{control_command, require_kvm, step};

const POOL: usize = 2;
/// The jail uids of this test's daemon (apart from the default range other daemons use).
const UID_BASE: u32 = 1_800_000_000;
const UID_COUNT: u32 = 4096;
/// Create/destroy cycles running at once.
const WORKERS: usize = 4;

fn cycles() -> usize {
    std::env::var("AIRLOCK_TEST_JAIL_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

/// How many descriptors `pid` has open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// `Key:` line of `/proc/PID/status`, as words.
fn status_field(pid: u32, key: &str) -> Vec<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/status"))
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

fn ns(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

/// Pids of processes running as one of this test's jail uids.
fn jailed_processes() -> Vec<u32> {
    let range = UID_BASE..UID_BASE + UID_COUNT;
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| alive(*pid))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("Uid:"))
                        .and_then(|v| v.split_whitespace().next()?.parse::<u32>().ok())
                })
                .is_some_and(|uid| range.contains(&uid))
        })
        .collect()
}

/// Mounts of the host's mount namespace that name the data directory or a jail.
fn host_mounts_of(data_dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&*data_dir.to_string_lossy()) || l.contains("airlock-jail"))
        .map(str::to_owned)
        .collect()
}

/// The control socket of VMM `pid` (from its command line).
fn control_of(pid: u32) -> PathBuf {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmd
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let i = args.iter().position(|a| a == "--control").unwrap();
    PathBuf::from(&args[i + 1])
}

/// Sends `probe ...` to VMM `pid` and returns its JSON answer.
fn probe(pid: u32, what: &str) -> serde_json::Value {
    let line = control_command(&control_of(pid), &format!("probe {what}"))
        .unwrap_or_else(|e| panic!("probe {what} on {pid}: {e}"));
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("probe {what}: {e}: {line:?}"));
    assert_eq!(v["ok"], true, "probe {what}: {v}");
    v
}

async fn sandbox(c: &mut Client, id: &str) -> Sandbox {
    c.get_sandbox(GetSandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap()
    .into_inner()
}

async fn create(c: &mut Client) -> Sandbox {
    c.create_sandbox(CreateSandboxRequest::default())
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}"))
        .into_inner()
}

async fn destroy(c: &mut Client, id: &str) {
    c.destroy_sandbox(DestroySandboxRequest {
        sandbox_id: id.into(),
    })
    .await
    .unwrap_or_else(|e| panic!("destroy {id}: {e:?}"));
}

/// Asserts that the VMM's network namespace, its sandbox's, holds `lo` and the TAP of its
/// card and nothing else, and has no route out: only the TAP's /30 (the guest's link).
fn assert_network_is_its_own(pid: u32) {
    let dev = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let mut names: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["lo", "tap0"], "interfaces of {pid}'s namespace");
    let route = std::fs::read_to_string(format!("/proc/{pid}/net/route")).unwrap();
    let routes: Vec<&str> = route.lines().skip(1).collect();
    assert_eq!(routes.len(), 1, "routes of {pid}'s namespace: {routes:?}");
    // 100.96.0.0/30 on tap0 (little-endian hex), no gateway.
    assert!(
        routes[0].starts_with("tap0\t00006064\t00000000\t"),
        "{routes:?}"
    );
}

/// Asserts what the host sees of a sandbox's VMM: credentials, filters, namespaces, cgroup,
/// limits, environment and descriptors.
fn assert_confined(pid: u32, data_dir: &Path, log: &Path, cgroup_parent: &str) {
    let uid = status_field(pid, "Uid");
    let gid = status_field(pid, "Gid");
    assert!(
        uid.iter().all(|u| *u == uid[0]),
        "real, effective, saved, fs uid: {uid:?}"
    );
    assert!(gid.iter().all(|g| *g == gid[0]), "{gid:?}");
    let n: u32 = uid[0].parse().unwrap();
    assert!(
        (UID_BASE..UID_BASE + UID_COUNT).contains(&n),
        "uid {n} is not a jail uid"
    );
    assert!(status_field(pid, "Groups").is_empty());
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(
            status_field(pid, cap),
            ["0000000000000000"],
            "{cap} of {pid}"
        );
    }
    assert_eq!(status_field(pid, "NoNewPrivs"), ["1"]);
    // Every thread runs under a seccomp filter (mode 2).
    let tasks: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .collect();
    assert!(tasks.len() >= 3, "main, vCPU and control threads");
    for t in tasks {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap();
        let name = status.lines().next().unwrap_or("").to_owned();
        assert!(
            status
                .lines()
                .any(|l| l.split_whitespace().eq(["Seccomp:", "2"])),
            "thread {name} of {pid} has no seccomp filter"
        );
    }
    let me = std::process::id().to_string();
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(
            ns(&pid.to_string(), kind),
            ns(&me, kind),
            "{kind} namespace of {pid}"
        );
    }
    assert_eq!(
        status_field(pid, "NSpid").last().map(String::as_str),
        Some("1")
    );
    assert_network_is_its_own(pid);
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(
        cgroups.contains(&format!("/{cgroup_parent}/vm-")),
        "{pid} is not in its sandbox cgroup: {cgroups}"
    );
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let limit = |name: &str| {
        limits
            .lines()
            .find(|l| l.starts_with(name))
            .map(|l| {
                l[name.len()..]
                    .split_whitespace()
                    .take(2)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap()
    };
    assert_eq!(limit("Max open files"), "1024 1024");
    assert_eq!(limit("Max processes"), "128 128");
    assert_eq!(limit("Max core file size"), "0 0");
    // A snapshot of its 256 MiB guest and logs, or its root disk's overlay (its quota) and a
    // snapshot's layer (the template's blocks and the overlay's), no more (RLIMIT_FSIZE).
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let after = |flag: &str| {
        let i = args.iter().position(|a| a == flag).unwrap_or_else(|| {
            panic!("{pid} has no {flag}: {args:?}");
        });
        args[i + 1].clone()
    };
    let quota_mib: u64 = after("--disk-quota-mib").parse().unwrap();
    let layer = {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(Path::new(&after("--snapshot")).join("layer")).unwrap();
        m.blocks() * 512
    };
    let max_file = ((256u64 + 128) << 20).max(layer + ((quota_mib + 128) << 20));
    assert_eq!(limit("Max file size"), format!("{max_file} {max_file}"));
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    for var in environ.split(|b| *b == 0).filter(|v| !v.is_empty()) {
        let var = String::from_utf8_lossy(var);
        let name = var.split('=').next().unwrap();
        assert!(
            ["AIRLOCK_LOG", "TMPDIR", "AIRLOCK_PROFILE"].contains(&name),
            "{pid} inherited {var}"
        );
    }
    let db = data_dir.join("airlock.db");
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let target = std::fs::read_link(fd.path()).unwrap_or_default();
        assert!(
            target != db && target != log,
            "{pid} holds the daemon's {}",
            target.display()
        );
    }
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/fd/0")).unwrap(),
        Path::new("/dev/null")
    );
}

/// From inside VMM `me`: the host's files and the other VMM are out of reach; its own run
/// directory is there.
fn assert_walled_off(me: u32, other: u32, data_dir: &Path) {
    let own_run_dir = control_of(me).parent().unwrap().to_path_buf();
    let other_run_dir = control_of(other).parent().unwrap().to_path_buf();
    let own = probe(
        me,
        &format!("open {}", own_run_dir.join("console.log").display()),
    );
    assert_eq!(own["opened"], true, "the probe itself works: {own}");
    for outside in [
        PathBuf::from("/etc/passwd"),
        PathBuf::from("/proc/self/status"),
        data_dir.join("airlock.db"),
        other_run_dir.join("vmm.log"),
        PathBuf::from(format!("/proc/{other}/status")),
    ] {
        let v = probe(me, &format!("open {}", outside.display()));
        assert_eq!(v["opened"], false, "{me} opened {}: {v}", outside.display());
        assert_eq!(v["errno"], libc::ENOENT, "{}: {v}", outside.display());
    }
    // The other VMM's pid is not in this one's PID namespace: there is nothing to signal.
    let kill_other = probe(me, &format!("kill {other} {}", libc::SIGKILL));
    assert_eq!(kill_other["sent"], false, "{kill_other}");
    assert_eq!(kill_other["errno"], libc::ESRCH, "{kill_other}");
    let kill_all = probe(me, &format!("kill -1 {}", libc::SIGKILL));
    assert_eq!(
        kill_all["errno"],
        libc::ESRCH,
        "anyone it could signal? {kill_all}"
    );
    // Itself: PID 1 of its own namespace.
    assert_eq!(probe(me, "kill 1 0")["sent"], true);
    assert!(alive(other));
}

async fn uids_in_use(port: u16) -> usize {
    let text = http_get(port, "/metrics").await;
    text.lines()
        .find_map(|l| l.strip_prefix("airlock_jail_uids_in_use "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no airlock_jail_uids_in_use in {text}"))
}

/// Waits until the pool is full again and no sandbox is alive.
async fn settle(c: &mut Client, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let live = c
            .list_sandboxes(ListSandboxesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .sandboxes
            .len();
        if live == 0 && jailed_processes().len() == POOL && uids_in_use(port).await == POOL {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "did not settle: {live} sandboxes alive"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_vmm_is_jailed_filtered_and_cleaned_up() {
    require_kvm();
    let dir = std::env::temp_dir().join(format!("airlock-jail-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cgroup_parent = format!("airlock-jail-test-{}", std::process::id());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    assert!(
        jailed_processes().is_empty(),
        "jail uids in use before the test"
    );
    let mut t = Instant::now();
    let daemon = start_daemon(
        &dir,
        &cgroup_parent,
        &format!(
            "pool_size = {POOL}\nmax_sandboxes = 16\nmetrics_listen = \"127.0.0.1:{port}\"\n\
             [jail]\ntest_hooks = true\nuid_base = {UID_BASE}\nuid_count = {UID_COUNT}\n"
        ),
    );
    let data_dir = daemon.data_dir.clone();
    let mut c = client(&daemon, None).await;
    let mut events = c
        .create_template(CreateTemplateRequest {
            name: "base".into(),
            no_warmup: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    while let Some(_ev) = events
        .message()
        .await
        .unwrap_or_else(|e| panic!("template: {e:?}\n{}", tail(&daemon.log)))
    {}
    step("template built in a jail", &mut t);

    // Two sandboxes; what the host sees of their VMMs.
    let a = create(&mut c).await;
    let b = create(&mut c).await;
    let (pa, pb) = (a.vmm_pid, b.vmm_pid);
    for pid in [pa, pb] {
        assert_confined(pid, &data_dir, &daemon.log, &cgroup_parent);
    }
    assert_ne!(
        status_field(pa, "Uid")[0],
        status_field(pb, "Uid")[0],
        "one uid each"
    );
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(
            ns(&pa.to_string(), kind),
            ns(&pb.to_string(), kind),
            "{kind}"
        );
    }
    step(
        "both VMMs confined (uid, capabilities, filters, namespaces, limits)",
        &mut t,
    );

    // From inside: the host and the other sandbox are out of reach; both still serve.
    assert_walled_off(pa, pb, &data_dir);
    assert_walled_off(pb, pa, &data_dir);
    for s in [&a, &b] {
        let (out, _, ex) = run(&mut c, &s.id, &["echo", "still here"]).await;
        assert_eq!((out.as_str(), ex.exit_code), ("still here\n", 0));
    }
    step(
        "probes refused by the jail; both sandboxes still serve",
        &mut t,
    );

    // A system call outside the filter: the VMM dies, the daemon says why and cleans up.
    let a_run_dir = control_of(pa).parent().unwrap().to_path_buf();
    let answer = control_command(&control_of(pa), "probe seccomp").unwrap_or_default();
    assert!(
        !answer.contains("survived"),
        "the forbidden call went through: {answer}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let dead = loop {
        let s = sandbox(&mut c, &a.id).await;
        if s.state == SandboxState::Dead as i32 {
            break s;
        }
        assert!(Instant::now() < deadline, "{} is still {:?}", a.id, s.state);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(dead.end_reason, "SECCOMP_VIOLATION", "{dead:?}");
    let socket = libc::SYS_socket.to_string();
    assert!(
        dead.end_message
            .contains(&format!("system call {socket} on a vmm thread")),
        "{}",
        dead.end_message
    );
    let err = c
        .exec(ExecRequest {
            sandbox_id: a.id.clone(),
            command: Some(exec_request::Command::Argv(Argv {
                args: vec!["true".into()],
            })),
            ..Default::default()
        })
        .await
        .expect_err("the sandbox is dead");
    assert_eq!(reason(&err).0, "SECCOMP_VIOLATION");
    assert!(!alive(pa));
    assert!(!a_run_dir.exists(), "its run directory is gone");
    let a_cgroup = a_run_dir.file_name().unwrap().to_owned();
    let cgroups = cgroups_left(&cgroup_parent);
    assert!(
        cgroups.iter().all(|cg| cg.file_name() != Some(&a_cgroup)),
        "its cgroup is gone: {cgroups:?}"
    );
    let (out, _, _) = run(&mut c, &b.id, &["echo", "unharmed"]).await;
    assert_eq!(out, "unharmed\n");
    destroy(&mut c, &b.id).await;
    step(
        "seccomp violation reported and cleaned up; the neighbour unharmed",
        &mut t,
    );

    // Many create/destroy cycles leave nothing behind but the warm pool.
    settle(&mut c, port).await;
    let daemon_pid = daemon.child.0.as_ref().unwrap().id();
    let fds_before = open_fds(daemon_pid);
    let n = cycles();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let mut c = c.clone();
        let done = done.clone();
        workers.push(tokio::spawn(async move {
            for _ in (w..n).step_by(WORKERS) {
                let s = create(&mut c).await;
                destroy(&mut c, &s.id).await;
                let k = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if k.is_multiple_of(100) {
                    eprintln!("  {k} of {n} create/destroy cycles");
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    step(&format!("{n} create/destroy cycles"), &mut t);
    settle(&mut c, port).await;
    let pool: Vec<u32> = jailed_processes();
    assert_eq!(pool.len(), POOL, "processes under jail uids: {pool:?}");
    for pid in &pool {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(
            String::from_utf8_lossy(&cmd).contains("\0pool\0"),
            "{pid} is not a pool VMM"
        );
    }
    let run_dirs: HashSet<PathBuf> = std::fs::read_dir(data_dir.join("run"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    let pool_dirs: HashSet<PathBuf> = pool
        .iter()
        .map(|p| control_of(*p).parent().unwrap().to_path_buf())
        .collect();
    assert_eq!(run_dirs, pool_dirs, "run directories beyond the pool's");
    // A sandbox's writable root lived in its VMM's run directory: gone with it. The warm
    // VMMs' overlays are still empty (nothing restored into them yet).
    for d in &pool_dirs {
        let overlay = std::fs::metadata(d.join("root.overlay"))
            .unwrap_or_else(|e| panic!("{}: no root.overlay: {e}", d.display()));
        assert_eq!(overlay.len(), 0, "{}", d.display());
    }
    let cgroups = cgroups_left(&cgroup_parent);
    let per_vmm = cgroups.len() / POOL;
    assert_eq!(cgroups.len(), per_vmm * POOL, "{cgroups:?}");
    assert!(
        cgroups.iter().all(|cg| pool_dirs
            .iter()
            .any(|d| d.ends_with(cg.file_name().unwrap()))),
        "cgroups beyond the pool's: {cgroups:?}"
    );
    assert_eq!(uids_in_use(port).await, POOL);
    assert_eq!(
        host_mounts_of(&data_dir),
        Vec::<String>::new(),
        "host mounts"
    );
    let jail_root = std::fs::read_dir(data_dir.join("jail")).unwrap().count();
    assert_eq!(jail_root, 0, "the jail mount point stays empty on the host");
    // The daemon's own descriptors: what it held before the cycles, give or take the few its
    // runtime opens and closes on its own (never one per cycle).
    let fds_after = open_fds(daemon_pid);
    assert!(
        fds_after <= fds_before + 8,
        "the daemon's descriptors went from {fds_before} to {fds_after} in {n} cycles"
    );
    let namespaces: HashSet<PathBuf> = pool.iter().map(|p| ns(&p.to_string(), "pid")).collect();
    assert_eq!(namespaces.len(), POOL, "PID namespaces beyond the pool's");
    // Each of the pool's VMMs has a network namespace of its own, and the daemon holds, of
    // namespaces, exactly theirs: one descriptor each (the exits of a warm VMM: the namespace,
    // the proxy's and the DNS server's sockets), none of an ended sandbox's. A TAP, a ruleset
    // or a socket of a namespace lives only as long as the namespace.
    let nets: HashSet<PathBuf> = pool.iter().map(|p| ns(&p.to_string(), "net")).collect();
    assert_eq!(
        nets.len(),
        POOL,
        "the pool's VMMs share a network namespace"
    );
    let held: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{daemon_pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("net:["))
        .collect();
    assert_eq!(
        held.iter().collect::<HashSet<_>>(),
        nets.iter().collect::<HashSet<_>>(),
        "network namespaces the daemon holds beyond the pool's"
    );
    assert_eq!(held.len(), POOL, "{held:?}");
    eprintln!(
        "after {n} cycles: daemon descriptors {fds_before} -> {fds_after}, {} jail processes, \
         {} cgroups, {} uids",
        pool.len(),
        cgroups.len(),
        uids_in_use(port).await
    );
    step("nothing left but the warm pool", &mut t);

    // The daemon stopped: nothing at all.
    let log = daemon.log.clone();
    drop(daemon);
    assert!(
        jailed_processes().is_empty(),
        "VMMs outlived the daemon: {}",
        tail(&log)
    );
    assert!(cgroups_left(&cgroup_parent).is_empty());
    let left = std::fs::read_dir(data_dir.join("run")).unwrap().count();
    assert_eq!(left, 0, "run directories after the daemon stopped");
    assert_eq!(host_mounts_of(&data_dir), Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&dir);
}
