"""Every call of the synchronous SDK against the live daemon of the session (conftest.py).

Executions cost seconds each on the nested-KVM build machines (the guest kernel is emulated),
so each test checks several things per execution.
"""

from __future__ import annotations

import base64
import http.client
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest

import airlock
from airlock import Client
from conftest import ACME_TOKEN, MAX_FILE_BYTES, MAX_SANDBOXES


def test_template_build_progress_and_listing(daemon, client):
    phases = [p.phase for p in daemon.progress]
    assert phases[0] == "booting" and phases[-1] == "ready", phases
    assert all(p.message for p in daemon.progress)
    base = daemon.base
    assert base.name == "base" and base.id.startswith("tpl-")
    assert (base.vcpus, base.memory_mib) == (1, 256)
    listed = {t.name: t for t in client.templates.list()}
    assert listed["base"].id == base.id
    assert listed["base"].kernel_version and listed["base"].rootfs_version
    assert listed["base"].tag == "latest" and listed["base"].reference == "base"
    assert listed["base"].size_bytes > 0
    assert listed["base"].source.startswith("image:default@"), listed["base"].source
    # Its build's progress is kept as its log.
    log = client.templates.log("base")
    assert "booting" in log.log and "ready" in log.log and not log.truncated
    # What it is made of, as an SPDX document.
    spdx = client.templates.sbom("base", format="spdx")
    assert spdx["spdxVersion"] == "SPDX-2.3"
    assert "git" in {p["name"] for p in spdx["packages"]}
    # Templates are immutable.
    with pytest.raises(airlock.TemplateExists) as e:
        client.templates.create("base")
    assert e.value.reason == "TEMPLATE_EXISTS"


def test_exec_result_fields(sandbox):
    script = 'echo "out $GREETING $(pwd)"; read line; echo "in $line"; echo oops >&2; exit 3'
    r = sandbox.exec(script, cwd="/tmp", env={"GREETING": "hello"}, stdin="piped\n")
    assert r.state == "exited" and r.exit_code == 3 and not r.ok
    assert r.stdout == "out hello /tmp\nin piped\n"
    assert r.stderr == "oops\n"
    assert r.execution_id.startswith("ex-")
    assert r.started_unix_ms > 0 and r.ended_unix_ms >= r.started_unix_ms
    assert r.duration_ms == r.ended_unix_ms - r.started_unix_ms
    assert r.cpu_user_us + r.cpu_system_us > 0

    py = sandbox.exec_code("import os, sys; print(os.getuid()); print('e', file=sys.stderr)")
    assert py.ok and py.stdout == "1000\n" and py.stderr == "e\n"
    # Code is unprivileged unless it asks for root, and so are file calls.
    root = sandbox.exec_code("import os; print(os.getuid(), os.getcwd())", user="root")
    assert root.stdout == "0 /root\n"
    sandbox.files.write("/tmp/owned-by-root", "r", mode=0o600, user="root")
    with pytest.raises(airlock.GuestPermissionDenied):
        sandbox.files.read("/tmp/owned-by-root")
    assert sandbox.files.read("/tmp/owned-by-root", user="root") == b"r"

    # The stored record and output, by id.
    again = sandbox._c.executions.get(r.execution_id)
    assert (again.exit_code, again.stdout, again.stderr) == (3, r.stdout, r.stderr)
    with pytest.raises(airlock.InvalidArgument):
        sandbox.exec([])


