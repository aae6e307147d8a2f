"""The interpreter server against E2B's own client-side parsing (e2b-code-interpreter 2.11.5).

Run: `$(rootfs/interpreter/tests/venv.sh | tail -1) -m pytest rootfs/interpreter/tests -q`
"""

import base64
import json
import re
import socket
import struct
import subprocess
import threading
import time

import pytest
from e2b_code_interpreter.models import Context, Execution, parse_output


def run(server, code, **body):
    body["code"] = code
    status, lines = server.execute_lines(body)
    assert status == 200, lines
    assert json.loads(lines[-1]) == {"type": "end_of_execution"}
    ex = Execution()
    for line in lines:
        parse_output(ex, line)
    return ex, [json.loads(line) for line in lines]


def new_context(server, **body):
    status, text = server.request("POST", "/contexts", body)
    assert status == 200, text
    return Context.from_json(json.loads(text))


def test_health(server):
    assert server.request("GET", "/health") == (200, "OK")


def test_variables_persist_and_streams(server):
    ex, raw = run(server, "x = 41")
    assert ex.error is None and ex.results == []
    ex, raw = run(server, "print('hi')\nimport sys; print('oops', file=sys.stderr)\nx + 1")
    assert ex.error is None
    assert ex.logs.stdout == ["hi\n"] and ex.logs.stderr == ["oops\n"]
    assert [r.text for r in ex.results] == ["42"] and ex.results[0].is_main_result
    assert ex.text == "42"
    assert isinstance(ex.execution_count, int) and ex.execution_count >= 2
    stamp = next(m["timestamp"] for m in raw if m["type"] == "stdout")
    assert isinstance(stamp, int) and abs(stamp - time.time_ns()) < 60 * 10**9


def test_string_result_quotes_stripped_like_e2b(server):
    ex, _ = run(server, "'abc'")
    assert ex.results[0].text == "abc"


def test_dataframe_html(server):
    ex, _ = run(server, "import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})")
    assert ex.error is None
    r = ex.results[0]
    assert r.is_main_result and "<table" in r.html and "dataframe" in r.html
    assert "_repr_html_" in dir(r) and r._repr_html_() == r.html


