//! Services: long-running processes that an image asks the agent to keep running (a code
//! interpreter's server, say), each named by a file `/etc/airlock/services/NAME.json`:
//!
//! ```json
//! {"argv": ["python3", "/usr/lib/airlock/interpreter/server.py"], "user": "user",
//!  "cwd": "/home/user", "env": {"K": "V"}}
//! ```
//!
//! Only `argv` is required. `user` defaults to the account of requests that name none (`user`
//! in a VM); a service never runs as root (uid 0), and is always locked down (no_new_privs and
//! an empty capability bounding set: sudo gives it nothing, whatever the sandbox's policy,
//! which is not known yet when it starts). `cwd` defaults to the account's home; `env` adds to
//! the environment executions start from (with the account's HOME, USER and LOGNAME).
//!
//! The files are read once, right after the agent is ready (so they cost the boot nothing), at
//! most [`MAX_SERVICES`] of them, in name order; a file that is not valid is reported on the
//! console and skipped. Each service gets a thread that starts it in its own cgroup
//! `service-NAME` (no execution's cleanup touches it; without cgroups, its own session and
//! process group), sends its stdout and stderr to `<state dir>/services/NAME.log` (rotated to
//! `NAME.log.1` at [`LOG_MAX_BYTES`]; the console where there is no state directory), and
//! starts it again whenever it exits, `kill -9` included, after a [`Backoff`]. Whatever the
//! service left running when its main process exited (a daemonised child) is killed before the
//! next start. Its exit comes from the reaper, like an execution's.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_proto::MAX_ARGV_ENV_BYTES;

use crate::exec_spec;
use crate::init;
use crate::reaper::{ExitSlot, Waker};
use crate::spawn::Spawner;
use crate::sys::{self, Reaped};
use crate::users::{Account, Users};

/// Where the image's service files are, inside the VM.
pub const SERVICES_DIR: &str = "/etc/airlock/services";
/// Most services started; files after these (in name order) are reported and skipped.
pub const MAX_SERVICES: usize = 8;
/// Largest service file read.
const MAX_FILE_BYTES: u64 = 64 << 10;
/// Most argv entries.
const MAX_ARGS: usize = 256;
/// Longest service name (the file name without `.json`).
const MAX_NAME_BYTES: usize = 32;
/// A log file is rotated (to `NAME.log.1`, replacing the one before) once it is this large.
pub const LOG_MAX_BYTES: u64 = 1 << 20;
/// The first restart delay, doubled after each quick exit up to [`BACKOFF_MAX`].
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// A run this long resets the delay to [`BACKOFF_MIN`].
pub const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(30);

/// A validated service file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub argv: Vec<String>,
    /// The account; empty: the default one (see [`Users::resolve`]).
    pub user: String,
    /// Empty: the account's home.
    pub cwd: String,
    /// Added to the base environment, sorted by name.
    pub env: Vec<(String, String)>,
}

/// A service file as written.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ServiceFile {
    argv: Vec<String>,
    #[serde(default)]
    user: String,
    #[serde(default)]
    cwd: String,
    #[serde(default)]
    env: BTreeMap<String, String>,
}