def test_output_streams_as_it_arrives(sandbox):
    # Three lines, one every 0.5 s: they arrive one by one, before the exit record.
    ex = sandbox.start(["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.5; done; echo done >&2"])
    seen = []
    arrival = []
    gen = ex.stream()
    try:
        while True:
            chunk = next(gen)
            seen.append((chunk.stream, chunk.text))
            arrival.append(time.monotonic())
    except StopIteration as stop:
        final = stop.value
    assert final.state == "exited" and final.exit_code == 0
    stdout = "".join(t for s, t in seen if s == "stdout")
    assert stdout == "line1\nline2\nline3\n"
    assert ("stderr", "done\n") in seen
    assert len([s for s, _ in seen if s == "stdout"]) >= 2, "stdout came in one piece: not streamed"

    # Callbacks, and a resumed stream from an offset (the output is stored by the daemon).
    chunks = []
    res = ex.wait(on_stdout=chunks.append)
    assert res.stdout == stdout and "".join(c.text for c in chunks) == stdout
    tail = list(_drain(sandbox._c.executions.attach(ex.id).stream(stdout_offset=len("line1\n"))))
    assert "".join(c.text for c in tail if c.stream == "stdout") == "line2\nline3\n"


def _drain(gen):
    try:
        while True:
            yield next(gen)
    except StopIteration:
        return


def test_timeout_and_kill(sandbox):
    t0 = time.monotonic()
    with pytest.raises(airlock.ExecTimeout) as e:
        sandbox.exec(["sleep", "60"], timeout=2)
    assert e.value.reason == "EXEC_TIMEOUT"
    assert e.value.result.state == "timed_out"
    assert e.value.result.error_reason == "EXEC_TIMEOUT"
    assert time.monotonic() - t0 < 30
    # check=False returns the record instead.
    r = sandbox.exec(["sleep", "60"], timeout=1, check=False)
    assert r.state == "timed_out"

    # A signal of the caller's choice ends the program by that signal...
    ex = sandbox.start(["sleep", "60"])
    assert ex.kill(signal.SIGTERM) is True
    r = ex.wait()
    assert (r.state, r.signal, r.exit_code) == ("exited", signal.SIGTERM, -1)
    assert ex.kill() is False
    # ...and the default (SIGKILL) is the platform's kill, recorded as such.
    ex = sandbox.start(["sleep", "60"])
    assert ex.kill() is True
    r = ex.wait()
    assert r.state == "killed" and r.error_reason == "KILLED"


def test_stdin_kept_open_takes_more_input(sandbox):
    ex = sandbox.start(["cat"], stdin="first\n", stdin_open=True)
    ex.write_stdin("second\n")
    ex.write_stdin(b"third\n")
    ex.close_stdin()
    r = ex.wait()
    assert r.stdout == "first\nsecond\nthird\n"
    assert r.exit_code == 0
    # Its stdin is closed, and so is an ended execution's: refused, not lost silently.
    with pytest.raises(airlock.InvalidArgument):
        ex.write_stdin("late\n")
    # Without stdin_open, stdin is closed after `stdin`.
    plain = sandbox.start(["sleep", "30"])
    with pytest.raises(airlock.InvalidArgument):
        plain.write_stdin("x")
    plain.kill()


def test_files(client):
    placed = {"/tmp/placed.txt": "from create\n", "/tmp/sub/bin.dat": bytes(range(256))}
    with client.sandboxes.create(files=placed) as sb:
        assert sb.files.read_text("/tmp/placed.txt") == "from create\n"
        assert sb.files.read("/tmp/sub/bin.dat") == bytes(range(256))
        # Several of the SDK's 256 KiB chunks; small, since the guest kernel's copying is
        # emulated on the nested build machines (well under 1 MiB/s).
        big = os.urandom(1 << 20)
        assert sb.files.write("/tmp/big.bin", big) == len(big)
        assert sb.files.read("/tmp/big.bin") == big
        assert sb.files.write("/tmp/exec.sh", "echo hi\n", mode=0o755) == 8
        entries = {e.name: e for e in sb.files.list("/tmp")}
        assert entries["big.bin"].size == len(big) and not entries["big.bin"].is_dir
        assert entries["sub"].is_dir
        assert entries["exec.sh"].mode & 0o777 == 0o755
        with pytest.raises(airlock.PathNotAllowed) as e:
            sb.files.write("/etc/passwd", "x")
        assert e.value.reason == "PATH_NOT_ALLOWED"
        with pytest.raises(airlock.PathNotAllowed):
            sb.files.read("/etc/shadow")
        with pytest.raises(airlock.FileTooLarge) as e:
            sb.files.write("/tmp/huge.bin", b"\0" * (MAX_FILE_BYTES + 1))
        assert e.value.limit == MAX_FILE_BYTES
    # The disk quota: the writable root holds disk_mib (less ext4's metadata), for WriteFile
    # and for programs alike.
    with client.sandboxes.create(disk_mib=16) as sb:
        sb.files.write("/tmp/fits.bin", b"\1" * (MAX_FILE_BYTES - 1))
        with pytest.raises(airlock.DiskQuotaExceeded) as e:
            for i in range(4):
                sb.files.write(f"/tmp/over{i}.bin", b"\2" * (MAX_FILE_BYTES - 1))
        assert isinstance(e.value, airlock.ResourceExhausted)
        assert e.value.limit == 16 << 20
    # A policy of the caller's own.
    with client.sandboxes.create(writable=["/tmp/in"], exportable=["/tmp"]) as sb:
        sb.files.write("/tmp/in/a.txt", "a")
        assert sb.files.read("/tmp/in/a.txt") == b"a"
        with pytest.raises(airlock.PathNotAllowed):
            sb.files.write("/tmp/elsewhere.txt", "b")


