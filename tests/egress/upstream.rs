//! The upstream of the egress, broker, tools, restart and hostile tests: a network namespace
//! the test process makes (`airlock-up-egress`, `-broker`, `-tools`, `-restart` or `-hostile`,
//! after the test binary, reached from the host over
//! a veth pair on a /30 of its own: the binaries may run at the same time), where a Python
//! HTTP/HTTPS server of the test listens on [`UPSTREAM`] and logs what reaches it; the daemon's
//! static host map names it (`allowed.test`, `denied.test`, `a.wild.test`). Under `/git/` it
//! serves the files of [`Upstream::git_root`] as they are (git's "dumb" HTTP protocol). Traffic
//! stays on this machine. Removed when the test process ends.
#![allow(dead_code)] // each test binary uses a part of it

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use airlock_api::v1::{EgressEvent, EgressRule, GetEgressLogRequest, NetworkPolicy, egress_rule};
use airlock_system_tests::harness::{Client, run_as};
use airlock_system_tests::shared::Shared;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// Which test binary this is (egress, broker, tools, restart, hostile): each has its own names and
/// /30, so that they may run at the same time.
const INDEX: usize = match env!("CARGO_CRATE_NAME").as_bytes()[0] {
    b'b' => 1,
    b't' => 2,
    b'r' => 3,
    b'h' => 4,
    _ => 0,
};
pub const NS: &str = concat!("airlock-up-", env!("CARGO_CRATE_NAME"));
pub const VETH: &str = concat!("al-up-", env!("CARGO_CRATE_NAME"));
pub const HOST_SIDE: &str = [
    "10.213.0.1",
    "10.213.0.5",
    "10.213.0.9",
    "10.213.0.13",
    "10.213.0.17",
][INDEX];
pub const UPSTREAM: &str = [
    "10.213.0.2",
    "10.213.0.6",
    "10.213.0.10",
    "10.213.0.14",
    "10.213.0.18",
][INDEX];

/// The daemon's settings: the static host map (`UPSTREAM_ADDRESS` replaced by [`UPSTREAM`]),
/// and the test CA as the broker's upstream CA (after `[network] broker_upstream_ca = "..."`,
/// from [`config`]).
const CONFIG: &str = r#"pool_size = 1
[network.hosts]
"allowed.test" = ["UPSTREAM_ADDRESS"]
"denied.test" = ["UPSTREAM_ADDRESS"]
"a.wild.test" = ["UPSTREAM_ADDRESS"]
"#;

/// The upstream's server: HTTP on 80, HTTPS on 443 (the test CA's certificate for
/// allowed.test), a UDP sink on 9999; every request and datagram is logged to argv[1].
pub const SERVER: &str = r#"
import http.server, os, socket, ssl, sys, threading
log = open(sys.argv[1], 'a', buffering=1)
addr = sys.argv[2]
git_root = sys.argv[5]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith('/git/'):
            return self.git()
        host = self.headers.get('Host')
        auth = self.headers.get('Authorization')
        key = self.headers.get('X-Api-Key')
        log.write(f"http {self.server.server_port} {host} auth={auth} key={key}\n")
        body = f"hello {host}".encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def git(self):
        # Static files (git's dumb HTTP protocol), never outside git_root.
        path = os.path.realpath(os.path.join(git_root, self.path[5:].split('?')[0].lstrip('/')))
        log.write(f"git {self.path}\n")
        if not path.startswith(git_root + '/') or not os.path.isfile(path):
            self.send_response(404)
            self.send_header('Content-Length', '0')
            self.end_headers()
            return
        body = open(path, 'rb').read()
        self.send_response(200)
        self.send_header('Content-Type', 'application/octet-stream')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
