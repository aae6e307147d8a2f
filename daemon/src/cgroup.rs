//! Per-sandbox cgroups for VMM processes, on cgroup v2 (unified) and v1 (separate `memory`,
//! `cpu`, `cpuacct` and `pids` hierarchies, as on the build machines).
//!
//! A sandbox's cgroup limits the whole VMM process: guest memory plus VMM overhead
//! (`memory.max` / `memory.limit_in_bytes`), CPU to its vCPU count (`cpu.max` /
//! `cpu.cfs_quota_us`) and threads (`pids.max`). Removal kills what is left in it and removes the
//! directories; it is idempotent.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Which cgroup layout the host has, with the parent directories of sandbox cgroups.
#[derive(Clone, Debug)]
pub enum Cgroups {
    V2 {
        parent: PathBuf,
    },
    V1 {
        memory: PathBuf,
        cpu: PathBuf,
        cpuacct: Option<PathBuf>,
        pids: PathBuf,
    },
}

/// Limits of one sandbox's cgroup.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub memory_bytes: u64,
    /// CPUs' worth of time per period (the vCPU count).
    pub cpus: u32,
    pub pids: u64,
}

/// One sandbox's cgroup (its directories in each hierarchy).
#[derive(Clone, Debug)]
pub struct Cgroup {
    version: u8,
    dirs: Vec<PathBuf>,
}

const PERIOD_US: u64 = 100_000;

impl Cgroups {
    /// Finds the hierarchy under `root` (normally `/sys/fs/cgroup`) and creates the parent
    /// cgroup `parent_name` in it.
    pub fn detect(root: &Path, parent_name: &str) -> io::Result<Self> {
        if root.join("cgroup.controllers").exists() {
            let parent = root.join(parent_name);
            fs::create_dir_all(&parent)?;
            // Children of the parent need the controllers delegated at both levels.
            for dir in [root, parent.as_path()] {
                let _ = fs::write(dir.join("cgroup.subtree_control"), "+memory +cpu +pids");
            }
            return Ok(Self::V2 { parent });
        }
        let v1 = |c: &str| {
            root.join(c)
                .join("tasks")
                .exists()
                .then(|| root.join(c).join(parent_name))
        };
        match (v1("memory"), v1("cpu"), v1("pids")) {
            (Some(memory), Some(cpu), Some(pids)) => {
                let cpuacct = v1("cpuacct");
                for d in [&memory, &cpu, &pids].into_iter().chain(cpuacct.as_ref()) {
                    fs::create_dir_all(d)?;
                }
                Ok(Self::V1 {
                    memory,
                    cpu,
                    cpuacct,
                    pids,
                })
            }
            _ => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "no cgroup v2 hierarchy and no v1 memory, cpu and pids hierarchies under {}",
                    root.display()
                ),
            )),
        }
    }

    /// "v1" or "v2".
    pub fn version(&self) -> &'static str {
        match self {
            Self::V2 { .. } => "v2",
            Self::V1 { .. } => "v1",
        }
    }

    /// The cgroup of sandbox `name`, whether or not it exists.
    pub fn cgroup(&self, name: &str) -> Cgroup {
        match self {
            Self::V2 { parent } => Cgroup {
                version: 2,
                dirs: vec![parent.join(name)],
            },
            Self::V1 {
                memory,
                cpu,
                cpuacct,
                pids,
            } => {
                let mut dirs = vec![memory.join(name), cpu.join(name), pids.join(name)];
                if let Some(a) = cpuacct {
                    dirs.push(a.join(name));
                }
                Cgroup { version: 1, dirs }
            }
        }
    }

    /// Creates sandbox `name`'s cgroup with `limits`, swap included (see [`limit_swap`]).
    pub fn create(&self, name: &str, limits: Limits) -> io::Result<Cgroup> {
        self.create_with(name, limits, host_has_swap())
    }

    /// [`create`](Self::create) on a host that has swap (`host_swap`) or not.
    fn create_with(&self, name: &str, limits: Limits, host_swap: bool) -> io::Result<Cgroup> {
        let cg = self.cgroup(name);
        for d in &cg.dirs {
            fs::create_dir_all(d)?;
        }
        let quota = PERIOD_US * u64::from(limits.cpus.max(1));
        if cg.version == 2 {
            let d = &cg.dirs[0];
            write(d, "memory.max", &limits.memory_bytes.to_string())?;
            limit_swap(&d.join("memory.swap.max"), "0", host_swap)?;
            write(d, "cpu.max", &format!("{quota} {PERIOD_US}"))?;
            write(d, "pids.max", &limits.pids.to_string())?;
        } else {
            let memory = limits.memory_bytes.to_string();
            write(&cg.dirs[0], "memory.limit_in_bytes", &memory)?;
            // Memory plus swap at most the memory limit: no swap.
            let memsw = cg.dirs[0].join("memory.memsw.limit_in_bytes");
            limit_swap(&memsw, &memory, host_swap)?;
            write(&cg.dirs[1], "cpu.cfs_period_us", &PERIOD_US.to_string())?;
            write(&cg.dirs[1], "cpu.cfs_quota_us", &quota.to_string())?;
            write(&cg.dirs[2], "pids.max", &limits.pids.to_string())?;
        }
        Ok(cg)
    }

    /// Names of the sandbox cgroups that exist (for reaping after a restart).
    pub fn existing(&self) -> Vec<String> {
        let dir = match self {
            Self::V2 { parent } => parent,
            Self::V1 { memory, .. } => memory,
        };
        fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// No swap for a sandbox: the memory limit is the limit. Where the kernel cannot limit a
/// cgroup's swap (no `file`: swap accounting is off), that is fine only on a host without
/// swap; otherwise the cgroup is refused rather than left to swap without bound.
fn limit_swap(file: &Path, value: &str, host_swap: bool) -> io::Result<()> {
    if file.exists() {
        return fs::write(file, value)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", file.display())));
    }
    if host_swap {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "the host has swap and the kernel cannot limit a cgroup's ({} is missing: \
                 enable swap accounting, e.g. swapaccount=1, or turn swap off)",
                file.display()
            ),
        ));
    }
    Ok(())
}

