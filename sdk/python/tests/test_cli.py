"""The `airlock` CLI against the live daemon, and the README's quickstarts run as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import REPO


def cli(daemon, *args, check=True, **kw):
    p = subprocess.run(
        [str(daemon.bin_dir / "airlock"), *args], capture_output=True, text=True, env=daemon.env(), timeout=600, **kw
    )
    if check and p.returncode != 0:
        raise AssertionError(f"airlock {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def readme_block(marker: str) -> str:
    """The fenced code block after `<!-- test: MARKER -->` in the README."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- test: %s -->\s*```[a-z]*\n(.*?)```" % re.escape(marker), text, re.S)
    assert m, f"README.md has no block marked <!-- test: {marker} -->"
    return m.group(1)


EXAMPLES = REPO / "sdk" / "python" / "examples"


def test_readme_python_quickstart(daemon):
    code = readme_block("python-quickstart")
    # quickstart.sh runs the file; the README shows the same lines.
    assert code == (EXAMPLES / "quickstart.py").read_text(), "README and examples/quickstart.py differ"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=daemon.env(), timeout=600)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "42", p.stdout
    assert lines[1].startswith("exit code 0, "), p.stdout
    assert lines[2:] == ["stdout one", "stdout two"], p.stdout


def test_readme_cli_session(daemon, tmp_path):
    script = readme_block("cli-session")
    assert script == (EXAMPLES / "cli-session.sh").read_text(), "README and examples/cli-session.sh differ"
    p = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, env=daemon.env(), cwd=tmp_path, timeout=900
    )
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr}"
    lines = p.stdout.splitlines()
    assert "42" in lines, p.stdout
    assert "hello from a file" in lines, p.stdout
    assert "exit 124" in lines, p.stdout
    assert "base" in p.stdout, p.stdout
    assert (tmp_path / "result.txt").read_text() == "6*7=42\n"


def test_cli_commands(daemon, tmp_path):
    # template ls (human and JSON)
    assert "base" in cli(daemon, "template", "ls").stdout
    tpls = json.loads(cli(daemon, "--json", "template", "ls").stdout)
    assert "base" in [t["name"] for t in tpls]

    # create --json prints an object with the id
    created = json.loads(cli(daemon, "--json", "create", "--label", "suite=cli", "--env", "WHO=cli").stdout)
    sid = created["id"]
    assert sid.startswith("sb-") and created["state"] == "running"
    try:
        listed = json.loads(cli(daemon, "--json", "ls").stdout)
        assert sid in [s["id"] for s in listed]
        assert sid in cli(daemon, "ls").stdout

        # exec: live output, and the remote exit code as our own; --json reports the execution id
        p = cli(daemon, "--json", "exec", sid, "--", "sh", "-c", 'echo "hi $WHO"; echo err >&2; exit 7', check=False)
        assert p.returncode == 7 and p.stdout == "hi cli\n"
        info = json.loads(p.stderr.splitlines()[0])
        assert "err" in p.stderr
        # logs: the stored output of that execution
        logs = cli(daemon, "logs", info["execution_id"], check=False)
        assert logs.returncode == 7 and logs.stdout == "hi cli\n"

        # cp both ways
        (tmp_path / "in.txt").write_text("payload\n")
        cli(daemon, "cp", str(tmp_path / "in.txt"), f"{sid}:/tmp/in.txt")
        cli(daemon, "cp", f"{sid}:/tmp/in.txt", str(tmp_path / "out.txt"))
        assert (tmp_path / "out.txt").read_text() == "payload\n"
        denied = cli(daemon, "cp", str(tmp_path / "in.txt"), f"{sid}:/etc/in.txt", check=False)
        assert denied.returncode != 0 and "PATH_NOT_ALLOWED" in denied.stderr

        # pause / resume / snapshot
        cli(daemon, "pause", sid)
        assert json.loads(cli(daemon, "--json", "ls").stdout)[0]["state"] in ("paused", "running")
        paused = [s for s in json.loads(cli(daemon, "--json", "ls").stdout) if s["id"] == sid][0]
        assert paused["state"] == "paused"
        cli(daemon, "resume", sid)
        cli(daemon, "snapshot", sid, "cli-snap")
        assert "cli-snap" in cli(daemon, "template", "ls").stdout
        cli(daemon, "template", "rm", "cli-snap")
        assert "cli-snap" not in cli(daemon, "template", "ls").stdout
    finally:
        cli(daemon, "rm", sid)
    # rm is idempotent
    cli(daemon, "rm", sid)

    # Errors: the reason code on stderr and a non-zero exit.
    missing = cli(daemon, "exec", "sb-0000000000000000", "--", "true", check=False)
    assert missing.returncode != 0 and "SANDBOX_NOT_FOUND" in missing.stderr

    # Template builds show progress; a failing one says why.
    bogus = tmp_path / "not-a-kernel"
    bogus.write_bytes(b"\0" * 4096)
    p = cli(daemon, "template", "create", "cli-broken", "--kernel", str(bogus), check=False)
    assert p.returncode != 0
    assert "booting" in p.stderr and "INTERNAL" in p.stderr


def test_cli_without_a_daemon(daemon, tmp_path):
    p = subprocess.run(
        [str(daemon.bin_dir / "airlock"), "ls"],
        capture_output=True,
        text=True,
        env=daemon.env(AIRLOCK_ADDR=f"unix://{tmp_path}/none.sock"),
        timeout=60,
    )
    assert p.returncode != 0 and "cannot reach airlockd" in p.stderr