/// Checks service `name`'s file `text`.
pub fn parse(name: &str, text: &str) -> Result<Service, String> {
    let valid_name = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !valid_name {
        return Err(format!(
            "invalid service name {name:?} (1 to {MAX_NAME_BYTES} of A-Z a-z 0-9 . _ -)"
        ));
    }
    let file: ServiceFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if file.argv.first().is_none_or(String::is_empty) {
        return Err("argv is empty".into());
    }
    if file.argv.len() > MAX_ARGS {
        return Err(format!(
            "argv has {} entries, limit {MAX_ARGS}",
            file.argv.len()
        ));
    }
    let args: usize = file.argv.iter().map(|a| a.len() + 1).sum();
    let vars: usize = file.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if args + vars > MAX_ARGV_ENV_BYTES {
        return Err(format!(
            "argv and env take {} bytes, limit {MAX_ARGV_ENV_BYTES}",
            args + vars
        ));
    }
    let strings = file
        .argv
        .iter()
        .chain(file.env.keys())
        .chain(file.env.values());
    if strings
        .chain([&file.user, &file.cwd])
        .any(|s| s.contains('\0'))
    {
        return Err("argv, env, user and cwd must not contain NUL bytes".into());
    }
    if let Some(bad) = file.env.keys().find(|k| k.is_empty() || k.contains('=')) {
        return Err(format!("invalid environment name {bad:?}"));
    }
    if !file.cwd.is_empty() && !file.cwd.starts_with('/') {
        return Err(format!("cwd {:?} is not absolute", file.cwd));
    }
    Ok(Service {
        name: name.to_owned(),
        argv: file.argv,
        user: file.user,
        cwd: file.cwd,
        env: file.env.into_iter().collect(),
    })
}

/// The services of `dir`'s `*.json` files, in name order, at most [`MAX_SERVICES`]; with a
/// message for each file skipped. A missing directory has none.
pub fn load(dir: &Path) -> (Vec<Service>, Vec<String>) {
    let mut errors = Vec::new();
    let mut names: Vec<(String, PathBuf)> = match fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .filter_map(|e| {
                let file = e.file_name().into_string().ok()?;
                let name = file.strip_suffix(".json")?.to_owned();
                Some((name, e.path()))
            })
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            errors.push(format!("{}: {e}", dir.display()));
            Vec::new()
        }
    };
    names.sort();
    let mut services = Vec::new();
    for (name, path) in names {
        if services.len() == MAX_SERVICES {
            errors.push(format!(
                "{}: skipped: at most {MAX_SERVICES} services",
                path.display()
            ));
            continue;
        }
        match read_bounded(&path).and_then(|text| parse(&name, &text)) {
            Ok(s) => services.push(s),
            Err(e) => errors.push(format!("{}: {e}", path.display())),
        }
    }
    (services, errors)
}

fn read_bounded(path: &Path) -> Result<String, String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    if !file.metadata().map_err(|e| e.to_string())?.is_file() {
        return Err("not a regular file".into());
    }
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(format!("larger than {MAX_FILE_BYTES} bytes"));
    }
    Ok(text)
}

/// The delay before a service starts again: [`BACKOFF_MIN`] after a run of at least
/// [`BACKOFF_RESET_AFTER`], else twice the last one, at most [`BACKOFF_MAX`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: BACKOFF_MIN }
    }
}

impl Backoff {
    /// The delay after a run that lasted `uptime`.
    pub fn after_run(&mut self, uptime: Duration) -> Duration {
        if uptime >= BACKOFF_RESET_AFTER {
            self.next = BACKOFF_MIN;
        }
        let delay = self.next;
        self.next = (delay * 2).min(BACKOFF_MAX);
        delay
    }
}

/// What every service's thread shares.
#[derive(Debug, Clone)]
pub struct Supervisor {
    pub spawner: Arc<Spawner>,
    pub users: Users,
    /// Where `services/NAME.log` go; none: the console.
    pub state_dir: Option<PathBuf>,
}

impl Supervisor {
    /// Reads `dir` and starts a thread for each service in it; reports problems on the console.
    pub fn start_all(&self, dir: &Path) {
        let (services, errors) = load(dir);
        for e in errors {
            eprintln!("airlock-agent: service file {e}");
        }
        for service in services {
            let me = self.clone();
            let name = service.name.clone();
            let thread = std::thread::Builder::new()
                .name(format!("service-{name}"))
                .spawn(move || me.supervise(&service));
            if let Err(e) = thread {
                eprintln!("airlock-agent: service {name}: no thread: {e}");
            }
        }
    }

