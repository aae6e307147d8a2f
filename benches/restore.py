#!/usr/bin/env python3
"""Snapshot-restore benchmark of airlock-vmm, with QEMU restoring its own snapshot as a
reference in the same run.

1. `airlock-vmm snapshot` boots the guest twice (256 MiB and 2048 MiB) and snapshots each once
   its agent answers (two cold boots: the slow part on nested-KVM build machines).
2. For each size, RUNS restores of each kind, one at a time. `restore_ms_<size>`: a warm
   `airlock-vmm pool --snapshot DIR` process (KVM VM, vCPUs, and the template's memory mapped
   and registered, as airlockd's pool per template keeps them) is sent `restore DIR`; the
   VMM's own measurement from receiving the request to vCPUs running (its log line
   "restored: vcpus running N us after the restore began").
   `reserved_pool_restore_ms_<size>`: a pool for any snapshot of that size (`--mem-mib`:
   address space reserved and registered, the memory file mapped over it at restore).
   `cold_restore_ms_<size>`: the same inside a fresh `airlock-vmm restore` process, and
   `cold_process_to_running_ms_<size>` from that process's start. `restore_to_agent_ms`
   (256 MiB, pool): from the restore request until the guest agent's Ready frame arrives over
   vsock; `cold_spawn_to_agent_ms` from spawning `airlock-vmm restore`.
   `restored_vmm_overhead_kib`: the VMM's resident memory outside guest memory once the agent
   answered.
3. `single_vm_pss_mib`: proportional set size of one restored, idle VM (agent answered);
   `clones20_pss_mib`: the PSS of 20 idle clones of the same snapshot, all running at once,
   summed; their ratio shows how much the MAP_PRIVATE clones share.
4. `qemu_restore_ms`: benches/qemu_restore.py in the same run (same kernel, image, memory).

Prints progress to stderr and one JSON object as the last line of stdout.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from stats import summary  # benches/stats.py

HERE = os.path.dirname(os.path.abspath(__file__))
RESTORED_RE = re.compile(rb"restored: vcpus running (\d+) us after the restore began")
AGENT_PORT = 52


def log(msg):
    print(f"restore: {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


def make_snapshot(vmm, kernel, rootfs, mem_mib, out, vcpus, extra=(), pass_fds=()):
    """Boots once and snapshots into `out` (`extra`: more `airlock-vmm snapshot` options,
    `pass_fds`: descriptors they name); returns the snapshot's JSON summary."""
    log(f"cold boot + snapshot of a {mem_mib} MiB guest (tens of seconds on nested KVM)")
    t = time.monotonic()
    r = subprocess.run(
        [vmm, "snapshot", "--kernel", kernel, "--rootfs", rootfs, "--mem-mib", str(mem_mib),
         "--vcpus", str(vcpus), "--out", out, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900, pass_fds=pass_fds)
    if r.returncode != 0:
        raise BenchError(f"snapshot failed ({r.returncode}): {r.stderr.decode()[-3000:]}")
    summary_line = json.loads(r.stdout.decode().strip().splitlines()[-1])
    log(f"  snapshot after {time.monotonic() - t:.1f} s: {summary_line}")
    return summary_line


def read_ready(sock_path, deadline):
    """Connects through the hybrid-vsock socket to the agent; returns when its first frame
    (Ready) has arrived."""
    while time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            s.connect(sock_path)
            s.sendall(f"CONNECT {AGENT_PORT}\n".encode())
            line = b""
            while not line.endswith(b"\n"):
                b = s.recv(1)
                if not b:
                    raise ConnectionError("closed during the handshake")
                line += b
            if not line.startswith(b"OK "):
                raise ConnectionError(line)
            header = b""
            while len(header) < 4:
                b = s.recv(4 - len(header))
                if not b:
                    raise ConnectionError("closed before Ready")
                header += b
            n = int.from_bytes(header, "little")
            body = b""
            while len(body) < n:
                b = s.recv(n - len(body))
                if not b:
                    raise ConnectionError("closed in Ready")
                body += b
            return s
        except (OSError, ConnectionError):
            s.close()
            time.sleep(0.002)
    raise BenchError(f"no agent answer on {sock_path}")


def control(path, line, timeout=60):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(path)
    s.sendall(line.encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        b = s.recv(4096)
        if not b:
            break
        data += b
    s.close()
    answer = json.loads(data.decode())
    if not answer.get("ok"):
        raise BenchError(f"control {line}: {answer}")
    return answer


class Restored:
    """One restored VM: `airlock-vmm restore` (cold process) or, with `pool=True`, a warm
    `airlock-vmm pool` process that is asked to restore once it has prepared its VM."""

    def __init__(self, vmm, snapshot, workdir, tag, pool=None, mem_mib=None, tap_fd=None):
        self.sock = os.path.join(workdir, f"{tag}.vsock")
        self.ctl = os.path.join(workdir, f"{tag}.ctl")
        self.err_path = os.path.join(workdir, f"{tag}.log")
        for p in (self.sock, self.ctl):
            if os.path.exists(p):
                os.unlink(p)
        self.err = open(self.err_path, "wb")
        console = os.path.join(workdir, f"{tag}.console")
        self.spawned = time.monotonic()
        if pool:
            argv = [vmm, "pool", "--control", self.ctl, "--vsock", self.sock, "--console",
                    console]
            if pool == "template":
                # As airlockd's pool per template does: it knows the snapshot it will restore.
                argv += ["--snapshot", snapshot]
            elif pool == "reserved":
                # A pool for any snapshot of this memory size.
                argv += ["--mem-mib", str(mem_mib)]
        else:
            argv = [vmm, "restore", "--snapshot", snapshot, "--vsock", self.sock, "--console",
                    console]
        fds = ()
        if tap_fd is not None:
            # The network card's TAP, inherited (airlock-vmm never opens /dev/net/tun).
            argv += ["--net-fd", str(tap_fd)]
            fds = (tap_fd,)
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.err,
                                     pass_fds=fds)
        self.conn = None
        if pool:
            deadline = time.monotonic() + 30
            while True:
                try:
                    control(self.ctl, "status")
                    break
                except (OSError, BenchError, ValueError):
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise BenchError("the pool process did not come up")
                    time.sleep(0.005)
            time.sleep(0.05)
            # From here on, the clock of "restore requested".
            self.spawned = time.monotonic()
            control(self.ctl, f"restore {snapshot}")

    def wait_ready(self, timeout=120):
        self.conn = read_ready(self.sock, time.monotonic() + timeout)
        return (time.monotonic() - self.spawned) * 1000.0

    def restore_us(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.err_path, "rb") as f:
                m = RESTORED_RE.search(f.read())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.001)
        with open(self.err_path, "rb") as f:
            raise BenchError(f"no restore line: {f.read().decode()[-2000:]}")

    def process_to_running_ms(self):
        with open(self.err_path, "rb") as f:
            m = re.search(rb"\((\d+) us after process start\)", f.read())
        return int(m.group(1)) / 1000.0 if m else None

    def smaps_totals(self, exclude):
        """(rss_kib, pss_kib, rss_outside_kib): RSS and PSS of the whole process, and the RSS
        outside mappings whose path is `exclude` (guest memory)."""
        rss = pss = outside = 0
        current_excluded = False
        with open(f"/proc/{self.proc.pid}/smaps") as f:
            for line in f:
                parts = line.split()
                if not parts:
                    continue
                if not parts[0].endswith(":") or "-" in parts[0]:
                    # A mapping header: "start-end perms offset dev inode [path]".
                    current_excluded = len(parts) >= 6 and parts[5] == exclude
                    continue
                if parts[0] == "Rss:":
                    kib = int(parts[1])
                    rss += kib
                    if not current_excluded:
                        outside += kib
                elif parts[0] == "Pss:":
                    pss += int(parts[1])
        return rss, pss, outside

    def stop(self):
        if self.conn:
            self.conn.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def run_qemu(args, kernel, rootfs, workdir):
    log("QEMU reference: boot once, save, restore RUNS times (benches/qemu_restore.py)")
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "qemu_restore.py"), "--kernel", kernel, "--rootfs",
         rootfs, "--runs", str(args.runs), "--mem-mib", "256", "--vcpus", str(args.vcpus),
         "--workdir", os.path.join(workdir, "qemu")],
        stdout=subprocess.PIPE, stderr=sys.stderr, timeout=1800)
    if r.returncode != 0:
        raise BenchError("qemu_restore.py failed")
    return json.loads(r.stdout.decode().strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vmm", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--rootfs", required=True)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--clones", type=int, default=20)
    ap.add_argument("--vcpus", type=int, default=1)
    ap.add_argument("--no-qemu", action="store_true")
    ap.add_argument("--workdir")
    ap.add_argument("--reuse-snapshots", action="store_true",
                    help="keep snapshots found in --workdir (same artifacts!) instead of booting")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds to wait after a VM ends before the next restore (the host "
                         "tears the last one down meanwhile)")
    args = ap.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix="airlock-restore-bench-")
    os.makedirs(workdir, exist_ok=True)
    live = []
    try:
        snaps = {}
        for mib in (256, 2048):
            out = os.path.join(workdir, f"snap{mib}")
            if args.reuse_snapshots and os.path.exists(os.path.join(out, "state")):
                snaps[mib] = (out, {"reused": out})
                continue
            shutil.rmtree(out, ignore_errors=True)
            snaps[mib] = (out, make_snapshot(args.vmm, args.kernel, args.rootfs, mib, out,
                                             args.vcpus))

        restore_ms = {256: [], 2048: []}
        reserved_ms = {256: [], 2048: []}
        cold_ms = {256: [], 2048: []}
        process_ms = {256: [], 2048: []}
        to_agent, cold_to_agent, overhead = [], [], []
        for run in range(args.runs):
            for mib in (256, 2048):
                snap = snaps[mib][0]
                for kind in ("template", "reserved", "cold"):
                    pool = None if kind == "cold" else kind
                    vm = Restored(args.vmm, snap, workdir, f"r{mib}-{run}-{kind}", pool=pool,
                                  mem_mib=mib)
                    live.append(vm)
                    ready_ms = vm.wait_ready()
                    us = vm.restore_us()
                    {"template": restore_ms, "reserved": reserved_ms,
                     "cold": cold_ms}[kind][mib].append(us / 1000.0)
                    if kind == "cold":
                        process_ms[mib].append(vm.process_to_running_ms())
                    if mib == 256 and kind != "reserved":
                        (to_agent if pool else cold_to_agent).append(ready_ms)
                        if pool:
                            time.sleep(0.2)
                            _, _, outside = vm.smaps_totals(os.path.join(snap, "memory"))
                            overhead.append(float(outside))
                    log(f"run {run + 1}/{args.runs} {mib} MiB {kind}: "
                        f"restore {us / 1000.0:.2f} ms, agent after {ready_ms:.1f} ms")
                    vm.stop()
                    live.remove(vm)
                    time.sleep(args.settle)

        snap256 = snaps[256][0]
        mem_path = os.path.join(snap256, "memory")
        single = Restored(args.vmm, snap256, workdir, "single")
        live.append(single)
        single.wait_ready()
        time.sleep(1.0)
        single_pss = single.smaps_totals(mem_path)[1] / 1024.0
        single.stop()
        live.remove(single)
        log(f"one idle restored VM: PSS {single_pss:.1f} MiB")

        clones = []
        t = time.monotonic()
        for i in range(args.clones):
            c = Restored(args.vmm, snap256, workdir, f"clone{i}")
            clones.append(c)
            live.append(c)
        for c in clones:
            c.wait_ready(timeout=300)
        all_ready_ms = (time.monotonic() - t) * 1000.0
        time.sleep(1.0)
        clones_pss = sum(c.smaps_totals(mem_path)[1] for c in clones) / 1024.0
        clones_rss = sum(c.smaps_totals(mem_path)[0] for c in clones) / 1024.0
        log(f"{args.clones} idle clones: PSS {clones_pss:.1f} MiB (RSS {clones_rss:.1f} MiB), "
            f"all answering after {all_ready_ms:.0f} ms")
        for c in clones:
            c.stop()
            live.remove(c)

        qemu = None if args.no_qemu else run_qemu(args, args.kernel, args.rootfs, workdir)

        r256 = summary(restore_ms[256], 3)
        r2048 = summary(restore_ms[2048], 3)
        result = {
            "bench": "restore",
            "restore_ms_256": r256,
            "restore_ms_2048": r2048,
            "restore_ratio_2048_to_256_p50": (r2048["p50"] / r256["p50"]) if r256["p50"] else None,
            "reserved_pool_restore_ms_256": summary(reserved_ms[256], 3),
            "reserved_pool_restore_ms_2048": summary(reserved_ms[2048], 3),
            "cold_restore_ms_256": summary(cold_ms[256], 3),
            "cold_restore_ms_2048": summary(cold_ms[2048], 3),
            "cold_process_to_running_ms_256": summary(process_ms[256], 3),
            "cold_process_to_running_ms_2048": summary(process_ms[2048], 3),
            "restore_to_agent_ms": summary(to_agent),
            "cold_spawn_to_agent_ms": summary(cold_to_agent),
            "restored_vmm_overhead_kib": summary(overhead, 0),
            "single_vm_pss_mib": round(single_pss, 1),
            "clones20_pss_mib": round(clones_pss, 1),
            "clones": args.clones,
            "clones_pss_ratio_to_single": round(clones_pss / single_pss, 2) if single_pss else None,
            "clones_all_answering_ms": round(all_ready_ms, 1),
            "snapshot_256": snaps[256][1],
            "snapshot_2048": snaps[2048][1],
            "qemu_restore_ms": qemu["qemu_restore_ms"] if qemu else None,
            "qemu_process_to_running_ms": qemu["qemu_process_to_running_ms"] if qemu else None,
            "ratio_qemu_to_ours_p50": (qemu["qemu_restore_ms"]["p50"] / r256["p50"])
            if qemu and r256["p50"] else None,
            "vcpus": args.vcpus,
            "host": {"machine": platform.machine(), "kernel": platform.release(),
                     "cpus": os.cpu_count(),
                     "kvm": "nested-pvm" if os.path.exists("/sys/module/kvm_pvm") else "host"},
        }
        print(json.dumps(result))
        return 0
    except BenchError as e:
        log(f"error: {e}")
        return 1
    finally:
        for vm in live:
            vm.stop()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
