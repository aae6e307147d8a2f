"""The unchanged `e2b-code-interpreter` package from PyPI against a live airlockd's E2B gateway,
in real VMs of Airlock's `code-interpreter` template.

Run by `tests/interpreter.rs` (a daemon with `[e2b] listen`, the template built or imported,
and a tenant whose token is the API key), in a venv of pinned packages (`tests/e2b/venv.sh
VERSION e2b-code-interpreter==X`). Only environment settings point the SDK at Airlock:
E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL. `Sandbox.create()` names no template: the
package's default, `code-interpreter-v1`, is Airlock's `code-interpreter`.
"""

import os
import struct
import time

import pytest
from e2b_code_interpreter import Sandbox

for var in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"):
    assert os.environ.get(var), f"{var} is not set: run this through `cargo test --test interpreter`"

# Guest kernel code is emulated on the nested build machines: a clone's first cell faults its
# memory in (seconds), so calls get room.
T = dict(timeout=240, request_timeout=240)


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create(timeout=900, request_timeout=240)
    yield s
    s.kill()


def png_size(data: bytes):
    """(width, height) from a PNG's IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    return struct.unpack(">II", data[16:24])


def test_variables_persist_and_results_are_rich(sbx):
    assert sbx.get_info().template_id in ("code-interpreter", "code-interpreter-v1")
    seen = []
    ex = sbx.run_code("x = 41\nprint('hello')\nx + 1", on_stdout=seen.append, **T)
    assert ex.error is None, ex.error
    assert ex.text == "42"
    assert ex.logs.stdout == ["hello\n"] and seen[0].line == "hello\n"
    assert sbx.run_code("x * 2", **T).text == "82"

    ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})", **T)
    assert "<table" in ex.results[0].html and "<td>x</td>" in ex.results[0].html

    ex = sbx.run_code(
        "import matplotlib.pyplot as plt\n"
        "fig = plt.figure(figsize=(4, 3), dpi=100)\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.show()",
        **T,
    )
    assert ex.error is None, ex.error
    assert ex.logs.stderr == [], ex.logs.stderr
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1, ex.results
    import base64

    assert png_size(base64.b64decode(pngs[0])) == (400, 300)

    ex = sbx.run_code("1 / 0", **T)
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    assert "ZeroDivisionError" in ex.error.traceback


def test_contexts_are_isolated_and_restart_clears_them(sbx):
    a = sbx.create_code_context(language="python")
    b = sbx.create_code_context(language="python")
    assert sbx.run_code("secret_of_a = 7", context=a, **T).error is None
    assert sbx.run_code("secret_of_a", context=b, **T).error.name == "NameError"
    assert sbx.run_code("secret_of_a", context=a, **T).text == "7"
    ids = [c.id for c in sbx.list_code_contexts()]
    assert a.id in ids and b.id in ids
    sbx.restart_code_context(a)
    assert sbx.run_code("secret_of_a", context=a, **T).error.name == "NameError"
    sbx.remove_code_context(a)
    sbx.remove_code_context(b)
    assert a.id not in [c.id for c in sbx.list_code_contexts()]


def test_a_timeout_interrupts_the_cell_and_the_context_lives_on(sbx):
    sbx.run_code("kept = 'still here'", **T)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="(?i)timed? ?out"):
        sbx.run_code("import time\ntime.sleep(120)", timeout=5, request_timeout=240)
    assert time.monotonic() - t0 < 60
    assert sbx.run_code("kept", **T).text == "'still here'"


def test_a_cell_past_the_memory_limit_is_reported_and_the_context_recovers(sbx):
    # Touched 64 MiB at a time (one 3 GiB request would be refused as a MemoryError by the
    # guest's overcommit check instead of reaching the memory limit).
    ex = sbx.run_code("hog = [b'x' * (64 << 20) for _ in range(64)]", **T)
    assert ex.error is not None and ex.error.name == "OomKilled", ex.error
    # The context's next cell starts a new kernel: minutes on nested KVM.
    assert sbx.run_code("21 * 2", timeout=900, request_timeout=900).text == "42"


def test_javascript_and_bash_cells(sbx):
    ex = sbx.run_code("const n = 6; n * 7", language="javascript", **T)
    assert ex.error is None, ex.error
    assert ex.text == "42"
    assert sbx.run_code("echo $((6 * 7))", language="bash", **T).logs.stdout == ["42\n"]


def test_the_interpreter_killed_with_sigkill_is_restarted(sbx):
    sbx.commands.run("pkill -9 -f /usr/lib/airlock/interpreter/server.py || true", timeout=120)
    deadline = time.monotonic() + 900  # a new server and kernel: minutes on nested KVM
    last = None
    while time.monotonic() < deadline:
        try:
            ex = sbx.run_code("'back'", timeout=900, request_timeout=900)
            if ex.text == "'back'":
                return
            last = ex
        except Exception as e:  # the server is starting again
            last = e
        time.sleep(2)
    pytest.fail(f"the interpreter did not come back: {last!r}")


def test_two_sandboxes_draw_different_random_numbers():
    other = Sandbox.create(timeout=300, request_timeout=240)
    try:
        mine = Sandbox.create(timeout=300, request_timeout=240)
        try:
            code = "import random, numpy\n(random.random(), float(numpy.random.rand()))"
            a = mine.run_code(code, **T).text
            b = other.run_code(code, **T).text
            assert a and b and a != b, (a, b)
        finally:
            mine.kill()
    finally:
        other.kill()
