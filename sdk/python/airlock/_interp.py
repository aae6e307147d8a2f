"""The code interpreter's models and the logic that the sync and async clients share.

``sandbox.run_code(...)`` sends a ``RunCode`` request and folds its event stream into a
:class:`CodeExecution` (results as MIME bundles, logs, the exception, the execution count);
:class:`Result` has the ``_repr_*_`` methods IPython calls, so a notebook shows a result as the
kernel would have. The names follow ``e2b_code_interpreter`` (``Result``, ``Logs``,
``ExecutionError``, ``OutputMessage``), so code written against it ports with few changes; its
``Execution`` is :class:`CodeExecution` here (``airlock.Execution`` is a started ``exec``).
"""

from __future__ import annotations

import base64
import json as _json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from . import errors
from ._proto import airlock_pb2 as pb

# MIME type -> Result attribute. The binary ones (png, jpeg, pdf) stay base64 text, as Jupyter
# and E2B keep them; ``_repr_png_`` and the like decode them.
MIME_ATTRS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}

_STATES = {
    pb.CODE_STATE_OK: "ok",
    pb.CODE_STATE_ERROR: "error",
    pb.CODE_STATE_TIMED_OUT: "timed_out",
    pb.CODE_STATE_OOM_KILLED: "oom_killed",
    pb.CODE_STATE_FAILED: "failed",
}


def _json_text(s: str) -> Any:
    """A JSON text of the API as a value: empty is None, one that does not parse stays text."""
    if not s:
        return None
    try:
        return _json.loads(s)
    except ValueError:
        return s


@dataclass(frozen=True)
class OutputMessage:
    """A piece of a cell's stdout or stderr, as the kernel printed it.

    Attributes:
        line: the text.
        timestamp: when it was printed, Unix time in nanoseconds.
        error: it is stderr's.
    """

    line: str
    timestamp: int = 0
    error: bool = False

    @property
    def text(self) -> str:
        """The text (``line``), as :attr:`airlock.OutputChunk.text` names it."""
        return self.line

    def __str__(self) -> str:
        return self.line


@dataclass
class Logs:
    """A cell's output: the pieces of stdout and of stderr in order."""

    stdout: List[str] = field(default_factory=list)
    stderr: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExecutionError:
    """The exception a cell raised: its class (``"ZeroDivisionError"``; ``"OomKilled"`` when
    the memory limit killed the kernel, ``"KernelDied"``, ``"Interrupted"``), its message and
    the traceback as one text."""

    name: str
    value: str
    traceback: str = ""

    def __str__(self) -> str:
        return f"{self.name}: {self.value}"


