"""The unchanged `e2b` SDK from PyPI against a live airlockd's E2B gateway.

Run by `tests/e2b.rs` (which starts the daemon with `[e2b] listen` and a tenant whose token
is the API key) once per pinned SDK version, each in a venv of its own (`tests/e2b/venv.sh`).
Only environment settings point the SDK at Airlock: E2B_API_KEY, E2B_API_URL and
E2B_SANDBOX_URL. Every test makes what it checks in real sandboxes (real VMs).
"""

import asyncio
import datetime
import os
import time
import uuid

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    Sandbox,
    SandboxQuery,
)

for var in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"):
    assert os.environ.get(var), f"{var} is not set: run this through `cargo test --test e2b`"

# Guest kernel code is emulated on the nested build machines: give commands room.
RUN = dict(timeout=120, request_timeout=120)


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create(timeout=600, envs={"GREETING": "bonjour"}, request_timeout=120)
    yield s
    s.kill()


def test_create_returns_a_running_sandbox_of_the_base_template(sbx):
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.template_id == "base"
    assert sbx.is_running()
    assert info.state.value == "running"


def test_run_streams_stdout_and_stderr_to_callbacks(sbx):
    out, err = [], []
    r = sbx.commands.run(
        "echo one; echo two >&2; python3 -c 'print(6 * 7)'; echo $GREETING",
        on_stdout=out.append,
        on_stderr=err.append,
        **RUN,
    )
    assert r.exit_code == 0
    assert r.stdout == "one\n42\nbonjour\n"
    assert r.stderr == "two\n"
    assert "".join(out) == r.stdout
    assert "".join(err) == r.stderr


def test_run_with_envs_and_cwd(sbx):
    r = sbx.commands.run("echo $WHO; pwd", envs={"WHO": "airlock"}, cwd="/tmp", **RUN)
    assert r.stdout == "airlock\n/tmp\n"


def test_a_non_zero_exit_raises_command_exit_exception(sbx):
    with pytest.raises(CommandExitException) as exc:
        sbx.commands.run("echo doomed >&2; exit 3", **RUN)
    assert exc.value.exit_code == 3
    assert "doomed" in exc.value.stderr


def test_a_background_command_is_waited_for(sbx):
    lines = []
    h = sbx.commands.run(
        "for i in 1 2 3; do echo line$i; sleep 0.2; done", background=True, **RUN
    )
    assert h.pid > 0
    # The sync SDK takes a background command's callbacks at wait().
    r = h.wait(on_stdout=lines.append)
    assert r.exit_code == 0
    assert r.stdout == "line1\nline2\nline3\n"
    assert "".join(lines) == r.stdout


def test_a_background_command_is_listed_and_killed(sbx):
    h = sbx.commands.run("sleep 300", background=True, **RUN)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert h.pid in listed, listed
    assert listed[h.pid].cmd == "/bin/bash"
    assert h.kill() is True
    with pytest.raises(CommandExitException) as exc:
        h.wait()
    assert exc.value.exit_code == -1
    # Gone: neither listed nor killable again.
    deadline = time.time() + 30
    while h.pid in {p.pid for p in sbx.commands.list()} and time.time() < deadline:
        time.sleep(0.2)
    assert h.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(h.pid) is False


def test_send_stdin_reaches_a_running_command(sbx):
    h = sbx.commands.run("head -n 2", background=True, stdin=True, **RUN)
    sbx.commands.send_stdin(h.pid, "first\n")
    sbx.commands.send_stdin(h.pid, "second\n")
    r = h.wait()
    assert r.stdout == "first\nsecond\n"


def test_connect_follows_a_running_command(sbx):
    h = sbx.commands.run("sleep 5; echo late", background=True, **RUN)
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    r = again.wait()
    assert r.stdout == "late\n"


