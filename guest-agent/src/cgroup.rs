//! One cgroup v2 per execution: limits, whole-tree kill and whole-tree accounting.
//!
//! Layout: `<root>/exec-<id>` under the agent's root (`/sys/fs/cgroup/airlock` in the guest);
//! the image's services (see `services`) get `<root>/service-<name>`, which no execution's
//! cleanup touches (an execution kills only its own cgroup).
//! The child process joins its cgroup between fork and exec (see `sys::prepare_child`), so every
//! descendant, daemonised or not, starts inside it. `cgroup.kill` ends them all at once.
//!
//! Controllers are used where the hierarchy has them: `pids` (`pids.max`, so a fork bomb stays
//! inside and fails its forks), `memory` (`memory.oom.group`, `memory.peak`, `memory.events`).
//! CPU time comes from `cpu.stat`, which every cgroup v2 has, even without the cpu controller.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `pids.max` of every execution.
pub const DEFAULT_PIDS_MAX: u32 = 1024;
/// How long removing a cgroup waits for its killed processes to be gone.
const REMOVE_PATIENCE: Duration = Duration::from_secs(2);

/// Setting up the agent's cgroup root failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The parent directory is not a cgroup v2 hierarchy.
    #[error("{0} is not in a cgroup v2 hierarchy (no cgroup.controllers)")]
    NotCgroup2(PathBuf),
    /// Creating a cgroup directory failed.
    #[error("creating cgroup {path}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Writing a control file failed.
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Which controllers the executions' cgroups have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Controllers {
    pub pids: bool,
    pub memory: bool,
    pub cpu: bool,
}

impl Controllers {
    /// From the text of a `cgroup.subtree_control` (or `cgroup.controllers`) file.
    pub fn parse(text: &str) -> Self {
        let has = |name| text.split_whitespace().any(|c| c == name);
        Self {
            pids: has("pids"),
            memory: has("memory"),
            cpu: has("cpu"),
        }
    }
}

/// The directory under which every execution gets its cgroup.
#[derive(Debug)]
pub struct CgroupRoot {
    dir: PathBuf,
    controllers: Controllers,
}

impl CgroupRoot {
    /// Creates `dir` (its parent must be a cgroup v2 directory), enables the pids, memory and cpu
    /// controllers for it and below where the hierarchy offers them, and removes stale
    /// `exec-*` cgroups left by an earlier agent.
    pub fn setup(dir: &Path) -> Result<Self, CgroupError> {
        let parent = dir.parent().unwrap_or(Path::new("/"));
        if !parent.join("cgroup.controllers").is_file() {
            return Err(CgroupError::NotCgroup2(parent.to_path_buf()));
        }
        match fs::create_dir(dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                return Err(CgroupError::Create {
                    path: dir.to_path_buf(),
                    source: e,
                });
            }
            _ => {}
        }
        enable_controllers(parent);
        enable_controllers(dir);
        let enabled = fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
        remove_stale(dir);
        Ok(Self {
            dir: dir.to_path_buf(),
            controllers: Controllers::parse(&enabled),
        })
    }

    pub fn controllers(&self) -> Controllers {
        self.controllers
    }

    /// Creates the cgroup of execution `id` with its limits (and `memory_max` bytes of memory,
    /// if given), ready for a child to join.
    pub fn create(&self, id: u64, memory_max: Option<u64>) -> Result<ExecCgroup, CgroupError> {
        let dir = self.dir.join(format!("exec-{id}"));
        fs::create_dir(&dir).map_err(|source| CgroupError::Create {
            path: dir.clone(),
            source,
        })?;
        let cgroup = ExecCgroup::configure(dir, self.controllers, memory_max);
        if cgroup.is_err() {
            // Best effort: an empty cgroup we could not configure is not worth keeping.
            let _ = fs::remove_dir(self.dir.join(format!("exec-{id}")));
        }
        cgroup
    }

    /// The cgroup of service `name`, empty: whatever an earlier run of the service left there
    /// is killed first. Like an execution's, but without `memory.oom.group`: a process of the
    /// service that the OOM killer picks (a code interpreter's kernel) dies alone, and the
    /// service lives on to notice.
    pub fn create_service(&self, name: &str) -> Result<ExecCgroup, CgroupError> {
        let dir = self.dir.join(format!("service-{name}"));
        if dir.is_dir() {
            let _ = write_file(&dir.join("cgroup.kill"), "1");
            wait_empty(&dir);
            let _ = fs::remove_dir(&dir);
        }
        fs::create_dir(&dir).map_err(|source| CgroupError::Create {
            path: dir.clone(),
            source,
        })?;
        ExecCgroup::configure_with(dir, self.controllers, None, false)
    }
}

