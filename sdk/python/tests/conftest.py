"""A live airlockd for the SDK and CLI tests.

The session fixture starts the real daemon (the binaries cargo built), with its own socket,
data directory and cgroup parent, and builds the template ``base`` through the SDK. What it
needs and cannot find (``/dev/kvm``, the binaries, the guest kernel and image) fails the run
with the command that provides it.

Environment:
    AIRLOCK_BIN_DIR   where airlockd, airlock-vmm and airlock are (default: target/debug,
                      else target/release, of the repository)
    AIRLOCK_KERNEL, AIRLOCK_ROOTFS   guest kernel and base image (default: what the daemon
                      finds under /var/cache/airlock, built by kernel-config/build.sh and
                      rootfs/build.sh)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import pytest

from airlock import Client, TemplateProgress

REPO = Path(__file__).resolve().parents[3]
ACME_TOKEN = "acme-test-token"
MAX_SANDBOXES = 8
MAX_FILE_BYTES = 4 << 20


def _bin_dir() -> Path:
    env = os.environ.get("AIRLOCK_BIN_DIR")
    candidates = [Path(env)] if env else [REPO / "target" / "debug", REPO / "target" / "release"]
    for d in candidates:
        if all((d / b).is_file() for b in ("airlockd", "airlock-vmm", "airlock")):
            return d
    pytest.fail(
        "airlockd, airlock-vmm and airlock not found in %s: build them with "
        "`cargo build --workspace --bins` (or set AIRLOCK_BIN_DIR)" % ", ".join(map(str, candidates)),
        pytrace=False,
    )


@dataclass
class Daemon:
    """A running airlockd of the test session."""

    address: str
    bin_dir: Path
    data_dir: Path
    cgroup_parent: str
    proc: subprocess.Popen
    log_path: Path
    base: object = None
    progress: List[TemplateProgress] = field(default_factory=list)

    def env(self, **extra: str) -> Dict[str, str]:
        """Environment for a CLI process talking to this daemon."""
        e = dict(os.environ)
        e.pop("AIRLOCK_TOKEN", None)
        e["AIRLOCK_ADDR"] = self.address
        e["PATH"] = f"{self.bin_dir}:{e.get('PATH', '')}"
        e.update(extra)
        return e

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _cgroup_dirs(name: str) -> List[Path]:
    roots = [Path("/sys/fs/cgroup")] + [p for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir()]
    return [r / name for r in roots if (r / name).is_dir()]


_SESSION_DAEMON = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the daemon's log (its temporary directory goes)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _SESSION_DAEMON is not None:
        report.sections.append(("airlockd log (last 60 lines)", _SESSION_DAEMON.log_tail(60)))


@pytest.fixture(scope="session")
def daemon():
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        pytest.fail("/dev/kvm is not usable: these tests need KVM (run them as root on a KVM host)", pytrace=False)
    bin_dir = _bin_dir()
    tmp = Path(tempfile.mkdtemp(prefix="airlock-pytest-"))
    sock = tmp / "airlockd.sock"
    cgroup_parent = f"airlock-pytest-{os.getpid()}"
    config = tmp / "airlockd.toml"
    config.write_text(
        f"""
pool_size = 1
max_sandboxes = {MAX_SANDBOXES}
max_file_bytes = {MAX_FILE_BYTES}
cgroup_parent = "{cgroup_parent}"
default_idle_ttl_s = 900
# A stopped daemon ends its sandboxes (the leftover check below relies on it).
adopt_on_restart = false

[tenants.acme]
tokens = ["{ACME_TOKEN}"]
quota = {{ max_sandboxes = 1, max_memory_mib = 4096 }}

# The VMMs accept `probe` commands, so that a test can make one break its seccomp filter.
[jail]
test_hooks = true
uid_base = 1700000000
"""
    )
    log_path = tmp / "airlockd.log"
    log = open(log_path, "wb")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "AIRLOCK_KERNEL", "AIRLOCK_ROOTFS", "AIRLOCK_CACHE_DIR")}
    env["RUST_LOG"] = "info"
    proc = subprocess.Popen(
        [
            str(bin_dir / "airlockd"),
            "--config",
            str(config),
            "--listen",
            f"unix://{sock}",
            "--data-dir",
            str(tmp / "data"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    d = Daemon(f"unix://{sock}", bin_dir, tmp / "data", cgroup_parent, proc, log_path)
    global _SESSION_DAEMON
    _SESSION_DAEMON = d
    deadline = time.monotonic() + 20
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"airlockd did not start:\n{d.log_tail()}", pytrace=False)
        time.sleep(0.05)
    try:
        with Client(d.address) as c:
            try:
                d.base = c.templates.create("base", on_progress=d.progress.append)
            except Exception as e:
                pytest.fail(
                    f"building the template failed ({e}); the guest kernel and image come from "
                    f"`kernel-config/build.sh` and `rootfs/build.sh`:\n{d.log_tail()}",
                    pytrace=False,
                )
        yield d
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        leftovers = subprocess.run(
            ["pgrep", "-f", f"airlock-vmm .*--control {tmp}/"], capture_output=True, text=True
        ).stdout.split()
        for pid in leftovers:
            os.kill(int(pid), signal.SIGKILL)
        for cg in _cgroup_dirs(cgroup_parent):
            for child in sorted(cg.glob("**/"), key=lambda p: -len(p.parts)):
                try:
                    child.rmdir()
                except OSError:
                    pass
        if os.environ.get("AIRLOCK_KEEP_TEST_DIR"):
            print(f"test directory kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        assert not leftovers, f"VMM processes left after the daemon stopped: {leftovers}"


@pytest.fixture
def client(daemon):
    with Client(daemon.address) as c:
        yield c


@pytest.fixture
def sandbox(client):
    with client.sandboxes.create(labels={"test": "sdk"}) as sb:
        yield sb
