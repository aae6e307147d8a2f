//! One `airlockd` and one template per test process, shared by its scenarios: the template's
//! cold boot costs tens of seconds on nested-KVM machines, so a test binary builds it once,
//! and each scenario is its own `#[test]`, failing alone. Scenarios run one at a time
//! ([`scenario`] hands out a lock), so each may count what it sees on the host. The daemon
//! stops when the test process exits (an `atexit` handler sends SIGTERM and waits; the daemon
//! also gets SIGTERM from the kernel if the process dies without exiting).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use airlock_api::v1::Template;

use crate::harness::{self, Client, remove_parent_cgroups, tail};

/// The shared daemon of this test process.
#[derive(Debug)]
pub struct Shared {
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    pub cgroup_parent: String,
    pub metrics_port: u16,
    pub pid: i32,
    /// The template `base`, built once.
    pub template: Template,
}

static SHARED: OnceLock<Shared> = OnceLock::new();
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The shared daemon (started with `config` appended to its settings by the first caller) and
/// the lock that keeps scenarios one at a time.
pub async fn scenario(config: &str) -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    scenario_with(config, None).await
}

/// [`scenario`] with the daemon's data directory on a tmpfs of `data_mib` MiB (a data
/// directory that can fill up).
pub async fn scenario_with(
    config: &str,
    data_mib: Option<u64>,
) -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    started(config, data_mib, &[]).await
}

/// [`scenario`] whose daemon also imports, at its start, the exported templates of `kept`
/// that are there (kept by an earlier run; see [`export_template`]).
pub async fn scenario_importing(
    config: &str,
    kept: &[PathBuf],
) -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    started(config, None, kept).await
}

async fn started(
    config: &str,
    data_mib: Option<u64>,
    kept: &[PathBuf],
) -> (tokio::sync::MutexGuard<'static, ()>, &'static Shared) {
    let guard = SERIAL.lock().await;
    let config = config.to_owned();
    let kept = kept.to_vec();
    // Started on a thread of its own: the template build blocks on a runtime of its own.
    let shared = match SHARED.get() {
        Some(s) => s,
        None => tokio::task::spawn_blocking(move || {
            SHARED.get_or_init(|| start(&config, data_mib, &kept))
        })
        .await
        .unwrap(),
    };
    (guard, shared)
}

impl Shared {
    /// A client of the default tenant (or of `token`'s).
    pub async fn client(&self, token: Option<&str>) -> Client {
        airlock_api::client(Some(&format!("unix://{}", self.socket.display())), token)
            .await
            .expect("connect to the shared airlockd")
    }

    /// Destroys every live sandbox of the default tenant and of `tokens`' tenants: what a
    /// failed scenario left, so that the next one starts clean.
    pub async fn clean(&self, tokens: &[&str]) {
        use airlock_api::v1::{DestroySandboxRequest, ListSandboxesRequest};
        let tokens = std::iter::once(None).chain(tokens.iter().map(|t| Some(*t)));
        for token in tokens {
            let mut c = self.client(token).await;
            let live = c
                .list_sandboxes(ListSandboxesRequest::default())
                .await
                .unwrap()
                .into_inner()
                .sandboxes;
            for s in live {
                c.destroy_sandbox(DestroySandboxRequest { sandbox_id: s.id })
                    .await
                    .unwrap();
            }
        }
    }

    /// The last lines of the daemon's log (for failure messages).
    pub fn log_tail(&self) -> String {
        tail(&self.log)
    }
}

fn start(config: &str, data_mib: Option<u64>, kept: &[PathBuf]) -> Shared {
    crate::require_kvm();
    let dir = std::env::temp_dir().join(format!("airlock-shared-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("data")).unwrap();
    if let Some(mib) = data_mib {
        let mounted = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=700"),
                "airlock-test",
            ])
            .arg(dir.join("data"))
            .status()
            .unwrap();
        assert!(mounted.success(), "mounting a tmpfs for the data directory");
    }
    let cgroup_parent = format!("airlock-test-{}", std::process::id());
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    // A template this run built already with the same binaries and files is imported at the
    // daemon's start instead of booted again (tens of seconds to minutes per test process on
    // nested-KVM machines).
    let cached = template_cache(config);
    // Test binaries run side by side (tests/run.sh): the first to need a template builds and
    // keeps it while the others wait for it here, instead of each booting its own.
    let _building = cached.as_deref().map(lock_template_cache);
    let import = import_setting(cached.iter().chain(kept));
    let extra = format!("{import}metrics_listen = \"127.0.0.1:{metrics_port}\"\n{config}");
    let setup = harness::daemon_setup(&dir, &cgroup_parent, &extra);
    let (socket, data_dir, log) = (setup.socket, setup.data_dir, setup.log);
    let pid = spawn_kept(setup.command);
    // SAFETY: registers a plain `extern "C"` function that runs at exit.
    unsafe { libc::atexit(stop_at_exit) };
    harness::wait_listening(&socket, &log);
    let mut shared = Shared {
        dir,
        socket,
        data_dir,
        log,
        cgroup_parent,
        metrics_port,
        pid,
        template: Template::default(),
    };
    shared.template = match imported_template(&shared) {
        Some(t) => t,
        None => {
            let t = build_template(&shared);
            if let Some(to) = &cached {
                export_template(&shared.data_dir.join("templates").join(&t.id), &t, to);
            }
            t
        }
    };
    shared
}

