//! System tests of sandbox egress through airlockd, in real VMs with real TAPs, nftables and
//! the daemon's proxy and DNS server: allowed names over HTTP and HTTPS, refusals (denied
//! names, literal addresses, the metadata address, DNS for denied and tunnel-shaped names,
//! UDP, ICMP), each decided at once and logged, and a policy changed on a running sandbox.
//!
//! Traffic stays on this machine. The upstream is a network namespace this test makes
//! (`airlock-up-egress`, reached from the host over a veth pair on 10.213.0.0/30), where a
//! Python HTTP/HTTPS server of the test listens on 10.213.0.2; the daemon's static host map
//! names it (`allowed.test`, `denied.test`, `a.wild.test`). Refused attempts never leave the
//! sandbox's namespace: the test checks that the upstream saw only what was allowed.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use airlock_api::v1::{
    CreateSandboxRequest, EgressEvent, EgressKind, EgressRule, FileToPlace, GetEgressLogRequest,
    ListAuditEventsRequest, NetworkPolicy, RemoveSecretsRequest, Sandbox, Secret, SecretBroker,
    SecretEnv, SetNetworkPolicyRequest, egress_rule, secret,
};
use airlock_system_tests::harness::{Client, run_as};
use airlock_system_tests::shared::{Shared, scenario};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

const NS: &str = "airlock-up-egress";
const VETH: &str = "al-up-egress";
const HOST_SIDE: &str = "10.213.0.1";
const UPSTREAM: &str = "10.213.0.2";

/// The daemon's settings: the static host map, and the test CA as the broker's upstream CA
/// (after `[network] broker_upstream_ca = "..."`, from [`config`]).
const CONFIG: &str = r#"pool_size = 1
[network.hosts]
"allowed.test" = ["10.213.0.2"]
"denied.test" = ["10.213.0.2"]
"a.wild.test" = ["10.213.0.2"]
"#;