def test_files_write_read_list_exists_remove(sbx):
    d = f"/home/user/w-{uuid.uuid4().hex[:8]}"
    assert sbx.files.make_dir(d) is True
    assert sbx.files.make_dir(d) is False  # already there
    info = sbx.files.write(f"{d}/a.txt", "hello files")
    assert info.path == f"{d}/a.txt"
    sbx.files.write(f"{d}/b.bin", b"\x00\x01\x02")
    assert sbx.files.read(f"{d}/a.txt") == "hello files"
    assert bytes(sbx.files.read(f"{d}/b.bin", format="bytes")) == b"\x00\x01\x02"
    names = sorted(e.name for e in sbx.files.list(d))
    assert names == ["a.txt", "b.bin"]
    assert sbx.files.exists(f"{d}/a.txt")
    assert not sbx.files.exists(f"{d}/nope.txt")
    # The guest sees what the SDK wrote, as the default user.
    r = sbx.commands.run(f"cat {d}/a.txt; echo; stat -c %U {d}/a.txt", **RUN)
    assert r.stdout == "hello files\nuser\n"
    sbx.files.remove(f"{d}/a.txt")
    assert not sbx.files.exists(f"{d}/a.txt")


def test_files_rename_and_info(sbx):
    d = f"/home/user/r-{uuid.uuid4().hex[:8]}"
    sbx.files.write(f"{d}/old.txt", "12345")
    moved = sbx.files.rename(f"{d}/old.txt", f"{d}/new.txt")
    assert moved.path == f"{d}/new.txt"
    assert not sbx.files.exists(f"{d}/old.txt")
    info = sbx.files.get_info(f"{d}/new.txt")
    assert info.size == 5
    assert info.type.value == "file"
    assert sbx.files.get_info(d).type.value == "dir"


def test_a_missing_file_raises(sbx):
    from e2b import NotFoundException

    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/definitely-missing.txt")


def test_set_timeout_moves_the_end():
    s = Sandbox.create(timeout=60, request_timeout=120)
    try:
        s.set_timeout(900)
        end = s.get_info().end_at
        now = datetime.datetime.now(datetime.timezone.utc)
        left = (end - now).total_seconds()
        assert 850 < left <= 905, left
    finally:
        s.kill()


def test_a_timeout_ends_the_sandbox():
    s = Sandbox.create(timeout=3, request_timeout=120)
    deadline = time.time() + 60
    while s.is_running() and time.time() < deadline:
        time.sleep(0.5)
    assert not s.is_running()


def test_list_by_metadata_and_kill():
    tag = uuid.uuid4().hex
    made = [
        Sandbox.create(timeout=300, metadata={"suite": tag, "n": str(i)}, request_timeout=120)
        for i in range(2)
    ]
    other = Sandbox.create(timeout=300, metadata={"suite": "other"}, request_timeout=120)
    try:
        found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert sorted(s.sandbox_id for s in found) == sorted(s.sandbox_id for s in made)
        assert all(s.metadata["suite"] == tag for s in found)
        # Paging: one a page, two pages.
        pages = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
        first = pages.next_items()
        assert pages.has_next
        second = pages.next_items()
        assert len(first) == len(second) == 1
        assert first[0].sandbox_id != second[0].sandbox_id
        assert Sandbox.kill(made[0].sandbox_id) is True
        left = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert [s.sandbox_id for s in left] == [made[1].sandbox_id]
        assert not made[0].is_running()
        # Killing what is gone says so.
        assert Sandbox.kill(made[0].sandbox_id) is False
    finally:
        for s in made[1:] + [other]:
            s.kill()


def test_connect_by_id_runs_commands():
    s = Sandbox.create(timeout=300, request_timeout=120)
    try:
        again = Sandbox.connect(s.sandbox_id)
        r = again.commands.run("echo reconnected", **RUN)
        assert r.stdout == "reconnected\n"
    finally:
        s.kill()


def test_the_async_client():
    async def scenario():
        s = await AsyncSandbox.create(timeout=300, request_timeout=120)
        try:
            out = []
            r = await s.commands.run("echo async; exit 0", on_stdout=out.append, **RUN)
            assert r.stdout == "async\n"
            assert "".join(out) == "async\n"
            await s.files.write("/home/user/async.txt", "from asyncio")
            assert await s.files.read("/home/user/async.txt") == "from asyncio"
            h = await s.commands.run("sleep 300", background=True, **RUN)
            assert await h.kill() is True
            with pytest.raises(CommandExitException):
                await h.wait()
            with pytest.raises(CommandExitException) as exc:
                await s.commands.run("exit 5", **RUN)
            assert exc.value.exit_code == 5
        finally:
            await s.kill()
        assert not await s.is_running()

    asyncio.run(scenario())


def test_the_readme_example_runs_unchanged():
    # E2B's README, verbatim but for the check of what it prints.
    with Sandbox.create() as sandbox:
        result = sandbox.commands.run('echo "Hello from E2B!"')
        assert result.stdout == "Hello from E2B!\n"
        made = sandbox.sandbox_id
    # Leaving the block killed it.
    assert Sandbox.kill(made) is False