class Result:
    """One result of a cell: a displayed value, or the cell's own (``is_main_result``), as a
    MIME bundle. Each format is an attribute (``None`` when absent): ``text`` (text/plain),
    ``html``, ``markdown``, ``svg``, ``latex``, ``javascript`` as text; ``png``, ``jpeg``,
    ``pdf`` as base64 text (as Jupyter sends them); ``json`` parsed; ``chart`` the chart data
    extracted from a matplotlib figure (parsed); ``extra`` what else the kernel attached
    (parsed, and any MIME type without an attribute). ``data`` is the bundle as it came.

    In a notebook, the ``_repr_*_`` methods show it (PNG and JPEG decoded to bytes)."""

    text: Optional[str]
    html: Optional[str]
    markdown: Optional[str]
    svg: Optional[str]
    png: Optional[str]
    jpeg: Optional[str]
    pdf: Optional[str]
    latex: Optional[str]
    json: Optional[Any]
    javascript: Optional[str]

    def __init__(
        self,
        data: Optional[Mapping[str, str]] = None,
        is_main_result: bool = False,
        chart: Any = None,
        extra: Any = None,
    ) -> None:
        self.data: Dict[str, str] = dict(data or {})
        self.is_main_result = bool(is_main_result)
        self.chart = chart
        for attr in MIME_ATTRS.values():
            setattr(self, attr, None)
        others: Dict[str, Any] = {}
        for mime, value in self.data.items():
            attr = MIME_ATTRS.get(mime)
            if attr == "json":
                self.json = _json_text(value)
            elif attr is not None:
                setattr(self, attr, value)
            else:
                others[mime] = _json_text(value) if mime.endswith("json") else value
        if isinstance(extra, dict):
            others.update(extra)
        elif extra is not None:
            others["extra"] = extra
        self.extra: Dict[str, Any] = others

    @classmethod
    def from_pb(cls, r: "pb.CodeResult") -> "Result":
        return cls(dict(r.data), r.is_main_result, _json_text(r.chart), _json_text(r.extra))

    def formats(self) -> List[str]:
        """The formats it has, by attribute name (``["text", "png", ...]``), then ``chart``
        and the keys of ``extra``."""
        out = [a for a in MIME_ATTRS.values() if getattr(self, a) is not None]
        if self.chart is not None:
            out.append("chart")
        out.extend(self.extra)
        return out

    def __str__(self) -> str:
        return self.text or ""

    def __repr__(self) -> str:
        if self.text is not None:
            return f"Result({self.text})"
        return f"Result(formats: {', '.join(self.formats())})"

    @staticmethod
    def _decode(b64: Optional[str]) -> Optional[bytes]:
        return None if b64 is None else base64.b64decode("".join(b64.split()))

    # IPython's display hooks: each returns None when the format is absent.
    def _repr_html_(self) -> Optional[str]:
        return self.html

    def _repr_markdown_(self) -> Optional[str]:
        return self.markdown

    def _repr_svg_(self) -> Optional[str]:
        return self.svg

    def _repr_png_(self) -> Optional[bytes]:
        return self._decode(self.png)

    def _repr_jpeg_(self) -> Optional[bytes]:
        return self._decode(self.jpeg)

    def _repr_pdf_(self) -> Optional[bytes]:
        return self._decode(self.pdf)

    def _repr_latex_(self) -> Optional[str]:
        return self.latex

    def _repr_json_(self) -> Optional[Any]:
        return self.json

    def _repr_javascript_(self) -> Optional[str]:
        return self.javascript