/// The upstream's server: HTTP on 80, HTTPS on 443 (the test CA's certificate for
/// allowed.test), a UDP sink on 9999; every request and datagram is logged to argv[1].
const SERVER: &str = r#"
import http.server, socket, ssl, sys, threading
log = open(sys.argv[1], 'a', buffering=1)
addr = sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        host = self.headers.get('Host')
        auth = self.headers.get('Authorization')
        key = self.headers.get('X-Api-Key')
        log.write(f"http {self.server.server_port} {host} auth={auth} key={key}\n")
        body = f"hello {host}".encode()
        self.send_response(200)
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
struct Upstream {
    dir: PathBuf,
    ca_pem: Vec<u8>,
    _server: Child,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn must(args: &[&str]) {
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

fn upstream() -> &'static Upstream {
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
        std::fs::create_dir_all(&dir).unwrap();
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
fn config(up: &Upstream) -> String {
    let ca = up.dir.join("ca.pem");
    CONFIG.replacen(
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
    fn seen(&self) -> String {
        std::fs::read_to_string(self.dir.join("upstream.log")).unwrap_or_default()
    }
}

fn domains(names: &[&str], ports: &[u32]) -> NetworkPolicy {
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

async fn start(
    network: Option<NetworkPolicy>,
) -> (
    tokio::sync::MutexGuard<'static, ()>,
    &'static Shared,
    Client,
    Sandbox,
) {
    let up = upstream();
    let (serial, s) = scenario(&config(up)).await;
    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network,
            files: vec![FileToPlace {
                path: "/tmp/ca.pem".into(),
                content: up.ca_pem.clone(),
                mode: 0o644,
            }],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    (serial, s, c, sb)
}

async fn log_of(c: &mut Client, id: &str) -> Vec<EgressEvent> {
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
async fn python(c: &mut Client, id: &str, code: &str, s: &Shared) -> Vec<String> {
    let (out, err, rec) = run_as(c, id, "root", &["python3", "-c", code]).await;
    assert_eq!(rec.exit_code, 0, "{rec:?}\nstderr: {err}\n{}", s.log_tail());
    if !err.is_empty() {
        eprintln!("guest stderr: {err}");
    }
    out.lines().map(str::to_owned).collect()
}

/// Guest helpers: `fetch(url)` prints the body, or the error's class with `fast`/`slow` (a
/// refusal must come at once); `raw` sends bytes on a connection and prints what came back.
const PRELUDE: &str = r#"
import socket, ssl, sys, time, urllib.request
ctx = ssl.create_default_context(cafile='/tmp/ca.pem')
# Untimed: a sandbox's first TCP connection also pays the guest kernel's one-time set-up
# (seconds on nested hosts, where guest kernel code is emulated), which is not what is timed.
try:
    socket.create_connection(('100.96.0.1', 9), timeout=60).recv(1)
except OSError:
    pass
def fetch(url):
    t = time.monotonic()
    try:
        r = urllib.request.urlopen(url, timeout=30, context=ctx).read().decode()
        print(url, r)
        return
    except Exception as e:
        while getattr(e, 'reason', None) is not None and isinstance(e.reason, Exception):
            e = e.reason
        r = type(e).__name__
        print(url, repr(e), file=sys.stderr)
    print(url, r, 'fast' if time.monotonic() - t < 10 else 'slow')
def raw(addr, port, data):
    t = time.monotonic()
    try:
        s = socket.create_connection((addr, port), timeout=30)
        s.sendall(data)
        r = s.recv(100).decode() or 'closed'
    except Exception as e:
        r = type(e).__name__
    print(addr, port, r, 'fast' if time.monotonic() - t < 10 else 'slow')
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_domain_is_reached_over_http_and_https_and_logged() {
    let (_serial, s, mut c, sb) = start(Some(domains(&["allowed.test"], &[80, 443]))).await;
    let code = format!("{PRELUDE}\nfetch('http://allowed.test/')\nfetch('https://allowed.test/')");
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            "http://allowed.test/ hello allowed.test",
            "https://allowed.test/ hello allowed.test"
        ]
    );
    let seen = upstream().seen();
    assert!(seen.contains("http 80 allowed.test"), "{seen}");
    assert!(seen.contains("http 443 allowed.test"), "{seen}");
    let log = log_of(&mut c, &sb.id).await;
    let dns: Vec<_> = log
        .iter()
        .filter(|e| e.kind == EgressKind::Dns as i32)
        .collect();
    assert!(
        dns.iter()
            .any(|e| e.allowed && e.name.starts_with("allowed.test") && e.answers == [UPSTREAM]),
        "{log:#?}"
    );
    let tcp: Vec<_> = log
        .iter()
        .filter(|e| e.kind == EgressKind::Tcp as i32)
        .collect();
    for port in [80, 443] {
        let e = tcp
            .iter()
            .find(|e| e.port == port)
            .unwrap_or_else(|| panic!("no TCP event for port {port}: {log:#?}"));
        assert!(e.allowed, "{e:?}");
        assert_eq!(e.name, "allowed.test");
        assert_eq!(e.address, UPSTREAM);
        assert_eq!(e.verdict, format!("allowed.test:80,443"));
        assert!(e.bytes_out > 0 && e.bytes_in > 0, "{e:?}");
    }
    assert!(
        log.windows(2).all(|w| w[0].seq < w[1].seq),
        "ordered by seq"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_connections_are_reset_at_once_and_logged() {
    let (_serial, s, mut c, sb) =
        start(Some(domains(&["allowed.test", "*.wild.test"], &[80]))).await;
    let before = upstream().seen();
    let code = format!(
        "{PRELUDE}
fetch('http://denied.test/')
raw('{UPSTREAM}', 80, b'GET / HTTP/1.1\\r\\nHost: denied.test\\r\\n\\r\\n')
raw('{UPSTREAM}', 80, b'hello\\n')
raw('169.254.169.254', 80, b'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n')
raw('{UPSTREAM}', 80, b'GET / HTTP/1.1\\r\\nHost: a.wild.test\\r\\n\\r\\n')
raw('{UPSTREAM}', 443, b'GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n')
"
    );
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            // The name is refused by DNS: no address, no connection.
            "http://denied.test/ gaierror fast".to_owned(),
            // A name the policy does not allow, at the upstream's literal address.
            format!("{UPSTREAM} 80 ConnectionResetError fast"),
            // No name at all.
            format!("{UPSTREAM} 80 ConnectionResetError fast"),
            // The metadata address, whatever the Host says.
            "169.254.169.254 80 ConnectionResetError fast".to_owned(),
            // A wildcard never opens a guarded (here private) address.
            format!("{UPSTREAM} 80 ConnectionResetError fast"),
            // An allowed name on a port the rule does not list.
            format!("{UPSTREAM} 443 ConnectionResetError fast"),
        ]
    );
    assert_eq!(
        upstream().seen(),
        before,
        "nothing denied reached the upstream"
    );
    let log = log_of(&mut c, &sb.id).await;
    let denied: Vec<_> = log.iter().filter(|e| !e.allowed).collect();
    let verdict_of = |kind: EgressKind, name: &str, addr: &str| {
        denied
            .iter()
            .find(|e| {
                e.kind == kind as i32 && e.name.starts_with(name) && e.address.starts_with(addr)
            })
            .map(|e| e.verdict.clone())
            .unwrap_or_else(|| panic!("no denied {kind:?} event for {name} {addr}: {log:#?}"))
    };
    assert_eq!(
        verdict_of(EgressKind::Dns, "denied.test", ""),
        "no rule allows this name"
    );
    assert!(verdict_of(EgressKind::Tcp, "denied.test", UPSTREAM).contains("10.0.0.0/8"));
    assert!(verdict_of(EgressKind::Tcp, "a.wild.test", UPSTREAM).contains("10.0.0.0/8"));
    assert!(verdict_of(EgressKind::Tcp, "", "169.254.169.254").contains("169.254.0.0/16"));
    assert!(
        denied
            .iter()
            .any(|e| e.port == 443 && e.name == "allowed.test"),
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_refuses_denied_and_tunnel_shaped_names_and_udp_and_icmp_are_dropped() {
    let (_serial, s, mut c, sb) =
        start(Some(domains(&["allowed.test", "*.allowed.test"], &[]))).await;
    let before = upstream().seen();
    let tunnel = format!("{}.allowed.test", "a".repeat(60));
    let code = format!(
        r#"
import socket, struct, subprocess
def query(name, qtype=1):
    q = struct.pack('>HHHHHH', 0x4242, 0x0100, 1, 0, 0, 0)
    for label in name.split('.'):
        q += bytes([len(label)]) + label.encode()
    q += b'\0' + struct.pack('>HH', qtype, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    s.sendto(q, ('100.96.0.1', 53))
    r = s.recv(512)
    print(name[:20], qtype, 'rcode', r[3] & 0xf, 'answers', struct.unpack('>H', r[6:8])[0])
query('allowed.test')
query('denied.test')
query('{tunnel}')
query('allowed.test', 16)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.sendto(b'leak', ('{UPSTREAM}', 9999))
p = subprocess.run(['busybox', 'ping', '-c', '1', '-W', '2', '{UPSTREAM}'], capture_output=True)
print('ping', p.returncode)
"#
    );
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            "allowed.test 1 rcode 0 answers 1",
            "denied.test 1 rcode 5 answers 0",
            "aaaaaaaaaaaaaaaaaaaa 1 rcode 5 answers 0",
            "allowed.test 16 rcode 5 answers 0",
            "ping 1",
        ]
    );
    // The datagram had a second to arrive, had it been let through.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(upstream().seen(), before, "no UDP reached the upstream");
    let log = log_of(&mut c, &sb.id).await;
    let tunnel_event = log
        .iter()
        .find(|e| e.name.starts_with("aaaa"))
        .unwrap_or_else(|| panic!("the tunnel-shaped query is logged: {log:#?}"));
    assert!(!tunnel_event.allowed);
    assert!(
        tunnel_event.verdict.contains("tunnel-shaped"),
        "{tunnel_event:?}"
    );
    assert!(
        log.iter().any(|e| e.query_type == "TXT" && !e.allowed),
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_applies_to_a_running_sandbox_at_once() {
    let (_serial, s, mut c, sb) = start(None).await;
    let code = format!("{PRELUDE}\nfetch('http://allowed.test/')");
    let denied = vec!["http://allowed.test/ gaierror fast".to_owned()];
    assert_eq!(
        python(&mut c, &sb.id, &code, s).await,
        denied,
        "deny-all by default"
    );
    let set = |network: NetworkPolicy| SetNetworkPolicyRequest {
        sandbox_id: sb.id.clone(),
        network: Some(network),
    };
    let r = c
        .set_network_policy(set(domains(&["allowed.test"], &[80])))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.network, Some(domains(&["allowed.test"], &[80])));
    assert_eq!(
        python(&mut c, &sb.id, &code, s).await,
        ["http://allowed.test/ hello allowed.test"]
    );
    c.set_network_policy(set(NetworkPolicy::default()))
        .await
        .unwrap();
    // The guest's resolver may have cached the name (TTL 30 s): the connection is refused
    // either way.
    let out = python(&mut c, &sb.id, &code, s).await;
    assert!(
        out == denied || out == ["http://allowed.test/ ConnectionResetError fast"],
        "{out:?}"
    );
    // Beyond the default ceiling (public addresses only): refused, the policy unchanged.
    let err = c
        .set_network_policy(set(NetworkPolicy {
            allow_internet: false,
            allow: vec![EgressRule {
                target: Some(egress_rule::Target::Cidr("10.213.0.0/30".into())),
                ports: vec![],
            }],
        }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("10.213.0.0/30"), "{err:?}");
}

/// A GET through an exposure at `addr`, presenting `token` the HTTP way, the raw way (a first
/// line) or not at all; the answer (empty: closed without one).
fn get_via(addr: &str, token: Option<&str>, raw: bool) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(20)))?;
    let mut req = String::new();
    match (token, raw) {
        (Some(t), true) => req.push_str(&format!("{t}\n")),
        (Some(t), false) => {
            req.push_str(&format!("GET / HTTP/1.0\r\nX-Airlock-Token: {t}\r\n\r\n"));
        }
        (None, _) => {}
    }
    if raw || token.is_none() {
        req.push_str("GET / HTTP/1.0\r\n\r\n");
    }
    s.write_all(req.as_bytes())?;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exposed_port_answers_with_the_token_only_and_until_its_ttl() {
    use airlock_api::v1::ExposePortRequest;
    use airlock_system_tests::harness::shell;
    let (_serial, s, mut c, sb) = start(None).await;
    c.exec(shell(
        &sb.id,
        "cd /tmp && echo exposed-content > index.html && exec python3 -m http.server 8000",
        0,
    ))
    .await
    .unwrap();
    let expose = |ttl_s| ExposePortRequest {
        sandbox_id: sb.id.clone(),
        guest_port: 8000,
        ttl_s,
    };
    let e = c.expose_port(expose(600)).await.unwrap().into_inner();
    assert_eq!(e.token.len(), 64);
    let addr = e.address.clone();
    // The guest's server takes a while to start on nested hosts.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let answer = loop {
        let (a, t) = (addr.clone(), e.token.clone());
        let got = tokio::task::spawn_blocking(move || get_via(&a, Some(&t), false))
            .await
            .unwrap();
        if let Ok(body) = &got
            && body.contains("exposed-content")
        {
            break body.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the exposed port never answered: {got:?}\n{}",
            s.log_tail()
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    };
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    let (a, t) = (addr.clone(), e.token.clone());
    let raw = tokio::task::spawn_blocking(move || get_via(&a, Some(&t), true))
        .await
        .unwrap()
        .unwrap();
    assert!(
        raw.contains("exposed-content"),
        "raw TCP with the token: {raw}"
    );
    for (token, raw) in [
        (None, false),
        (Some("0".repeat(64)), false),
        (Some("wrong".into()), true),
    ] {
        let a = addr.clone();
        let got = tokio::task::spawn_blocking(move || get_via(&a, token.as_deref(), raw))
            .await
            .unwrap();
        assert!(
            !got.as_deref().unwrap_or("").contains("exposed-content"),
            "answered without the token: {got:?}"
        );
    }
    // A short exposure: gone after its TTL.
    let short = c.expose_port(expose(2)).await.unwrap().into_inner();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let a = short.address.clone();
    let after = tokio::task::spawn_blocking(move || get_via(&a, Some(&short.token), false))
        .await
        .unwrap();
    assert!(after.is_err(), "the exposure outlived its TTL: {after:?}");
    let log = log_of(&mut c, &sb.id).await;
    let exposed: Vec<_> = log
        .iter()
        .filter(|e| e.kind == EgressKind::Expose as i32)
        .collect();
    assert!(
        exposed.iter().any(|e| e.allowed && e.bytes_out > 0),
        "{log:#?}"
    );
    assert!(
        exposed
            .iter()
            .filter(|e| !e.allowed && e.verdict == "no valid token")
            .count()
            >= 3,
        "{log:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_of_one_template_have_working_separate_networks() {
    let (_serial, s, mut c, first) = start(Some(domains(&["allowed.test"], &[80]))).await;
    let mut others = Vec::new();
    for network in [Some(domains(&["allowed.test"], &[80])), None] {
        let sb = c
            .create_sandbox(CreateSandboxRequest {
                network,
                files: vec![FileToPlace {
                    path: "/tmp/ca.pem".into(),
                    content: upstream().ca_pem.clone(),
                    mode: 0o644,
                }],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        others.push(sb);
    }
    let before = upstream().seen().lines().count();
    let code = format!("{PRELUDE}\nfetch('http://allowed.test/')");
    let mut tasks = Vec::new();
    for id in [&first.id, &others[0].id, &others[1].id] {
        let (mut c, id, code) = (c.clone(), id.clone(), code.clone());
        tasks.push(tokio::spawn(
            async move { python(&mut c, &id, &code, s).await },
        ));
    }
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(t.await.unwrap());
    }
    assert_eq!(outs[0], ["http://allowed.test/ hello allowed.test"]);
    assert_eq!(outs[1], ["http://allowed.test/ hello allowed.test"]);
    assert_eq!(outs[2], ["http://allowed.test/ gaierror fast"], "deny-all");
    assert_eq!(
        upstream().seen().lines().count(),
        before + 2,
        "one request from each allowed sandbox"
    );
    // Each log holds its own sandbox's attempts only.
    let denied_log = log_of(&mut c, &others[1].id).await;
    assert!(
        !denied_log.is_empty() && denied_log.iter().all(|e| !e.allowed),
        "{denied_log:#?}"
    );
    for sb in [&first, &others[0]] {
        let log = log_of(&mut c, &sb.id).await;
        let allowed = log
            .iter()
            .filter(|e| e.kind == EgressKind::Tcp as i32 && e.allowed)
            .count();
        assert_eq!(allowed, 1, "{log:#?}");
    }
    for sb in &others {
        c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
            sandbox_id: sb.id.clone(),
        })
        .await
        .unwrap();
    }
}

/// A value no one guesses, of the shape the guest's scan looks for (`brk-` and 32 hex digits).
fn broker_value(salt: u64) -> String {
    use sha2::Digest as _;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let d = sha2::Sha256::digest(format!("{now} {} {salt}", std::process::id()));
    let hex: String = d.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("brk-{hex}")
}

fn sha256_hex(s: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn broker(name: &str, value: &str, header: &str, format: &str, https: bool) -> Secret {
    Secret {
        name: name.into(),
        value: value.into(),
        delivery: Some(secret::Delivery::Broker(SecretBroker {
            hosts: vec!["allowed.test".into()],
            header: header.into(),
            format: format.into(),
            https,
        })),
        ttl_s: 0,
    }
}

/// The guest's side: requests to a brokered host over HTTP (with a header of its own that the
/// secret replaces) and HTTPS (trusting the system bundle only, where the sandbox's CA is),
/// and to a host no secret names; then a search for the secrets' values in every process's
/// environment, the files under /etc, /run, /tmp, /home, /root and /usr/local, and its own
/// memory. The code holds only the values' digests; CONTROL, an environment secret, shows
/// that the search finds what is there.
const BROKER_GUEST: &str = r#"
import hashlib, os, re, urllib.request
def get(url, headers={}):
    req = urllib.request.Request(url, headers=headers)
    print(url, urllib.request.urlopen(req, timeout=60).read().decode())
get('http://allowed.test/one', {'Authorization': 'the-guests-own'})
get('https://allowed.test/two')
get('http://a.wild.test/three')
pat = re.compile(rb'brk-[0-9a-f]{32}')
def hits(data, digests):
    return sum(1 for m in pat.findall(data) if hashlib.sha256(m).hexdigest() in digests)
def search(digests):
    n = 0
    for pid in os.listdir('/proc'):
        if pid.isdigit():
            try:
                n += hits(open(f'/proc/{pid}/environ', 'rb').read(), digests)
            except OSError:
                pass
    for top in ['/etc', '/run', '/tmp', '/home', '/root', '/usr/local']:
        for d, _, files in os.walk(top):
            for f in files:
                try:
                    n += hits(open(os.path.join(d, f), 'rb').read(), digests)
                except OSError:
                    pass
    with open('/proc/self/mem', 'rb', 0) as mem:
        for line in open('/proc/self/maps'):
            parts = line.split()
            if not parts[1].startswith('rw') or (len(parts) > 5 and parts[5] != '[heap]'):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split('-'))
            try:
                mem.seek(lo)
                n += hits(mem.read(hi - lo), digests)
            except OSError:
                pass
    return n
print('traces', search(BROKERED), search(CONTROL) > 0)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokered_secrets_reach_the_upstream_as_headers_and_never_the_guest() {
    let up = upstream();
    let (_serial, s) = scenario(&config(up)).await;
    s.clean(&[]).await;
    let mut c = s.client(None).await;
    let (plain, tls, control) = (broker_value(1), broker_value(2), broker_value(3));
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network: Some(domains(&["allowed.test", "a.wild.test"], &[])),
            secrets: vec![
                // Plain HTTP only, as Authorization: Bearer.
                broker("API", &plain, "", "", false),
                // HTTPS too (the proxy terminates TLS with the sandbox's CA), its own header.
                broker("TLSKEY", &tls, "X-Api-Key", "key {value}", true),
                Secret {
                    name: "CONTROL".into(),
                    value: control.clone(),
                    delivery: Some(secret::Delivery::Env(SecretEnv::default())),
                    ttl_s: 0,
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    let before = up.seen().lines().count();
    let code = BROKER_GUEST
        .replace(
            "search(BROKERED)",
            &format!(
                "search({{'{}', '{}'}})",
                sha256_hex(&plain),
                sha256_hex(&tls)
            ),
        )
        .replace(
            "search(CONTROL)",
            &format!("search({{'{}'}})", sha256_hex(&control)),
        );
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            "http://allowed.test/one hello allowed.test",
            "https://allowed.test/two hello allowed.test",
            "http://a.wild.test/three hello a.wild.test",
            "traces 0 True",
        ],
        "the brokered values are nowhere in the guest; the control is in the environ and the \
         memory of the process"
    );
    let seen: Vec<String> = up.seen().lines().skip(before).map(str::to_owned).collect();
    assert_eq!(
        seen,
        [
            // A secret brokered over HTTPS is added to plain HTTP to its hosts as well.
            format!("http 80 allowed.test auth=Bearer {plain} key=key {tls}"),
            format!("http 443 allowed.test auth=None key=key {tls}"),
            "http 80 a.wild.test auth=None key=None".to_owned(),
        ],
        "each header only where its secret names the host and the scheme, replacing the \
         guest's own"
    );
    let log = log_of(&mut c, &sb.id).await;
    let brokered = log
        .iter()
        .filter(|e| e.allowed && e.verdict.ends_with("; brokered"))
        .count();
    assert_eq!(brokered, 2, "{log:#?}");
    let uses = c
        .list_audit_events(ListAuditEventsRequest {
            sandbox_id: sb.id.clone(),
            kinds: vec!["secret.use".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    let broker_uses: Vec<&str> = uses
        .iter()
        .filter(|e| e.detail_json.contains("\"broker\""))
        .map(|e| e.detail_json.as_str())
        .collect();
    assert_eq!(broker_uses.len(), 2, "{uses:#?}");
    assert!(
        uses.iter()
            .all(|e| !e.detail_json.contains(&plain) && !e.detail_json.contains(&tls)),
        "names only in the audit trail"
    );
    // Removed, the secret is no longer added.
    c.remove_secrets(RemoveSecretsRequest {
        sandbox_id: sb.id.clone(),
        names: vec!["API".into()],
    })
    .await
    .unwrap();
    let (_, err, rec) = run_as(
        &mut c,
        &sb.id,
        "",
        &["wget", "-q", "-O", "/dev/null", "http://allowed.test/four"],
    )
    .await;
    assert_eq!(rec.exit_code, 0, "{err}");
    let last = up.seen().lines().last().unwrap_or_default().to_owned();
    assert_eq!(
        last,
        format!("http 80 allowed.test auth=None key=key {tls}")
    );
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
        sandbox_id: sb.id.clone(),
    })
    .await
    .unwrap();
}