def test_the_file_api_and_the_export_policy(client):
    policy = airlock.ExportPolicy(max_file_bytes=64, max_total_bytes=100, denied=["*.sqlite"])
    with client.sandboxes.create(export=policy) as sb:
        sb.files.make_dir("/tmp/proj/src")
        sb.files.write("/tmp/proj/src/main.py", "print(1)\n")
        sb.files.write("/tmp/proj/.env", "SECRET=1")
        sb.files.rename("/tmp/proj/src/main.py", "/tmp/proj/app.py")
        names = [e.name for e in sb.files.list("/tmp/proj", recursive=True)]
        assert names == [".env", "app.py", "src"], names
        st = sb.files.stat("/tmp/proj/app.py")
        assert (st.size, st.is_dir, st.uid) == (9, False, 1000)
        assert sb.files.exists("/tmp/proj/src") and not sb.files.exists("/tmp/proj/src/main.py")
        assert sb.files.read_text("/tmp/proj/app.py") == "print(1)\n"
        with pytest.raises(airlock.ExportDenied) as e:
            sb.files.read("/tmp/proj/.env")
        assert ".env" in e.value.metadata["rule"]
        sb.files.write("/tmp/proj/db.sqlite", "x")
        with pytest.raises(airlock.ExportDenied):
            sb.files.read("/tmp/proj/db.sqlite")
        sb.files.write("/tmp/proj/big.txt", "b" * 65)
        with pytest.raises(airlock.ExportDenied) as e:
            sb.files.read("/tmp/proj/big.txt")
        assert "per-file" in e.value.metadata["rule"]
        for _ in range(20):
            try:
                sb.files.read("/tmp/proj/app.py")
            except airlock.ExportDenied as e:
                assert "export cap" in e.metadata["rule"]
                break
        else:
            raise AssertionError("the sandbox's export cap never stopped a read")
        sb.files.remove("/tmp/proj", recursive=True)
        assert not sb.files.exists("/tmp/proj")
        with pytest.raises(airlock.FileNotFound):
            sb.files.stat("/tmp/proj")
        with pytest.raises(airlock.PathNotAllowed):
            sb.files.make_dir("/etc/x")


