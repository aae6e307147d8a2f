"""Exceptions of the Airlock SDK.

Every failed call raises an :class:`AirlockError` subclass chosen by the reason code that
``airlockd`` sends in a ``google.rpc.ErrorInfo`` detail (the codes are listed at the top of
``proto/airlock.proto``). The classes tell three kinds of trouble apart:

* your own request: :class:`InvalidArgument`, :class:`Unauthenticated`, :class:`NotFound` and its
  subclasses, :class:`TemplateExists`, :class:`VolumeExists`, :class:`VolumeInUse`,
  :class:`SandboxNotRunning`, :class:`PathNotAllowed`,
  :class:`NetworkNotAllowed`, :class:`PackagesNotAllowed`, :class:`SecretsPresent`,
  :class:`GuestPermissionDenied`;
* limits: :class:`ResourceExhausted` (:class:`CapacityExhausted`, :class:`QuotaExceeded`,
  :class:`FileTooLarge`, :class:`DiskQuotaExceeded`);
* the code you ran or the sandbox it ran in: :class:`StartFailed`, :class:`ExecTimeout`,
  :class:`SandboxDead` (:class:`GuestCrashed`, :class:`OomKilled`, :class:`SeccompViolation`);
* the platform: :class:`Unavailable`, :class:`InternalError`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import grpc

__all__ = [
    "AirlockError",
    "InvalidArgument",
    "Unauthenticated",
    "NotFound",
    "SandboxNotFound",
    "ExecutionNotFound",
    "TemplateNotFound",
    "FileNotFound",
    "TemplateExists",
    "VolumeNotFound",
    "VolumeExists",
    "VolumeInUse",
    "SandboxNotRunning",
    "ResourceExhausted",
    "CapacityExhausted",
    "QuotaExceeded",
    "FileTooLarge",
    "DiskQuotaExceeded",
    "PathNotAllowed",
    "ExportDenied",
    "NetworkNotAllowed",
    "PackagesNotAllowed",
    "RootNotAllowed",
    "ImageRefused",
    "RegistryUnavailable",
    "BuildStepFailed",
    "TemplateInUse",
    "TemplateOutdated",
    "NotPermitted",
    "SecretsPresent",
    "GuestPermissionDenied",
    "StartFailed",
    "ExecTimeout",
    "SandboxDead",
    "GuestCrashed",
    "OomKilled",
    "SeccompViolation",
    "Unavailable",
    "InterpreterUnavailable",
    "NodeLost",
    "ClusterUnavailable",
    "InternalError",
]


class AirlockError(Exception):
    """A failed Airlock call.

    Attributes:
        reason: the reason code (``"SANDBOX_NOT_FOUND"``, ``"CAPACITY_EXHAUSTED"``, ...).
        message: the daemon's sentence.
        metadata: the details of the ``ErrorInfo`` (for example ``limit`` and ``current``).
        code: the gRPC status code, if the error came from a call.
        result: for errors of an execution (:class:`ExecTimeout`, :class:`OomKilled`, ...), the
            :class:`~airlock.ExecResult` with the output it produced before it ended.
    """

    reason_codes: tuple = ()

    def __init__(
        self,
        message: str,
        reason: str = "",
        metadata: Optional[Dict[str, str]] = None,
        code: Optional[grpc.StatusCode] = None,
        result: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.metadata: Dict[str, str] = dict(metadata or {})
        self.code = code
        self.result = result

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}" if self.reason else self.message


class InvalidArgument(AirlockError):
    """The request is malformed (a bad name, id, path, shape or limit)."""

    reason_codes = ("INVALID_ARGUMENT",)


class Unauthenticated(AirlockError):
    """No token, or a token the daemon does not know."""

    reason_codes = ("UNAUTHENTICATED",)


class NotFound(AirlockError):
    """Something the call names does not exist (for this tenant)."""


class SandboxNotFound(NotFound):
    reason_codes = ("SANDBOX_NOT_FOUND",)


class ExecutionNotFound(NotFound):
    reason_codes = ("EXECUTION_NOT_FOUND",)


class TemplateNotFound(NotFound):
    reason_codes = ("TEMPLATE_NOT_FOUND",)


class FileNotFound(NotFound):
    """A file or directory the call names does not exist in the sandbox."""

    reason_codes = ("FILE_NOT_FOUND",)


class TemplateExists(AirlockError):
    """A template of that name exists; templates are immutable."""

    reason_codes = ("TEMPLATE_EXISTS",)


class VolumeNotFound(NotFound):
    reason_codes = ("VOLUME_NOT_FOUND",)


class VolumeExists(AirlockError):
    """A volume of that name exists."""

    reason_codes = ("VOLUME_EXISTS",)


class VolumeInUse(AirlockError):
    """The volume is mounted where this use cannot share it (one read-write user, or any
    number of read-only ones; a mounted volume is not deleted). ``metadata["sandbox_id"]``
    names a sandbox that has it."""

    reason_codes = ("VOLUME_IN_USE",)


class SandboxNotRunning(AirlockError):
    """The sandbox is paused, dead or destroyed."""

    reason_codes = ("SANDBOX_NOT_RUNNING",)


class ResourceExhausted(AirlockError):
    """A limit was reached; ``metadata`` has ``limit`` and ``current`` where they apply."""

    @property
    def limit(self) -> Optional[int]:
        return _int(self.metadata.get("limit"))

    @property
    def current(self) -> Optional[int]:
        return _int(self.metadata.get("current"))


class CapacityExhausted(ResourceExhausted):
    """The host is full (sandboxes or committed memory)."""

    reason_codes = ("CAPACITY_EXHAUSTED",)


class QuotaExceeded(ResourceExhausted):
    """The tenant's quota is used up."""

    reason_codes = ("QUOTA_EXCEEDED",)