    /// Runs `service` for ever, again after each exit.
    fn supervise(&self, service: &Service) {
        let mut backoff = Backoff::default();
        loop {
            let started = Instant::now();
            let outcome = self.run_once(service);
            let uptime = started.elapsed();
            let delay = backoff.after_run(uptime);
            eprintln!(
                "airlock-agent: service {}: {outcome} after {} ms; starting it again in {} ms",
                service.name,
                uptime.as_millis(),
                delay.as_millis()
            );
            std::thread::sleep(delay);
        }
    }

    /// Starts the service and waits until its main process exits; says how it ended.
    fn run_once(&self, service: &Service) -> String {
        let account = match self.account(service) {
            Ok(a) => a,
            Err(e) => return format!("not started: {e}"),
        };
        let mut log = match self.log(service) {
            Ok(l) => l,
            Err(e) => return format!("not started: its log: {e}"),
        };
        let cgroup = match &self.spawner.cgroups {
            Some(root) => match root.create_service(&service.name) {
                Ok(cg) => Some(cg),
                Err(e) => return format!("not started: {e}"),
            },
            None => None,
        };
        let started = self.spawn(
            service,
            account.as_ref(),
            cgroup.as_ref().map(|c| c.procs_fd()),
        );
        let (pid, waker, exit, reader) = match started {
            Ok(s) => s,
            Err(e) => {
                if let Some(cg) = &cgroup {
                    let _ = cg.kill_and_remove();
                }
                return format!("not started: {e}");
            }
        };
        let reaped = pump(&reader, &waker, &exit, &mut log);
        // What it left running goes with it: the next run starts clean.
        match &cgroup {
            Some(cg) => {
                let _ = cg.kill_and_remove();
            }
            None => {
                let _ = sys::killpg(i32::try_from(pid).unwrap_or(0), libc::SIGKILL);
            }
        }
        describe(&reaped)
    }

    /// The account the service runs as (none: the agent's own), locked down; never root.
    fn account(&self, service: &Service) -> Result<Option<Account>, String> {
        let account = self.users.resolve(&service.user).map_err(|e| e.message)?;
        match account {
            Some(a) if a.is_root() => Err(format!("account {:?} is root", a.name)),
            Some(a) => Ok(Some(Account {
                lock_down: true,
                ..a
            })),
            None => Ok(None),
        }
    }

    fn log(&self, service: &Service) -> io::Result<Log> {
        match &self.state_dir {
            Some(state) => {
                let dir = state.join("services");
                // The agent's umask is 0: the mode is exactly this.
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(&dir)?;
                Log::open(dir.join(format!("{}.log", service.name)))
            }
            None => Ok(Log::Console),
        }
    }

    /// Spawns the service's main process, its stdout and stderr on one pipe.
    fn spawn(
        &self,
        service: &Service,
        account: Option<&Account>,
        cgroup_procs: Option<std::os::fd::RawFd>,
    ) -> io::Result<(u32, Arc<Waker>, Arc<ExitSlot>, io::PipeReader)> {
        let invalid = |m: &str| io::Error::new(io::ErrorKind::InvalidInput, m.to_owned());
        let (program, args) = service
            .argv
            .split_first()
            .ok_or_else(|| invalid("no argv"))?;
        let mut env: BTreeMap<String, String> = exec_spec::base_env("").into_iter().collect();
        if let Some(a) = account {
            env.insert("HOME".into(), a.home.clone());
            env.insert("USER".into(), a.name.clone());
            env.insert("LOGNAME".into(), a.name.clone());
        }
        env.extend(service.env.iter().cloned());
        let cwd = if service.cwd.is_empty() {
            account
                .map(|a| a.home.as_str())
                .filter(|h| h.starts_with('/') && Path::new(h).is_dir())
                .unwrap_or("/")
        } else {
            service.cwd.as_str()
        };
        let cwd = CString::new(cwd).map_err(|_| invalid("cwd contains a NUL byte"))?;
        let (reader, writer) = io::pipe()?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env_clear()
            .envs(&env)
            .stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer);
        let drop_to = account.map(|a| sys::Credentials {
            uid: a.uid,
            gid: a.gid,
            groups: a.groups.clone(),
            lock_down: a.lock_down,
        });
        sys::prepare_child(&mut cmd, cgroup_procs, drop_to, cwd);
        let waker = Arc::new(Waker::new()?);
        let exit = Arc::new(ExitSlot::new(Arc::clone(&waker)));
        let child = self.spawner.reaper.spawn(&mut cmd, Arc::clone(&exit))?;
        // The write ends went with `cmd`'s stdout and stderr when it was dropped: the pipe
        // reads EOF once every process holding it is gone.
        drop(cmd);
        sys::set_nonblocking(reader.as_fd())?;
        Ok((child.id(), waker, exit, reader))
    }
}