def test_volumes_outlive_sandboxes_and_have_one_writer(client):
    vol = client.volumes.create("sdk-work", size_mib=32)
    assert (vol.name, vol.size_mib, vol.attached_to) == ("sdk-work", 32, [])
    assert [v.name for v in client.volumes.list()] == ["sdk-work"]
    with pytest.raises(airlock.VolumeExists):
        client.volumes.create("sdk-work", size_mib=32)
    with client.sandboxes.create(volumes={"/data": "sdk-work"}) as sb:
        assert sb.volumes == [airlock.Mount("sdk-work", "/data")]
        sb.exec(["sh", "-c", "echo kept > /data/f"])
        with pytest.raises(airlock.VolumeInUse) as e:
            client.sandboxes.create(volumes=[airlock.Mount("sdk-work", "/d", read_only=True)])
        assert e.value.metadata["sandbox_id"] == sb.id
        with pytest.raises(airlock.VolumeInUse):
            client.volumes.delete("sdk-work")
    with client.sandboxes.create(volumes=[airlock.Mount("sdk-work", "/d", read_only=True)]) as sb:
        assert sb.exec(["cat", "/d/f"]).stdout == "kept\n"
    with pytest.raises(airlock.VolumeNotFound):
        client.sandboxes.create(volumes={"/x": "no-such-volume"})
    assert client.volumes.delete("sdk-work") is True
    assert client.volumes.delete("sdk-work") is False


def test_network_policy_and_egress_log(client):
    policy = airlock.Network(domains=["example.invalid"])
    with client.sandboxes.create(network=policy) as sb:
        assert sb.network == policy and not sb.network.deny_all
        log = sb.egress_log()
        assert isinstance(log, list) and all(isinstance(e, airlock.EgressEvent) for e in log)
        assert log.dropped >= 0
        # None replaces the policy with deny-all.
        assert sb.set_network(None) is sb
        assert sb.network.deny_all
        assert sb.refresh().network.deny_all


def test_a_network_policy_beyond_the_ceiling_is_refused(client):
    # The daemon's default ceiling allows public addresses only: a private range is beyond it.
    with pytest.raises(airlock.NetworkNotAllowed) as e:
        client.sandboxes.create(network=airlock.Network(cidrs=["10.0.0.0/8"]))
    assert e.value.reason == "NETWORK_NOT_ALLOWED"


def test_an_offline_sandbox_installs_nothing_and_logs_why(client):
    with client.sandboxes.create(packages=airlock.Packages(offline=True)) as sb:
        assert sb.packages.offline, sb.packages
        # What pip asks first, asked with Python's urllib (pip's own start costs minutes of
        # emulated guest kernel on the nested build hosts; tests/packages.rs runs pip itself).
        index = "http://100.96.0.1:3141/r/pypi/simple/anything-at-all/"
        r = sb.exec(["python3", "-c", f"import urllib.request; urllib.request.urlopen({index!r})"], timeout=300)
        assert r.state == "exited" and r.exit_code != 0, f"fetched offline:\n{r.stdout}\n{r.stderr}"
        assert "403" in r.stderr and "offline mode" in r.stderr, r.stderr
        # The proxy logs each refusal as it answers it; wait a little for the record anyway.
        deadline = time.monotonic() + 10
        while True:
            log = sb.install_log()
            denied = [e for e in log if e.outcome == "denied"]
            if denied or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert isinstance(log, airlock.InstallLog) and log.dropped == 0
        assert all(isinstance(e, airlock.InstallEvent) for e in log), list(log)
        assert denied, f"no denied install event: {list(log)}\n{r.stdout}\n{r.stderr}"
        assert any("offline" in e.message for e in denied), denied
        assert all(e.sandbox_id == sb.id and e.seq > 0 for e in log), list(log)
        # Paged: the first event alone.
        assert [e.seq for e in sb.install_log(limit=1)] == [log[0].seq]


def _http_get(url: str, headers=None) -> bytes:
    # No proxy from the environment: the exposed address is the daemon's host.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
        return resp.read()