class FileTooLarge(ResourceExhausted):
    """A file is over the daemon's size limit."""

    reason_codes = ("FILE_TOO_LARGE",)


class DiskQuotaExceeded(ResourceExhausted):
    """The sandbox's writable space (``disk_mib``) is full."""

    reason_codes = ("DISK_QUOTA_EXCEEDED",)


class PathNotAllowed(AirlockError):
    """The sandbox's file policy forbids the path."""

    reason_codes = ("PATH_NOT_ALLOWED",)


class ExportDenied(AirlockError):
    """The sandbox's export policy refuses the read: a denied pattern, or the per-file or
    per-sandbox cap; ``metadata["rule"]`` says which."""

    reason_codes = ("EXPORT_DENIED",)


class NetworkNotAllowed(AirlockError):
    """A network policy asks for more than the operator allows the tenant (its egress
    ceiling); ``rule`` names the rule that goes beyond it."""

    reason_codes = ("NETWORK_NOT_ALLOWED",)

    @property
    def rule(self) -> str:
        return self.metadata.get("rule", "")


class PackagesNotAllowed(AirlockError):
    """A package policy asks for more than the operator allows the tenant (its package
    ceiling): a registry the ceiling does not allow; ``tenant`` names the tenant."""

    reason_codes = ("PACKAGES_NOT_ALLOWED",)

    @property
    def tenant(self) -> str:
        return self.metadata.get("tenant", "")


class SecretsPresent(AirlockError):
    """A snapshot of a sandbox that holds secrets (remove them first:
    :meth:`~airlock.Sandbox.remove_secrets`), or whose guest was given secret values (variables
    or files), which its memory, and so the template, may keep. ``metadata["sandbox_id"]``
    names it."""

    reason_codes = ("SECRETS_PRESENT",)


class RootNotAllowed(AirlockError):
    """The sandbox was created with ``no_root``, and the call asked for root (an execution or
    file call as ``"root"``)."""

    reason_codes = ("ROOT_NOT_ALLOWED",)


class ImageRefused(InvalidArgument):
    """An OCI image (``templates.create(oci_image=...)``) cannot become a template: a hostile
    or malformed entry, a wrong digest, a cap exceeded, another platform.
    ``metadata["image"]`` names it."""

    reason_codes = ("IMAGE_REFUSED",)


class TemplateInUse(AirlockError):
    """``templates.delete`` of a version live sandboxes run from. ``metadata["sandbox_id"]``
    names some of them, ``metadata["count"]`` says how many."""

    reason_codes = ("TEMPLATE_IN_USE",)


class TemplateOutdated(AirlockError):
    """The template was made by a VMM or guest agent this daemon cannot restore; rebuild it
    (``templates.rebuild``)."""

    reason_codes = ("TEMPLATE_OUTDATED",)


class NotPermitted(AirlockError):
    """The token lacks the right the call needs (a tenant's run-only token may not make or
    delete templates)."""

    reason_codes = ("NOT_PERMITTED",)


class BuildStepFailed(AirlockError):
    """A Dockerfile build's step failed (``templates.build``): its command exited non-zero or
    could not start. ``metadata["line"]`` is its line; the message has its last output."""

    reason_codes = ("BUILD_STEP_FAILED",)


class GuestPermissionDenied(AirlockError):
    """The guest account the call acted as (``user``) may not touch the path."""

    reason_codes = ("GUEST_PERMISSION_DENIED",)


class StartFailed(AirlockError):
    """The guest could not start the command: no such program, working directory or account,
    or the account (``user``) may not run it there."""

    reason_codes = ("START_FAILED",)


class ExecTimeout(AirlockError):
    """An execution ran past its timeout and was ended by the daemon (``result`` has its output)."""

    reason_codes = ("EXEC_TIMEOUT",)


