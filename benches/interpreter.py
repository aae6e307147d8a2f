"""The code interpreter's latency: cells in the warm kernel of the `code-interpreter` template
against a fresh `python3 -c` of the same code (an execution), in sandboxes of one live
airlockd, alternating run by run.

Each run, on each side: create a sandbox and get the first `1+1` (create -> first result), then
CELLS more `1+1` (a cell's round trip; on the exec side `python3 -c 'print(1+1)'`), then a
matplotlib figure as a PNG (the cell returns it as a result; the exec side imports matplotlib,
draws and writes the PNG to stdout), then destroy. Prints one JSON object: per side and step the
summary (p50/p90/p99, mean, samples, ms) and the ratios exec / cell of the p50s.

The template is built once (boot, the kernel's start and warm-up: minutes on nested KVM) and
kept in KEEP (default $AIRLOCK_CACHE_DIR/bench-interpreter/<image name>); a later run imports
it (delete the directory to build it again).

Usage (benches/run.sh interpreter): interpreter.py --daemon AIRLOCKD --vmm AIRLOCK_VMM
    --kernel VMLINUX --rootfs IMAGE --runs N --cells N [--keep DIR]
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import summary  # noqa: E402

TEMPLATE = "code-interpreter"
PLOT = (
    "import io, matplotlib\n"
    "matplotlib.use('Agg')\n"
    "import matplotlib.pyplot as plt\n"
    "fig = plt.figure(figsize=(4, 3), dpi=100)\n"
    "plt.plot([1, 2, 3], [1, 4, 9])\n"
)
PLOT_CELL = PLOT.replace("matplotlib.use('Agg')\n", "") + "plt.show()\n"
PLOT_EXEC = PLOT + (
    "b = io.BytesIO()\nfig.savefig(b, format='png')\n"
    "import sys\nsys.stdout.buffer.write(b.getvalue())\n"
)


def start_daemon(args, tmp, keep):
    sock = tmp / "airlockd.sock"
    imported = f'import_templates = ["{keep}"]\n' if (keep / "template.pb").is_file() else ""
    (tmp / "airlockd.toml").write_text(
        f"""
pool_size = 1
cgroup_parent = "airlock-bench-interp-{os.getpid()}"
vmm_binary = "{args.vmm}"
adopt_on_restart = false
template_build_timeout_s = 1800
{imported}
[images.{TEMPLATE}]
kernel = "{args.kernel}"
rootfs = "{args.rootfs}"
"""
    )
    log = open(tmp / "airlockd.log", "wb")
    proc = subprocess.Popen(
        [args.daemon, "--config", str(tmp / "airlockd.toml"), "--listen", f"unix://{sock}",
         "--data-dir", str(tmp / "data")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"airlockd did not start: {(tmp / 'airlockd.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, f"unix://{sock}"


def ensure_template(client, tmp, keep):
    from airlock._proto import airlock_pb2 as pb

    listed = client._unary("ListTemplates", pb.ListTemplatesRequest()).templates
    if any(t.name == TEMPLATE for t in listed):
        print(f"== template {TEMPLATE} imported from {keep}", file=sys.stderr)
        return
    print(f"== building the template {TEMPLATE} (minutes on nested KVM)", file=sys.stderr)
    t0 = time.monotonic()
    client.templates.create(
        TEMPLATE, image=TEMPLATE, memory_mib=1024, warmup="/usr/lib/airlock/interpreter-warmup"
    )
    print(f"== built in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    t = next(t for t in client._unary("ListTemplates", pb.ListTemplatesRequest()).templates
             if t.name == TEMPLATE)
    # Kept as the daemon imports it: the snapshot's files and the record.
    src = tmp / "data" / "templates" / t.id
    part = keep.with_name(keep.name + f".tmp-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    for name in ("state", "memory", "layer", "layer.map"):
        if (src / name).exists():
            subprocess.run(["cp", "--sparse=always", str(src / name), str(part / name)], check=True)
    (part / "template.pb").write_bytes(t.SerializeToString())
    shutil.rmtree(keep, ignore_errors=True)
    part.rename(keep)


def timed(f):
    t0 = time.perf_counter()
    v = f()
    return v, (time.perf_counter() - t0) * 1000


def check(ok, what):
    if not ok:
        raise SystemExit(f"bench: {what}")


def cell_run(client, cells):
    t = {}

    def first():
        s = client.sandboxes.create(template=TEMPLATE)
        return s, s.run_code("1+1", timeout=300)

    (s, ex), t["create_to_first_result"] = timed(first)
    check(ex.text == "2", f"first cell: {ex}")
    rts = []
    for _ in range(cells):
        ex, ms = timed(lambda: s.run_code("1+1", timeout=300))
        check(ex.text == "2", f"cell: {ex}")
        rts.append(ms)
    ex, t["plot_png"] = timed(lambda: s.run_code(PLOT_CELL, timeout=300))
    check(any(r.png for r in ex.results), f"no PNG: {ex}")
    s.destroy()
    return t, rts


def exec_run(client, cells):
    t = {}

    def first():
        s = client.sandboxes.create(template=TEMPLATE)
        return s, s.exec(["python3", "-c", "print(1+1)"], timeout=300)

    (s, r), t["create_to_first_result"] = timed(first)
    check(r.stdout.strip() == "2", f"first exec: {r}")
    rts = []
    for _ in range(cells):
        r, ms = timed(lambda: s.exec(["python3", "-c", "print(1+1)"], timeout=300))
        check(r.stdout.strip() == "2", f"exec: {r}")
        rts.append(ms)
    r, t["plot_png"] = timed(lambda: s.exec(["python3", "-c", PLOT_EXEC], timeout=300))
    check(r.stdout_bytes[:4] == b"\x89PNG", f"no PNG: {r.exit_code} {r.stderr[-500:]}")
    s.destroy()
    return t, rts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--vmm", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--rootfs", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cells", type=int, default=5)
    ap.add_argument("--keep")
    args = ap.parse_args()
    cache = Path(os.environ.get("AIRLOCK_CACHE_DIR", "/var/cache/airlock"))
    keep = Path(args.keep) if args.keep else cache / "bench-interpreter" / Path(args.rootfs).stem
    keep.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="airlock-bench-interp-"))
    proc, address = start_daemon(args, tmp, keep)
    try:
        import airlock

        with airlock.Client(address) as client:
            ensure_template(client, tmp, keep)
            # One of each first: the pool and the connections settle.
            cell_run(client, 1)
            exec_run(client, 1)
            results = {"cell": [], "exec": []}
            round_trips = {"cell": [], "exec": []}
            for i in range(args.runs):
                for side, f in (("cell", cell_run), ("exec", exec_run)):
                    t, rts = f(client, args.cells)
                    results[side].append(t)
                    round_trips[side].extend(rts)
                print(f"run {i + 1}/{args.runs}", file=sys.stderr)
        out = {"bench": "interpreter", "runs": args.runs, "cells": args.cells, "unit": "ms"}
        for side, runs in results.items():
            out[side] = {step: summary([r[step] for r in runs]) for step in runs[0]}
            out[side]["round_trip_1_plus_1"] = summary(round_trips[side])
        out["ratio_exec_over_cell_p50"] = {
            step: round(out["exec"][step]["p50"] / out["cell"][step]["p50"], 3)
            for step in out["cell"]
        }
        print(json.dumps(out))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