def test_an_exposed_port_answers_token_holders_only(sandbox):
    sandbox.files.write("/tmp/www/hello.txt", "hello from the guest\n")
    # An HTTP server in the guest, started without waiting for it (it runs until killed).
    server = sandbox.start(["python3", "-m", "http.server", "8000"], cwd="/tmp/www")
    try:
        exposure = sandbox.expose_port(8000, ttl=120)
        assert isinstance(exposure, airlock.Exposure)
        assert (exposure.sandbox_id, exposure.guest_port) == (sandbox.id, 8000)
        assert exposure.token and exposure.headers == {"X-Airlock-Token": exposure.token}
        assert ":" in exposure.address and exposure.url == f"http://{exposure.address}"
        assert exposure.expires_unix_ms > time.time() * 1000
        url = f"{exposure.url}/hello.txt"
        # The server takes a while to listen: retry until it answers.
        deadline = time.monotonic() + 120  # a guest Python server starts slowly on nested hosts
        while True:
            try:
                body = _http_get(url, exposure.headers)
                break
            except (OSError, http.client.HTTPException) as e:
                assert time.monotonic() < deadline, f"the exposed server did not answer: {e!r}"
                time.sleep(0.5)
        assert body == b"hello from the guest\n"
        # Without the token the daemon closes the connection.
        with pytest.raises((OSError, http.client.HTTPException)):
            _http_get(url)
        with pytest.raises((OSError, http.client.HTTPException)):
            _http_get(url, {"X-Airlock-Token": "not-the-token"})
        # Both kinds of callers are in the egress log (the accepted one once it has ended).
        deadline = time.monotonic() + 10
        while True:
            seen = {e.allowed for e in sandbox.egress_log() if e.kind == "expose" and e.port == 8000}
            if seen == {True, False} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert seen == {True, False}, seen
        with pytest.raises(airlock.InvalidArgument):
            sandbox.expose_port(0)
    finally:
        server.kill()


API_KEY = "sk-test-abcdef123456"


def test_secrets_are_redacted_from_output_and_never_shown(client):
    b64 = base64.b64encode(API_KEY.encode()).decode()
    with client.sandboxes.create(secrets=[airlock.Secret.env("API_KEY", API_KEY)]) as sb:
        # The record names it, never its value.
        assert [(s.name, s.delivery, s.targets, s.removed) for s in sb.secrets] == [
            ("API_KEY", "env", ("API_KEY",), False)
        ]
        assert API_KEY not in str(sb.info) and API_KEY not in str(sb.refresh().info)
        code = (
            "import base64, os\n"
            "v = os.environ['API_KEY']\n"
            "print(v)\n"
            "print(base64.b64encode(v.encode()).decode())\n"
            "print(os.environ.get('ONE_OFF', 'unset'))"
        )
        # An execution's own secret besides the sandbox's.
        r = sb.exec_code(code, secrets={"ONE_OFF": "one-off-value-42"})
        assert r.ok, r.stderr
        lines = r.stdout.splitlines()
        assert lines[:2] == ["[REDACTED:API_KEY]", "[REDACTED:API_KEY]"], r.stdout
        assert lines[2] == "[REDACTED:ONE_OFF]", r.stdout
        out = r.stdout + r.stderr
        assert API_KEY not in out and b64 not in out and b64.rstrip("=") not in out
        assert sorted(r.secret_names) == ["API_KEY", "ONE_OFF"]
        stored = client.executions.get(r.execution_id)
        assert stored.stdout == r.stdout and API_KEY not in stored.stdout
        # Its memory may hold the value: no snapshot of it.
        with pytest.raises(airlock.SecretsPresent) as e:
            sb.snapshot("sdk-secret-snap")
        assert e.value.reason == "SECRETS_PRESENT" and API_KEY not in str(e.value)
        with pytest.raises(airlock.InvalidArgument):
            sb.exec(["true"], secrets=[airlock.Secret.file("F", "file-value-1")])
        # Removed: shown as such, and later executions go without it.
        assert sb.remove_secrets("API_KEY") is sb
        assert [(s.name, s.removed) for s in sb.secrets] == [("API_KEY", True)]
        r = sb.exec(["sh", "-c", "echo ${API_KEY:-unset}"])
        assert r.stdout == "unset\n" and r.secret_names == []
    assert "sdk-secret-snap" not in {t.name for t in client.templates.list()}