@dataclass
class CodeExecution:
    """What a cell did.

    Attributes:
        results: its :class:`Result` s in order (the main one, the cell's value, last).
        logs: its stdout and stderr pieces.
        error: the exception it raised (:class:`ExecutionError`), or ``None``.
        execution_count: the context's count after it (``In [N]``; 0 when it never ran).
        state: ``"ok"``, ``"error"`` (it raised), ``"timed_out"``, ``"oom_killed"``,
            ``"failed"`` (the kernel died otherwise, or the interpreter was unreachable).
        context_id: the context it ran in.
        error_reason, error_message: why it did not run to its end (``EXEC_TIMEOUT``,
            ``OOM_KILLED``, ``INTERPRETER_UNAVAILABLE``, ...), for the last three states.
        duration_ms: its wall-clock time as the daemon measured it.
    """

    results: List[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: Optional[ExecutionError] = None
    execution_count: int = 0
    state: str = ""
    context_id: str = ""
    error_reason: str = ""
    error_message: str = ""
    duration_ms: int = 0

    @property
    def text(self) -> Optional[str]:
        """The main result's text (the cell's value, as ``Out[N]`` shows it), or ``None``."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    @property
    def stdout(self) -> str:
        """All of its stdout as one text."""
        return "".join(self.logs.stdout)

    @property
    def stderr(self) -> str:
        """All of its stderr as one text."""
        return "".join(self.logs.stderr)

    def raise_for_platform(self) -> "CodeExecution":
        """Raises when the cell did not run to its end on its own: :class:`~airlock.ExecTimeout`
        (its timeout interrupted it; the context lives on), :class:`~airlock.OomKilled` (the
        memory limit killed its kernel; the context restarts on its next cell), or the error of
        ``error_reason`` (:class:`~airlock.InterpreterUnavailable`,
        :class:`~airlock.SandboxDead`, ...), each carrying this execution as ``result``. An
        exception of the code is its business: it is in :attr:`error`, not raised."""
        if self.state in ("ok", "error"):
            return self
        reason = self.error_reason or {
            "timed_out": "EXEC_TIMEOUT",
            "oom_killed": "OOM_KILLED",
        }.get(self.state, "INTERNAL")
        cls = errors.error_class(reason)
        if cls is errors.AirlockError:
            cls = errors.InternalError
        raise cls(self.error_message or self.state, reason=reason, result=self)


@dataclass(frozen=True)
class CodeContext:
    """A context of the interpreter: its own kernel and variables, in a language and a working
    directory."""

    id: str
    language: str
    cwd: str

    @classmethod
    def from_pb(cls, c: "pb.CodeContext") -> "CodeContext":
        return cls(id=c.id, language=c.language, cwd=c.cwd)


ContextSpec = Union[None, str, CodeContext]


def context_id(context: ContextSpec) -> str:
    if context is None:
        return ""
    return context.id if isinstance(context, CodeContext) else str(context)


def run_code_request(
    sandbox_id: str,
    code: str,
    language: Optional[str],
    context: ContextSpec,
    env: Optional[Mapping[str, str]],
    timeout: Optional[float],
) -> "pb.RunCodeRequest":
    if language and context:
        raise errors.InvalidArgument(
            "run_code takes a language or a context, not both (a context has its language)",
            "INVALID_ARGUMENT",
        )
    if timeout is not None and timeout < 0:
        raise errors.InvalidArgument("a timeout cannot be negative", "INVALID_ARGUMENT")
    timeout_ms = max(1, int(round(timeout * 1000))) if timeout else 0
    return pb.RunCodeRequest(
        sandbox_id=sandbox_id,
        code=code,
        language=language or "",
        context_id=context_id(context),
        env={str(k): str(v) for k, v in (env or {}).items()},
        timeout_ms=timeout_ms,
    )


Callback = Optional[Callable[[Any], Any]]


class CodeCollector:
    """Folds RunCode events into a :class:`CodeExecution`, calling the callbacks as they come."""

    def __init__(self, on_stdout: Callback, on_stderr: Callback, on_result: Callback, on_error: Callback) -> None:
        self.execution = CodeExecution()
        self.on_stdout, self.on_stderr = on_stdout, on_stderr
        self.on_result, self.on_error = on_result, on_error
        self.ended = False

    def add(self, ev: "pb.RunCodeEvent") -> Any:
        """Takes an event; returns what its callback returned (an awaitable, for async ones)."""
        ex = self.execution
        kind = ev.WhichOneof("event")
        if kind == "stdout":
            ex.logs.stdout.append(ev.stdout.text)
            cb, arg = self.on_stdout, OutputMessage(ev.stdout.text, ev.stdout.timestamp_unix_ns, False)
        elif kind == "stderr":
            ex.logs.stderr.append(ev.stderr.text)
            cb, arg = self.on_stderr, OutputMessage(ev.stderr.text, ev.stderr.timestamp_unix_ns, True)
        elif kind == "result":
            arg = Result.from_pb(ev.result)
            ex.results.append(arg)
            cb = self.on_result
        elif kind == "error":
            arg = ExecutionError(ev.error.name, ev.error.value, ev.error.traceback)
            ex.error = arg
            cb = self.on_error
        elif kind == "end":
            e = ev.end
            ex.state = _STATES.get(e.state, "unspecified")
            ex.execution_count = e.execution_count
            ex.context_id = e.context_id
            ex.error_reason = e.error_reason
            ex.error_message = e.error_message
            ex.duration_ms = e.duration_ms
            self.ended = True
            return None
        else:
            return None
        return cb(arg) if cb is not None else None

    def finish(self, check: bool) -> CodeExecution:
        if not self.ended:
            raise errors.Unavailable(
                "the RunCode stream ended before the cell did", "AGENT_UNAVAILABLE", result=self.execution
            )
        return self.execution.raise_for_platform() if check else self.execution


def create_context_request(sandbox_id: str, language: Optional[str], cwd: Optional[str]):
    return pb.CreateCodeContextRequest(sandbox_id=sandbox_id, language=language or "", cwd=cwd or "")