/// Writes `+pids +memory +cpu` to `dir`'s `cgroup.subtree_control`, one at a time: a hierarchy
/// that lacks one (or binds it to cgroup v1) still gets the others.
fn enable_controllers(dir: &Path) {
    let path = dir.join("cgroup.subtree_control");
    for controller in ["+pids", "+memory", "+cpu"] {
        let _ = write_file(&path, controller);
    }
}

/// Removes `exec-*` and `service-*` directories under `dir` (left by an agent that was killed);
/// busy ones stay.
fn remove_stale(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("exec-") || name.starts_with("service-") {
            let path = entry.path();
            let _ = write_file(&path.join("cgroup.kill"), "1");
            let _ = fs::remove_dir(&path);
        }
    }
}

/// Writes `value` to an existing control file with one write.
fn write_file(path: &Path, value: &str) -> io::Result<()> {
    OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

/// Accounting read from an execution's cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CgroupStats {
    pub user_us: u64,
    pub system_us: u64,
    /// `memory.peak`, where the memory controller is on.
    pub peak_memory_bytes: Option<u64>,
    /// Processes the OOM killer killed in the cgroup.
    pub oom_kills: u64,
}

/// The cgroup of one execution.
#[derive(Debug)]
pub struct ExecCgroup {
    dir: PathBuf,
    /// `cgroup.procs`, open for the child to write itself into.
    procs: File,
    controllers: Controllers,
}

impl ExecCgroup {
    fn configure(
        dir: PathBuf,
        controllers: Controllers,
        memory_max: Option<u64>,
    ) -> Result<Self, CgroupError> {
        Self::configure_with(dir, controllers, memory_max, true)
    }

    /// As [`configure`](Self::configure); `oom_group`: the OOM killer kills the whole cgroup
    /// (an execution) rather than the one process it picked (a service).
    fn configure_with(
        dir: PathBuf,
        controllers: Controllers,
        memory_max: Option<u64>,
        oom_group: bool,
    ) -> Result<Self, CgroupError> {
        let set = |file: &str, value: &str| {
            let path = dir.join(file);
            write_file(&path, value).map_err(|source| CgroupError::Write { path, source })
        };
        if controllers.pids {
            set("pids.max", &DEFAULT_PIDS_MAX.to_string())?;
        }
        if controllers.memory {
            if oom_group {
                set("memory.oom.group", "1")?;
            }
            if let Some(bytes) = memory_max {
                set("memory.max", &bytes.to_string())?;
                // No swap in a microVM, but a limit must not leak into it where there is one.
                let _ = set("memory.swap.max", "0");
            }
        }
        let path = dir.join("cgroup.procs");
        let procs = OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|source| CgroupError::Write { path, source })?;
        Ok(Self {
            dir,
            procs,
            controllers,
        })
    }

    /// The open `cgroup.procs` for `sys::prepare_child`.
    pub fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Kills every process in the cgroup (`cgroup.kill`; SIGKILL to each member where the kernel
    /// lacks it).
    pub fn kill(&self) -> io::Result<()> {
        match write_file(&self.dir.join("cgroup.kill"), "1") {
            Err(e) if e.kind() == io::ErrorKind::NotFound => self.signal_each(libc::SIGKILL),
            other => other,
        }
    }

    /// Sends `sig` to each process listed in `cgroup.procs`.
    pub fn signal_each(&self, sig: i32) -> io::Result<()> {
        let text = fs::read_to_string(self.dir.join("cgroup.procs"))?;
        for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // A process may exit between the read and the kill: ESRCH is expected.
            let _ = crate::sys::kill(pid, sig);
        }
        Ok(())
    }

    /// CPU time, peak memory and OOM kills of everything that ran in the cgroup.
    pub fn stats(&self) -> CgroupStats {
        let read = |file: &str| fs::read_to_string(self.dir.join(file)).unwrap_or_default();
        let cpu = read("cpu.stat");
        let mut stats = CgroupStats {
            user_us: keyed_value(&cpu, "user_usec").unwrap_or(0),
            system_us: keyed_value(&cpu, "system_usec").unwrap_or(0),
            ..CgroupStats::default()
        };
        if self.controllers.memory {
            stats.peak_memory_bytes = read("memory.peak").trim().parse().ok();
            let events = read("memory.events");
            stats.oom_kills = keyed_value(&events, "oom_kill").unwrap_or(0);
        }
        stats
    }

    /// Kills what is left, waits until the processes are gone (they take a moment to die),
    /// reads the accounting and removes the cgroup.
    pub fn kill_and_remove(&self) -> (CgroupStats, io::Result<()>) {
        let _ = self.kill();
        wait_empty(&self.dir);
        let stats = self.stats();
        let removed = match fs::remove_dir(&self.dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other,
        };
        (stats, removed)
    }
}