class SandboxDead(AirlockError):
    """The sandbox's VM ended on its own; the sandbox is gone."""

    reason_codes = ("SANDBOX_DEAD",)


class GuestCrashed(SandboxDead):
    """The guest kernel panicked or the VM failed."""

    reason_codes = ("GUEST_CRASHED",)


class OomKilled(SandboxDead):
    """Out of memory: the execution (or the whole sandbox) was killed."""

    reason_codes = ("OOM_KILLED",)


class SeccompViolation(SandboxDead):
    """The sandbox's VMM made a system call outside its seccomp filter and was ended: the host
    stopped what may have been an attack on it."""

    reason_codes = ("SECCOMP_VIOLATION",)


class Unavailable(AirlockError):
    """The daemon or the guest agent cannot be reached."""

    reason_codes = ("AGENT_UNAVAILABLE",)


class InterpreterUnavailable(Unavailable):
    """The sandbox's code interpreter did not answer (a template without one, or it is
    restarting): ``run_code`` and the code contexts need a code-interpreter template."""

    reason_codes = ("INTERPRETER_UNAVAILABLE",)


class RegistryUnavailable(Unavailable):
    """An image's registry did not answer as it should: unreachable, timed out, or it refused
    the credentials. ``metadata["registry"]`` names it."""

    reason_codes = ("REGISTRY_UNAVAILABLE",)


class NodeLost(Unavailable):
    """Cluster mode: the node that ran the sandbox (or the execution) left the cluster; the
    sandbox is reported dead with end reason ``NODE_LOST``."""

    reason_codes = ("NODE_LOST",)


class ClusterUnavailable(Unavailable):
    """Cluster mode: the cluster's store (etcd) could not be reached; try again."""

    reason_codes = ("CLUSTER_UNAVAILABLE",)


class InternalError(AirlockError):
    """A fault of the platform."""

    reason_codes = ("INTERNAL",)


_BY_REASON = {
    code: cls
    for cls in (
        InvalidArgument,
        Unauthenticated,
        SandboxNotFound,
        ExecutionNotFound,
        TemplateNotFound,
        FileNotFound,
        TemplateExists,
        VolumeNotFound,
        VolumeExists,
        VolumeInUse,
        SandboxNotRunning,
        CapacityExhausted,
        QuotaExceeded,
        FileTooLarge,
        DiskQuotaExceeded,
        PathNotAllowed,
        ExportDenied,
        NetworkNotAllowed,
        PackagesNotAllowed,
        RootNotAllowed,
        ImageRefused,
        RegistryUnavailable,
        BuildStepFailed,
        TemplateInUse,
        TemplateOutdated,
        NotPermitted,
        SecretsPresent,
        GuestPermissionDenied,
        StartFailed,
        ExecTimeout,
        SandboxDead,
        GuestCrashed,
        OomKilled,
        SeccompViolation,
        Unavailable,
        InterpreterUnavailable,
        NodeLost,
        ClusterUnavailable,
        InternalError,
    )
    for code in cls.reason_codes
}

# Without a known reason code, the gRPC status decides.
_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PathNotAllowed,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: TemplateExists,
    grpc.StatusCode.FAILED_PRECONDITION: SandboxNotRunning,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}

STATUS_DETAILS_KEY = "grpc-status-details-bin"


def error_class(reason: str, code: Optional[grpc.StatusCode] = None) -> type:
    """The exception class of a reason code (or, failing that, of a gRPC status code)."""
    if reason in _BY_REASON:
        return _BY_REASON[reason]
    if code is not None and code in _BY_STATUS:
        return _BY_STATUS[code]
    return InternalError if code is not None else AirlockError


def from_rpc_error(err: grpc.RpcError) -> AirlockError:
    """Turns a failed call (sync or asyncio) into the matching :class:`AirlockError`."""
    code = err.code() if hasattr(err, "code") else None
    message = err.details() if hasattr(err, "details") else str(err)
    reason, metadata = "", {}
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == STATUS_DETAILS_KEY:
            reason, metadata = _error_info(value)
    if not reason and code == grpc.StatusCode.UNAVAILABLE and not trailers:
        message = f"cannot reach airlockd: {message}"
    cls = error_class(reason, code)
    return cls(message or "", reason=reason, metadata=metadata, code=code)


def _error_info(blob: bytes):
    from google.rpc import error_details_pb2, status_pb2

    status = status_pb2.Status()
    try:
        status.ParseFromString(blob)
    except Exception:  # a malformed detail: fall back to the status code
        return "", {}
    for any_detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if any_detail.Unpack(info):
            return info.reason, dict(info.metadata)
    return "", {}


def _int(v: Optional[str]) -> Optional[int]:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None