/// Holds an exclusive lock on `KEY.lock` beside the template cache entry `dir` until the
/// returned file is closed.
pub fn lock_template_cache(dir: &Path) -> std::fs::File {
    use std::os::fd::AsRawFd as _;
    let lock = dir.with_extension("lock");
    if let Some(root) = lock.parent() {
        std::fs::create_dir_all(root).unwrap();
    }
    let f = std::fs::File::create(&lock).unwrap();
    // SAFETY: flock(2) on a descriptor this function owns; it blocks until the lock is ours.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock {}", lock.display());
    f
}

/// The daemon setting that imports the templates kept in `kept`, those that are there (none:
/// nothing; the daemon builds them).
pub fn import_setting<'a>(kept: impl IntoIterator<Item = &'a PathBuf>) -> String {
    let there: Vec<String> = kept
        .into_iter()
        .filter(|d| d.join(EXPORT_RECORD).is_file())
        .map(|d| format!("{:?}", d.display().to_string()))
        .collect();
    if there.is_empty() {
        return String::new();
    }
    format!("import_templates = [{}]\n", there.join(", "))
}

/// The record file of an exported template (as airlockd's `templates::EXPORT_RECORD`).
pub const EXPORT_RECORD: &str = "template.pb";

/// Settings that change what a template build makes: a daemon started with any of them
/// builds its own.
const TEMPLATE_SETTINGS: [&str; 8] = [
    "default_vcpus",
    "default_memory_mib",
    "default_disk_mib",
    "writable_root",
    "volume_slots",
    "images",
    "[images.default",
    "[jail",
];

/// Where this run keeps the template of a daemon started with `config`:
/// `$AIRLOCK_CACHE_DIR/test-templates/KEY` ([`template_cache_dir`]). `None` (build it) when the
/// settings change what a build makes or `AIRLOCK_TEST_TEMPLATE_CACHE=0`.
fn template_cache(config: &str) -> Option<PathBuf> {
    if config.lines().any(|l| {
        TEMPLATE_SETTINGS
            .iter()
            .any(|k| l.trim_start().starts_with(k))
    }) {
        return None;
    }
    template_cache_dir()
}

/// Where this run keeps the template `base` of the default settings:
/// `$AIRLOCK_CACHE_DIR/test-templates/KEY`, KEY a digest of the kernel, the base image and the
/// two binaries (each by path, size and modification time: a rebuild is a new key). `None`
/// when `AIRLOCK_TEST_TEMPLATE_CACHE=0`.
pub fn template_cache_dir() -> Option<PathBuf> {
    use sha2::Digest as _;
    use std::os::unix::fs::MetadataExt as _;
    if std::env::var("AIRLOCK_TEST_TEMPLATE_CACHE").is_ok_and(|v| v == "0") {
        return None;
    }
    let mut h = sha2::Sha256::new();
    for f in [
        crate::kernel(),
        crate::rootfs(),
        crate::binary("airlock-vmm"),
        crate::binary("airlockd"),
    ] {
        let m = std::fs::metadata(&f).ok()?;
        h.update(format!(
            "{} {} {} {}\n",
            f.display(),
            m.len(),
            m.mtime(),
            m.mtime_nsec()
        ));
    }
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let root = std::env::var_os("AIRLOCK_CACHE_DIR")
        .map_or_else(|| PathBuf::from("/var/cache/airlock"), PathBuf::from)
        .join("test-templates");
    Some(root.join(key))
}

