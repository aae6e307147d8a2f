//! System tests of the guest's network card (virtio-net on a TAP) in real VMs:
//! - `airlock-vmm` alone: one cold boot with a card, whose warm-up talks TCP to a server on the
//!   TAP's host side, then a snapshot; two clones of that snapshot, each on a TAP of its own in
//!   a network namespace of its own, each reaching its own server — and only its own;
//! - through airlockd: a sandbox's guest has `eth0` on the network its VMM's jail made, where
//!   every connection ends at the daemon's egress proxy, which resets it at once under the
//!   default deny-all policy (tests/egress.rs tests the policies).
//!
//! Traffic stays on this machine: every TAP lives in a network namespace this test makes (as
//! the jail does), the servers listen there on the gateway address, and nothing is routed out
//! of them.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use airlock_proto::{GATEWAY_IPV4, GATEWAY_MAC, GUEST_IPV4, GUEST_PREFIX};
use airlock_system_tests::harness::{create_sandbox, run};
use airlock_system_tests::shared::scenario;
use airlock_system_tests::{TempDir, binary, kernel, require_kvm, rootfs, step};

const PORT: u16 = 8080;

/// A network namespace of this test, made as airlockd's jail makes a sandbox's
/// (`airlock_netcfg::new_netns_with_tap`: `lo` and `tap0` with the gateway's address and MAC,
/// no route out), and a TCP server on the gateway address there that answers each
/// connection's first line with `pong <name> <line>` and reports who connected. The namespace
/// lives as long as its server's socket (this test process).
struct TestNet {
    name: String,
    tap: OwnedFd,
    peers: Receiver<(SocketAddr, String)>,
}

impl TestNet {
    fn new(tag: &str) -> Self {
        let name = format!("net-{tag}");
        let (made, listener) = airlock_netcfg::new_netns_with_tap(
            c"tap0",
            GATEWAY_MAC,
            GATEWAY_IPV4,
            GUEST_PREFIX,
            || TcpListener::bind((GATEWAY_IPV4, PORT)),
        )
        .expect("a network namespace with a TAP and a server on the gateway (root, /dev/net/tun)");
        let (tx, peers) = channel();
        let label = name.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                let peer = conn.peer_addr().expect("peer address");
                let mut line = Vec::new();
                let mut byte = [0u8; 1];
                while conn.read(&mut byte).unwrap_or(0) == 1 && byte[0] != b'\n' {
                    line.push(byte[0]);
                }
                let line = String::from_utf8_lossy(&line).into_owned();
                let _ = writeln!(conn, "pong {label} {line}");
                if tx.send((peer, line)).is_err() {
                    return;
                }
            }
        });
        Self {
            name,
            tap: made.tap,
            peers,
        }
    }

    fn tap_fd(&self) -> RawFd {
        self.tap.as_raw_fd()
    }

    /// The next connection the server answered: who, and what it said.
    fn next_peer(&self) -> (SocketAddr, String) {
        self.peers
            .recv_timeout(Duration::from_secs(5))
            .unwrap_or_else(|_| panic!("no connection reached the server in {}", self.name))
    }

    /// Whether no connection came at all.
    fn saw_nothing(&self) -> bool {
        self.peers.try_recv().is_err()
    }
}

