#!/usr/bin/env python3
"""Restore -> Ready of clones of a snapshot taken right after the warm-up, against clones of
one taken once the guest had settled (`airlock-vmm snapshot --settle-ms`), side by side.

1. Two cold boots of the same guest (256 MiB, the daemon's default warm-up `python3 -c pass`):
   one snapshotted at once (`--settle-ms 0`), one after the guest went quiet (the default).
2. RUNS rounds, alternating: a warm `airlock-vmm pool --snapshot DIR` process (as airlockd
   keeps them) is asked to restore, and the time from the request until the guest agent's
   Ready arrives over vsock is taken, with the VMM's own restore time.

Prints progress to stderr and one JSON object as the last line of stdout: `unsettled` and
`settled`, each with `restore_to_ready_ms` and `restore_ms` summaries (samples included, for
benches/plot.py), and how long the settled snapshot waited.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from restore import Restored, make_snapshot  # benches/restore.py
from stats import summary  # benches/stats.py

WARMUP = "python3 -c pass"


def log(msg):
    print(f"settle: {msg}", file=sys.stderr, flush=True)


def snapshot(vmm, kernel, rootfs, out, settle_ms):
    shutil.rmtree(out, ignore_errors=True)
    log(f"--settle-ms {settle_ms}")
    return make_snapshot(vmm, kernel, rootfs, 256, out, 1,
                         extra=("--warmup", WARMUP, "--settle-ms", str(settle_ms)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vmm", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--rootfs", required=True)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="airlock-settle-bench-")
    try:
        kinds = {"unsettled": 0, "settled": 10000}
        made = {k: snapshot(args.vmm, args.kernel, args.rootfs, os.path.join(workdir, k), ms)
                for k, ms in kinds.items()}
        ready = {k: [] for k in kinds}
        restore = {k: [] for k in kinds}
        for run in range(args.runs):
            for kind in kinds:
                vm = Restored(args.vmm, os.path.join(workdir, kind), workdir,
                              f"{kind}-{run}", pool="template")
                try:
                    ready_ms = vm.wait_ready()
                    us = vm.restore_us()
                finally:
                    vm.stop()
                ready[kind].append(ready_ms)
                restore[kind].append(us / 1000.0)
                log(f"run {run + 1}/{args.runs} {kind}: restore {us / 1000.0:.2f} ms, "
                    f"agent after {ready_ms:.1f} ms")
                time.sleep(0.5)
        out = {"bench": "settle", "runs": args.runs, "warmup": WARMUP}
        for kind in kinds:
            out[kind] = {
                "restore_to_ready_ms": summary(ready[kind]),
                "restore_ms": summary(restore[kind], digits=3),
                "snapshot": made[kind].get("settle"),
            }
        print(json.dumps(out))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