def test_matplotlib_png(server):
    ex, _ = run(server, "import matplotlib.pyplot as plt\n"
                        "fig = plt.figure(figsize=(4, 3), dpi=100)\n"
                        "plt.plot([1, 3, 2])\n"
                        "plt.show()")
    assert ex.error is None, ex.error
    assert ex.logs.stderr == [], ex.logs.stderr  # no warning of the kernel's settings
    pngs = [r for r in ex.results if r.png]
    assert len(pngs) == 1 and not pngs[0].is_main_result
    png = base64.b64decode(pngs[0].png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (400, 300)


def test_display_and_extra_mime(server):
    ex, _ = run(server, "from IPython.display import display, Markdown\n"
                        "display(Markdown('**b**'))\n"
                        "display({'application/x-custom': 'v', 'text/plain': 't'}, raw=True)")
    assert ex.results[0].markdown == "**b**" and not ex.results[0].is_main_result
    assert ex.results[1].extra == {"application/x-custom": "v"} and ex.results[1].text == "t"


def test_exception(server):
    ex, _ = run(server, "def f():\n    raise ValueError('bad value')\nf()")
    assert ex.error.name == "ValueError" and ex.error.value == "bad value"
    assert "f()" in ex.error.traceback and "ValueError" in ex.error.traceback
    assert "\x1b[" not in ex.error.traceback


def test_env_vars_per_cell(server):
    ex, _ = run(server, "import os; os.environ.get('AIRLOCK_T')", env_vars={"AIRLOCK_T": "v1"})
    assert ex.text == "v1"
    ex, _ = run(server, "import os; os.environ.get('AIRLOCK_T')")
    assert ex.results == [] or ex.text == "None"


def test_contexts_isolated_restart_remove(server, tmp_path):
    a = new_context(server, language="python")
    b = new_context(server, cwd=str(tmp_path))
    assert a.language == "python" and a.cwd == server.workdir and b.cwd == str(tmp_path)
    run(server, "secret = 1", context_id=a.id)
    ex, _ = run(server, "secret", context_id=b.id)
    assert ex.error and ex.error.name == "NameError"
    ex, _ = run(server, "import os; os.getcwd()", context_id=b.id)
    assert ex.text == str(tmp_path)
    ids = [c["id"] for c in json.loads(server.request("GET", "/contexts")[1])]
    assert a.id in ids and b.id in ids

    assert server.request("POST", f"/contexts/{a.id}/restart")[0] == 200
    ex, _ = run(server, "secret", context_id=a.id)
    assert ex.error and ex.error.name == "NameError"

    for c in (a, b):
        assert server.request("DELETE", f"/contexts/{c.id}")[0] == 200
    assert server.execute_lines({"code": "1", "context_id": a.id})[0] == 404
    assert server.request("POST", f"/contexts/{a.id}/restart")[0] == 404


def test_bad_requests(server):
    assert server.execute_lines({"code": "1", "language": "r"}) == (
        400, "language not available in this template")
    assert server.execute_lines({"code": "1", "language": "cobol"})[0] == 400
    assert server.request("POST", "/execute", "{not json")[0] == 400
    assert server.request("POST", "/contexts", {"language": "java"})[0] == 400


# (set state, a cell that runs for long, the state read back): the interrupted context keeps it.
SLOW_CELLS = {
    "python": ("keep = 'alive'", "import time\nprint('start', flush=True)\ntime.sleep(30)", "keep"),
    "bash": ("KEEP=alive", "echo start; sleep 30", "echo $KEEP"),
    "javascript": ("var keep = 'alive'", "console.log('start'); while (true) {}", "keep"),
}


@pytest.mark.parametrize("language", sorted(SLOW_CELLS))
def test_disconnect_interrupts(server, language):
    if language == "javascript" and not server.node:
        pytest.skip("no node")
    setup, slow, probe = SLOW_CELLS[language]
    ctx = new_context(server, language=language)
    run(server, setup, context_id=ctx.id)
    s = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"code": slow, "context_id": ctx.id}).encode()
    s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while b"start" not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.close()
    t0 = time.monotonic()
    ex, _ = run(server, probe, context_id=ctx.id)
    assert (ex.text or "".join(ex.logs.stdout)).strip() == "alive"
    assert time.monotonic() - t0 < 8
    server.request("DELETE", f"/contexts/{ctx.id}")


def test_kernel_death_then_restart(server):
    ctx = new_context(server)
    run(server, "y = 1", context_id=ctx.id)
    ex, raw = run(server, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                  context_id=ctx.id)
    assert ex.error and ex.error.name in ("KernelDied", "OomKilled")
    ex, _ = run(server, "'y' in globals()", context_id=ctx.id)
    assert ex.text == "False"
    server.request("DELETE", f"/contexts/{ctx.id}")


def test_oom_killed_then_recovers(server):
    ctx = new_context(server)
    ex, _ = run(server, "import os, signal\n"
                        f"open({server.workdir + '/vmstat'!r}, 'w').write('oom_kill 1\\n')\n"
                        "os.kill(os.getpid(), signal.SIGKILL)", context_id=ctx.id)
    assert ex.error and ex.error.name == "OomKilled"
    ex, _ = run(server, "1 + 1", context_id=ctx.id)
    assert ex.text == "2" and ex.error is None
    server.request("DELETE", f"/contexts/{ctx.id}")


