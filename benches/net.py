"""Network bench: restore with the network card on and off, and the guest's TCP through
airlockd's egress proxy against a plain TAP (benches/nettcp.py, unless --no-tcp).

Two snapshots of the same guest (kernel, image, 256 MiB, vCPUs), one booted with a virtio-net
card on a TAP and one without; then RUNS rounds that restore each once in a fresh
`airlock-vmm restore` process, alternating, every card-carrying clone on a TAP of its own.
Reported per configuration: the VMM's restore time (`restored: vcpus running N us after the
restore began`) and process spawn -> the guest agent's Ready over vsock.

Every TAP lives in a network namespace this bench makes (and deletes); the restore part
configures no address and sends no packet. Then (nettcp.py) connection setup and upload
throughput from a clone of the card-carrying snapshot on a plain TAP, and from a sandbox of a
live airlockd through its proxy, side by side: `tcp_plain`, `tcp_proxied` and their ratios.
Needs root (namespaces, /dev/net/tun, cgroups) and /dev/kvm.
Prints progress on stderr and one JSON object on stdout."""
import argparse
import ctypes
import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from restore import BenchError, Restored, make_snapshot  # noqa: E402
from stats import summary  # noqa: E402
import nettcp  # noqa: E402

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CLONE_NEWNET = 0x40000000
LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def log(msg):
    print(f"net: {msg}", file=sys.stderr, flush=True)


class Netns:
    """A network namespace of this bench, in which TAPs are made."""

    def __init__(self, name):
        self.name = name
        subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "netns", "add", name], check=True)

    def open_tap(self, ifname):
        """A TAP `ifname` in this namespace: the calling thread enters it, opens the TAP and
        goes back."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        there = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            if LIBC.setns(there, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
            try:
                fd = os.open("/dev/net/tun", os.O_RDWR)
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(),
                                                      IFF_TAP | IFF_NO_PI))
                return fd
            finally:
                if LIBC.setns(home, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back")
        finally:
            os.close(home)
            os.close(there)

    def delete(self):
        subprocess.run(["ip", "netns", "del", self.name], stderr=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vmm", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--rootfs", required=True)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--vcpus", type=int, default=1)
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds between restores (the host tears the last VM down)")
    ap.add_argument("--no-tcp", action="store_true", help="only the restore part")
    ap.add_argument("--bench", help="airlock-bench (its guest-exec runs the plain guest's script)")
    ap.add_argument("--create-bench", help="airlock-create-bench (its --net-run: the proxied one)")
    ap.add_argument("--daemon", help="airlockd")
    ap.add_argument("--conns", type=int, default=30, help="connections timed in each guest")
    ap.add_argument("--mib", type=int, default=2, help="MiB per upload")
    ap.add_argument("--tcp-runs", type=int, default=3, help="uploads in each guest")
    ap.add_argument("--tcp-timeout", type=int, default=1800,
                    help="seconds the guest script may take")
    args = ap.parse_args()
    if not args.no_tcp and not (args.bench and args.create_bench and args.daemon):
        ap.error("--bench, --create-bench and --daemon (or --no-tcp)")
    # SIGTERM unwinds like ^C: the finally blocks remove what the bench made.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = tempfile.mkdtemp(prefix="airlock-net-bench-")
    ns = Netns(f"airlock-bench-net-{os.getpid()}")
    live = []
    try:
        snaps = {}
        for card in ("off", "on"):
            out = os.path.join(workdir, f"snap-{card}")
            extra = []
            tap = None
            if card == "on":
                tap = ns.open_tap("tapsnap")
                extra = ["--net-fd", str(tap)]
            fds = (tap,) if tap is not None else ()
            make_snapshot(args.vmm, args.kernel, args.rootfs, 256, out, args.vcpus, extra, fds)
            if tap is not None:
                os.close(tap)
            snaps[card] = out
        restore_ms = {"off": [], "on": []}
        ready_ms = {"off": [], "on": []}
        for run in range(args.runs):
            for card in ("off", "on"):
                tap = ns.open_tap(f"tap{run}") if card == "on" else None
                vm = Restored(args.vmm, snaps[card], workdir, f"{card}-{run}", tap_fd=tap)
                live.append(vm)
                ready = vm.wait_ready()
                us = vm.restore_us()
                restore_ms[card].append(us / 1000.0)
                ready_ms[card].append(ready)
                log(f"run {run + 1}/{args.runs} card {card}: restore {us / 1000.0:.2f} ms, "
                    f"agent after {ready:.1f} ms")
                vm.stop()
                live.remove(vm)
                if tap is not None:
                    os.close(tap)
                time.sleep(args.settle)
        result = {
            "bench": "net",
            "vcpus": args.vcpus,
            "mem_mib": 256,
            "restore_ms_card_off": summary(restore_ms["off"], 3),
            "restore_ms_card_on": summary(restore_ms["on"], 3),
            "spawn_to_agent_ms_card_off": summary(ready_ms["off"]),
            "spawn_to_agent_ms_card_on": summary(ready_ms["on"]),
        }
        failed = False
        if not args.no_tcp:
            try:
                result.update(nettcp.measure(args, ns, snaps["on"], workdir, live))
            except (BenchError, OSError, subprocess.SubprocessError) as e:
                log(f"tcp part failed: {e}")
                result["tcp_error"] = str(e)
                failed = True
        print(json.dumps(result))
        return 1 if failed else 0
    finally:
        for vm in live:
            vm.stop()
        ns.delete()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