def test_the_audit_trail_records_a_sandbox_and_verifies(daemon, client):
    with client.sandboxes.create(labels={"test": "audit"}) as sb:
        r = sb.exec(["true"])
    page = client.audit_events(sandbox_id=sb.id)
    assert isinstance(page, airlock.AuditLog) and all(isinstance(e, airlock.AuditEvent) for e in page)
    kinds = [e.kind for e in page]
    assert "sandbox.create" in kinds and "exec.start" in kinds, kinds
    assert kinds.index("sandbox.create") < kinds.index("exec.start")
    start = next(e for e in page if e.kind == "exec.start")
    assert (start.tenant, start.sandbox_id, start.execution_id) == ("default", sb.id, r.execution_id)
    assert isinstance(start.detail, dict)
    assert all(e.sandbox_id == sb.id for e in page)
    # Filters and pages.
    assert [e.kind for e in client.audit_events(sandbox_id=sb.id, kinds=["exec.start"])] == ["exec.start"]
    assert [e.seq for e in client.iter_audit_events(sandbox_id=sb.id, page_size=1)] == [e.seq for e in page]
    assert [e.seq for e in client.audit_events(limit=1)] == [page.first_seq]
    # The whole trail verifies, from the first kept event to the head.
    trail = client.audit_trail()
    assert trail.head_seq >= page[-1].seq and trail.head_hash
    result = airlock.verify_audit(trail, trail.head_seq, trail.head_hash, first_seq=trail.first_seq)
    assert result.ok, str(result)
    assert trail.verify().ok and result.events == len(trail) >= len(page)
    # An edit of it does not.
    i = next(n for n, e in enumerate(trail) if e.seq == start.seq)
    forged = list(trail)
    forged[i] = airlock.AuditEvent(**dict(start.to_dict(), detail_json='{"command":"true"}'))
    assert [p.seq for p in airlock.verify_audit(forged).problems] == [start.seq]
    # Another tenant's trail has none of it.
    with Client(daemon.address, token=ACME_TOKEN) as acme:
        assert list(acme.audit_events(sandbox_id=sb.id)) == []


def test_pause_resume_snapshot_and_templates(client):
    with client.sandboxes.create(files={"/tmp/state.txt": "saved"}) as sb:
        assert sb.state == "running"
        assert sb.pause().state == "paused"
        assert sb.refresh().state == "paused"
        with pytest.raises(airlock.SandboxNotRunning) as e:
            sb.files.read("/tmp/state.txt")
        assert e.value.reason == "SANDBOX_NOT_RUNNING"
        assert sb.resume().state == "running"
        tpl = sb.snapshot("snap-test")
        assert tpl.name == "snap-test" and tpl.source_sandbox_id == sb.id
        assert sb.refresh().state == "running"
    assert "snap-test" in {t.name for t in client.templates.list()}
    with client.sandboxes.create(template="snap-test") as clone:
        assert clone.template == "snap-test"
        assert clone.files.read_text("/tmp/state.txt") == "saved"
        # A version sandboxes run from is not deleted under them.
        with pytest.raises(airlock.TemplateInUse) as e:
            client.templates.delete("snap-test")
        assert e.value.metadata["sandbox_id"] == clone.id
    client.templates.delete("snap-test")
    assert "snap-test" not in {t.name for t in client.templates.list()}
    with pytest.raises(airlock.TemplateNotFound):
        client.sandboxes.create(template="snap-test")


def test_get_list_labels_and_idempotent_destroy(client):
    a = client.sandboxes.create(labels={"team": "a", "suite": "list"})
    b = client.sandboxes.create(labels={"team": "b", "suite": "list"})
    try:
        assert {s.id for s in client.sandboxes.list(labels={"suite": "list"})} == {a.id, b.id}
        assert [s.id for s in client.sandboxes.list(labels={"team": "b"})] == [b.id]
        got = client.sandboxes.get(a.id)
        assert got.id == a.id and got.labels == {"team": "a", "suite": "list"}
        assert got.create_ms > 0 and got.vcpus == 1 and got.memory_mib == 256
    finally:
        assert a.destroy() is True
        assert a.destroy() is False  # destroying twice succeeds
        b.destroy()
    assert client.sandboxes.list(labels={"suite": "list"}) == []
    destroyed = client.sandboxes.list(labels={"suite": "list"}, states=["destroyed"])
    assert {s.id for s in destroyed} == {a.id, b.id}
    assert all(s.state == "destroyed" for s in destroyed)
    with pytest.raises(airlock.InvalidArgument):
        client.sandboxes.list(states=["sleepy"])


