"""The unchanged `e2b-code-interpreter` package from PyPI against a live airlockd's E2B gateway.

Only environment settings point it at Airlock: E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL.
`Sandbox.create()` asks for the package's default template, `code-interpreter-v1`, which
Airlock's `code-interpreter` template answers to. Every test runs cells in a real VM.
"""

import base64
import os
import struct
import time

import pytest
from e2b import TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox

for var in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL"):
    assert os.environ.get(var), f"{var} must point the SDK at the gateway"


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox.create()
    yield sb
    sb.kill()


def png_size(b64):
    png = base64.b64decode(b64)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


def test_variables_persist_and_the_last_expression_is_the_result(sandbox):
    sandbox.run_code("x = 41")
    execution = sandbox.run_code("print('x is', x)\nx + 1")
    assert execution.text == "42"
    assert execution.logs.stdout == ["x is 41\n"]
    assert execution.error is None
    assert execution.execution_count >= 2


def test_a_dataframe_comes_back_as_html_and_a_figure_as_a_png(sandbox):
    df = sandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert "<table" in df.results[0].html
    seen = []
    chart = sandbox.run_code(
        "import matplotlib.pyplot as plt\nplt.figure(figsize=(4, 3), dpi=100)\n"
        "plt.plot([1, 3, 2])\nplt.show()",
        on_result=seen.append,
    )
    pngs = [r.png for r in chart.results if r.png]
    assert len(pngs) == 1 and len(seen) == len(chart.results)
    assert png_size(pngs[0]) == (400, 300)


def test_an_exception_has_its_name_value_and_traceback(sandbox):
    execution = sandbox.run_code("def f():\n    raise ValueError('bad input')\nf()")
    assert execution.error.name == "ValueError"
    assert execution.error.value == "bad input"
    assert "raise ValueError" in execution.error.traceback


def test_contexts_are_isolated_and_restart_clears_state(sandbox):
    a = sandbox.create_code_context()
    b = sandbox.create_code_context(language="python")
    assert {a.id, b.id} <= {c.id for c in sandbox.list_code_contexts()}
    sandbox.run_code("only_in_a = 1", context=a)
    assert sandbox.run_code("only_in_a", context=b).error.name == "NameError"
    assert sandbox.run_code("only_in_a", context=a).text == "1"
    sandbox.restart_code_context(a)
    assert sandbox.run_code("only_in_a", context=a).error.name == "NameError"
    sandbox.remove_code_context(b)
    assert b.id not in {c.id for c in sandbox.list_code_contexts()}


def test_javascript_cells_have_results(sandbox):
    execution = sandbox.run_code("const n = 41; console.log('js'); n + 1", language="javascript")
    assert execution.text == "42"
    assert execution.logs.stdout == ["js\n"]


def test_a_timeout_interrupts_the_cell_and_the_next_one_runs(sandbox):
    sandbox.run_code("survivor = 'yes'")
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time\ntime.sleep(60)", timeout=2)
    assert time.monotonic() - t0 < 30
    assert sandbox.run_code("survivor").text == "yes"


def test_a_killed_interpreter_is_restarted(sandbox):
    sandbox.commands.run("pkill -9 -f /usr/lib/airlock/interpreter/server.py", user="root")
    deadline = time.monotonic() + 60
    while True:
        try:
            assert sandbox.run_code("1 + 1").text == "2"
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_the_async_sandbox_runs_cells():
    import asyncio

    async def main():
        sb = await AsyncSandbox.create()
        try:
            out = []
            execution = await sb.run_code("print('async')\n2 ** 10", on_stdout=out.append)
            assert execution.text == "1024"
            assert [m.line for m in out] == ["async\n"]
        finally:
            await sb.kill()

    asyncio.run(main())
