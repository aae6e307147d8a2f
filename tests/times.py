#!/usr/bin/env python3
"""Where the time of a test run goes: the timing table of ./tests/run.sh.

    tests/times.py tee STAGE        passes its standard input through to standard output and
                                    records the cargo test binaries and tests it sees in it
    tests/times.py lanes STAGE N -- SPEC...
                                    runs the cargo test binaries SPEC (`tests/NAME.rs` for the
                                    system test NAME) N at a time, longest first, each one's
                                    output shown whole when it ends; exits 1 if any failed
    tests/times.py stage NAME T0 T1 RC
                                    records a stage of run.sh (start and end in Unix seconds)
    tests/times.py report           prints the table and writes target/test-times.json

Records live in $AIRLOCK_TIMES_DIR (run.sh sets target/test-times). Per-test seconds come from
when libtest reports each test as done: the time since the binary's previous test ended (or the
binary started). The system tests of one binary run one at a time (tests/shared.rs), so for
them this is the test's own time; a binary's first test includes its daemon's start.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES_DIR = Path(os.environ.get("AIRLOCK_TIMES_DIR", ROOT / "target" / "test-times"))
CACHE_DIR = Path(os.environ.get("AIRLOCK_CACHE_DIR", "/var/cache/airlock"))
# Durations of the last run's system test binaries, for the lanes' order (longest first).
LAST_TIMES = CACHE_DIR / "test-times-last.json"
OUT_JSON = ROOT / "target" / "test-times.json"

# The budget (issue 34): the whole run on a warm machine, and any one test binary or stage.
BUDGET_TOTAL_S = 40 * 60
BUDGET_FILE_S = 6 * 60

RUNNING = re.compile(r"^\s*Running (?:unittests )?(\S+) \((\S+)\)")
DOCTESTS = re.compile(r"^\s*Doc-tests (\S+)")
TEST_DONE = re.compile(r"test (\S+) \.\.\. (ok|FAILED|ignored)")
RESULT = re.compile(
    r"test result: (ok|FAILED)\. (\d+) passed; (\d+) failed; (\d+) ignored;.*finished in ([\d.]+)s"
)


def binary_name(src: str, exe: str) -> str:
    """`tests/packages.rs` for a system test file (the package's root is tests/), `airlock_vmm
    (src/lib.rs)` for unit tests and other packages' integration tests."""
    crate = re.sub(r"-[0-9a-f]{16}$", "", Path(exe).name)
    if "/" not in src and src not in ("lib.rs", "main.rs"):
        return f"tests/{src}"
    return f"{crate} ({src})"


class Recorder:
    """Follows cargo test output line by line and keeps what each binary and test took."""

    def __init__(self, stage: str):
        self.stage = stage
        self.start = time.time()
        self.binaries: list[dict] = []
        self.cur: dict | None = None

    def _close(self, now: float) -> None:
        if self.cur is not None and "end" not in self.cur:
            self.cur["end"] = now
            self.cur.setdefault("seconds", round(now - self.cur["start"], 1))

    def line(self, text: str, now: float) -> None:
        m = RUNNING.search(text)
        d = DOCTESTS.search(text) if not m else None
        if m or d:
            self._close(now)
            name = binary_name(m.group(1), m.group(2)) if m else f"{d.group(1)} (doc tests)"
            self.cur = {"name": name, "start": now, "last": now, "tests": []}
            self.binaries.append(self.cur)
            return
        if self.cur is None:
            return
        m = TEST_DONE.search(text)
        if m:
            self.cur["tests"].append(
                {
                    "name": m.group(1),
                    "result": m.group(2),
                    "seconds": round(now - self.cur["last"], 1),
                }
            )
            self.cur["last"] = now
            return
        m = RESULT.search(text)
        if m:
            self.cur.update(
                result=m.group(1),
                passed=int(m.group(2)),
                failed=int(m.group(3)),
                ignored=int(m.group(4)),
                seconds=float(m.group(5)),
            )
            self._close(now)

    def finish(self) -> dict:
        self._close(time.time())
        for b in self.binaries:
            b.pop("last", None)
        return {"stage": self.stage, "start": self.start, "end": time.time(), "binaries": self.binaries}


def write_record(name: str, record: dict) -> None:
    TIMES_DIR.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    (TIMES_DIR / f"binaries-{safe}-{os.getpid()}.json").write_text(json.dumps(record))


def cmd_tee(stage: str) -> int:
    rec = Recorder(stage)
    out = sys.stdout.buffer
    for raw in sys.stdin.buffer:
        out.write(raw)
        out.flush()
        rec.line(raw.decode("utf-8", "replace"), time.time())
    write_record(stage, rec.finish())
    return 0


# Seconds of each system test file in a run two at a time (2026-12-06, build machine), for the
# order of the lanes when no earlier run left its times.
DEFAULT_SECONDS = {
    "tests/npm.rs": 700, "pytest:sdk/python/tests": 620, "tests/disk.rs": 400,
    "tests/agent.rs": 400, "tests/e2b.rs": 300, "tests/egress.rs": 300, "tests/daemon.rs": 300,
    "tests/snapshot.rs": 280, "tests/packages.rs": 260, "tests/jail.rs": 230, "tests/net.rs": 200,
    "tests/broker.rs": 135, "tests/cluster.rs": 110, "tests/restart.rs": 110, "tests/tools.rs": 180, "tests/images.rs": 100, "tests/builds.rs": 320,
    "tests/faults.rs": 100, "tests/boot.rs": 90, "tests/secrets.rs": 70, "tests/exposure.rs": 4,
}


def last_durations() -> dict[str, float]:
    try:
        return {**DEFAULT_SECONDS, **json.loads(LAST_TIMES.read_text())}
    except (OSError, ValueError):
        return dict(DEFAULT_SECONDS)


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat ((0, 0) where unreadable)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return (0.0, 0.0)
    idle = sum(fields[3:5])  # idle, iowait
    return (sum(fields) - idle, sum(fields))


# How long one system test binary (or the pytest run) may take before it is killed with its
# process group: a hang guard, about twice the slowest one's time on a machine busy with other
# work (npm.rs and the SDK's pytest took 700 s and passed 900 s on a cold machine running a
# template build beside them).
BINARY_DEADLINE_S = float(os.environ.get("AIRLOCK_TEST_BINARY_TIMEOUT", "1500"))


def kill_group(p: subprocess.Popen, spec: str) -> None:
    """Kills `p`'s process group (a binary past its deadline)."""
    sys.stderr.write(f"== {spec}: past its deadline of {BINARY_DEADLINE_S:.0f} s, killed\n")
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def cmd_lanes(stage: str, jobs: int, specs: list[str]) -> int:
    """Runs each spec (`tests/NAME.rs`) as `cargo test -p airlock-system-tests --test NAME`."""
    last = last_durations()
    order = sorted(specs, key=lambda s: -last.get(s, 0.0))
    queue = list(order)
    lock = threading.Lock()
    results: dict[str, dict] = {}
    failed: list[str] = []

    def run_one(spec: str) -> None:
        if spec.startswith("pytest:"):
            # The SDK and CLI tests: pytest of the venv tests/run.sh made, times from JUnit XML.
            target = spec.split(":", 1)[1]
            xml = TIMES_DIR / f"pytest-{re.sub(r'[^A-Za-z0-9_.-]', '_', target)}.xml"
            python = os.environ.get("AIRLOCK_SDK_PYTHON", "python3")
            cmd = [python, "-m", "pytest", "-q", "-rA", f"--junitxml={xml}", target]
        else:
            name = Path(spec).stem
            cmd = ["cargo", "test", "-p", "airlock-system-tests", "--test", name, "--", "--nocapture"]
        rec = Recorder(spec)
        lines: list[str] = []
        t0 = time.time()
        # Its own process group, so that a binary past its deadline is killed with everything
        # it started (a hung test must cost minutes, not the whole CI run).
        with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) as p:
            timer = threading.Timer(BINARY_DEADLINE_S, kill_group, args=(p, spec))
            timer.start()
            assert p.stdout is not None
            for raw in p.stdout:
                now = time.time()
                text = raw.decode("utf-8", "replace")
                lines.append(f"[{now - t0:7.1f}] {text}")
                rec.line(text, now)
            rc = p.wait()
            timer.cancel()
        if rc == -signal.SIGKILL and time.time() - t0 >= BINARY_DEADLINE_S:
            lines.append(f"[{time.time() - t0:7.1f}] tests/times.py: killed after its deadline of "
                         f"{BINARY_DEADLINE_S:.0f} s (AIRLOCK_TEST_BINARY_TIMEOUT)\n")
        record = rec.finish()
        secs = time.time() - t0
        if spec.startswith("pytest:"):
            # pytest's own tests are read from its XML by `report`; this is the whole run.
            record["binaries"] = []
            record["pytest"] = {"name": spec, "seconds": round(secs, 1)}
        elif record["binaries"]:
            # The process's time (build check, daemon start and stop included), not libtest's.
            record["binaries"][0]["seconds"] = round(secs, 1)
        with lock:
            results[spec] = record
            if rc != 0:
                failed.append(spec)
            verdict = "ok" if rc == 0 else f"FAILED (exit {rc})"
            sys.stdout.write(f"\n==== {spec}: {verdict} in {secs:.1f} s ====\n")
            sys.stdout.write("".join(lines))
            sys.stdout.write(f"==== end of {spec} ====\n")
            sys.stdout.flush()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                spec = queue.pop(0)
                sys.stderr.write(f"== {spec} started\n")
            run_one(spec)

    threads = [threading.Thread(target=worker) for _ in range(max(1, jobs))]
    start = time.time()
    cpu0 = cpu_times()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    binaries = [b for s in order if s in results for b in results[s]["binaries"]]
    runs = [results[s]["pytest"] for s in order if s in results and "pytest" in results[s]]
    cpu1 = cpu_times()
    # How much of the machine's CPU the lanes kept busy: near 100 %, another lane cannot help
    # (guest kernel work is emulated on the host's cores); well below, it may.
    busy = (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1]) if cpu1[1] > cpu0[1] else None
    write_record(stage, {"stage": stage, "start": start, "end": time.time(), "binaries": binaries, "jobs": jobs,
                         "cpu_busy": None if busy is None else round(busy, 3)})
    if not failed:
        last.update({b["name"]: b["seconds"] for b in binaries + runs})
        try:
            LAST_TIMES.parent.mkdir(parents=True, exist_ok=True)
            LAST_TIMES.write_text(json.dumps(last, indent=1, sort_keys=True))
        except OSError:
            pass
    if failed:
        sys.stdout.write(f"\nfailed: {', '.join(failed)}\n")
    return 1 if failed else 0


def cmd_stage(name: str, t0: str, t1: str, rc: str) -> int:
    TIMES_DIR.mkdir(parents=True, exist_ok=True)
    with open(TIMES_DIR / "stages.tsv", "a") as f:
        f.write(f"{name}\t{t0}\t{t1}\t{rc}\n")
    return 0


def pytest_binaries() -> list[dict]:
    """The SDK/CLI tests from pytest's JUnit XML, one entry per test file."""
    out = []
    for xml in sorted(TIMES_DIR.glob("pytest-*.xml")):
        try:
            root = ET.parse(xml).getroot()
        except (OSError, ET.ParseError):
            continue
        files: dict[str, dict] = {}
        for case in root.iter("testcase"):
            cls = case.get("classname", "")
            fname = "sdk/python/tests/" + cls.split(".")[-1] + ".py" if cls else "pytest"
            b = files.setdefault(fname, {"name": fname, "seconds": 0.0, "tests": [], "passed": 0, "failed": 0, "ignored": 0})
            secs = float(case.get("time", "0") or 0)
            result = "ok"
            if case.find("failure") is not None or case.find("error") is not None:
                result = "FAILED"
                b["failed"] += 1
            elif case.find("skipped") is not None:
                result = "ignored"
                b["ignored"] += 1
            else:
                b["passed"] += 1
            b["seconds"] = round(b["seconds"] + secs, 1)
            b["tests"].append({"name": case.get("name", "?"), "result": result, "seconds": round(secs, 1)})
        out.extend(files.values())
    return out


def fmt_s(s: float) -> str:
    return f"{s:8.1f}"


def cmd_report() -> int:
    stages = []
    try:
        for line in (TIMES_DIR / "stages.tsv").read_text().splitlines():
            name, t0, t1, rc = line.split("\t")
            stages.append({"name": name, "seconds": round(float(t1) - float(t0), 1), "start": float(t0), "end": float(t1), "rc": int(rc)})
    except OSError:
        pass
    records = []
    for f in sorted(TIMES_DIR.glob("binaries-*.json")):
        try:
            records.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            pass
    by_stage: dict[str, list[dict]] = {}
    lanes: dict[str, str] = {}
    for r in records:
        by_stage.setdefault(r["stage"], []).extend(r["binaries"])
        if r.get("jobs"):
            busy = r.get("cpu_busy")
            lanes[r["stage"]] = f"  ({r['jobs']} at once" + ("" if busy is None else f", CPU {busy:.0%} busy") + ")"
    py = pytest_binaries()
    if py:
        by_stage.setdefault(os.environ.get("AIRLOCK_PYTEST_STAGE", "system tests"), []).extend(py)
    total = 0.0
    if stages:
        total = max(s["end"] for s in stages) - min(s["start"] for s in stages)
    warm = all(s["seconds"] < 60 for s in stages if s["name"] in ("guest kernel", "base image"))
    warnings = []
    lines = ["", "== timing table (seconds) =="]
    for s in stages:
        flag = "" if s["rc"] == 0 else "  FAILED"
        lines.append(f"{fmt_s(s['seconds'])}  {s['name']}{flag}{lanes.get(s['name'], '')}")
        key = next((k for k in by_stage if k == s["name"]), None)
        for b in by_stage.get(key, []) if key else []:
            n = b.get("passed", 0) + b.get("failed", 0)
            counts = f"{n} tests" + (f", {b['failed']} failed" if b.get("failed") else "")
            over = b["seconds"] > BUDGET_FILE_S
            lines.append(f"{fmt_s(b['seconds'])}      {b['name']} ({counts}){'  OVER 6 MIN' if over else ''}")
            if over:
                warnings.append(f"{b['name']} took {b['seconds']:.0f} s, over the {BUDGET_FILE_S // 60}-minute budget of one file")
    tests = [
        {"binary": b["name"], **t}
        for bs in by_stage.values()
        for b in bs
        for t in b.get("tests", [])
    ]
    slowest = sorted(tests, key=lambda t: -t["seconds"])[:10]
    lines.append("-- the ten slowest tests --")
    for t in slowest:
        lines.append(f"{fmt_s(t['seconds'])}  {t['binary']}: {t['name']}")
    lines.append(f"{fmt_s(total)}  TOTAL ({'warm' if warm else 'cold'}: the kernel and image {'came from' if warm else 'were not all in'} the cache)")
    if warm and total > BUDGET_TOTAL_S:
        warnings.append(f"the run took {total / 60:.1f} min on a warm machine, over the budget of {BUDGET_TOTAL_S // 60} min")
    for w in warnings:
        lines.append(f"WARNING: {w}")
    print("\n".join(lines), flush=True)
    doc = {
        "total_seconds": round(total, 1),
        "warm": warm,
        "budget": {"total_seconds": BUDGET_TOTAL_S, "file_seconds": BUDGET_FILE_S},
        "warnings": warnings,
        "stages": [
            {**s, "binaries": by_stage.get(s["name"], []),
             **{k: r[k] for r in records if r["stage"] == s["name"] for k in ("jobs", "cpu_busy") if k in r}}
            for s in stages
        ],
        "slowest_tests": slowest,
    }
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(json.dumps(doc, indent=1))
    print(f"(written to {OUT_JSON})", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "tee":
        return cmd_tee(argv[1])
    if len(argv) >= 4 and argv[0] == "lanes" and argv[3] == "--":
        return cmd_lanes(argv[1], int(argv[2]), argv[4:])
    if len(argv) == 5 and argv[0] == "stage":
        return cmd_stage(*argv[1:])
    if argv == ["report"]:
        return cmd_report()
    sys.stderr.write(__doc__ or "")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