/// `airlock-vmm ARGS` with the TAP `tap` inherited (its close-on-exec flag cleared in the
/// child), to its end.
fn vmm_with_tap(tap: RawFd, args: &[&str]) -> Output {
    let mut cmd = Command::new(binary("airlock-vmm"));
    let (sub, rest) = args.split_first().expect("a subcommand");
    // Right after the subcommand: `run` passes what follows `--` to the guest.
    cmd.arg(sub)
        .arg("--net-fd")
        .arg(tap.to_string())
        .args(rest)
        .stdin(Stdio::null());
    let keep = move || {
        // SAFETY: fcntl(2) is async-signal-safe; it only clears FD_CLOEXEC on `tap`.
        if unsafe { libc::fcntl(tap, libc::F_SETFD, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: the hook makes one async-signal-safe system call between fork and exec.
    unsafe { cmd.pre_exec(keep) };
    cmd.output().expect("spawn airlock-vmm")
}

/// A guest program that connects to the gateway's server, says `line` and prints the answer.
fn client_code(line: &str) -> String {
    format!(
        "import socket; s = socket.create_connection(('{GATEWAY_IPV4}', {PORT}), timeout=60); \
         s.sendall(b'{line}\\n'); print(s.makefile().readline().strip())"
    )
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr tail: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .rev()
            .take(15)
            .collect::<Vec<_>>()
            .join("\n")
    )
}

#[test]
fn clones_of_a_guest_with_a_network_card_each_reach_their_own_network() {
    require_kvm();
    // A fresh boot can only have been told its network by its agent: check what it uses.
    assert_eq!(GUEST_IPV4, Ipv4Addr::new(100, 96, 0, 2));
    let mut t = Instant::now();
    let dir = TempDir::new("net");
    let snap = dir.0.join("snapshot");
    let origin = TestNet::new("origin");
    let warmup = format!("python3 -c \"{}\"", client_code("origin"));
    let out = vmm_with_tap(
        origin.tap_fd(),
        &[
            "snapshot",
            "--kernel",
            kernel().to_str().unwrap(),
            "--rootfs",
            rootfs().to_str().unwrap(),
            "--out",
            snap.to_str().unwrap(),
            "--warmup",
            &warmup,
        ],
    );
    assert!(
        out.status.success(),
        "snapshot with a network card: {}",
        text(&out)
    );
    let (peer, said) = origin.next_peer();
    assert_eq!(peer.ip(), GUEST_IPV4, "the booted guest's address");
    assert_eq!(said, "origin");
    step("boot, a TCP exchange over the card, snapshot", &mut t);

    let nets: Vec<TestNet> = (0..2).map(|i| TestNet::new(&format!("clone{i}"))).collect();
    let outs: Vec<Output> = std::thread::scope(|s| {
        let runs: Vec<_> = nets
            .iter()
            .enumerate()
            .map(|(i, net)| {
                let (snap, code) = (&snap, client_code(&format!("clone{i}")));
                let tap = net.tap_fd();
                s.spawn(move || {
                    vmm_with_tap(
                        tap,
                        &[
                            "run",
                            "--snapshot",
                            snap.to_str().unwrap(),
                            "--",
                            "python3",
                            "-c",
                            &code,
                        ],
                    )
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().expect("clone")).collect()
    });
    step("two clones restored, each a TCP exchange", &mut t);
    for (i, (net, out)) in nets.iter().zip(&outs).enumerate() {
        assert!(out.status.success(), "clone {i}: {}", text(out));
        let answer = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            answer.trim(),
            format!("pong {} clone{i}", net.name),
            "clone {i} must reach the server of its own network"
        );
        let (peer, said) = net.next_peer();
        assert_eq!(peer.ip(), GUEST_IPV4);
        assert_eq!(said, format!("clone{i}"));
        assert!(net.saw_nothing(), "one connection per clone");
    }
    assert!(
        origin.saw_nothing(),
        "no clone reached the origin's network"
    );
}

/// In the guest: eth0's address; a connection to the gateway and one to a documentation
/// address (192.0.2.1): both reach only the sandbox's egress proxy (the namespace's ruleset
/// redirects every TCP connection to it), which resets them, the policy being deny-all. The
/// first is not timed (it also resolves the gateway's MAC, which a loaded nested host can make
/// take seconds).
const PROBE: &str = "import errno, fcntl, socket, struct, time
s = socket.socket()
print('eth0', socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack('256s', b'eth0'))[20:24]))
def probe(addr):
    t = time.monotonic()
    try:
        c = socket.create_connection((addr, 80), timeout=60)
        c.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')
        r = 'open' if c.recv(10) else 'closed'
    except OSError as e:
        r = type(e).__name__
    return r, 'fast' if time.monotonic() - t < 10 else 'slow'
print('gateway', probe('100.96.0.1')[0])
print('outside', *probe('192.0.2.1'))
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_has_a_card_on_a_network_of_its_own_with_no_way_out() {
    let (_serial, s) = scenario("pool_size = 1\n").await;
    let mut c = s.client(None).await;
    let sb = create_sandbox(&mut c, &s.log).await;
    let (out, err, rec) = run(&mut c, &sb.id, &["python3", "-c", PROBE]).await;
    assert_eq!(rec.exit_code, 0, "{rec:?}\nstderr: {err}\n{}", s.log_tail());
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            format!("eth0 {GUEST_IPV4}").as_str(),
            "gateway ConnectionResetError",
            "outside ConnectionResetError fast"
        ],
        "stderr: {err}"
    );
}
