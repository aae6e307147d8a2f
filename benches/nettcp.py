"""Network bench, second part: the guest's TCP through airlockd's egress proxy, against a plain
TAP without it, in the same run (benches/net.py calls `measure`).

The same guest script (GUEST) runs in two guests:

- plain: a clone of net.py's snapshot with a card (`airlock-vmm restore`, no daemon), on a TAP
  `tap0` in the bench's network namespace that holds the gateway address 100.96.0.1/30 (no
  nftables, no proxy); the server (SERVER) listens on 100.96.0.1 in that namespace, and the
  guest connects straight to it.
- proxied: a sandbox of a live airlockd (`airlock-create-bench --net-run`: its own data dir and
  cgroup parent, pool of one, the template built by one cold boot) whose policy allows the
  domain `bench.test`; the daemon's host map names 10.214.0.2, where the server listens in an
  upstream namespace this bench makes (veth pair on 10.214.0.0/30, as tests/egress.rs does).
  The guest resolves the name through the daemon's DNS server once; every connection goes
  through the sandbox's nftables redirect and the transparent proxy, which reads the HTTP Host
  line, checks the policy and connects from the host's namespace.

The guest measures (a) connection setup: CONNS sequential connect() + a request head + the
server's one-byte answer, per connection (after one warm-up connection); (b) throughput guest
-> server: TCP_RUNS uploads of MIB MiB each, timed in the guest from connect() until the
server's acknowledgement (`send_mib_s`) and by the server from the request head to the last
byte (`server_mib_s`). Every connection starts with an HTTP request head (`Host: bench.test`),
which the proxy needs to decide a domain rule, in both guests alike."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from restore import BenchError, Restored  # noqa: E402
from stats import summary  # noqa: E402

PORT = 18080
GATEWAY = "100.96.0.1"
UP_NS_PREFIX = "airlock-bench-up"
UP_VETH = "al-bench-up"
UP_HOST = "10.214.0.1"
UP_ADDR = "10.214.0.2"
NAME = "bench.test"

# argv: host port conns mib runs. Progress on stderr, one JSON line on stdout.
GUEST = r"""
import json, socket, sys, time
host, port, conns, mib, runs = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
def log(m):
    print(f"guest: {m}", file=sys.stderr, flush=True)
addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
log(f"{host} is {addr[0]}")
def conn():
    s = socket.create_connection(addr, timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
def ping():
    t = time.monotonic()
    s = conn()
    s.sendall(b"GET /ping HTTP/1.1\r\nHost: bench.test\r\n\r\n")
    b = s.recv(1)
    ms = (time.monotonic() - t) * 1000.0
    s.close()
    if b != b"k":
        raise SystemExit(f"ping: answer {b!r}")
    return ms
log(f"warm-up connection: {ping():.1f} ms")
connect_ms = []
for i in range(conns):
    connect_ms.append(ping())
    if (i + 1) % 10 == 0 or i + 1 == conns:
        log(f"{i + 1}/{conns} connections, last {connect_ms[-1]:.1f} ms")
size = mib << 20
chunk = memoryview(bytearray(256 << 10))
uploads = []
for r in range(runs):
    t = time.monotonic()
    s = conn()
    s.sendall(f"POST /sink HTTP/1.1\r\nHost: bench.test\r\nContent-Length: {size}\r\n\r\n".encode())
    left = size
    while left:
        k = min(left, len(chunk))
        s.sendall(chunk[:k])
        left -= k
    ack = b""
    while True:
        d = s.recv(100)
        if not d:
            break
        ack += d
    secs = time.monotonic() - t
    s.close()
    got, server_s = ack.split()
    if int(got) != size:
        raise SystemExit(f"upload: the server got {int(got)} of {size} bytes")
    uploads.append({"guest_s": secs, "server_s": float(server_s)})
    log(f"upload {r + 1}/{runs}: {mib} MiB in {secs:.2f} s ({mib / secs:.2f} MiB/s), "
        f"server {float(server_s):.2f} s")
print(json.dumps({"connect_ms": connect_ms, "uploads": uploads}), flush=True)
"""

# argv: address port. Prints `ready` once listening. A request head, then: `/ping` -> one
# byte `k`; else Content-Length bytes of body -> "<bytes> <seconds from head to last byte>".
SERVER = r"""
import socket, sys, threading, time
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((sys.argv[1], int(sys.argv[2])))
ls.listen(128)
print("ready", flush=True)
def serve(c):
    with c:
        buf = b""
        while b"\r\n\r\n" not in buf:
            d = c.recv(65536)
            if not d:
                return
            buf += d
        t = time.monotonic()
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        if lines[0].split()[1] == b"/ping":
            c.sendall(b"k")
            return
        n = 0
        for l in lines[1:]:
            k, _, v = l.partition(b":")
            if k.strip().lower() == b"content-length":
                n = int(v)
        got = len(body)
        while got < n:
            d = c.recv(1 << 20)
            if not d:
                break
            got += len(d)
        c.sendall(f"{got} {time.monotonic() - t:.6f}".encode())
while True:
    c, _ = ls.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def log(msg):
    print(f"net: {msg}", file=sys.stderr, flush=True)


def ip(*args, check=True):
    r = subprocess.run(["ip", *args], stderr=subprocess.PIPE)
    if check and r.returncode != 0:
        raise BenchError(f"ip {' '.join(args)}: {r.stderr.decode().strip()}")


class Server:
    """SERVER in network namespace `ns` on addr:PORT."""

    def __init__(self, ns, addr):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, addr, str(PORT)],
            stdout=subprocess.PIPE, stderr=sys.stderr)
        if self.proc.stdout.readline().strip() != b"ready":
            self.stop()
            raise BenchError(f"the server on {addr} did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def guest_result(out, side):
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        raise BenchError(f"{side}: no result from the guest script: {out[-2000:]!r}")


def guest_argv(host, conns, mib, runs):
    return ["python3", "-c", GUEST, host, str(PORT), str(conns), str(mib), str(runs)]


def run_plain(a, ns, snapshot, workdir, live):
    """The guest on a plain TAP, the server on the gateway address in the same namespace."""
    log("tcp plain: a clone with its card on tap0 (100.96.0.1/30, no proxy), server on "
        f"{GATEWAY}:{PORT}")
    tap = ns.open_tap("tap0")
    server = vm = None
    try:
        ip("-n", ns.name, "link", "set", "lo", "up")
        ip("-n", ns.name, "addr", "add", f"{GATEWAY}/30", "dev", "tap0")
        ip("-n", ns.name, "link", "set", "tap0", "up")
        server = Server(ns.name, GATEWAY)
        vm = Restored(a.vmm, snapshot, workdir, "tcp-plain", tap_fd=tap)
        live.append(vm)
        vm.wait_ready()
        r = subprocess.run(
            [a.bench, "guest-exec", "--vsock", vm.sock, "--",
             *guest_argv(GATEWAY, a.conns, a.mib, a.tcp_runs)],
            stdout=subprocess.PIPE, stderr=sys.stderr, timeout=a.tcp_timeout)
        if r.returncode != 0:
            raise BenchError(f"plain: the guest script failed ({r.returncode})")
        return guest_result(r.stdout, "plain")
    finally:
        if vm is not None:
            vm.stop()
            live.remove(vm)
        if server is not None:
            server.stop()
        os.close(tap)


def remove_cgroups(name):
    for h in ("", "memory", "cpu", "pids", "cpuacct"):
        try:
            os.rmdir(os.path.join("/sys/fs/cgroup", h, name))
        except OSError:
            pass


def run_proxied(a):
    """The guest in a sandbox of a live airlockd, the server upstream behind its proxy."""
    ns = f"{UP_NS_PREFIX}-{os.getpid()}"
    ip("link", "del", UP_VETH, check=False)
    ip("netns", "del", ns, check=False)
    server = proc = None
    try:
        ip("netns", "add", ns)
        ip("link", "add", UP_VETH, "type", "veth", "peer", "name", "eth0", "netns", ns)
        ip("addr", "add", f"{UP_HOST}/30", "dev", UP_VETH)
        ip("link", "set", UP_VETH, "up")
        ip("-n", ns, "addr", "add", f"{UP_ADDR}/30", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        server = Server(ns, UP_ADDR)
        log(f"tcp proxied: airlockd (pool of one; template: a cold boot), a sandbox allowed "
            f"{NAME} -> {UP_ADDR}:{PORT} (upstream namespace {ns})")
        # Its own session: on failure the whole group (it and its daemon) gets SIGTERM, and the
        # daemon ends its VMMs.
        proc = subprocess.Popen(
            [a.create_bench, "--net-run", "--daemon", a.daemon, "--vmm", a.vmm,
             "--kernel", a.kernel, "--rootfs", a.rootfs,
             "--config-extra", f'[network.hosts]\n"{NAME}" = ["{UP_ADDR}"]',
             "--allow-domain", NAME, "--",
             *guest_argv(NAME, a.conns, a.mib, a.tcp_runs)],
            stdout=subprocess.PIPE, stderr=sys.stderr, start_new_session=True)
        out, _ = proc.communicate(timeout=a.tcp_timeout + 900)
        if proc.returncode != 0:
            raise BenchError(f"proxied: airlock-create-bench --net-run failed ({proc.returncode})")
        return guest_result(out, "proxied")
    finally:
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=90)
                except (OSError, subprocess.TimeoutExpired):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            # What create-bench removes itself when it ends normally.
            remove_cgroups(f"airlock-bench-net-{proc.pid}")
            shutil.rmtree(os.path.join(tempfile.gettempdir(), f"airlock-netrun-bench-{proc.pid}"),
                          ignore_errors=True)
        if server is not None:
            server.stop()
        ip("link", "del", UP_VETH, check=False)
        ip("netns", "del", ns, check=False)


def side_summary(r, mib):
    return {
        "connect_ms": summary(r["connect_ms"], 2),
        "send_mib_s": summary([mib / u["guest_s"] for u in r["uploads"]], 2),
        "server_mib_s": summary([mib / u["server_s"] for u in r["uploads"]], 2),
    }


def ratio(x, y):
    return round(x / y, 2) if x is not None and y else None


def measure(a, ns, snapshot, workdir, live):
    """Keys for net.py's JSON: tcp_plain, tcp_proxied and their ratios (proxied / plain)."""
    plain = side_summary(run_plain(a, ns, snapshot, workdir, live), a.mib)
    proxied = side_summary(run_proxied(a), a.mib)
    return {
        "tcp_conns": a.conns,
        "tcp_upload_mib": a.mib,
        "tcp_upload_runs": a.tcp_runs,
        "tcp_plain": plain,
        "tcp_proxied": proxied,
        "tcp_ratio_proxied_to_plain": {
            "connect_ms_p50": ratio(proxied["connect_ms"]["p50"], plain["connect_ms"]["p50"]),
            "connect_ms_p90": ratio(proxied["connect_ms"]["p90"], plain["connect_ms"]["p90"]),
            "send_mib_s_p50": ratio(proxied["send_mib_s"]["p50"], plain["send_mib_s"]["p50"]),
            "server_mib_s_p50": ratio(proxied["server_mib_s"]["p50"],
                                      plain["server_mib_s"]["p50"]),
        },
    }
