//! A live `airlockd` for system tests: started with the built artifacts, a client of it, and
//! what tests look at on the host afterwards (processes, cgroups).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use airlock_api::v1::*;

use crate::{ChildGuard, binary, kernel, rootfs};

/// The gRPC client type of the tests.
pub type Client = airlock_api::v1::airlock_client::AirlockClient<airlock_api::AuthChannel>;

/// A running `airlockd` of a test; dropping it stops the daemon (SIGTERM, then SIGKILL).
#[derive(Debug)]
pub struct Daemon {
    pub cgroup_parent: String,
    pub child: ChildGuard,
    pub socket: PathBuf,
    pub data_dir: PathBuf,
    pub log: PathBuf,
}

/// Where a test daemon in `dir` listens, keeps its data and logs, and how it is started.
#[derive(Debug)]
pub struct DaemonSetup {
    pub command: Command,
    pub socket: PathBuf,
    pub data_dir: PathBuf,
    pub log: PathBuf,
}

/// The `airlockd` of a test, on a Unix socket in `dir`, with its data in `dir/data`, sandbox
/// cgroups under `cgroup_parent`, the built kernel, image and VMM, and `extra` appended to its
/// config (top-level keys first, then tables). Not started yet.
/// The size of a test daemon's jail uid range.
const UID_RANGE: u32 = 16_384;

/// The first uid of the range of the daemon in `dir`: one of 32,768 ranges from 10^9 (below
/// the production default, 1.9 * 10^9), picked by the test process and the directory.
fn uid_base(dir: &Path) -> u32 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (std::process::id(), dir).hash(&mut h);
    1_000_000_000 + (h.finish() % 32_768) as u32 * UID_RANGE
}