def test_pause_then_connect_resumes():
    s = Sandbox.create(timeout=300, request_timeout=120)
    try:
        s.files.write("/home/user/kept.txt", "across a pause")
        s.pause()
        assert s.get_info().state.value == "paused"
        assert not s.is_running()
        again = Sandbox.connect(s.sandbox_id)
        assert again.get_info().state.value == "running"
        assert again.files.read("/home/user/kept.txt") == "across a pause"
        assert again.commands.run("echo awake", **RUN).stdout == "awake\n"
    finally:
        s.kill()


def test_metrics_describe_the_sandbox(sbx):
    m = sbx.get_metrics()
    assert len(m) >= 1
    assert m[0].cpu_count == sbx.get_info().cpu_count
    assert m[0].mem_total == sbx.get_info().memory_mb * 1024 * 1024
    assert m[0].mem_used > 0


def test_write_files_many_and_list_with_depth(sbx):
    d = f"/home/user/m-{uuid.uuid4().hex[:8]}"
    infos = sbx.files.write_files(
        [
            {"path": f"{d}/top.txt", "data": "top"},
            {"path": f"{d}/sub/deep.txt", "data": "deep"},
        ]
    )
    assert sorted(i.path for i in infos) == [f"{d}/sub/deep.txt", f"{d}/top.txt"]
    assert sbx.files.read(f"{d}/sub/deep.txt") == "deep"
    shallow = sorted(e.name for e in sbx.files.list(d))
    assert shallow == ["sub", "top.txt"]
    deep = sorted(e.path for e in sbx.files.list(d, depth=2))
    assert deep == [f"{d}/sub", f"{d}/sub/deep.txt", f"{d}/top.txt"]


def test_gzip_and_streamed_uploads(sbx):
    import inspect

    if "gzip" not in inspect.signature(sbx.files.write).parameters:
        pytest.skip("this SDK version has no gzip uploads")
    path = "/home/user/zipped.txt"
    sbx.files.write(path, "z" * 10000, gzip=True)
    assert sbx.files.read(path) == "z" * 10000
    sbx.files.write("/home/user/streamed.bin", iter([b"ab", b"cd", b"ef"]))
    assert sbx.files.read("/home/user/streamed.bin") == "abcdef"


def test_stream_input_and_close_stdin(sbx):
    if not hasattr(sbx.commands, "close_stdin"):
        pytest.skip("this SDK version has no close_stdin")
    h = sbx.commands.run("cat", background=True, stdin=True, **RUN)
    sbx.commands.stream_input(h.pid, ["one ", "two ", b"three"])
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "one two three"


def test_a_template_built_with_the_sdk_builder_runs(tmp_path):
    """E2B's `Template` builder and `Template.build`: files uploaded by hash, a COPY of a
    directory, envs, a RUN as root and one as another user, a workdir; then a sandbox of it."""
    from e2b import Template

    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "hello.txt").write_text("hello from the context\n")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template("base")
        .copy("app", "/opt/app/")
        .set_envs({"GREETING": "built by e2b"})
        .run_cmd("echo ran > /opt/app/ran.txt && chmod 777 /opt/app")
        .run_cmd("id -un > /opt/app/who.txt", user="user")
        .set_workdir("/opt/app")
    )
    logs = []
    assert not Template.exists("e2b-built")
    info = Template.build(template, "e2b-built:v1", on_build_logs=logs.append)
    assert info.template_id == "e2b-built"
    assert Template.exists("e2b-built")
    messages = "\n".join(str(getattr(e, "message", e)) for e in logs)
    assert "Uploaded 'app'" in messages, messages
    sbx = Sandbox.create("e2b-built:v1")
    try:
        r = sbx.commands.run('cat hello.txt ran.txt who.txt; echo "$GREETING"; pwd', **RUN)
        assert r.stdout == "hello from the context\nran\nuser\nbuilt by e2b\n/opt/app\n", r
    finally:
        sbx.kill()
    # The same files again: already there, not uploaded twice.
    logs.clear()
    Template.build(template, "e2b-built:v1", on_build_logs=logs.append)
    messages = "\n".join(str(getattr(e, "message", e)) for e in logs)
    assert "already cached" in messages, messages
