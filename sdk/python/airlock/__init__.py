"""Airlock: run untrusted code in microVM sandboxes.

Quickstart (the daemon ``airlockd`` must be running; see the repository's README)::

    from airlock import Client

    with Client() as client:
        with client.sandboxes.create() as sandbox:
            print(sandbox.exec_code("print(6*7)").stdout)   # 42
        # The code interpreter (a stateful kernel; rich results):
        with client.sandboxes.create("code-interpreter") as sandbox:
            sandbox.run_code("x = 6")
            print(sandbox.run_code("x * 7").text)             # 42

The asyncio flavour is :class:`airlock.aio.AsyncClient`.
"""

from ._common import (
    DEFAULT_SOCKET,
    AuditEvent,
    AuditLog,
    AuditProblem,
    AuditVerification,
    EgressEvent,
    EgressLog,
    ExecResult,
    ExportPolicy,
    Exposure,
    FileEntry,
    InstallEvent,
    InstallLog,
    Mount,
    Network,
    OutputChunk,
    Packages,
    Rule,
    Secret,
    SecretInfo,
    Template,
    TemplateProgress,
    TemplateLog,
    Node,
    Usage,
    Volume,
    verify_audit,
)
from ._interp import CodeContext, CodeExecution, ExecutionError, Logs, OutputMessage, Result
from .client import Client, Execution, Sandbox
from . import errors
from .errors import *  # noqa: F401,F403  (the exception classes; see errors.__all__)

__version__ = "0.1.0"

__all__ = [
    "Client",
    "Sandbox",
    "Execution",
    "ExecResult",
    "OutputChunk",
    "CodeExecution",
    "CodeContext",
    "Result",
    "Logs",
    "ExecutionError",
    "OutputMessage",
    "FileEntry",
    "Template",
    "TemplateProgress",
    "TemplateLog",
    "Node",
    "Usage",
    "Network",
    "Rule",
    "EgressEvent",
    "EgressLog",
    "Exposure",
    "Packages",
    "InstallEvent",
    "InstallLog",
    "Volume",
    "Mount",
    "ExportPolicy",
    "Secret",
    "SecretInfo",
    "AuditEvent",
    "AuditLog",
    "AuditProblem",
    "AuditVerification",
    "verify_audit",
    "DEFAULT_SOCKET",
] + errors.__all__