/// Waits (at most [`REMOVE_PATIENCE`]) until no process is left in the cgroup at `dir`
/// (`cgroup.events`): killed processes take a moment to die.
fn wait_empty(dir: &Path) {
    let populated = || {
        let events = fs::read_to_string(dir.join("cgroup.events")).unwrap_or_default();
        keyed_value(&events, "populated") != Some(0)
    };
    let mut pause = Duration::from_millis(1);
    let mut waited = Duration::ZERO;
    while populated() && waited < REMOVE_PATIENCE {
        std::thread::sleep(pause);
        waited += pause;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// The value of `key` in a flat-keyed cgroup file (`key value` per line).
pub fn keyed_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_value_finds_exact_key() {
        let cpu = "usage_usec 30\nuser_usec 20\nsystem_usec 10\nnr_periods 0\n";
        assert_eq!(keyed_value(cpu, "user_usec"), Some(20));
        assert_eq!(keyed_value(cpu, "system_usec"), Some(10));
        assert_eq!(keyed_value(cpu, "usec"), None);
    }

    #[test]
    fn keyed_value_distinguishes_oom_kill_from_oom_group_kill() {
        let events = "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 1\n";
        assert_eq!(keyed_value(events, "oom_kill"), Some(2));
    }

    #[test]
    fn controllers_parse_whole_words_only() {
        let c = Controllers::parse("cpuset cpu io memory hugetlb pids rdma misc\n");
        assert_eq!(
            c,
            Controllers {
                pids: true,
                memory: true,
                cpu: true
            }
        );
        assert_eq!(
            Controllers::parse("cpuset hugetlb\n"),
            Controllers::default()
        );
    }

    /// A plain directory standing in for a cgroup: control files are ordinary files there.
    struct FakeCgroup(PathBuf);

    impl FakeCgroup {
        fn new(tag: &str, files: &[(&str, &str)]) -> Self {
            let dir = std::env::temp_dir()
                .join(format!("airlock-fake-cgroup-{}-{tag}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            for (name, content) in files {
                fs::write(dir.join(name), content).unwrap();
            }
            Self(dir)
        }

        fn read(&self, name: &str) -> String {
            fs::read_to_string(self.0.join(name)).unwrap()
        }
    }

    impl Drop for FakeCgroup {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    const ALL: Controllers = Controllers {
        pids: true,
        memory: true,
        cpu: true,
    };

    #[test]
    fn configure_sets_a_memory_limit_when_one_is_asked_for() {
        let files = [
            ("pids.max", "max"),
            ("memory.oom.group", "0"),
            ("memory.max", "max"),
            // Cgroup files need no truncation; these fakes start empty where a shorter value
            // is written.
            ("memory.swap.max", ""),
            ("cgroup.procs", ""),
        ];
        let fake = FakeCgroup::new("memory-max", &files);
        ExecCgroup::configure(fake.0.clone(), ALL, Some(32 << 20)).unwrap();
        assert_eq!(fake.read("memory.max"), (32u64 << 20).to_string());
        assert_eq!(fake.read("memory.swap.max"), "0");
        let none = FakeCgroup::new("memory-none", &files);
        ExecCgroup::configure(none.0.clone(), ALL, None).unwrap();
        assert_eq!(none.read("memory.max"), "max");
    }

    #[test]
    fn configure_sets_pids_max_and_oom_group_where_controllers_are_on() {
        let files = [
            ("pids.max", "max"),
            ("memory.oom.group", "0"),
            ("cgroup.procs", ""),
        ];
        let fake = FakeCgroup::new("configure", &files);
        ExecCgroup::configure(fake.0.clone(), ALL, None).unwrap();
        assert_eq!(fake.read("pids.max"), "1024");
        assert_eq!(fake.read("memory.oom.group"), "1");
    }

    #[test]
    fn configure_without_controllers_touches_only_cgroup_procs() {
        let fake = FakeCgroup::new("bare", &[("cgroup.procs", "")]);
        assert!(ExecCgroup::configure(fake.0.clone(), Controllers::default(), None).is_ok());
        let missing = FakeCgroup::new("missing", &[("cgroup.procs", "")]);
        let err = ExecCgroup::configure(missing.0.clone(), ALL, None).unwrap_err();
        assert!(matches!(err, CgroupError::Write { .. }), "{err:?}");
    }

    #[test]
    fn kill_writes_one_to_cgroup_kill() {
        let files = [("cgroup.procs", ""), ("cgroup.kill", "")];
        let fake = FakeCgroup::new("kill", &files);
        let cg = ExecCgroup::configure(fake.0.clone(), Controllers::default(), None).unwrap();
        cg.kill().unwrap();
        assert_eq!(fake.read("cgroup.kill"), "1");
    }

    #[test]
    fn stats_read_cpu_peak_memory_and_oom_kills() {
        let files = [
            ("cgroup.procs", ""),
            ("pids.max", ""),
            ("memory.oom.group", ""),
            (
                "cpu.stat",
                "usage_usec 700\nuser_usec 500\nsystem_usec 200\n",
            ),
            ("memory.peak", "123456\n"),
            ("memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n"),
        ];
        let fake = FakeCgroup::new("stats", &files);
        let cg = ExecCgroup::configure(fake.0.clone(), ALL, None).unwrap();
        let expected = CgroupStats {
            user_us: 500,
            system_us: 200,
            peak_memory_bytes: Some(123_456),
            oom_kills: 1,
        };
        assert_eq!(cg.stats(), expected);
    }

    #[test]
    fn stats_without_memory_controller_have_no_peak() {
        let files = [
            ("cgroup.procs", ""),
            ("cpu.stat", "user_usec 5\nsystem_usec 6\n"),
        ];
        let fake = FakeCgroup::new("nomem", &files);
        let cg = ExecCgroup::configure(fake.0.clone(), Controllers::default(), None).unwrap();
        let stats = cg.stats();
        assert_eq!((stats.user_us, stats.system_us), (5, 6));
        assert_eq!(stats.peak_memory_bytes, None);
        assert_eq!(stats.oom_kills, 0);
    }

    #[test]
    fn setup_refuses_a_directory_outside_cgroup2() {
        let err = CgroupRoot::setup(Path::new("/proc/airlock-nonexistent")).unwrap_err();
        assert!(matches!(err, CgroupError::NotCgroup2(_)), "{err:?}");
    }
}
