"""The unchanged E2B SDK (e2b-code-interpreter 2.11.5) against the server: debug mode sends
the interpreter's routes to http://localhost:<JUPYTER_PORT>, which is pointed at the test port."""

import asyncio
import time

import e2b_code_interpreter.code_interpreter_async as casync
import e2b_code_interpreter.code_interpreter_sync as csync
import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox


@pytest.fixture
def sandbox(server, monkeypatch):
    monkeypatch.setattr(csync, "JUPYTER_PORT", server.port)
    monkeypatch.setattr(casync, "JUPYTER_PORT", server.port)
    return Sandbox.create(debug=True)


def test_run_code_contexts_and_timeout(sandbox):
    seen = []
    ex = sandbox.run_code("sdk_x = 1\nprint('hi')\nsdk_x + 1", on_stdout=seen.append)
    assert ex.text == "2" and ex.logs.stdout == ["hi\n"] and seen[0].line == "hi\n"

    ctx = sandbox.create_code_context(language="python")
    assert ctx.id in [c.id for c in sandbox.list_code_contexts()]
    assert sandbox.run_code("sdk_x", context=ctx).error.name == "NameError"
    sandbox.restart_code_context(ctx)
    sandbox.remove_code_context(ctx)

    assert sandbox.run_code("echo hi", language="bash").logs.stdout == ["hi\n"]
    with pytest.raises(Exception, match="not available"):
        sandbox.run_code("1", language="r")

    # The SDK's timeout closes the connection: the server interrupts, the context survives.
    with pytest.raises(Exception, match="timed out"):
        sandbox.run_code("import time; time.sleep(20)", timeout=1)
    t0 = time.monotonic()
    assert sandbox.run_code("sdk_x").text == "1"
    assert time.monotonic() - t0 < 8


def test_async_sdk(server, monkeypatch):
    monkeypatch.setattr(casync, "JUPYTER_PORT", server.port)

    async def main():
        sb = await AsyncSandbox.create(debug=True)
        ex = await sb.run_code("import pandas as pd\npd.DataFrame({'a': [1]})")
        assert "<table" in ex.results[0].html
        ctx = await sb.create_code_context(language="bash")
        assert (await sb.run_code("echo $((6*7))", context=ctx)).logs.stdout == ["42\n"]
        await sb.remove_code_context(ctx)

    asyncio.run(main())