def test_errors_a_client_can_tell_apart(daemon, client, tmp_path):
    with pytest.raises(airlock.SandboxNotFound) as e:
        client.sandboxes.get("sb-0000000000000000")
    assert isinstance(e.value, airlock.NotFound) and e.value.reason == "SANDBOX_NOT_FOUND"
    with pytest.raises(airlock.ExecutionNotFound):
        client.executions.get("ex-0000000000000000")
    with pytest.raises(airlock.TemplateNotFound):
        client.sandboxes.create(template="no-such-template")
    with pytest.raises(airlock.InvalidArgument) as e:
        client.sandboxes.create(vcpus=3)
    assert e.value.reason == "INVALID_ARGUMENT"
    with pytest.raises(airlock.Unauthenticated):
        Client(daemon.address, token="wrong").sandboxes.list()
    with pytest.raises(airlock.Unavailable):
        Client(f"unix://{tmp_path}/nothing.sock", timeout=5).sandboxes.list()
    # A kernel that is no kernel: the template build fails on the platform's side.
    bogus = tmp_path / "not-a-kernel"
    bogus.write_bytes(b"\0" * 4096)
    with pytest.raises(airlock.InternalError) as e:
        client.templates.create("broken", kernel_path=str(bogus))
    assert e.value.reason == "INTERNAL"
    assert "broken" not in {t.name for t in client.templates.list()}
    # OCI images: a malformed reference, and a registry beyond the tenant's egress ceiling
    # (the default one: public addresses only), are refused before anything is fetched.
    with pytest.raises(airlock.ImageRefused) as e:
        client.templates.create("broken", oci_image="Not A Reference!")
    assert e.value.reason == "IMAGE_REFUSED" and isinstance(e.value, airlock.InvalidArgument)
    assert e.value.metadata["image"] == "Not A Reference!"
    with pytest.raises(airlock.NetworkNotAllowed):
        client.templates.create("broken", oci_image="127.0.0.1:9/team/app:v1")
    with pytest.raises(ValueError):
        client.templates.create("broken", registry_auth=("u", "p"))
    # Dockerfile builds: an unsupported instruction and a COPY source outside the context are
    # refused before anything runs.
    with pytest.raises(airlock.InvalidArgument) as e:
        client.templates.build("broken", "FROM base\nEXPOSE 80\n")
    assert "line 2: EXPOSE is not supported" in str(e.value)
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "here.txt").write_text("x")
    with pytest.raises(airlock.InvalidArgument) as e:
        client.templates.build("broken", "FROM base\nCOPY gone.txt /tmp/\n", context=tmp_path / "ctx")
    assert "gone.txt is not in the build context" in str(e.value)