/// The template `base` the daemon imported at its start, if it did.
fn imported_template(s: &Shared) -> Option<Template> {
    with_client(s, |mut c, _| async move {
        c.list_templates(airlock_api::v1::ListTemplatesRequest {})
            .await
            .unwrap()
            .into_inner()
            .templates
            .into_iter()
            .find(|t| t.name == "base")
    })
}

/// Keeps the template built in `dir` for the next test processes of this run: its snapshot's
/// files (holes kept) and record, put in place whole (a rename) or not at all. Entries older
/// than a day go.
pub fn export_template(dir: &Path, t: &Template, to: &Path) {
    use prost::Message as _;
    let Some(root) = to.parent() else { return };
    let _ = std::fs::create_dir_all(root);
    let day = Duration::from_secs(24 * 3600);
    for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > day);
        if old {
            let _ = std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_file(e.path()));
        }
    }
    let tmp = root.join(format!(".tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let copied = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(&tmp)?;
        for name in ["state", "memory", "layer", "layer.map"] {
            let src = dir.join(name);
            if !src.exists() {
                continue;
            }
            let ok = Command::new("cp")
                .arg("--sparse=always")
                .arg(&src)
                .arg(tmp.join(name))
                .status()?
                .success();
            if !ok {
                return Err(std::io::Error::other(format!("cp {}", src.display())));
            }
        }
        std::fs::write(tmp.join(EXPORT_RECORD), t.encode_to_vec())?;
        std::fs::rename(&tmp, to)
    })();
    if let Err(e) = copied {
        eprintln!("template not kept for later test processes: {e}");
        let _ = std::fs::remove_dir_all(&tmp);
    }
}

/// Spawns `cmd` from a thread that lives as long as the process, so that the child's
/// parent-death signal (SIGTERM) comes only when the process dies.
fn spawn_kept(mut cmd: Command) -> i32 {
    use std::os::unix::process::CommandExt;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let set_death_signal = || {
            // SAFETY: prctl(2) is async-signal-safe; it only sets this child's parent-death
            // signal.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
            Ok(())
        };
        // SAFETY: the closure runs between fork and exec and only calls prctl (above).
        unsafe { cmd.pre_exec(set_death_signal) };
        #[expect(clippy::zombie_processes, reason = "reaped by waitpid in stop_at_exit")]
        let child = cmd.spawn().expect("spawn airlockd");
        tx.send(child.id() as i32).unwrap();
        loop {
            std::thread::park();
        }
    });
    rx.recv().unwrap()
}

fn build_template(s: &Shared) -> Template {
    with_client(s, |mut c, log| async move {
        harness::build_template(&mut c, "base", &log).await
    })
}

/// Runs `f` with a client of the shared daemon (and its log's path) on a thread and runtime
/// of its own: the callers run inside the test's runtime, blocking.
fn with_client<T, F, Fut>(s: &Shared, f: F) -> T
where
    T: Send + 'static,
    F: FnOnce(Client, PathBuf) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    let (socket, log) = (s.socket.clone(), s.log.clone());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let c = airlock_api::client(Some(&format!("unix://{}", socket.display())), None)
                .await
                .unwrap();
            f(c, log).await
        })
    })
    .join()
    .unwrap()
}

/// Prints what the daemon logged of guests that crashed (with their consoles), so that a
/// crash in any test of this process shows its cause in the test output.
fn report_guest_crashes(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let crashes: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("GUEST_CRASHED") || l.contains("the guest's console ended"))
        .collect();
    if !crashes.is_empty() {
        eprintln!(
            "guest crashes in the shared daemon's log:\n{}",
            crashes.join("\n")
        );
    }
}

/// Stops the shared daemon (SIGTERM, then SIGKILL after 60 s) and removes what it had.
extern "C" fn stop_at_exit() {
    let Some(s) = SHARED.get() else { return };
    // SAFETY: kill(2) and waitpid(2) on our own child; no memory is shared.
    unsafe { libc::kill(s.pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut status = 0;
        // SAFETY: as above; `status` is a live local.
        let r = unsafe { libc::waitpid(s.pid, &mut status, libc::WNOHANG) };
        if r != 0 {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: as above.
            unsafe { libc::kill(s.pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    report_guest_crashes(&s.log);
    remove_parent_cgroups(&s.cgroup_parent);
    // A tmpfs the data directory may be on (nothing when it is not a mount point).
    let _ = Command::new("umount")
        .arg(s.dir.join("data"))
        .stderr(std::process::Stdio::null())
        .status();
    let _ = std::fs::remove_dir_all(&s.dir);
}
