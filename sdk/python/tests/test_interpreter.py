"""Unit tests of the code interpreter's client side: no daemon (they use none of conftest's
fixtures). An in-process gRPC server (grpcio, the generated servicer) plays the daemon's
RunCode and code-context RPCs; the sync and async clients talk to it over a Unix socket.

What they check: events become a CodeExecution (results, logs, error, count, state), callbacks
get them as they come (async ones awaited), the Result's formats and ``_repr_*_`` methods,
the end states that raise (timeout, OOM, interpreter unavailable) and those that do not (an
exception of the code), the request's fields, leaving early cancels the call, and contexts.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import tempfile
import threading
from concurrent import futures

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

import airlock
from airlock import CodeContext, CodeExecution, ExecutionError, OutputMessage, Result
from airlock._proto import airlock_pb2 as pb
from airlock._proto import airlock_pb2_grpc as pb_grpc
from airlock.aio import AsyncClient

# A 1x1 PNG, as Jupyter sends image/png (base64, here wrapped in lines as it may be).
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
PNG_B64 = base64.encodebytes(PNG).decode()
JPEG_B64 = base64.b64encode(b"\xff\xd8\xff\xe0jpeg").decode()
PDF_B64 = base64.b64encode(b"%PDF-1.4 x").decode()


def _ev(**kw) -> pb.RunCodeEvent:
    return pb.RunCodeEvent(**kw)


def _end(state, count=0, reason="", message=""):
    return _ev(
        end=pb.CodeEnd(
            state=state,
            execution_count=count,
            context_id="ctx-py",
            error_reason=reason,
            error_message=message,
            duration_ms=42,
        )
    )


def _abort(context, code, reason, message):
    """Fails the call as airlockd does: a status with a google.rpc.ErrorInfo detail."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain="airlock")
    detail = status_pb2.Status(code=code.value[0], message=message)
    detail.details.add().Pack(info)
    context.set_trailing_metadata((("grpc-status-details-bin", detail.SerializeToString()),))
    context.abort(code, message)


