"""Network bench, first part: restore with the network card on and off.

Two snapshots of the same guest (kernel, image, 256 MiB, vCPUs), one booted with a virtio-net
card on a TAP and one without; then RUNS rounds that restore each once in a fresh
`airlock-vmm restore` process, alternating, every card-carrying clone on a TAP of its own.
Reported per configuration: the VMM's restore time (`restored: vcpus running N us after the
restore began`) and process spawn -> the guest agent's Ready over vsock.

Every TAP lives in a network namespace this bench makes (and deletes); no address is
configured and no packet is sent. Needs root (namespaces, /dev/net/tun) and /dev/kvm.
Prints progress on stderr and one JSON object on stdout."""
import argparse
import ctypes
import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from restore import Restored, make_snapshot  # noqa: E402
from stats import summary  # noqa: E402

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
    args = ap.parse_args()
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
        print(json.dumps(result))
    finally:
        for vm in live:
            vm.stop()
        ns.delete()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