/// Copies the service's output to `log` until its main process exits (then what is already
/// in the pipe); returns the exit.
fn pump(reader: &io::PipeReader, waker: &Waker, exit: &ExitSlot, log: &mut Log) -> Reaped {
    use std::os::fd::AsRawFd;
    let mut buf = vec![0u8; 16 << 10];
    let mut open = true;
    loop {
        if let Some((reaped, _)) = exit.take() {
            if open {
                drain(reader, &mut buf, log);
            }
            return reaped;
        }
        let mut fds = [
            libc::pollfd {
                fd: waker.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: if open { reader.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        if let Err(e) = sys::poll(&mut fds, None) {
            eprintln!("airlock-agent: poll: {e}");
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        if fds[0].revents != 0 {
            waker.drain();
        }
        if open && fds[1].revents != 0 {
            open = drain(reader, &mut buf, log);
        }
    }
}

/// Reads what is in the pipe now into `log`; false once it is at EOF (or broken).
fn drain(mut reader: &io::PipeReader, buf: &mut [u8], log: &mut Log) -> bool {
    loop {
        match reader.read(buf) {
            Ok(0) => return false,
            Ok(n) => log.write(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

/// How a service's main process ended, in words.
fn describe(reaped: &Reaped) -> String {
    if libc::WIFSIGNALED(reaped.status) {
        format!("killed by signal {}", libc::WTERMSIG(reaped.status))
    } else {
        format!("exited with code {}", libc::WEXITSTATUS(reaped.status))
    }
}

/// Where a service's output goes.
#[derive(Debug)]
enum Log {
    Console,
    File {
        path: PathBuf,
        file: File,
        written: u64,
    },
}

impl Log {
    /// Readable by every account (0644), so that an execution as the service's own
    /// unprivileged account (a template's warm-up, a user debugging) can read why it failed.
    fn open(path: PathBuf) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o644)
            .open(&path)?;
        let written = file.metadata()?.len();
        Ok(Self::File {
            path,
            file,
            written,
        })
    }

    /// Appends `data`; a file that reached [`LOG_MAX_BYTES`] becomes `NAME.log.1` first.
    fn write(&mut self, data: &[u8]) {
        match self {
            Self::Console => {
                // The console is the agent's stderr; a failed write has nowhere to go.
                let _ = io::stderr().write_all(data);
            }
            Self::File {
                path,
                file,
                written,
            } => {
                if *written >= LOG_MAX_BYTES {
                    let mut old = path.clone().into_os_string();
                    old.push(".1");
                    let _ = fs::rename(&*path, old);
                    match Self::open(path.clone()) {
                        Ok(fresh) => *self = fresh,
                        Err(e) => {
                            init::console(&format!("airlock-agent: {}: {e}", path.display()));
                            *self = Self::Console;
                        }
                    }
                    return self.write(data);
                }
                let _ = file.write_all(data);
                *written += data.len() as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_takes_a_full_file_and_defaults_the_rest() {
        let text = r#"{"argv": ["python3", "/srv/s.py"], "user": "user", "cwd": "/home/user",
                      "env": {"B": "2", "A": "1"}}"#;
        let s = parse("interpreter", text).unwrap();
        assert_eq!(s.argv, ["python3", "/srv/s.py"]);
        assert_eq!((s.user.as_str(), s.cwd.as_str()), ("user", "/home/user"));
        assert_eq!(s.env, [("A".into(), "1".into()), ("B".into(), "2".into())]);
        let s = parse("x", r#"{"argv": ["/bin/true"]}"#).unwrap();
        assert_eq!((s.user.as_str(), s.cwd.as_str()), ("", ""));
        assert!(s.env.is_empty());
    }

    #[test]
    fn parse_refuses_bad_files() {
        let bad = [
            ("ok", r#"{"argv": []}"#),
            ("ok", r#"{"argv": [""]}"#),
            ("ok", r#"{"argv": ["a"], "bogus": 1}"#),
            ("ok", r#"{"argv": "a"}"#),
            ("ok", r#"{"argv": ["a\u0000b"]}"#),
            ("ok", r#"{"argv": ["a"], "env": {"A=B": "c"}}"#),
            ("ok", r#"{"argv": ["a"], "env": {"": "c"}}"#),
            ("ok", r#"{"argv": ["a"], "cwd": "relative"}"#),
            ("ok", "not json"),
            ("", r#"{"argv": ["a"]}"#),
            (".hidden", r#"{"argv": ["a"]}"#),
            ("a/b", r#"{"argv": ["a"]}"#),
            (&"n".repeat(MAX_NAME_BYTES + 1), r#"{"argv": ["a"]}"#),
        ];
        for (name, text) in bad {
            assert!(parse(name, text).is_err(), "{name:?} {text}");
        }
    }

    #[test]
    fn parse_bounds_argv() {
        let many = serde_json::json!({ "argv": vec!["a"; MAX_ARGS + 1] }).to_string();
        assert!(parse("x", &many).unwrap_err().contains("entries"));
        let big = serde_json::json!({ "argv": ["a", "x".repeat(MAX_ARGV_ENV_BYTES)] });
        assert!(parse("x", &big.to_string()).unwrap_err().contains("bytes"));
    }

    #[test]
    fn load_reads_json_files_in_name_order_bounded() {
        let dir = std::env::temp_dir().join(format!("airlock-services-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        for i in 0..MAX_SERVICES + 2 {
            fs::write(dir.join(format!("s{i:02}.json")), r#"{"argv": ["a"]}"#).unwrap();
        }
        fs::write(dir.join("a-bad.json"), "{").unwrap();
        fs::write(dir.join("README"), "not a service").unwrap();
        let (services, errors) = load(&dir);
        let names: Vec<_> = services.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            ["s00", "s01", "s02", "s03", "s04", "s05", "s06", "s07"]
        );
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[0].contains("a-bad.json"), "{errors:?}");
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(load(&dir), (vec![], vec![]));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets_after_a_long_run() {
        let mut b = Backoff::default();
        let quick = Duration::from_millis(10);
        let delays: Vec<_> = (0..8).map(|_| b.after_run(quick).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(b.after_run(BACKOFF_RESET_AFTER), BACKOFF_MIN);
        assert_eq!(b.after_run(quick), BACKOFF_MIN * 2);
    }

    #[test]
    fn log_rotates_at_its_limit() {
        let dir = std::env::temp_dir().join(format!("airlock-svclog-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.log");
        let mut log = Log::open(path.clone()).unwrap();
        let chunk = vec![b'x'; 64 << 10];
        for _ in 0..(LOG_MAX_BYTES / chunk.len() as u64) {
            log.write(&chunk);
        }
        log.write(b"after");
        assert_eq!(fs::read(&path).unwrap(), b"after");
        assert_eq!(
            fs::metadata(dir.join("s.log.1")).unwrap().len(),
            LOG_MAX_BYTES
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