class FakeAirlock(pb_grpc.AirlockServicer):
    """RunCode's events chosen by the cell's source; contexts kept in a list."""

    def __init__(self) -> None:
        self.requests = []
        self.contexts = []
        self.cancelled = threading.Event()

    def RunCode(self, request, context):
        self.requests.append(request)
        if request.sandbox_id != "sb-1":
            _abort(context, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND", "no sandbox sb-x")
        code = request.code
        if code == "plot":
            yield _ev(stdout=pb.CodeOutput(text="hello\n", timestamp_unix_ns=11))
            yield _ev(stderr=pb.CodeOutput(text="warn\n", timestamp_unix_ns=12))
            yield _ev(stdout=pb.CodeOutput(text="again\n", timestamp_unix_ns=13))
            yield _ev(
                result=pb.CodeResult(
                    data={
                        "text/plain": "<Figure size 640x480 with 1 Axes>",
                        "image/png": PNG_B64,
                        "image/svg+xml": "<svg/>",
                    },
                    chart=json.dumps({"type": "line", "title": "t", "elements": []}),
                )
            )
            yield _ev(
                result=pb.CodeResult(
                    data={
                        "text/plain": "   a\n0  1",
                        "text/html": "<table><tr><td>1</td></tr></table>",
                        "application/json": '{"a": [1]}',
                        "application/vnd.custom+json": '{"k": 2}',
                        "text/latex": "$a$",
                        "text/markdown": "**a**",
                        "application/javascript": "console.log(1)",
                        "image/jpeg": JPEG_B64,
                        "application/pdf": PDF_B64,
                    },
                    extra='{"note": "x"}',
                )
            )
            yield _ev(result=pb.CodeResult(data={"text/plain": "2"}, is_main_result=True))
            yield _end(pb.CODE_STATE_OK, 5)
        elif code == "raise":
            yield _ev(stdout=pb.CodeOutput(text="before\n"))
            yield _ev(
                error=pb.CodeError(
                    name="ZeroDivisionError", value="division by zero", traceback="Traceback...\n1/0\n"
                )
            )
            yield _end(pb.CODE_STATE_ERROR, 6)
        elif code == "sleep":
            yield _ev(stdout=pb.CodeOutput(text="tick\n"))
            yield _end(pb.CODE_STATE_TIMED_OUT, 7, "EXEC_TIMEOUT", "the cell ran past 1 s")
        elif code == "oom":
            yield _ev(error=pb.CodeError(name="OomKilled", value="the kernel was killed by the memory limit"))
            yield _end(pb.CODE_STATE_OOM_KILLED, 0, "OOM_KILLED", "killed")
        elif code == "nointerp":
            yield _end(pb.CODE_STATE_FAILED, 0, "INTERPRETER_UNAVAILABLE", "no interpreter on port 49999")
        elif code == "cut":
            yield _ev(stdout=pb.CodeOutput(text="partial\n"))
        elif code == "forever":
            context.add_callback(self.cancelled.set)
            yield _ev(stdout=pb.CodeOutput(text="first\n"))
            self.cancelled.wait(10)
        else:
            yield _end(pb.CODE_STATE_OK, 1)

    def CreateCodeContext(self, request, context):
        c = pb.CodeContext(
            id=f"ctx-{len(self.contexts) + 1}",
            language=request.language or "python",
            cwd=request.cwd or "/home/user",
        )
        self.contexts.append(c)
        return c

    def ListCodeContexts(self, request, context):
        return pb.ListCodeContextsResponse(contexts=self.contexts)

    def RestartCodeContext(self, request, context):
        for c in self.contexts:
            if c.id == request.context_id:
                return c
        _abort(context, grpc.StatusCode.NOT_FOUND, "CONTEXT_NOT_FOUND", "no such context")

    def RemoveCodeContext(self, request, context):
        before = len(self.contexts)
        self.contexts = [c for c in self.contexts if c.id != request.context_id]
        if len(self.contexts) == before:
            _abort(context, grpc.StatusCode.NOT_FOUND, "CONTEXT_NOT_FOUND", "no such context")
        return pb.RemoveCodeContextResponse()

    def GetSandbox(self, request, context):
        if request.sandbox_id != "sb-1":
            _abort(context, grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND", "no sandbox")
        return pb.Sandbox(id=request.sandbox_id, template="code-interpreter", state=pb.SANDBOX_STATE_RUNNING)


@pytest.fixture
def fake():
    d = tempfile.mkdtemp(prefix="airlock-interp-", dir="/tmp")
    sock = os.path.join(d, "d.sock")
    servicer = FakeAirlock()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AirlockServicer_to_server(servicer, server)
    server.add_insecure_port("unix://" + sock)
    server.start()
    servicer.address = "unix://" + sock
    try:
        yield servicer
    finally:
        servicer.cancelled.set()
        server.stop(None)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sandbox(fake):
    with airlock.Client(fake.address) as client:
        yield client.sandboxes.get("sb-1")


def test_events_become_an_execution_and_reach_the_callbacks(fake, sandbox):
    seen = []
    ex = sandbox.run_code(
        "plot",
        env={"A": 1},
        timeout=2.5,
        on_stdout=lambda m: seen.append(("out", m)),
        on_stderr=lambda m: seen.append(("err", m)),
        on_result=lambda r: seen.append(("result", r)),
        on_error=lambda e: seen.append(("error", e)),
    )
    assert isinstance(ex, CodeExecution)
    assert ex.logs.stdout == ["hello\n", "again\n"] and ex.logs.stderr == ["warn\n"]
    assert (ex.stdout, ex.stderr) == ("hello\nagain\n", "warn\n")
    assert (ex.state, ex.execution_count, ex.context_id, ex.duration_ms) == ("ok", 5, "ctx-py", 42)
    assert ex.error is None
    assert len(ex.results) == 3 and ex.text == "2"
    assert [k for k, _ in seen] == ["out", "err", "out", "result", "result", "result"]
    assert seen[0][1] == OutputMessage("hello\n", 11, False)
    assert seen[1][1].error and str(seen[1][1]) == "warn\n" and seen[1][1].text == "warn\n"
    assert seen[3][1] is ex.results[0]

    req = fake.requests[-1]
    assert (req.sandbox_id, req.code, req.language, req.context_id) == ("sb-1", "plot", "", "")
    assert (dict(req.env), req.timeout_ms) == ({"A": "1"}, 2500)


def test_results_have_every_format_and_show_in_a_notebook(sandbox):
    fig, table, main = sandbox.run_code("plot").results
    assert fig.text.startswith("<Figure") and not fig.is_main_result
    assert fig.png == PNG_B64 and fig._repr_png_() == PNG
    assert fig._repr_svg_() == "<svg/>" and fig.svg == "<svg/>"
    assert fig.chart == {"type": "line", "title": "t", "elements": []}
    assert fig._repr_html_() is None and fig._repr_jpeg_() is None and fig._repr_json_() is None
    assert fig.formats() == ["text", "svg", "png", "chart"]

    assert table.html.startswith("<table>") and table._repr_html_() == table.html
    assert table.json == {"a": [1]} and table._repr_json_() == {"a": [1]}
    assert table._repr_latex_() == "$a$" and table._repr_markdown_() == "**a**"
    assert table._repr_javascript_() == "console.log(1)"
    assert table._repr_jpeg_() == b"\xff\xd8\xff\xe0jpeg" and table._repr_pdf_().startswith(b"%PDF")
    assert table.extra == {"application/vnd.custom+json": {"k": 2}, "note": "x"}
    assert table.formats() == [
        "text", "html", "markdown", "jpeg", "pdf", "latex", "json", "javascript",
        "application/vnd.custom+json", "note",
    ]
    assert table.data["text/html"] == table.html

    assert main.is_main_result and str(main) == "2" and repr(main) == "Result(2)"
    assert repr(Result({"text/html": "<b/>"})) == "Result(formats: html)"
    assert str(Result({})) == "" and Result({}).formats() == []


def test_an_exception_of_the_code_is_returned_not_raised(sandbox):
    errs = []
    ex = sandbox.run_code("raise", on_error=errs.append)
    assert ex.state == "error" and ex.execution_count == 6
    assert ex.error == ExecutionError("ZeroDivisionError", "division by zero", "Traceback...\n1/0\n")
    assert str(ex.error) == "ZeroDivisionError: division by zero"
    assert errs == [ex.error] and ex.logs.stdout == ["before\n"] and ex.text is None


def test_timeout_oom_and_no_interpreter_raise_with_the_execution(sandbox):
    with pytest.raises(airlock.ExecTimeout) as e:
        sandbox.run_code("sleep", timeout=1)
    assert e.value.reason == "EXEC_TIMEOUT" and "1 s" in e.value.message
    assert e.value.result.state == "timed_out" and e.value.result.logs.stdout == ["tick\n"]

    with pytest.raises(airlock.OomKilled) as e:
        sandbox.run_code("oom")
    assert e.value.result.error.name == "OomKilled" and e.value.result.state == "oom_killed"

    with pytest.raises(airlock.InterpreterUnavailable) as e:
        sandbox.run_code("nointerp")
    assert isinstance(e.value, airlock.Unavailable)

    # check=False returns them.
    ex = sandbox.run_code("sleep", check=False)
    assert (ex.state, ex.error_reason, ex.execution_count) == ("timed_out", "EXEC_TIMEOUT", 7)
    assert sandbox.run_code("oom", check=False).state == "oom_killed"

    with pytest.raises(airlock.Unavailable, match="ended before the cell"):
        sandbox.run_code("cut")


def test_request_errors(fake, sandbox):
    with pytest.raises(airlock.InvalidArgument):
        sandbox.run_code("1", language="python", context="ctx-1")
    with pytest.raises(airlock.InvalidArgument):
        sandbox.run_code("1", timeout=-1)
    sandbox.run_code("1", context=CodeContext("ctx-9", "bash", "/"), timeout=0.0001)
    req = fake.requests[-1]
    assert (req.context_id, req.language, req.timeout_ms) == ("ctx-9", "", 1)
    sandbox.run_code("1", "javascript")
    assert fake.requests[-1].language == "javascript"

    with airlock.Client(fake.address) as client:
        other = airlock.Sandbox(client, pb.Sandbox(id="sb-x"))
        with pytest.raises(airlock.SandboxNotFound):
            other.run_code("1")


def test_leaving_early_cancels_the_call(fake, sandbox):
    def boom(_):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        sandbox.run_code("forever", on_stdout=boom)
    assert fake.cancelled.wait(5), "the server saw the client go (the daemon interrupts the cell)"


def test_contexts(fake, sandbox):
    c = sandbox.create_code_context("javascript", cwd="/tmp")
    assert c == CodeContext("ctx-1", "javascript", "/tmp")
    d = sandbox.create_code_context()
    assert (d.language, d.cwd) == ("python", "/home/user")
    assert sandbox.list_code_contexts() == [c, d]
    assert sandbox.restart_code_context(c) == c
    assert sandbox.restart_code_context("ctx-2") == d
    sandbox.remove_code_context(c)
    assert sandbox.list_code_contexts() == [d]
    with pytest.raises(airlock.NotFound) as e:
        sandbox.remove_code_context("ctx-1")
    assert e.value.reason == "CONTEXT_NOT_FOUND"


def test_async_twins(fake):
    async def main():
        got = []

        async def on_out(m):
            await asyncio.sleep(0)
            got.append(m.line)

        async with AsyncClient(fake.address) as client:
            sb = await client.sandboxes.get("sb-1")
            ex = await sb.run_code("plot", on_stdout=on_out, on_result=lambda r: got.append(r.text))
            assert got == ["hello\n", "again\n", ex.results[0].text, ex.results[1].text, "2"]
            assert ex.text == "2" and ex.results[0]._repr_png_() == PNG
            assert (await sb.run_code("raise")).error.name == "ZeroDivisionError"
            with pytest.raises(airlock.ExecTimeout) as e:
                await sb.run_code("sleep", timeout=1)
            assert e.value.result.state == "timed_out"
            with pytest.raises(airlock.OomKilled):
                await sb.run_code("oom")
            assert (await sb.run_code("oom", check=False)).state == "oom_killed"

            c = await sb.create_code_context("bash")
            assert await sb.list_code_contexts() == [c]
            assert await sb.restart_code_context(c.id) == c
            await sb.remove_code_context(c)
            assert await sb.list_code_contexts() == []

            def boom(_):
                raise RuntimeError("stop")

            with pytest.raises(RuntimeError):
                await sb.run_code("forever", on_stdout=boom)
        assert await asyncio.get_running_loop().run_in_executor(None, fake.cancelled.wait, 5)

    asyncio.run(main())