def test_tenants_quota_and_capacity(daemon, client):
    with Client(daemon.address, token=ACME_TOKEN) as acme:
        mine = acme.sandboxes.create(labels={"owner": "acme"})
        try:
            with pytest.raises(airlock.QuotaExceeded) as e:
                acme.sandboxes.create()
            assert isinstance(e.value, airlock.ResourceExhausted)
            assert (e.value.limit, e.value.current) == (1, 1)
            # Another tenant sees nothing of it.
            assert mine.id not in {s.id for s in client.sandboxes.list()}
            with pytest.raises(airlock.SandboxNotFound):
                client.sandboxes.get(mine.id)
            with pytest.raises(airlock.SandboxNotFound):
                client.sandboxes.get(mine.id).destroy()
            # Usage is the caller's own, against its own quota.
            usage = acme.usage()
            assert (usage.tenant, usage.live_sandboxes, usage.max_sandboxes) == ("acme", 1, 1)
            assert usage.memory_mib == 256 and usage.max_memory_mib == 4096
            assert usage.sandbox_records >= 1 and usage.record_retention_s > usage.output_retention_s > 0
            assert client.usage().tenant == "default"
            # Outside cluster mode the daemon is its only node, unnamed, and holds the sandbox.
            (node,) = client.nodes()
            assert (node.name, mine.node) == ("", "")
            assert node.sandboxes >= 1 and any(t.endswith("/base") for t in node.templates)
        finally:
            mine.destroy()

    made = []
    try:
        with pytest.raises(airlock.CapacityExhausted) as e:
            for _ in range(MAX_SANDBOXES + 1):
                made.append(client.sandboxes.create(labels={"suite": "capacity"}))
        assert e.value.reason == "CAPACITY_EXHAUSTED"
        assert e.value.limit == MAX_SANDBOXES and e.value.current == MAX_SANDBOXES
        assert len(made) <= MAX_SANDBOXES
    finally:
        for s in made:
            s.destroy()


def _wait_dead(sb) -> None:
    deadline = time.monotonic() + 30
    while sb.refresh().state != "dead":
        assert time.monotonic() < deadline, "the sandbox was not reported dead"
        time.sleep(0.2)


def test_a_killed_vmm_makes_a_dead_sandbox(client):
    sb = client.sandboxes.create()
    pid = sb.info.vmm_pid
    assert pid > 0
    os.kill(pid, signal.SIGKILL)
    _wait_dead(sb)
    assert sb.end_reason == "SANDBOX_DEAD"
    with pytest.raises(airlock.SandboxDead) as e:
        sb.exec(["true"])
    assert e.value.reason == "SANDBOX_DEAD"
    assert sb.destroy() is False


def test_out_of_memory_ends_the_execution(sandbox):
    # The program allocates 4 MiB at a time without end; its limit is 24 MiB.
    hog = "chunks = []\nwhile True:\n    chunks.append(b'x' * (4 << 20))\n    print(len(chunks), flush=True)"
    with pytest.raises(airlock.OomKilled) as e:
        sandbox.exec_code(hog, memory_limit_mib=24)
    assert isinstance(e.value, airlock.SandboxDead)
    assert e.value.reason == "OOM_KILLED"
    r = e.value.result
    assert r.state == "oom_killed" and r.signal == 9
    allocated = [int(x) for x in r.stdout.split()]
    assert allocated and max(allocated) <= 6, r.stdout
    # The sandbox itself lives on.
    assert sandbox.refresh().state == "running"


def _vmm_control_socket(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"--control") + 1].decode()


def test_a_vmm_that_breaks_its_seccomp_filter_is_reported(client):
    sb = client.sandboxes.create()
    # The test hook makes the VMM's event loop open an AF_INET socket, outside its filter.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(_vmm_control_socket(sb.info.vmm_pid))
        s.sendall(b"probe seccomp\n")
        assert b"survived" not in s.recv(4096)
    _wait_dead(sb)
    assert sb.end_reason == "SECCOMP_VIOLATION"
    with pytest.raises(airlock.SeccompViolation) as e:
        sb.exec(["true"])
    assert isinstance(e.value, airlock.SandboxDead)
    assert e.value.reason == "SECCOMP_VIOLATION"


def test_a_guest_kernel_panic_is_reported(client):
    sb = client.sandboxes.create()
    with pytest.raises(airlock.GuestCrashed) as e:
        sb.exec(["sh", "-c", "echo c > /proc/sysrq-trigger"], user="root")
    assert e.value.reason == "GUEST_CRASHED"
    assert e.value.result.state == "failed"
    assert sb.refresh().state == "dead" and sb.end_reason == "GUEST_CRASHED"
    with pytest.raises(airlock.GuestCrashed):
        sb.files.read("/tmp/x")
