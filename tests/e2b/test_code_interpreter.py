"""The unchanged `e2b-code-interpreter` package from PyPI against a live airlockd's E2B gateway,
in real VMs of Airlock's `code-interpreter` template.

Run by `tests/interpreter.rs` (a daemon with `[e2b] listen`, the template built or imported,
and a tenant whose token is the API key), in a venv of pinned packages (`tests/e2b/venv.sh
VERSION e2b-code-interpreter==X`). Only environment settings point the SDK at Airlock:
E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL. `Sandbox.create()` names no template: the
package's default, `code-interpreter-v1`, is Airlock's `code-interpreter`.

Each cell here runs in the kernel the template warmed before its snapshot, or in bash and Node
contexts: a new Python kernel (a new Python context, a restart, the context after an OOM kill,
the server after a `kill -9`) takes minutes on one emulated vCPU of a nested-KVM build machine,
and a cell filling the guest's memory thrashed there for over 5 minutes before the OOM killer
came. Those paths run against real kernels on the host (rootfs/interpreter/tests, with this
package too).
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
    # Bash contexts (a bash each): their start costs seconds here, a Python kernel's minutes.
    a = sbx.create_code_context(language="bash", request_timeout=240)
    b = sbx.create_code_context(language="bash", request_timeout=240)
    assert a.language == "bash" and a.id != b.id
    assert sbx.run_code("MINE=7", context=a, **T).error is None
    assert sbx.run_code('echo "${MINE:-unset}"', context=b, **T).logs.stdout == ["unset\n"]
    assert sbx.run_code('echo "$MINE"', context=a, **T).logs.stdout == ["7\n"]
    ids = [c.id for c in sbx.list_code_contexts()]
    assert a.id in ids and b.id in ids
    sbx.restart_code_context(a)
    assert sbx.run_code('echo "${MINE:-unset}"', context=a, **T).logs.stdout == ["unset\n"]
    sbx.remove_code_context(a)
    sbx.remove_code_context(b)
    assert a.id not in [c.id for c in sbx.list_code_contexts()]


def test_a_timeout_interrupts_the_cell_and_the_context_lives_on(sbx):
    sbx.run_code("kept = 'still here'", **T)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="(?i)timed? ?out"):
        sbx.run_code("import time\ntime.sleep(120)", timeout=5, request_timeout=240)
    assert time.monotonic() - t0 < 60
    # (E2B's server takes the quotes off a string's text/plain, as Airlock's does.)
    assert sbx.run_code("kept", **T).text == "still here"


def test_javascript_and_bash_cells(sbx):
    ex = sbx.run_code("const n = 6; n * 7", language="javascript", **T)
    assert ex.error is None, ex.error
    assert ex.text == "42"
    assert sbx.run_code("echo $((6 * 7))", language="bash", **T).logs.stdout == ["42\n"]


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