pub fn daemon_setup(dir: &Path, cgroup_parent: &str, extra: &str) -> DaemonSetup {
    let socket = dir.join("airlockd.sock");
    let data_dir = dir.join("data");
    let config = dir.join("airlockd.toml");
    std::fs::write(
        &config,
        format!(
            "cgroup_parent = \"{cgroup_parent}\"\n\
             kernel = \"{}\"\nrootfs = \"{}\"\nvmm_binary = \"{}\"\nready_timeout_ms = 120000\n\
             {}{extra}{}",
            kernel().display(),
            rootfs().display(),
            binary("airlock-vmm").display(),
            // A stopped test daemon leaves nothing running, unless the test asks otherwise.
            if extra.contains("adopt_on_restart") {
                ""
            } else {
                "adopt_on_restart = false\n"
            },
            // Test processes run side by side (tests/run.sh), and a process may run several
            // daemons: each daemon hands its VMMs uids of a range of its own (the daemon
            // refuses a range another live daemon holds), kept across its restarts (its data
            // directory names it), unless the test sets one.
            if extra.contains("[jail]") {
                String::new()
            } else {
                format!(
                    "\n[jail]\nuid_base = {}\nuid_count = {UID_RANGE}\n",
                    uid_base(dir)
                )
            }
        ),
    )
    .unwrap();
    let log = dir.join(format!(
        "airlockd-{}.log",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    ));
    let mut command = Command::new(binary("airlockd"));
    command
        .arg("--config")
        .arg(&config)
        .arg("--listen")
        .arg(format!("unix://{}", socket.display()))
        .arg("--data-dir")
        .arg(&data_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let _ = std::fs::remove_file(&socket);
    DaemonSetup {
        command,
        socket,
        data_dir,
        log,
    }
}

/// Waits (up to 30 s) until a daemon listens on `socket`.
pub fn wait_listening(socket: &Path, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline,
            "airlockd did not listen: {}",
            tail(log)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (up to 30 s) until something accepts TCP connections on loopback `port` (a daemon's
/// TCP listeners start after its Unix socket, so [`wait_listening`] does not cover them).
pub fn wait_tcp_listening(port: u16, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "airlockd did not listen on port {port}: {}",
            tail(log)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `airlockd` as [`daemon_setup`] describes it and waits until it listens.
pub fn start_daemon(dir: &Path, cgroup_parent: &str, extra: &str) -> Daemon {
    let mut setup = daemon_setup(dir, cgroup_parent, extra);
    let child = ChildGuard::spawn(&mut setup.command);
    wait_listening(&setup.socket, &setup.log);
    Daemon {
        cgroup_parent: cgroup_parent.to_owned(),
        child,
        socket: setup.socket,
        data_dir: setup.data_dir,
        log: setup.log,
    }
}

impl Drop for Daemon {
    /// A failed test still stops the daemon cleanly (SIGTERM ends every VMM it started) before
    /// `ChildGuard` would kill it outright.
    fn drop(&mut self) {
        if let Some(child) = self.child.0.as_mut() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            remove_parent_cgroups(&self.cgroup_parent);
        }
    }
}

/// The body (and head) of `GET path` on `127.0.0.1:port`.
pub async fn http_get(port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body
}

/// Cgroup hierarchies the daemon may use (v2 at the root, v1 per controller).
pub const HIERARCHIES: [&str; 5] = ["", "memory", "cpu", "pids", "cpuacct"];

/// Removes the test's (empty) parent cgroups.
pub fn remove_parent_cgroups(parent: &str) {
    for h in HIERARCHIES {
        let _ = std::fs::remove_dir(Path::new("/sys/fs/cgroup").join(h).join(parent));
    }
}

/// The last 30 lines of a log file.
pub fn tail(p: &Path) -> String {
    let t = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = t.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A gRPC client of `d`, with `token` if given.
pub async fn client(d: &Daemon, token: Option<&str>) -> Client {
    airlock_api::client(Some(&format!("unix://{}", d.socket.display())), token)
        .await
        .expect("connect to airlockd")
}

/// Builds the template `name` (one cold boot, the default warm-up, a snapshot) and returns it;
/// a failure shows the daemon's log at `log`.
pub async fn build_template(c: &mut Client, name: &str, log: &Path) -> Template {
    let mut events = c
        .create_template(CreateTemplateRequest {
            name: name.into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("template {name}: {e:?}\n{}", tail(log)))
        .into_inner();
    let mut template = None;
    while let Some(ev) = events
        .message()
        .await
        .unwrap_or_else(|e| panic!("template {name}: {e:?}\n{}", tail(log)))
    {
        if let Some(t) = ev.template {
            template = Some(t);
        }
    }
    template.expect("the last event carries the template")
}

/// A sandbox of the default template; a failure shows the daemon's log at `log`.
pub async fn create_sandbox(c: &mut Client, log: &Path) -> Sandbox {
    c.create_sandbox(CreateSandboxRequest::default())
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", tail(log)))
        .into_inner()
}

/// An Exec request of a `/bin/sh -c` script.
pub fn shell(sandbox: &str, script: &str, timeout_ms: u64) -> ExecRequest {
    ExecRequest {
        sandbox_id: sandbox.into(),
        command: Some(exec_request::Command::Shell(script.into())),
        timeout_ms,
        ..Default::default()
    }
}

/// The ErrorInfo reason and metadata of a failed call.
pub fn reason(s: &tonic::Status) -> (String, HashMap<String, String>) {
    airlock_api::error_info(s).unwrap_or_else(|| panic!("no ErrorInfo in {s:?}"))
}

/// Whether `pid` runs (exists and is not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            !s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

/// Pids of processes whose command line mentions `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline"))
            && String::from_utf8_lossy(&cmd).contains(needle)
            && alive(pid)
        {
            out.push(pid);
        }
    }
    out
}

/// Sandbox cgroups left under the test's parent, in every hierarchy.
pub fn cgroups_left(parent: &str) -> Vec<PathBuf> {
    let mut left = Vec::new();
    for h in HIERARCHIES {
        let dir = Path::new("/sys/fs/cgroup").join(h).join(parent);
        if let Ok(rd) = std::fs::read_dir(&dir) {
            left.extend(rd.flatten().filter(|e| e.path().is_dir()).map(|e| e.path()));
        }
    }
    left
}

/// An execution's record with its retained output.
pub async fn execution_with_output(c: &mut Client, execution: &str) -> GetExecutionResponse {
    c.get_execution(GetExecutionRequest {
        execution_id: execution.into(),
        include_output: true,
    })
    .await
    .unwrap_or_else(|e| panic!("get execution {execution}: {e:?}"))
    .into_inner()
}

/// Runs `argv` in `sandbox` and follows it to its end: (stdout, stderr, record).
pub async fn run(c: &mut Client, sandbox: &str, argv: &[&str]) -> (String, String, Execution) {
    run_as(c, sandbox, "", argv).await
}

/// [`run`] as the guest account `user` (empty: the default).
pub async fn run_as(
    c: &mut Client,
    sandbox: &str,
    user: &str,
    argv: &[&str],
) -> (String, String, Execution) {
    run_long(c, sandbox, user, argv, 300_000).await
}

/// [`run_as`] with a timeout of `timeout_ms` instead of 5 minutes (programs whose start alone
/// takes minutes through the emulated guest kernel of the build machines, such as npm).
pub async fn run_long(
    c: &mut Client,
    sandbox: &str,
    user: &str,
    argv: &[&str],
    timeout_ms: u64,
) -> (String, String, Execution) {
    let ex = c
        .exec(ExecRequest {
            sandbox_id: sandbox.into(),
            command: Some(exec_request::Command::Argv(Argv {
                args: argv.iter().map(|s| s.to_string()).collect(),
            })),
            timeout_ms,
            user: user.into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("exec in {sandbox}: {e:?}"))
        .into_inner();
    let mut s = c
        .stream_execution(StreamExecutionRequest {
            execution_id: ex.execution_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    while let Some(ev) = s.message().await.unwrap() {
        match ev.event {
            Some(execution_event::Event::Output(o)) if o.stream == StreamKind::Stdout as i32 => {
                out.extend(o.data)
            }
            Some(execution_event::Event::Output(o)) => err.extend(o.data),
            Some(execution_event::Event::Exit(e)) => {
                return (
                    String::from_utf8_lossy(&out).into(),
                    String::from_utf8_lossy(&err).into(),
                    e,
                );
            }
            None => {}
        }
    }
    panic!("execution {} stream ended without an exit", ex.execution_id);
}

/// Reads a whole file out of a sandbox.
pub async fn read_all(c: &mut Client, sandbox: &str, path: &str) -> Vec<u8> {
    let mut chunks = c
        .read_file(ReadFileRequest {
            sandbox_id: sandbox.into(),
            path: path.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(ch) = chunks.message().await.unwrap() {
        out.extend(ch.data);
    }
    out
}

/// A reply to [`http_exchange`]: the status and its reason phrase, the head (lowercase) and the
/// body (chunks joined).
#[derive(Debug)]
pub struct HttpReply {
    pub status: u16,
    pub reason: String,
    pub head: String,
    pub body: Vec<u8>,
}

impl HttpReply {
    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The value of header `name` (lowercase), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim())
        })
    }
}

/// One HTTP/1.1 request on `s` (`Connection: close`; `Host: 127.0.0.1` unless `headers` name
/// one) and its whole reply.
pub fn http_exchange(
    mut s: std::net::TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpReply {
    use std::io::{Read as _, Write as _};
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str("Host: 127.0.0.1\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let rest = &raw[split + 4..];
    let first = head.lines().next().unwrap_or("");
    let mut parts = first.splitn(3, ' ');
    let status = parts
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let reason = parts.next().unwrap_or("").to_owned();
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    HttpReply {
        status,
        reason,
        head,
        body,
    }
}

/// The data of a chunked body.
fn dechunk(mut rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = String::from_utf8_lossy(&rest[..eol]);
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        let data = &rest[eol + 2..];
        out.extend_from_slice(&data[..n.min(data.len())]);
        rest = data.get(n + 2..).unwrap_or_default();
    }
    out
}

/// The network of a sandbox as its guest sees it, entered from the host: connections made
/// here start inside the sandbox's namespace (the VMM's), so they meet the daemon's sockets
/// there exactly where the guest's do. Made once per sandbox; the namespace's own ruleset is
/// left as it is.
#[derive(Debug)]
pub struct GuestNet {
    ns: std::os::fd::OwnedFd,
}

impl GuestNet {
    /// The namespace of the sandbox whose VMM is `vmm_pid`. The sandbox's ruleset redirects the
    /// guest's TCP (arriving on its TAP) to the daemon's proxy; connections made in the
    /// namespace itself do not pass that hook, so a table of the test's own (`airlock_test`)
    /// sends them to the proxy the same way, keeping their original destination (which the
    /// proxy reads, as it does for the guest's).
    pub fn of(vmm_pid: u32) -> Self {
        let ns: std::os::fd::OwnedFd = std::fs::File::open(format!("/proc/{vmm_pid}/ns/net"))
            .unwrap_or_else(|e| panic!("the namespace of VMM {vmm_pid}: {e}"))
            .into();
        // Made again (flushed first) when a test enters the same namespace twice.
        let rules = "add table ip airlock_test\nflush table ip airlock_test\n\
                     table ip airlock_test {\n  chain output {\n    \
                     type nat hook output priority -100; policy accept;\n    \
                     ip daddr 100.96.0.1 tcp dport != 15001 dnat to 100.96.0.1:15001\n  }\n}\n";
        use std::os::fd::AsFd as _;
        let out = airlock_netcfg::in_netns(ns.as_fd(), move || {
            let mut child = Command::new("nft")
                .args(["-f", "-"])
                .stdin(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            use std::io::Write as _;
            child.stdin.take().unwrap().write_all(rules.as_bytes())?;
            child.wait_with_output()
        })
        .unwrap();
        assert!(
            out.status.success(),
            "nft in the sandbox's namespace: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { ns }
    }

    /// A TCP connection to `addr` from inside the sandbox's namespace.
    pub fn connect(&self, addr: std::net::SocketAddr) -> std::net::TcpStream {
        use std::os::fd::AsFd as _;
        airlock_netcfg::in_netns(self.ns.as_fd(), move || {
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(30))
        })
        .unwrap_or_else(|e| panic!("connect to {addr} in the sandbox's namespace: {e}"))
    }

    /// `GET url` (`http://HOST:PORT/PATH`) through the sandbox's network, with `headers`.
    pub fn get(&self, url: &str, headers: &[(&str, &str)]) -> HttpReply {
        let rest = url
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("not an http URL: {url}"));
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let addr: std::net::SocketAddr = authority
            .parse()
            .unwrap_or_else(|e| panic!("{authority}: {e}"));
        let mut all = vec![("Host", authority)];
        all.extend_from_slice(headers);
        http_exchange(
            self.connect(addr),
            "GET",
            if path.is_empty() { "/" } else { path },
            &all,
            &[],
        )
    }
}