/// Whether the host has swap (`SwapTotal` in /proc/meminfo).
fn host_has_swap() -> bool {
    keyed_kb(Path::new("/proc/meminfo"), "SwapTotal:").is_some_and(|kb| kb > 0)
}

/// A `Key: N kB` line of a file like /proc/meminfo.
fn keyed_kb(path: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    fs::write(dir.join(file), value)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.join(file).display())))
}

fn read_u64(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `key value` lines of a flat-keyed cgroup file.
fn keyed(path: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

impl Cgroup {
    /// Moves process `pid` (all its threads) into the cgroup.
    pub fn add(&self, pid: u32) -> io::Result<()> {
        for d in &self.dirs {
            write(d, "cgroup.procs", &pid.to_string())?;
        }
        Ok(())
    }

    /// CPU time used, microseconds.
    pub fn cpu_usage_us(&self) -> u64 {
        if self.version == 2 {
            keyed(&self.dirs[0].join("cpu.stat"), "usage_usec").unwrap_or(0)
        } else {
            self.dirs
                .get(3)
                .and_then(|d| read_u64(&d.join("cpuacct.usage")))
                .map(|ns| ns / 1000)
                .unwrap_or(0)
        }
    }

    /// Peak memory use, bytes (current use where the kernel keeps no peak).
    pub fn memory_peak_bytes(&self) -> u64 {
        let d = &self.dirs[0];
        if self.version == 2 {
            read_u64(&d.join("memory.peak"))
                .or_else(|| read_u64(&d.join("memory.current")))
                .unwrap_or(0)
        } else {
            read_u64(&d.join("memory.max_usage_in_bytes")).unwrap_or(0)
        }
    }

    /// Whether the kernel's OOM killer killed something in the cgroup.
    pub fn oom_killed(&self) -> bool {
        let d = &self.dirs[0];
        let n = if self.version == 2 {
            keyed(&d.join("memory.events"), "oom_kill")
        } else {
            keyed(&d.join("memory.oom_control"), "oom_kill")
        };
        n.unwrap_or(0) > 0
    }

    /// Kills every process left in the cgroup and removes its directories. Idempotent: a
    /// cgroup that does not exist is removed already.
    pub fn remove(&self) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        for d in &self.dirs {
            loop {
                if !d.exists() {
                    break;
                }
                if let Ok(text) = fs::read_to_string(d.join("cgroup.procs")) {
                    for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                        // SAFETY: kill(2) with a pid read from the cgroup; no memory is involved.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
                match fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) => {
                        if Instant::now() > deadline {
                            return Err(io::Error::new(
                                e.kind(),
                                format!("removing {}: {e}", d.display()),
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keyed_files_are_parsed() {
        let dir = std::env::temp_dir().join(format!("airlock-cg-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(keyed(&dir.join("memory.events"), "oom_kill"), Some(1));
        assert_eq!(keyed(&dir.join("memory.events"), "oom"), Some(1));
        assert_eq!(keyed(&dir.join("memory.events"), "missing"), None);
        let _ = fs::remove_dir_all(&dir);
    }

    /// A fake v1 hierarchy (memory, cpu, pids) under a temporary directory.
    fn fake_v1(tag: &str) -> (PathBuf, Cgroups) {
        let root = std::env::temp_dir().join(format!("airlock-cgv1-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for c in ["memory", "cpu", "pids"] {
            fs::create_dir_all(root.join(c)).unwrap();
            fs::write(root.join(c).join("tasks"), "").unwrap();
        }
        let cgs = Cgroups::detect(&root, "airlock").unwrap();
        (root, cgs)
    }

    #[test]
    fn swap_is_limited_or_the_cgroup_is_refused_on_a_host_that_swaps() {
        let limits = Limits {
            memory_bytes: 384 << 20,
            cpus: 1,
            pids: 64,
        };
        let (root, cgs) = fake_v1("swap");
        // A kernel that accounts swap: memory + swap at most the memory limit.
        let vm = root.join("memory/airlock/vm-1");
        fs::create_dir_all(&vm).unwrap();
        fs::write(vm.join("memory.memsw.limit_in_bytes"), "").unwrap();
        cgs.create_with("vm-1", limits, true).unwrap();
        let memsw = fs::read_to_string(vm.join("memory.memsw.limit_in_bytes")).unwrap();
        assert_eq!(memsw, (384u64 << 20).to_string());
        // One that cannot: refused on a host with swap, fine on one without.
        let err = cgs.create_with("vm-2", limits, true).unwrap_err();
        assert!(err.to_string().contains("swap"), "{err}");
        cgs.create_with("vm-3", limits, false).unwrap();
        // A swap limit the kernel refuses is an error, not a warning.
        let v2 = root.join("v2");
        fs::create_dir_all(v2.join("memory.swap.max")).unwrap();
        assert!(limit_swap(&v2.join("memory.swap.max"), "0", false).is_err());
        assert_eq!(
            keyed_kb(Path::new("/proc/meminfo"), "MemTotal:").map(|k| k > 0),
            Some(true)
        );
        let _ = fs::remove_dir_all(&root);
    }

    #[test]
    fn detect_refuses_a_tree_without_cgroups() {
        let dir = std::env::temp_dir().join(format!("airlock-nocg-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        assert!(Cgroups::detect(&dir, "airlock").is_err());
        let _ = fs::remove_dir_all(&dir);
    }
}