def test_restart_while_running(server):
    ctx = new_context(server)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=run(server, "import time; time.sleep(30)",
                                                         context_id=ctx.id)))
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    assert server.request("POST", f"/contexts/{ctx.id}/restart")[0] == 200
    t.join(timeout=20)
    assert not t.is_alive() and time.monotonic() - t0 < 15
    ex, _ = box["r"]
    assert ex.error and ex.error.name == "ContextRestarting"
    ex, _ = run(server, "'ok'", context_id=ctx.id)
    assert ex.text == "ok"
    server.request("DELETE", f"/contexts/{ctx.id}")


def test_reseed_after_sandbox_id_changes(server):
    ctx = new_context(server)
    ex, _ = run(server, "import random, numpy\nrandom.seed(1); numpy.random.seed(1)\n"
                        "a = (random.random(), numpy.random.random())\n"
                        "random.seed(1); numpy.random.seed(1)", context_id=ctx.id)
    with open(server.sandbox_id_file, "w") as f:
        f.write("sandbox-2")
    ex, _ = run(server, "b = (random.random(), numpy.random.random()); "
                        "[x != y for x, y in zip(a, b)]", context_id=ctx.id)
    assert ex.text == "[True, True]"
    # Unchanged file: no reseed, seeding stays deterministic.
    ex, _ = run(server, "random.seed(1); numpy.random.seed(1)", context_id=ctx.id)
    ex, _ = run(server, "(random.random(), numpy.random.random()) == a", context_id=ctx.id)
    assert ex.text == "True"
    server.request("DELETE", f"/contexts/{ctx.id}")


def test_bash(server):
    ex, _ = run(server, "X=5\ncd /\necho out; echo err >&2", language="bash")
    assert ex.logs.stdout == ["out\n"] and ex.logs.stderr == ["err\n"] and ex.error is None
    ex, _ = run(server, "printf %s \"$X:$(pwd):$AIRLOCK_B\"", language="bash",
                env_vars={"AIRLOCK_B": "e"})
    assert "".join(ex.logs.stdout) == "5:/:e"
    ex, _ = run(server, "echo ${AIRLOCK_B-unset}; false", language="bash")
    assert ex.logs.stdout == ["unset\n"]
    assert ex.error.name == "CommandExitError" and ex.error.value == "exit status 1"
    ex, _ = run(server, "exit 3", language="bash")
    assert ex.error.name == "KernelDied"
    ex, _ = run(server, "echo again", language="bash")
    assert ex.logs.stdout == ["again\n"] and ex.error is None


def test_javascript(server):
    if not server.node:
        pytest.skip("no node")
    ex, _ = run(server, "console.log('hello'); const o = {a: 1}; o", language="javascript")
    assert ex.logs.stdout == ["hello\n"]
    assert ex.results[0].text == "{ a: 1 }" and ex.results[0].is_main_result
    ex, _ = run(server, "o.a + 1", language="js")
    assert ex.text == "2" and ex.execution_count == 2
    ex, _ = run(server, "const w = await new Promise(r => setTimeout(() => r(7), 10)); w * 2",
                language="js")
    assert ex.error is None and ex.text == "14"
    ex, _ = run(server, "w + 1", language="js")
    assert ex.text == "8"
    ex, _ = run(server, "Promise.resolve(8)", language="js")
    assert ex.text == "8"
    ex, _ = run(server, "null.x", language="js")
    assert ex.error.name == "TypeError" and "null" in ex.error.value
    assert "node_repl" not in ex.error.traceback
    ex, _ = run(server, "process.env.AIRLOCK_J", language="js", env_vars={"AIRLOCK_J": "j"})
    assert ex.text == "j"


def test_typescript(server):
    node = server.node
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout if node else ""
    m = re.match(r"v(\d+)\.(\d+)", version or "")
    if not m or (int(m[1]), int(m[2])) < (22, 12):
        pytest.skip(f"typescript needs node >= 22.12 (have {version.strip() or 'none'})")
    ex, _ = run(server, "function sq(n: number): number { return n * n }\nsq(7)",
                language="typescript")
    assert ex.error is None and ex.text == "49"