plain = http.server.ThreadingHTTPServer((addr, 80), H)
tls = http.server.ThreadingHTTPServer((addr, 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[3], sys.argv[4])
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind((addr, 9999))
def sink():
    while True:
        d, a = u.recvfrom(2048)
        log.write(f"udp {a[0]}\n")
threading.Thread(target=sink, daemon=True).start()
threading.Thread(target=tls.serve_forever, daemon=True).start()
print('ready', flush=True)
plain.serve_forever()
"#;

/// The upstream namespace and its server; removed when the test process ends.
pub struct Upstream {
    pub dir: PathBuf,
    pub ca_pem: Vec<u8>,
    _server: Child,
}

pub fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn must(args: &[&str]) {
    assert!(ip(args), "ip {} (iproute2, as root)", args.join(" "));
}

/// The upstream server's pid, killed at exit (it would outlive the test, holding its stderr).
static SERVER_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn remove_upstream() {
    let pid = SERVER_PID.swap(0, std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) of our own child, which has not been reaped (so the pid is still its).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let _ = ip(&["netns", "del", NS]);
    let _ = ip(&["link", "del", VETH]);
}

pub fn upstream() -> &'static Upstream {
    static UP: OnceLock<Upstream> = OnceLock::new();
    UP.get_or_init(|| {
        remove_upstream();
        must(&["netns", "add", NS]);
        // SAFETY: registers a plain `extern "C"` function that runs at exit.
        unsafe { libc::atexit(remove_upstream) };
        must(&[
            "link", "add", VETH, "type", "veth", "peer", "name", "eth0", "netns", NS,
        ]);
        must(&["addr", "add", &format!("{HOST_SIDE}/30"), "dev", VETH]);
        must(&["link", "set", VETH, "up"]);
        must(&[
            "-n",
            NS,
            "addr",
            "add",
            &format!("{UPSTREAM}/30"),
            "dev",
            "eth0",
        ]);
        must(&["-n", NS, "link", "set", "eth0", "up"]);
        must(&["-n", NS, "link", "set", "lo", "up"]);
        let dir = std::env::temp_dir().join(format!("airlock-egress-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("git")).unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Distinct names: a leaf whose subject equals its issuer is taken for self-signed.
        ca.distinguished_name
            .push(DnType::CommonName, "Airlock egress test CA");
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(vec!["allowed.test".to_owned()]).unwrap();
        leaf.distinguished_name
            .push(DnType::CommonName, "allowed.test");
        let cert = leaf.signed_by(&key, &ca).unwrap();
        std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
        std::fs::write(dir.join("server.py"), SERVER).unwrap();
        let mut server = Command::new("ip")
            .args(["netns", "exec", NS, "python3"])
            .arg(dir.join("server.py"))
            .arg(dir.join("upstream.log"))
            .arg(UPSTREAM)
            .arg(dir.join("server.pem"))
            .arg(dir.join("server.key"))
            .arg(dir.join("git").canonicalize().unwrap())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the upstream server (python3 in the upstream namespace)");
        SERVER_PID.store(server.id() as i32, std::sync::atomic::Ordering::SeqCst);
        let mut line = String::new();
        BufReader::new(server.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "the upstream server did not start");
        Upstream {
            dir,
            ca_pem: ca.pem().into_bytes(),
            _server: server,
        }
    })
}

/// [`CONFIG`] with the upstream's CA as the one the broker trusts besides the public roots.
pub fn config(up: &Upstream) -> String {
    let ca = up.dir.join("ca.pem");
    CONFIG.replace("UPSTREAM_ADDRESS", UPSTREAM).replacen(
        "[network.hosts]",
        &format!(
            "[network]\nbroker_upstream_ca = {:?}\n[network.hosts]",
            ca.display().to_string()
        ),
        1,
    )
}

impl Upstream {
    /// What reached the upstream so far.
    pub fn seen(&self) -> String {
        std::fs::read_to_string(self.dir.join("upstream.log")).unwrap_or_default()
    }

    /// The directory served under `http://allowed.test/git/`.
    pub fn git_root(&self) -> PathBuf {
        self.dir.join("git")
    }
}

pub fn domains(names: &[&str], ports: &[u32]) -> NetworkPolicy {
    NetworkPolicy {
        allow_internet: false,
        allow: names
            .iter()
            .map(|n| EgressRule {
                target: Some(egress_rule::Target::Domain((*n).to_owned())),
                ports: ports.to_vec(),
            })
            .collect(),
    }
}

pub async fn log_of(c: &mut Client, id: &str) -> Vec<EgressEvent> {
    c.get_egress_log(GetEgressLogRequest {
        sandbox_id: id.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .events
}

/// Runs Python `code` in the sandbox (as root: raw sockets for ping); its stdout lines.
pub async fn python(c: &mut Client, id: &str, code: &str, s: &Shared) -> Vec<String> {
    let (out, err, rec) = run_as(c, id, "root", &["python3", "-c", code]).await;
    assert_eq!(rec.exit_code, 0, "{rec:?}\nstderr: {err}\n{}", s.log_tail());
    if !err.is_empty() {
        eprintln!("guest stderr: {err}");
    }
    out.lines().map(str::to_owned).collect()
}

/// `fetch(url)` of the guests' Python helpers done by the guest's `busybox wget` (whose messages
/// these tests know; the base image's `wget` is GNU wget), timed by the
/// bash that runs it (a Python start costs tens of seconds of emulated guest kernel work on the
/// nested build machines, a wget a second or two): `URL BODY`, or `URL ERROR fast|slow`
/// (wget's own message; fast: under 10 s, a refusal rather than a timeout).
pub async fn wget(c: &mut Client, id: &str, url: &str, s: &Shared) -> String {
    // Untimed first: the clone's first connection pays the guest kernel's one-time set-up and
    // busybox's first page-in (many seconds on a loaded nested host), which is not what is
    // timed.
    let script = format!(
        "timeout 60 busybox wget -q -O /dev/null http://100.96.0.1:9/ 2>/dev/null; \
         SECONDS=0; if busybox wget -q -O /tmp/body {url} 2>/tmp/err; then echo \"{url} $(</tmp/body)\"; \
         else if ((SECONDS < 10)); then t=fast; else t=slow; fi; echo \"{url} $(</tmp/err) $t\"; fi"
    );
    let (out, err, rec) = run_as(c, id, "root", &["bash", "-c", &script]).await;
    assert_eq!(rec.exit_code, 0, "{rec:?}\nstderr: {err}\n{}", s.log_tail());
    out.trim_end().to_owned()
}
