#!/usr/bin/env python3
"""Boot benchmark: airlock-vmm against QEMU's microvm machine, same kernel and image.

Each run starts the VMM as a child process and measures, from just before the spawn, the time
until `airlock: userspace up` appears on its console (stdout); runs alternate between the two
VMMs so that machine noise hits both alike. airlock-vmm also logs its resident memory outside
guest RAM at that moment. Prints progress to stderr and one JSON object as the last line.
"""
import argparse
import json
import os
import platform
import re
import select
import subprocess
import sys
import time

from stats import pct, summary  # benches/stats.py

READY = b"airlock: userspace up"
OVERHEAD_RE = re.compile(rb"vmm overhead: (\d+) KiB")


def run_once(cmd, timeout_s, env=None):
    """Returns (ms to the ready line or None, exit code, stderr bytes)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    ready_ms = None
    tail = b""
    err = b""
    streams = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
    deadline = start + timeout_s
    while streams and time.monotonic() < deadline:
        readable, _, _ = select.select(list(streams), [], [], max(0.0, deadline - time.monotonic()))
        for fd in readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                del streams[fd]
                continue
            if streams[fd] == "err":
                err += chunk
                continue
            tail = (tail + chunk)[-4096:]
            if ready_ms is None and READY in tail:
                ready_ms = (time.monotonic() - start) * 1000.0
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    return ready_ms, code, err


def git_sha():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vmm", required=True)
    ap.add_argument("--qemu", required=True, help="kernel-config/qemu-boot.sh")
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--rootfs", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vcpus", type=int, default=1)
    ap.add_argument("--mem-mib", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()

    ours_cmd = [a.vmm, "boot", "--kernel", a.kernel, "--rootfs", a.rootfs,
                "--vcpus", str(a.vcpus), "--mem-mib", str(a.mem_mib)]
    qemu_cmd = [a.qemu, a.kernel, a.rootfs, str(a.vcpus)]
    qemu_env = dict(os.environ, AIRLOCK_QEMU_MEM=str(a.mem_mib))
    ours, qemu, overhead, failures = [], [], [], []
    for i in range(a.runs):
        for name, cmd, out, env in (("ours", ours_cmd, ours, None), ("qemu", qemu_cmd, qemu, qemu_env)):
            ms, code, err = run_once(cmd, a.timeout, env)
            print(f"run {i + 1}/{a.runs} {name}: ready {ms and round(ms)} ms, exit {code}",
                  file=sys.stderr, flush=True)
            if ms is None:
                failures.append({"vmm": name, "run": i + 1, "exit": code,
                                 "stderr_tail": err[-2000:].decode(errors="replace")})
                continue
            out.append(ms)
            m = OVERHEAD_RE.search(err) if name == "ours" else None
            if m:
                overhead.append(int(m.group(1)))

    result = {
        "bench": "boot",
        "git_sha": git_sha(),
        "host": {"machine": platform.machine(), "kernel": platform.release(),
                 "cpus": os.cpu_count(),
                 "kvm": "nested-pvm" if os.path.exists("/sys/module/kvm_pvm") else "bare-metal"},
        "vcpus": a.vcpus,
        "mem_mib": a.mem_mib,
        "ours_ms": summary(ours),
        "qemu_ms": summary(qemu),
        "ratio_p50": (pct(ours, 50) / pct(qemu, 50)) if ours and qemu else None,
        "vmm_overhead_kib": max(overhead) if overhead else None,
        "vmm_overhead_kib_samples": overhead,
        "failures": failures,
    }
    print(json.dumps(result))
    return 0 if ours and qemu and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
