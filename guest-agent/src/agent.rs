//! The agent's shared state and the facts it reports in `Ready`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use airlock_proto::PROTOCOL_VERSION;
use airlock_proto::pb::{self, Ready, Reseeded};

use crate::cgroup::CgroupRoot;
use crate::clock::millis;
use crate::error::ReqError;
use crate::exec::ExecTable;
use crate::exec_spec;
use crate::reaper::Reaper;
use crate::reseed::{self, Identity};
use crate::spawn::Spawner;
use crate::sys;
use crate::users::Users;

/// Where the kernel lists the online CPUs (`0-3,5`).
pub const CPUS_ONLINE: &str = "/sys/devices/system/cpu/online";

/// How the agent was started (from its command line, or the PID 1 defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Running as PID 1 in a VM: power-off reboots, Reseed touches the kernel's RNG and host
    /// name. Otherwise an ordinary process, which must leave its machine alone.
    pub pid1: bool,
    /// Where state files (the sandbox id) go; none: not written.
    pub state_dir: Option<PathBuf>,
    /// Output buffered per execution while nobody owns it.
    pub orphan_buffer_bytes: usize,
    /// The account of requests that name none; none: the agent's own.
    pub default_user: Option<String>,
    /// The working directory of executions that name none (else the account's home).
    pub workdir: Option<String>,
}

/// State shared by every connection and execution.
#[derive(Debug)]
pub struct Agent {
    /// Running as PID 1 in a VM (power-off reboots) rather than as an ordinary process.
    pub pid1: bool,
    /// Where executions' processes start: the reaper, and per-execution cgroups where cgroup
    /// v2 is available.
    pub spawner: Arc<Spawner>,
    pub execs: Arc<ExecTable>,
    /// Where state files go (see [`Settings::state_dir`]).
    pub state_dir: Option<PathBuf>,
    /// The accounts requests act as.
    pub users: Users,
    identity: Mutex<Identity>,
    ready: Ready,
}

impl Agent {
    pub fn new(
        settings: Settings,
        reaper: Arc<Reaper>,
        cgroups: Option<CgroupRoot>,
        ready: Ready,
    ) -> Self {
        Self {
            pid1: settings.pid1,
            spawner: Arc::new(Spawner { reaper, cgroups }),
            execs: Arc::new(ExecTable::new(settings.orphan_buffer_bytes)),
            state_dir: settings.state_dir,
            users: Users::new(settings.default_user).with_workdir(settings.workdir),
            identity: Mutex::new(Identity::default()),
            ready,
        }
    }

    /// The first frame of every connection: the facts of the start, with what Reseed changed.
    pub fn ready(&self) -> Ready {
        let identity = self.identity();
        let mut ready = self.ready.clone();
        if let Some(name) = &identity.hostname {
            ready.hostname.clone_from(name);
        }
        ready.sandbox_id.clone_from(&identity.sandbox_id);
        ready
    }

    /// The identity Reseed sets; holding it serialises Reseeds.
    pub fn identity(&self) -> MutexGuard<'_, Identity> {
        self.identity.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The environment executions start from (see [`exec_spec::base_env`]).
    pub fn base_env(&self) -> Vec<(String, String)> {
        exec_spec::base_env(&self.identity().sandbox_id)
    }

    /// Handles a Reseed request (see [`reseed::handle`]).
    pub fn reseed(&self, req: pb::Reseed) -> Result<Reseeded, ReqError> {
        let no_root = req.no_root;
        let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        self.users
            .set_defaults(nonempty(&req.default_user), nonempty(&req.workdir));
        let mut done = reseed::handle(self.pid1, self.state_dir.as_deref(), &self.identity, req)?;
        if no_root {
            self.users.forbid_root();
        }
        done.no_root = self.users.root_forbidden();
        Ok(done)
    }

    /// Kills every execution, unmounts the volumes, syncs, and powers the VM off (PID 1) or
    /// exits (host mode).
    pub fn power_off(&self) -> ! {
        self.execs.kill_all();
        let volumes = std::mem::take(&mut self.identity().volumes);
        crate::volumes::unmount_all(&volumes);
        sys::sync();
        if !self.pid1 {
            std::process::exit(0);
        }
        if let Err(e) = sys::reboot() {
            eprintln!("airlock-agent: reboot: {e}");
        }
        // PID 1 must never exit: that panics the kernel.
        loop {
            sys::pause();
        }
    }
}

/// The optional features this agent offers (see `Ready.capabilities` in agent.proto).
pub fn capabilities(cgroups: Option<&CgroupRoot>) -> Vec<String> {
    let mut caps = vec![
        "exec", "stdin", "signal", "files", "reseed", "attach", "users",
    ];
    match cgroups {
        Some(root) => {
            caps.push("cgroups");
            let c = root.controllers();
            if c.pids {
                caps.push("cgroup-pids");
            }
            if c.memory {
                caps.push("cgroup-memory");
            }
        }
        None => caps.push("process-groups"),
    }
    caps.into_iter().map(String::from).collect()
}

/// The `Ready` frame: `boot_time` is CLOCK_BOOTTIME when the agent began listening, `cpus_online`
/// the text of [`CPUS_ONLINE`].
pub fn build_ready(boot_time: Duration, cpus_online: &str, cgroups: Option<&CgroupRoot>) -> Ready {
    Ready {
        protocol_version: PROTOCOL_VERSION,
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        capabilities: capabilities(cgroups),
        boot_time_ms: millis(boot_time),
        hostname: sys::hostname().unwrap_or_default(),
        cpus: count_cpus(cpus_online),
        mem_total_bytes: sys::mem_total_bytes().unwrap_or(0),
        sandbox_id: String::new(),
    }
}

/// Counts the CPUs in a kernel CPU list such as `0-3,5` (0 if it does not parse).
pub fn count_cpus(list: &str) -> u32 {
    let mut total = 0u32;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        match (lo.parse::<u32>(), hi.parse::<u32>()) {
            (Ok(lo), Ok(hi)) if hi >= lo => total = total.saturating_add(hi - lo + 1),
            _ => return 0,
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_cpus_reads_ranges_and_singles() {
        assert_eq!(count_cpus("0\n"), 1);
        assert_eq!(count_cpus("0-1"), 2);
        assert_eq!(count_cpus("0-3,5,7-8\n"), 7);
    }

    #[test]
    fn count_cpus_of_garbage_is_zero() {
        assert_eq!(count_cpus(""), 0);
        assert_eq!(count_cpus("a-b"), 0);
        assert_eq!(count_cpus("3-1"), 0);
    }

    #[test]
    fn capabilities_without_cgroups_name_process_groups() {
        let caps = capabilities(None);
        assert!(caps.iter().any(|c| c == "exec"));
        assert!(caps.iter().any(|c| c == "reseed"));
        assert!(caps.iter().any(|c| c == "attach"));
        assert!(caps.iter().any(|c| c == "process-groups"));
        assert!(!caps.iter().any(|c| c == "cgroups"));
    }

    #[test]
    fn ready_carries_version_and_machine_facts() {
        let ready = build_ready(Duration::from_millis(1234), "0-1\n", None);
        assert_eq!(ready.protocol_version, PROTOCOL_VERSION);
        assert_eq!(ready.boot_time_ms, 1234);
        assert_eq!(ready.cpus, 2);
        assert!(ready.mem_total_bytes > 0);
        assert!(!ready.hostname.is_empty());
    }
}
