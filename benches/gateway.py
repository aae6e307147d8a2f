"""The E2B gateway's cost: the same work through the unchanged `e2b` SDK and the gateway, and
through Airlock's own Python SDK over gRPC, against one live airlockd, alternating run by run.

Each run, on each side: create a sandbox (template `base`), run `true` in it (the first
command: a connection to the agent, a process), run `echo` five times more (warm commands),
each as E2B's SDK runs commands (`/bin/bash -l -c CMD`, on the gRPC side too),
write and read back a 64 KiB file, kill it. Prints one JSON object: per side and step the
summary (p50/p90/p99, mean, samples, ms) and the ratios gateway / gRPC of the p50s.

Usage (benches/run.sh e2b): gateway.py --daemon AIRLOCKD --vmm AIRLOCK_VMM --runs N
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats import summary  # noqa: E402

# Shaped as E2B's SDKs want an API key: `e2b_` and hex digits.
KEY = "e2b_be4c40123456789abcdef0123456789abcdef0"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(args, tmp):
    port = free_port()
    sock = tmp / "airlockd.sock"
    (tmp / "airlockd.toml").write_text(
        f"""
pool_size = 2
cgroup_parent = "airlock-bench-e2b-{os.getpid()}"
vmm_binary = "{args.vmm}"
adopt_on_restart = false
[tenants.bench]
tokens = ["{KEY}"]
[e2b]
listen = "127.0.0.1:{port}"
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
    return proc, f"unix://{sock}", port


def timed(f):
    t0 = time.perf_counter()
    v = f()
    return v, (time.perf_counter() - t0) * 1000


def e2b_run(Sandbox, payload):
    t = {}
    s, t["create"] = timed(lambda: Sandbox.create(timeout=300, request_timeout=300))
    _, t["first_command"] = timed(lambda: s.commands.run("true", timeout=300))
    _, t["5_commands"] = timed(lambda: [s.commands.run("echo hi", timeout=300) for _ in range(5)])
    _, t["write_read_64k"] = timed(
        lambda: (s.files.write("/home/user/p.bin", payload), s.files.read("/home/user/p.bin", format="bytes"))
    )
    _, t["kill"] = timed(s.kill)
    return t


def grpc_run(client, payload):
    t = {}
    s, t["create"] = timed(lambda: client.sandboxes.create(writable=["/"], exportable=["/"]))
    # The argv E2B's SDK sends for a command: a login bash (its start dominates on nested hosts).
    _, t["first_command"] = timed(lambda: s.exec(["/bin/bash", "-l", "-c", "true"]))
    _, t["5_commands"] = timed(lambda: [s.exec(["/bin/bash", "-l", "-c", "echo hi"]) for _ in range(5)])
    _, t["write_read_64k"] = timed(
        lambda: (s.files.write("/home/user/p.bin", payload), s.files.read("/home/user/p.bin"))
    )
    _, t["kill"] = timed(s.destroy)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--vmm", required=True)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="airlock-bench-e2b-"))
    proc, address, port = start_daemon(args, tmp)
    try:
        os.environ.update(
            E2B_API_KEY=KEY,
            E2B_API_URL=f"http://127.0.0.1:{port}",
            E2B_SANDBOX_URL=f"http://127.0.0.1:{port}",
        )
        os.environ.pop("E2B_DEBUG", None)
        from e2b import Sandbox
        import airlock

        payload = os.urandom(64 << 10)
        with airlock.Client(address) as op:
            print("== building the template base", file=sys.stderr)
            op.templates.create("base")
        results = {"gateway": [], "grpc": []}
        with airlock.Client(address, token=KEY) as client:
            # One of each first: the warm pool and the connections settle.
            e2b_run(Sandbox, payload)
            grpc_run(client, payload)
            for i in range(args.runs):
                results["gateway"].append(e2b_run(Sandbox, payload))
                results["grpc"].append(grpc_run(client, payload))
                print(f"run {i + 1}/{args.runs}", file=sys.stderr)
        out = {"bench": "e2b", "runs": args.runs, "unit": "ms"}
        for side, runs in results.items():
            out[side] = {step: summary([r[step] for r in runs]) for step in runs[0]}
        out["ratio_gateway_over_grpc_p50"] = {
            step: round(out["gateway"][step]["p50"] / out["grpc"][step]["p50"], 3)
            for step in out["grpc"]
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
