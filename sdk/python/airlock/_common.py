"""What the sync and the asyncio client share: addresses, requests, results."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import errors
from ._proto import airlock_pb2 as pb

#: Where ``airlockd`` listens by default.
DEFAULT_SOCKET = "/run/airlock/airlockd.sock"
#: Environment variable with the daemon's address (overrides the default socket).
ADDR_ENV = "AIRLOCK_ADDR"
#: Environment variable with the tenant token.
TOKEN_ENV = "AIRLOCK_TOKEN"

SERVICE = "airlock.v1.Airlock"

# Calls that are safe to repeat are retried by gRPC itself when the daemon is briefly
# unreachable (UNAVAILABLE before an answer). Creates, execs and writes are never retried.
_IDEMPOTENT = [
    "GetSandbox",
    "ListSandboxes",
    "ListTemplates",
    "GetExecution",
    "DestroySandbox",
    "ListFiles",
    "ReadFile",
    "StreamExecution",
    "ListAuditEvents",
]
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE, "method": m} for m in _IDEMPOTENT],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

CHANNEL_OPTIONS = [
    ("grpc.service_config", _SERVICE_CONFIG),
    ("grpc.enable_retries", 1),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]

#: Chunk size of file uploads.
CHUNK = 256 << 10


def channel_options(target: str) -> list:
    """Options of a channel to ``target``. On a Unix socket gRPC would send the percent-encoded
    socket path as the HTTP/2 ``:authority``, which the daemon's HTTP/2 stack refuses as
    malformed; a plain name is sent instead."""
    opts = list(CHANNEL_OPTIONS)
    if target.startswith("unix:"):
        opts.append(("grpc.default_authority", "localhost"))
    return opts


def resolve_address(address: Optional[str]) -> str:
    """The gRPC target of ``address``, ``$AIRLOCK_ADDR`` or the default socket.

    Accepted forms: ``unix:///PATH``, ``unix:PATH``, an absolute path, ``https://HOST:PORT``
    (TLS, see ``CA_CERT_ENV``), ``tcp://HOST:PORT``, ``http://HOST:PORT`` and ``HOST:PORT``.
    """
    a = address or os.environ.get(ADDR_ENV) or f"unix://{DEFAULT_SOCKET}"
    if a.startswith("unix://"):
        return "unix://" + a[len("unix://") :]
    if a.startswith("unix:"):
        return "unix://" + os.path.abspath(a[len("unix:") :])
    if a.startswith("/"):
        return "unix://" + a
    for scheme in ("tcp://", "http://", "https://"):
        if a.startswith(scheme):
            return a[len(scheme) :].rstrip("/")
    return a


#: Environment variables of a TLS client (``https://HOST:PORT``): the CA that signed the
#: daemon's certificate, and for mutual TLS the client's certificate and key (PEM files).
CA_CERT_ENV = "AIRLOCK_CA_CERT"
CLIENT_CERT_ENV = "AIRLOCK_CLIENT_CERT"
CLIENT_KEY_ENV = "AIRLOCK_CLIENT_KEY"


def is_tls(address: Optional[str]) -> bool:
    """Whether ``address`` (or ``$AIRLOCK_ADDR``) asks for TLS (``https://``)."""
    return (address or os.environ.get(ADDR_ENV) or "").startswith("https://")


def tls_credentials(grpc_module):
    """Channel credentials from the TLS environment variables."""

    def read(var: str):
        path = os.environ.get(var)
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc_module.ssl_channel_credentials(
        root_certificates=read(CA_CERT_ENV),
        private_key=read(CLIENT_KEY_ENV),
        certificate_chain=read(CLIENT_CERT_ENV),
    )


def call_metadata(token: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    t = token if token is not None else os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {t}"),) if t else ()


# ---- results ----


@dataclass(frozen=True)
class Volume:
    """A volume: an ext4 file system of the caller's that outlives sandboxes."""

    name: str
    size_mib: int
    created_unix_ms: int
    used_bytes: int
    #: Live sandboxes that have it mounted.
    attached_to: List[str]

    @classmethod
    def from_pb(cls, v: "pb.Volume") -> "Volume":
        return cls(
            name=v.name,
            size_mib=v.size_mib,
            created_unix_ms=v.created_unix_ms,
            used_bytes=v.used_bytes,
            attached_to=list(v.attached_to),
        )


@dataclass(frozen=True)
class ExportPolicy:
    """What file reads may take out of a sandbox, narrowing the operator's ceiling: the largest
    file, the bytes in all (0: the ceiling) and path patterns refused besides the operator's
    (``"*.sqlite"``; one with ``/`` matches the whole path)."""

    max_file_bytes: int = 0
    max_total_bytes: int = 0
    denied: Sequence[str] = ()


@dataclass(frozen=True)
class Mount:
    """A volume mounted in a sandbox: ``Mount("work", "/data")``, read-only with
    ``read_only=True``."""

    volume: str
    path: str
    read_only: bool = False


#: What ``volumes=`` accepts: a list of :class:`Mount`, or ``{path: volume name}`` (read-write).
VolumesSpec = Optional[Union[Sequence[Mount], Mapping[str, str]]]


def volume_attachments(volumes: VolumesSpec) -> List["pb.VolumeAttachment"]:
    """The ``VolumeAttachment`` list of a ``volumes=`` argument."""
    if volumes is None:
        return []
    if isinstance(volumes, Mapping):
        volumes = [Mount(name, path) for path, name in volumes.items()]
    out = []
    for m in volumes:
        if not isinstance(m, Mount):
            raise TypeError(f"volumes: expected Mount or {{path: name}}, not {type(m).__name__}")
        out.append(pb.VolumeAttachment(name=m.volume, mount_path=m.path, read_only=m.read_only))
    return out


@dataclass(frozen=True)
class Template:
    """A template: a snapshot that sandboxes are restored from."""

    name: str
    id: str
    tenant: str
    vcpus: int
    memory_mib: int
    kernel_version: str
    rootfs_version: str
    source_sandbox_id: str
    created_unix_ms: int
    memory_file_bytes: int
    #: What it was made from: ``oci:REFERENCE@sha256:DIGEST`` (an OCI image),
    #: ``dockerfile:sha256:HEX`` (a Dockerfile and its context), ``image:NAME@VERSION`` (a
    #: registered image); a snapshot's is its source template's.
    source: str = ""
    #: An imported image's defaults: ``env`` (KEY=VALUE list), ``working_dir``, ``user``,
    #: ``entrypoint``, ``cmd``; ``None`` for other templates.
    image_defaults: Optional[Dict[str, Any]] = None
    #: The version's tag (``latest`` unless its creator named one): sandboxes name it
    #: ``name:tag``, ``name`` alone being ``latest`` (else the newest version).
    tag: str = "latest"
    #: Bytes its files take on the daemon's disk.
    size_bytes: int = 0
    #: Live sandboxes (running or paused) restored from it, when listed.
    live_sandboxes: int = 0

    @property
    def reference(self) -> str:
        """How sandboxes name this version: ``name`` for ``latest``, else ``name:tag``."""
        return self.name if self.tag == "latest" else f"{self.name}:{self.tag}"

    @classmethod
    def from_pb(cls, t: "pb.Template") -> "Template":
        d = t.image_defaults if t.HasField("image_defaults") else None
        return cls(
            name=t.name,
            id=t.id,
            tenant=t.tenant,
            vcpus=t.vcpus,
            memory_mib=t.memory_mib,
            kernel_version=t.kernel_version,
            rootfs_version=t.rootfs_version,
            source_sandbox_id=t.source_sandbox_id,
            created_unix_ms=t.created_unix_ms,
            memory_file_bytes=t.memory_file_bytes,
            source=t.source,
            tag=t.tag or "latest",
            size_bytes=t.size_bytes,
            live_sandboxes=t.live_sandboxes,
            image_defaults=None
            if d is None
            else {
                "env": list(d.env),
                "working_dir": d.working_dir,
                "user": d.user,
                "entrypoint": list(d.entrypoint),
                "cmd": list(d.cmd),
            },
        )


#: The largest build context the daemon takes (an uncompressed tar).
MAX_CONTEXT_BYTES = 3 << 20


def context_tar(directory: Union[str, "os.PathLike[str]"]) -> bytes:
    """``directory`` as an uncompressed tar (names relative to it, sorted; owners and times
    zeroed): regular files and directories only."""
    import io
    import tarfile

    root = os.fspath(directory)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            entries = [(d, True) for d in dirnames] + [(f, False) for f in sorted(filenames)]
            for name, is_dir in sorted(entries):
                full = os.path.join(dirpath, name)
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                if os.path.islink(full) or not (os.path.isdir(full) or os.path.isfile(full)):
                    raise ValueError(f"{full}: the build context holds regular files and directories only")
                info = tar.gettarinfo(full, arcname=rel)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if is_dir:
                    tar.addfile(info)
                else:
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
    data = buf.getvalue()
    if len(data) > MAX_CONTEXT_BYTES:
        raise ValueError(f"the build context is {len(data)} bytes, more than {MAX_CONTEXT_BYTES}")
    return data


def build_request(
    name: str,
    dockerfile: str,
    *,
    context: Union[bytes, str, "os.PathLike[str]", None] = None,
    build_args: Optional[Mapping[str, str]] = None,
    network: "NetworkSpec" = None,
    start: str = "",
    ready_command: str = "",
    ready_url: str = "",
    ready_timeout: int = 0,
    no_cache: bool = False,
    registry_auth: Optional[Tuple[str, str]] = None,
    replace: bool = False,
) -> "pb.BuildTemplateRequest":
    """The BuildTemplate request of ``templates.build`` (sync and asyncio alike): ``context``
    is a directory (sent as a tar) or the tar's bytes."""
    if context is None:
        ctx = b""
    elif isinstance(context, bytes):
        ctx = context
    else:
        ctx = context_tar(context)
    user, password = registry_auth if registry_auth is not None else ("", "")
    req = pb.BuildTemplateRequest(
        name=name,
        dockerfile=dockerfile,
        context=ctx,
        build_args=dict(build_args or {}),
        start=start,
        ready_command=ready_command,
        ready_url=ready_url,
        ready_timeout_s=ready_timeout,
        no_cache=no_cache,
        registry_username=user,
        registry_password=password,
        replace=replace,
    )
    policy = network_policy(network)
    if policy is not None:
        req.network.CopyFrom(policy)
    return req


def template_request(
    name: str,
    *,
    image: str = "",
    kernel_path: str = "",
    rootfs_path: str = "",
    vcpus: int = 0,
    memory_mib: int = 0,
    warmup: str = "",
    no_warmup: bool = False,
    oci_image: str = "",
    registry_auth: Optional[Tuple[str, str]] = None,
    replace: bool = False,
) -> "pb.CreateTemplateRequest":
    """The CreateTemplate request of ``templates.create`` (sync and asyncio alike)."""
    req = pb.CreateTemplateRequest(
        name=name,
        replace=replace,
        image=image,
        kernel_path=kernel_path,
        rootfs_path=rootfs_path,
        vcpus=vcpus,
        memory_mib=memory_mib,
        warmup=warmup,
        no_warmup=no_warmup,
    )
    if oci_image:
        user, password = registry_auth if registry_auth is not None else ("", "")
        req.oci.CopyFrom(pb.OciImage(reference=oci_image, username=user, password=password))
    elif registry_auth is not None:
        raise ValueError("registry_auth goes with oci_image")
    return req


def rebuild_request(
    name: str, tag: str = "", registry_auth: Optional[Tuple[str, str]] = None
) -> "pb.RebuildTemplateRequest":
    """The RebuildTemplate request of ``templates.rebuild`` (sync and asyncio alike)."""
    user, password = registry_auth if registry_auth is not None else ("", "")
    return pb.RebuildTemplateRequest(
        name=name, tag=tag, registry_username=user, registry_password=password
    )


@dataclass(frozen=True)
class TemplateLog:
    """The kept log of a template's build (``truncated``: its beginning was dropped; the log
    keeps its last MiB)."""

    log: str
    truncated: bool


@dataclass(frozen=True)
class TemplateProgress:
    """One progress event of a template build."""

    phase: str
    elapsed_ms: int
    message: str


@dataclass(frozen=True)
class Usage:
    """What the caller's tenant holds now against its quota (0: no limit beyond the host's),
    and how long ended sandboxes' records and output are kept."""

    tenant: str
    live_sandboxes: int
    max_sandboxes: int
    memory_mib: int
    max_memory_mib: int
    templates: int
    max_templates: int
    template_mib: int
    max_template_mib: int
    output_bytes: int
    max_output_mib: int
    sandbox_records: int
    execution_records: int
    record_retention_s: int
    output_retention_s: int

    @classmethod
    def from_pb(cls, u) -> "Usage":
        return cls(**{f: getattr(u, f) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Node:
    """A node of the daemon's cluster (outside cluster mode: the daemon itself, unnamed)."""

    name: str
    tag: str
    address: str
    version: str
    sandboxes: int
    max_sandboxes: int
    committed_mib: int
    capacity_mib: int
    templates: List[str]
    started_unix_ms: int

    @classmethod
    def from_pb(cls, n) -> "Node":
        fields = {f: getattr(n, f) for f in cls.__dataclass_fields__}
        fields["templates"] = list(n.templates)
        return cls(**fields)


@dataclass(frozen=True)
class FileEntry:
    name: str
    is_dir: bool
    size: int
    mode: int
    is_symlink: bool = False
    mtime_unix_ms: int = 0
    uid: int = 0
    gid: int = 0

    @classmethod
    def from_pb(cls, e: "pb.FileEntry") -> "FileEntry":
        return cls(e.name, e.is_dir, e.size, e.mode, e.is_symlink, e.mtime_unix_ms, e.uid, e.gid)


def list_request(sandbox_id: str, path: str, user: Optional[str], recursive: bool, max_entries: int):
    return pb.ListFilesRequest(
        sandbox_id=sandbox_id, path=path, user=user or "", recursive=recursive, max_entries=max_entries
    )


@dataclass(frozen=True)
class OutputChunk:
    """Output of a running execution, as it arrives."""

    stream: str  # "stdout" or "stderr"
    offset: int
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


@dataclass
class ExecResult:
    """What an execution left: its record and its output."""

    execution_id: str
    state: str  # "exited", "timed_out", "killed", "oom_killed", "failed", "running"
    exit_code: int
    signal: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    error_reason: str = ""
    error_message: str = ""
    started_unix_ms: int = 0
    ended_unix_ms: int = 0
    cpu_user_us: int = 0
    cpu_system_us: int = 0
    peak_memory_bytes: int = 0
    output_truncated: bool = False
    command: List[str] = field(default_factory=list)
    #: The names of the secrets it was given (the sandbox's and its own; never their values).
    secret_names: List[str] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        """It exited with status 0."""
        return self.state == "exited" and self.exit_code == 0

    @property
    def duration_ms(self) -> int:
        """Wall-clock time from start to end, as the daemon measured it."""
        return max(0, self.ended_unix_ms - self.started_unix_ms) if self.ended_unix_ms else 0

    @classmethod
    def from_pb(cls, e: "pb.Execution", stdout: bytes = b"", stderr: bytes = b"") -> "ExecResult":
        return cls(
            execution_id=e.id,
            state=execution_state(e.state),
            exit_code=e.exit_code,
            signal=e.signal,
            stdout_bytes=stdout,
            stderr_bytes=stderr,
            error_reason=e.error_reason,
            error_message=e.error_message,
            started_unix_ms=e.started_unix_ms,
            ended_unix_ms=e.ended_unix_ms,
            cpu_user_us=e.cpu_user_us,
            cpu_system_us=e.cpu_system_us,
            peak_memory_bytes=e.peak_memory_bytes,
            output_truncated=e.output_truncated,
            command=list(e.command),
            secret_names=list(e.secret_names),
        )

    def raise_for_platform(self) -> "ExecResult":
        """Raises the matching error when the execution did not end on its own or by a kill
        (timeout, out of memory, a lost sandbox); returns itself otherwise. A non-zero exit code
        is the program's business and raises nothing."""
        if self.state in ("exited", "killed", "running"):
            return self
        reason = self.error_reason or {
            "timed_out": "EXEC_TIMEOUT",
            "oom_killed": "OOM_KILLED",
        }.get(self.state, "SANDBOX_DEAD")
        cls = errors.error_class(reason)
        raise cls(self.error_message or self.state, reason=reason, result=self)


# ---- networking ----


@dataclass(frozen=True)
class Rule:
    """One egress rule: a ``domain`` (``api.example.com``, or ``*.example.com`` for every name
    below it) or a ``cidr`` (``203.0.113.0/24``; an address alone is one host), and the
    destination ``ports`` it allows (empty: every port)."""

    domain: str = ""
    cidr: str = ""
    ports: Sequence[int] = ()

    def __post_init__(self) -> None:
        if bool(self.domain) == bool(self.cidr):
            raise errors.InvalidArgument("a rule needs a domain or a cidr (one of them)", "INVALID_ARGUMENT")
        object.__setattr__(self, "ports", _ports(self.ports))

    def to_pb(self) -> "pb.EgressRule":
        r = pb.EgressRule(ports=list(self.ports))
        if self.domain:
            r.domain = self.domain
        else:
            r.cidr = self.cidr
        return r

    @classmethod
    def from_pb(cls, r: "pb.EgressRule") -> "Rule":
        which = r.WhichOneof("target")
        return cls(domain=r.domain if which == "domain" else "", cidr=r.cidr if which == "cidr" else "", ports=tuple(r.ports))

    def __str__(self) -> str:
        target = self.domain or (f"[{self.cidr}]" if ":" in self.cidr and self.ports else self.cidr)
        return f"{target}:{','.join(map(str, self.ports))}" if self.ports else target


@dataclass(frozen=True, eq=False)
class Network:
    """A sandbox's egress policy: what it may reach over its network.

    * ``Network()``: nothing (deny-all), as when no policy is given at all;
    * ``Network(allow_internet=True)``: every public address on every port;
    * ``Network(domains=["api.example.com", "*.example.com"], cidrs=["203.0.113.0/24"],
      ports=[443])``: one rule per domain and per CIDR, each allowing ``ports`` (empty: every
      port); ``rules`` adds :class:`Rule` objects (or dicts of their fields) with ports of their
      own.

    Private, loopback, link-local and other internal ranges stay closed unless a CIDR rule
    inside them opens them (never a domain or ``allow_internet``), and only as far as the
    operator's ceiling for the tenant allows (beyond it: :class:`~airlock.NetworkNotAllowed`).
    Two policies are equal when they allow the same rules in the same order.
    """

    allow_internet: bool = False
    domains: Sequence[str] = ()
    cidrs: Sequence[str] = ()
    ports: Sequence[int] = ()
    rules: Sequence[Union[Rule, Mapping[str, Any]]] = ()

    def __post_init__(self) -> None:
        normal = {
            "allow_internet": bool(self.allow_internet),
            "domains": _strings("domains", self.domains),
            "cidrs": _strings("cidrs", self.cidrs),
            "ports": _ports(self.ports),
            "rules": tuple(r if isinstance(r, Rule) else Rule(**r) for r in self.rules),
        }
        for name, value in normal.items():
            object.__setattr__(self, name, value)  # frozen: only here
        if self.ports and not (self.domains or self.cidrs):
            raise errors.InvalidArgument("ports apply to domains and cidrs: give some", "INVALID_ARGUMENT")
        if self.allow_internet and self.all_rules():
            raise errors.InvalidArgument(
                "allow_internet already allows every public address: give rules or allow_internet, not both",
                "INVALID_ARGUMENT",
            )

    @property
    def deny_all(self) -> bool:
        """Nothing is allowed."""
        return not self.allow_internet and not self.all_rules()

    def all_rules(self) -> List[Rule]:
        """Every rule: one per domain and per CIDR (with ``ports``), then ``rules``."""
        return (
            [Rule(domain=d, ports=self.ports) for d in self.domains]
            + [Rule(cidr=c, ports=self.ports) for c in self.cidrs]
            + list(self.rules)
        )

    def to_pb(self) -> "pb.NetworkPolicy":
        return pb.NetworkPolicy(allow_internet=self.allow_internet, allow=[r.to_pb() for r in self.all_rules()])

    @classmethod
    def from_pb(cls, p: Optional["pb.NetworkPolicy"]) -> "Network":
        if p is None:
            return cls()
        return cls(allow_internet=p.allow_internet, rules=[Rule.from_pb(r) for r in p.allow])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Network):
            return NotImplemented
        return (self.allow_internet, self.all_rules()) == (other.allow_internet, other.all_rules())

    def __hash__(self) -> int:
        return hash((self.allow_internet, tuple(self.all_rules())))

    def __str__(self) -> str:
        """``deny-all``, ``allow-internet`` or the rules (``*.example.com:443 203.0.113.0/24``)."""
        if self.allow_internet:
            return "allow-internet"
        return " ".join(map(str, self.all_rules())) or "deny-all"


#: What ``network=`` accepts: ``None`` (deny-all), ``"internet"``, a :class:`Network`, or a
#: list of :class:`Rule` (or of dicts such as ``{"domain": "*.example.com", "ports": [443]}``).
NetworkSpec = Union[None, str, Network, Sequence[Union[Rule, Mapping[str, Any]]]]


def network_policy(network: NetworkSpec) -> Optional["pb.NetworkPolicy"]:
    """The ``NetworkPolicy`` of a ``network=`` argument (``None`` for ``None``: deny-all)."""
    if network is None:
        return None
    if isinstance(network, pb.NetworkPolicy):
        return network
    if isinstance(network, str):
        if network == "internet":
            return Network(allow_internet=True).to_pb()
        raise errors.InvalidArgument(
            f"network={network!r}: expected None, \"internet\", a Network or a list of rules "
            '(a domain goes in Network(domains=[...]))',
            "INVALID_ARGUMENT",
        )
    if isinstance(network, Network):
        return network.to_pb()
    if isinstance(network, (list, tuple)):
        return Network(rules=network).to_pb()
    raise errors.InvalidArgument(
        f"network: expected None, \"internet\", a Network or a list of rules, not {type(network).__name__}",
        "INVALID_ARGUMENT",
    )


def _strings(what: str, values: Sequence[str]) -> Tuple[str, ...]:
    if isinstance(values, str):
        raise errors.InvalidArgument(f"{what} must be a list of strings, not a string", "INVALID_ARGUMENT")
    out = tuple(values)
    if not all(isinstance(v, str) and v for v in out):
        raise errors.InvalidArgument(f"{what} must be non-empty strings", "INVALID_ARGUMENT")
    return out


def _ports(ports: Iterable[int]) -> Tuple[int, ...]:
    if isinstance(ports, int):
        ports = (ports,)
    out = tuple(ports)
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in out):
        raise errors.InvalidArgument(f"ports must be numbers from 1 to 65535: {out!r}", "INVALID_ARGUMENT")
    return out


@dataclass(frozen=True)
class EgressEvent:
    """One entry of a sandbox's egress log: a DNS query, a TCP connection attempt, or a
    connection to one of its exposed ports (``kind == "expose"``, ``address``: the caller's)."""

    seq: int  # 1, 2, ... per sandbox
    time_unix_ms: int
    kind: str  # "dns", "tcp" or "expose"
    name: str  # the name asked for (DNS) or stated by the connection (TLS SNI, HTTP Host)
    address: str  # where it connected (TCP), or the caller's address (expose)
    port: int
    bytes_out: int  # TCP: bytes the guest sent and received through the proxy
    bytes_in: int
    duration_ms: float
    allowed: bool
    verdict: str  # the rule that allowed it, or why it was denied
    query_type: str  # DNS: A, AAAA, ...
    answers: Tuple[str, ...] = ()  # DNS: the addresses the answer held

    @classmethod
    def from_pb(cls, e: "pb.EgressEvent") -> "EgressEvent":
        kind = {
            pb.EGRESS_KIND_DNS: "dns",
            pb.EGRESS_KIND_TCP: "tcp",
            pb.EGRESS_KIND_EXPOSE: "expose",
        }.get(e.kind, "unknown")
        return cls(
            seq=e.seq,
            time_unix_ms=e.time_unix_ms,
            kind=kind,
            name=e.name,
            address=e.address,
            port=e.port,
            bytes_out=e.bytes_out,
            bytes_in=e.bytes_in,
            duration_ms=e.duration_ms,
            allowed=e.allowed,
            verdict=e.verdict,
            query_type=e.query_type,
            answers=tuple(e.answers),
        )


class SandboxLog(list):
    """A page of one of a sandbox's logs (a list of its events, oldest first), and
    ``dropped``: how many events the sandbox made beyond what the log keeps (counted, not
    stored). :class:`EgressLog` and :class:`InstallLog` are its two kinds."""

    #: The event class of the log.
    event: Any = None

    def __init__(self, events: Iterable[Any] = (), dropped: int = 0) -> None:
        super().__init__(events)
        self.dropped = dropped

    @classmethod
    def from_pb(cls, resp: Any) -> Any:
        return cls((cls.event.from_pb(e) for e in resp.events), resp.dropped)


def log_query(
    after_seq: int,
    limit: int,
    kinds: Optional[Sequence[str]],
    since: "TimeSpec",
    until: "TimeSpec",
) -> Dict[str, Any]:
    """The fields every log's request shares (the egress and install logs, the audit trail):
    the events after ``after_seq``, at most ``limit`` (0: the daemon's default), of ``kinds``
    (empty: all), at or after ``since`` and before ``until``."""
    if after_seq < 0 or limit < 0:
        raise errors.InvalidArgument("after_seq and limit cannot be negative", "INVALID_ARGUMENT")
    return dict(
        after_seq=after_seq,
        limit=limit,
        kinds=list(_strings("kinds", kinds or ())),
        since_unix_ms=_unix_ms("since", since),
        until_unix_ms=_unix_ms("until", until),
    )


class EgressLog(SandboxLog):
    """The events :meth:`~airlock.Sandbox.egress_log` returned (a list of
    :class:`EgressEvent`), and ``dropped``: how many events the sandbox made beyond what its log
    keeps (counted, not stored)."""

    event = EgressEvent


def egress_log_request(
    sandbox_id: str,
    after_seq: int,
    limit: int,
    kinds: Optional[Sequence[str]] = None,
    since: "TimeSpec" = None,
    until: "TimeSpec" = None,
) -> "pb.GetEgressLogRequest":
    return pb.GetEgressLogRequest(
        sandbox_id=sandbox_id, **log_query(after_seq, limit, kinds, since, until)
    )


# ---- packages ----


@dataclass(frozen=True)
class Packages:
    """A sandbox's package policy: what its pip and npm may install through the daemon's
    package proxy (the one path packages reach a sandbox by).

    * ``Packages()``: what the operator's ceiling for the tenant allows, as when no policy is
      given at all;
    * ``Packages(offline=True)``: no installs at all (every index page and file is refused);
    * ``Packages(registries=["pypi"], allow=["requests", "types-*"], deny=["evil-*"],
      max_download_bytes=50 << 20)``: only these registries (by the operator's names; empty:
      every registry the ceiling allows), only packages matching ``allow`` (empty: any),
      never those matching ``deny`` (it wins over ``allow``), and at most this many bytes of
      package files in all, cached ones included (0: the ceiling's cap).

    Patterns are package names (PEP 503-normalised for PyPI: ``Foo_Bar`` is ``foo-bar``) with
    ``*`` for any run of characters (``types-*``, ``@acme/*``). The ceiling narrows a policy,
    never widens it: its lists add to the policy's, offline if either is, the smaller cap; a
    registry the ceiling does not allow raises :class:`~airlock.PackagesNotAllowed`.
    :attr:`~airlock.Sandbox.packages` is the policy in force (the two combined).
    """

    registries: List[str] = field(default_factory=list)
    allow: List[str] = field(default_factory=list)
    deny: List[str] = field(default_factory=list)
    offline: bool = False
    max_download_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("registries", "allow", "deny"):
            object.__setattr__(self, name, list(_strings(name, getattr(self, name))))  # frozen: only here
        object.__setattr__(self, "offline", bool(self.offline))
        cap = self.max_download_bytes
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise errors.InvalidArgument(
                f"max_download_bytes must be a number of bytes (0: the ceiling's cap): {cap!r}", "INVALID_ARGUMENT"
            )

    def __hash__(self) -> int:
        return hash((tuple(self.registries), tuple(self.allow), tuple(self.deny), self.offline, self.max_download_bytes))

    def to_pb(self) -> "pb.PackagePolicy":
        return pb.PackagePolicy(
            registries=self.registries,
            allow=self.allow,
            deny=self.deny,
            offline=self.offline,
            max_download_bytes=self.max_download_bytes,
        )

    @classmethod
    def from_pb(cls, p: Optional["pb.PackagePolicy"]) -> "Packages":
        if p is None:
            return cls()
        return cls(
            registries=list(p.registries),
            allow=list(p.allow),
            deny=list(p.deny),
            offline=p.offline,
            max_download_bytes=p.max_download_bytes,
        )

    def __str__(self) -> str:
        """As the CLI shows it: ``offline``, what it sets of ``registries=pypi,npm``,
        ``allow=requests,types-*``, ``deny=evil-*`` and ``max-download=50MiB``, or ``any``."""
        if self.offline:
            return "offline"
        parts = [f"{k}={','.join(v)}" for k, v in (("registries", self.registries), ("allow", self.allow), ("deny", self.deny)) if v]
        cap = self.max_download_bytes
        if cap:
            parts.append(f"max-download={cap >> 20}MiB" if cap % (1 << 20) == 0 else f"max-download={cap}B")
        return " ".join(parts) or "any"


def package_policy(packages: "Optional[Packages]") -> Optional["pb.PackagePolicy"]:
    """The ``PackagePolicy`` of a ``packages=`` argument (``None`` for ``None``: the ceiling's)."""
    if packages is None:
        return None
    if isinstance(packages, pb.PackagePolicy):
        return packages
    if isinstance(packages, Packages):
        return packages.to_pb()
    raise errors.InvalidArgument(
        f"packages: expected None or a Packages, not {type(packages).__name__}", "INVALID_ARGUMENT"
    )


#: The lowercase names of ``InstallOutcome`` (as the CLI prints them).
_INSTALL_OUTCOMES = {
    pb.INSTALL_OUTCOME_CACHED: "cached",
    pb.INSTALL_OUTCOME_FETCHED: "fetched",
    pb.INSTALL_OUTCOME_DENIED: "denied",
    pb.INSTALL_OUTCOME_HASH_MISMATCH: "hash_mismatch",
    pb.INSTALL_OUTCOME_OVER_CAP: "over_cap",
    pb.INSTALL_OUTCOME_UPSTREAM_ERROR: "upstream_error",
    pb.INSTALL_OUTCOME_BAD_SIGNATURE: "bad_signature",
}


@dataclass(frozen=True)
class InstallEvent:
    """One entry of a sandbox's install log: a package file (or a refused index page) its pip
    or npm asked the daemon's package proxy for, and what came of it."""

    seq: int  # 1, 2, ... per sandbox
    time_unix_ms: int
    tenant: str
    sandbox_id: str
    registry: str  # the operator's name of the registry
    kind: str  # its kind: "pypi" or "npm"
    package: str  # the package's name, normalised
    version: str  # the version of the file ("" for a refused index page)
    file: str  # the file's name ("" for a refused index page)
    bytes: int  # the file's size and SHA-256 (hex), as served or as fetched
    sha256: str
    outcome: str  # "cached", "fetched", "denied", "hash_mismatch", "over_cap" or "upstream_error"
    message: str  # why, in a sentence (the rule that refused it, the digests, the cap)

    @classmethod
    def from_pb(cls, e: "pb.InstallEvent") -> "InstallEvent":
        return cls(
            seq=e.seq,
            time_unix_ms=e.time_unix_ms,
            tenant=e.tenant,
            sandbox_id=e.sandbox_id,
            registry=e.registry,
            kind=e.kind,
            package=e.package,
            version=e.version,
            file=e.file,
            bytes=e.bytes,
            sha256=e.sha256,
            outcome=_INSTALL_OUTCOMES.get(e.outcome, "unknown"),
            message=e.message,
        )


class InstallLog(SandboxLog):
    """The events :meth:`~airlock.Sandbox.install_log` returned (a list of
    :class:`InstallEvent`), and ``dropped``: how many events the sandbox made beyond what its
    log keeps (counted, not stored)."""

    event = InstallEvent


def install_log_request(
    sandbox_id: str,
    after_seq: int,
    limit: int,
    kinds: Optional[Sequence[str]] = None,
    since: "TimeSpec" = None,
    until: "TimeSpec" = None,
) -> "pb.GetInstallLogRequest":
    return pb.GetInstallLogRequest(
        sandbox_id=sandbox_id, **log_query(after_seq, limit, kinds, since, until)
    )


# ---- secrets ----

#: What the API calls a secret's name: a letter or ``_``, then up to 63 letters, digits, ``_``.
_SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}\Z")
_SECRET_DELIVERIES = ("env", "file", "broker")


@dataclass(frozen=True)
class Secret:
    """A secret for a sandbox (``secrets=`` of :meth:`~airlock.client.Sandboxes.create`) or
    for one execution (``secrets=`` of :meth:`~airlock.Sandbox.exec`): a name, a value, and
    the way in. Make one with a constructor of its delivery:

    * ``Secret.env("API_KEY", value)`` (or ``Secret("API_KEY", value)``): the environment
      variable ``API_KEY`` of the executions (``var=`` names another);
    * ``Secret.file("TOKEN", value, path="/home/user/.token")``: a file in the guest (default
      ``/run/secrets/NAME``), mode 0400, owned by ``user`` (default: the guest's ``user``);
    * ``Secret.broker("GH", value, hosts=["api.github.com"])``: never enters the guest; the
      sandbox's egress proxy adds the header ``header`` (default ``Authorization``) with
      ``format`` (default ``"Bearer {value}"``) to its HTTP requests to ``hosts`` (and to its
      HTTPS ones with ``https=True``).

    ``ttl``: seconds it lives (``None``: as long as the sandbox), then it is removed as by
    :meth:`~airlock.Sandbox.remove_secrets`. The daemon keeps values in memory only, and
    redacts them (and their base64, hex and URL-encoded forms) from every output, record and
    error as ``[REDACTED:NAME]``. The value never shows in ``repr`` or ``str``.
    """

    name: str
    value: str = field(repr=False)
    delivery: str = "env"  # "env", "file" or "broker"
    var: str = ""  # env: the variable ("": the name)
    path: str = ""  # file: absolute path in the guest ("": /run/secrets/NAME)
    user: str = ""  # file: the account that may read it ("": "user")
    hosts: Tuple[str, ...] = ()  # broker: host names, exact or "*.example.com"
    header: str = ""  # broker: "" is Authorization
    format: str = ""  # broker: "{value}" stands for the secret; "" is "Bearer {value}"
    https: bool = False  # broker: HTTPS too (the proxy terminates the guest's TLS)
    ttl: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _SECRET_NAME.match(self.name):
            raise errors.InvalidArgument(
                f"a secret's name is a letter or _ then up to 63 letters, digits or _: {self.name!r}",
                "INVALID_ARGUMENT",
            )
        if not isinstance(self.value, str):
            raise errors.InvalidArgument(
                f"secret {self.name}: the value must be a str, not {type(self.value).__name__}", "INVALID_ARGUMENT"
            )
        if self.delivery not in _SECRET_DELIVERIES:
            raise errors.InvalidArgument(
                f"secret {self.name}: delivery must be env, file or broker, not {self.delivery!r}", "INVALID_ARGUMENT"
            )
        for f in ("var", "path", "user", "header", "format"):
            if not isinstance(getattr(self, f), str):
                raise errors.InvalidArgument(f"secret {self.name}: {f} must be a string", "INVALID_ARGUMENT")
        object.__setattr__(self, "hosts", _strings(f"secret {self.name}: hosts", self.hosts))  # frozen: only here
        object.__setattr__(self, "https", bool(self.https))
        if self.delivery == "broker" and not self.hosts:
            raise errors.InvalidArgument(f"secret {self.name}: a broker secret needs hosts", "INVALID_ARGUMENT")
        if self.delivery != "broker" and (self.hosts or self.header or self.format or self.https):
            raise errors.InvalidArgument(
                f"secret {self.name}: hosts, header, format and https are for broker secrets", "INVALID_ARGUMENT"
            )
        if self.delivery != "file" and (self.path or self.user):
            raise errors.InvalidArgument(f"secret {self.name}: path and user are for file secrets", "INVALID_ARGUMENT")
        if self.delivery != "env" and self.var:
            raise errors.InvalidArgument(f"secret {self.name}: var is for env secrets", "INVALID_ARGUMENT")
        _seconds(self.ttl)  # refuses a negative one

    @classmethod
    def env(cls, name: str, value: str, var: Optional[str] = None, *, ttl: Optional[float] = None) -> "Secret":
        """The environment variable ``var`` (default: ``name``) of every execution."""
        return cls(name, value, "env", var=var or "", ttl=ttl)

    @classmethod
    def file(
        cls,
        name: str,
        value: str,
        path: Optional[str] = None,
        *,
        user: Optional[str] = None,
        ttl: Optional[float] = None,
    ) -> "Secret":
        """A file at ``path`` (default: ``/run/secrets/NAME``), readable by ``user`` only
        (default: the guest's ``user``). Not for a single execution."""
        return cls(name, value, "file", path=path or "", user=user or "", ttl=ttl)

    @classmethod
    def broker(
        cls,
        name: str,
        value: str,
        hosts: Sequence[str],
        *,
        header: str = "Authorization",
        format: str = "Bearer {value}",
        https: bool = False,
        ttl: Optional[float] = None,
    ) -> "Secret":
        """Added by the sandbox's egress proxy as ``header: format`` (``{value}`` standing for
        the secret) to its requests to ``hosts`` (which its network policy must allow); plain
        HTTP only unless ``https``. Not for a single execution."""
        return cls(name, value, "broker", hosts=hosts, header=header, format=format, https=https, ttl=ttl)

    def to_pb(self) -> "pb.Secret":
        s = pb.Secret(name=self.name, value=self.value, ttl_s=_seconds(self.ttl))
        if self.delivery == "env":
            s.env.var = self.var
        elif self.delivery == "file":
            s.file.path = self.path
            s.file.user = self.user
        else:
            s.broker.hosts.extend(self.hosts)
            s.broker.header = self.header
            s.broker.format = self.format
            s.broker.https = self.https
        return s

    @property
    def target(self) -> str:
        """Where it goes: the variable, the path (``""``: the default) or the hosts."""
        if self.delivery == "env":
            return self.var or self.name
        if self.delivery == "file":
            return self.path
        return ",".join(self.hosts)

    def __repr__(self) -> str:
        parts = [f"{self.name!r}", f"delivery={self.delivery!r}"]
        if self.target:
            parts.append(f"target={self.target!r}")
        if self.ttl is not None:
            parts.append(f"ttl={self.ttl!r}")
        return f"Secret({', '.join(parts)}, value=<hidden>)"

    __str__ = __repr__


#: What ``secrets=`` accepts: a list of :class:`Secret`, or ``{name: value}`` (environment
#: variables of that name).
SecretsSpec = Optional[Union[Sequence[Secret], Mapping[str, str]]]


def secret_list(secrets: SecretsSpec, env_only: bool = False) -> List["pb.Secret"]:
    """The ``Secret`` list of a ``secrets=`` argument; ``env_only`` (an execution's): env
    delivery only."""
    if secrets is None:
        return []
    if isinstance(secrets, Mapping):
        secrets = [Secret.env(name, value) for name, value in secrets.items()]
    elif isinstance(secrets, (str, bytes, Secret)):
        raise errors.InvalidArgument("secrets: expected a list of Secret or {name: value}", "INVALID_ARGUMENT")
    out = []
    for s in secrets:
        if not isinstance(s, Secret):
            raise errors.InvalidArgument(
                f"secrets: expected Secret or {{name: value}}, not {type(s).__name__}", "INVALID_ARGUMENT"
            )
        if env_only and s.delivery != "env":
            raise errors.InvalidArgument(
                f"secret {s.name}: an execution's secrets are environment variables only "
                f"(Secret.env), not {s.delivery}; give it to the sandbox instead",
                "INVALID_ARGUMENT",
            )
        out.append(s.to_pb())
    return out


@dataclass(frozen=True)
class SecretInfo:
    """A sandbox's secret as the daemon shows it (:attr:`~airlock.Sandbox.secrets`): never its
    value."""

    name: str
    delivery: str  # "env", "file" or "broker"
    targets: Tuple[str, ...]  # the variable, the path, or the hosts
    expires_unix_ms: int  # when its TTL ends it (0: with the sandbox)
    removed: bool  # removed by remove_secrets or its TTL

    @classmethod
    def from_pb(cls, s: "pb.SecretInfo") -> "SecretInfo":
        return cls(
            name=s.name,
            delivery=s.delivery,
            targets=tuple(s.targets),
            expires_unix_ms=s.expires_unix_ms,
            removed=s.removed,
        )


def remove_secrets_request(sandbox_id: str, names: Sequence[str]) -> "pb.RemoveSecretsRequest":
    """No names: every secret of the sandbox."""
    return pb.RemoveSecretsRequest(sandbox_id=sandbox_id, names=list(_strings("names", names)))


# ---- audit ----

#: The ``prev_hash`` of a tenant's first audit event.
ZERO_HASH = "0" * 64


@dataclass(frozen=True)
class AuditEvent:
    """One event of the tenant's audit trail (:meth:`~airlock.Client.audit_events`): what one
    of its sandboxes did, hash-chained to the event before it (see :func:`verify_audit`)."""

    seq: int  # 1, 2, ... per tenant, without gaps
    time_unix_ms: int
    tenant: str
    # sandbox.create, sandbox.end, exec.start, exec.end, file.write, file.read, package,
    # egress, secret.use, secret.remove, denial
    kind: str
    sandbox_id: str
    execution_id: str
    detail_json: str  # what happened, a JSON object (as hashed: keep it as it came)
    prev_hash: str  # hex SHA-256 of the event before (64 zeroes for the first)
    hash: str

    @property
    def detail(self) -> Any:
        """:attr:`detail_json` parsed (a dict)."""
        return json.loads(self.detail_json)

    @classmethod
    def from_pb(cls, e: "pb.AuditEvent") -> "AuditEvent":
        return cls(
            seq=e.seq,
            time_unix_ms=e.time_unix_ms,
            tenant=e.tenant,
            kind=e.kind,
            sandbox_id=e.sandbox_id,
            execution_id=e.execution_id,
            detail_json=e.detail_json,
            prev_hash=e.prev_hash,
            hash=e.hash,
        )

    def to_dict(self) -> Dict[str, Any]:
        """Its fields, as ``airlock audit export`` writes an event (one JSON object a line)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class AuditLog(List[AuditEvent]):
    """A page of the audit trail (a list of :class:`AuditEvent`, oldest first), and:
    ``next_after_seq``, the ``after_seq`` of the next page (0: no more); ``head_seq`` and
    ``head_hash``, the tenant's last event when the daemon answered (to check that an export
    is complete); ``first_seq``, the first event retention kept (the chain's anchor)."""

    def __init__(
        self,
        events: Iterable[AuditEvent] = (),
        next_after_seq: int = 0,
        head_seq: int = 0,
        head_hash: str = "",
        first_seq: int = 0,
    ) -> None:
        super().__init__(events)
        self.next_after_seq = next_after_seq
        self.head_seq = head_seq
        self.head_hash = head_hash
        self.first_seq = first_seq

    @classmethod
    def from_pb(cls, resp: "pb.ListAuditEventsResponse") -> "AuditLog":
        return cls(
            (AuditEvent.from_pb(e) for e in resp.events),
            resp.next_after_seq,
            resp.head_seq,
            resp.head_hash,
            resp.first_seq,
        )

    def extend_page(self, page: "AuditLog") -> None:
        """Appends ``page``'s events and takes its cursor and head (collecting every page)."""
        self.extend(page)
        self.next_after_seq = page.next_after_seq
        self.head_seq, self.head_hash, self.first_seq = page.head_seq, page.head_hash, page.first_seq

    def verify(self) -> "AuditVerification":
        """:func:`verify_audit` of these events as a complete trail (the first kept event to
        the head): true only of an unfiltered :meth:`~airlock.Client.audit_trail` from
        ``after_seq=0``; a page or a filtered list reports the events it lacks."""
        return verify_audit(self, head_seq=self.head_seq, head_hash=self.head_hash, first_seq=self.first_seq)


#: When audit events are asked for: a :class:`datetime.datetime`, or Unix time in seconds (as
#: :func:`time.time` gives it).
TimeSpec = Optional[Union[float, datetime.datetime]]


def _unix_ms(what: str, t: TimeSpec) -> int:
    if t is None:
        return 0
    if isinstance(t, datetime.datetime):
        return int(t.timestamp() * 1000)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
        raise errors.InvalidArgument(
            f"{what}: expected a datetime or Unix time in seconds, not {t!r}", "INVALID_ARGUMENT"
        )
    return int(t * 1000)


def audit_request(
    after_seq: int,
    limit: int,
    kinds: Optional[Sequence[str]],
    sandbox_id: Optional[str],
    since: TimeSpec,
    until: TimeSpec,
) -> "pb.ListAuditEventsRequest":
    return pb.ListAuditEventsRequest(
        sandbox_id=sandbox_id or "", **log_query(after_seq, limit, kinds, since, until)
    )


@dataclass(frozen=True)
class AuditProblem:
    """What :func:`verify_audit` found wrong, and the event (by seq) it concerns."""

    seq: int
    problem: str

    def __str__(self) -> str:
        return f"event {self.seq}: {self.problem}"


@dataclass(frozen=True)
class AuditVerification:
    """What :func:`verify_audit` found: ``ok`` (true, and the object truthy, when there are no
    ``problems``), how many ``events`` it checked and the seq of the ``first_seq`` and
    ``last_seq`` of them (0: none)."""

    events: int
    first_seq: int
    last_seq: int
    problems: Tuple[AuditProblem, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"ok: {self.events} events, seq {self.first_seq} to {self.last_seq}, chain intact"
        lines = [str(p) for p in self.problems]
        lines.append(f"FAILED: {len(self.problems)} problems in {self.events} events")
        return "\n".join(lines)


def _json_int(s: str) -> Union[int, float]:
    # serde_json: -0 is the float -0.0; beyond u64 / i64 an integer is an f64.
    n = int(s)
    if s.startswith("-") and n == 0:
        return -0.0
    if -(1 << 63) <= n < (1 << 64):
        return n
    return float(s)


def _json_constant(s: str):
    raise ValueError(f"{s} is not JSON")


def _f64(x: float) -> str:
    """A float as serde_json writes it (ryu's shortest digits, its layout)."""
    if not math.isfinite(x):
        raise ValueError("a number out of range")
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign = "-" if x < 0 else ""
    mant, _, exp = repr(abs(x)).partition("e")
    whole, _, frac = mant.partition(".")
    digits = (whole + frac).lstrip("0")
    k = int(exp or 0) - len(frac)
    stripped = digits.rstrip("0")
    k += len(digits) - len(stripped)
    digits = stripped
    n = len(digits)
    kk = n + k  # 10^(kk-1) <= x < 10^kk
    if 0 <= k and kk <= 16:
        out = digits + "0" * k + ".0"
    elif 0 < kk <= 16:
        out = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:
        out = "0." + "0" * -kk + digits
    elif n == 1:
        out = f"{digits}e{kk - 1}"
    else:
        out = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + out


def _canonical_json(v: Any) -> str:
    """Compact JSON, keys sorted at every level, as serde_json writes a ``Value``."""
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _f64(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ",".join(_canonical_json(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(
            json.dumps(k, ensure_ascii=False) + ":" + _canonical_json(v[k]) for k in sorted(v)
        ) + "}"
    raise TypeError(f"not a JSON value: {type(v).__name__}")


def audit_canonical(event: Any, detail: Any) -> str:
    """The canonical form an audit event's hash covers: the JSON object of its ``seq``,
    ``time_unix_ms``, ``tenant``, ``kind``, ``sandbox_id``, ``execution_id`` and ``detail``
    (:attr:`~AuditEvent.detail_json` parsed), compact, keys sorted at every level."""
    return _canonical_json(
        {
            "seq": event.seq,
            "time_unix_ms": event.time_unix_ms,
            "tenant": event.tenant,
            "kind": event.kind,
            "sandbox_id": event.sandbox_id,
            "execution_id": event.execution_id,
            "detail": detail,
        }
    )


def audit_hash(prev_hash: str, canonical: str) -> str:
    """The hash of an audit event: hex SHA-256 of ``prev_hash``, a newline and its canonical
    form (:func:`audit_canonical`)."""
    return hashlib.sha256(f"{prev_hash}\n{canonical}".encode("utf-8")).hexdigest()


def _event_hash(e: Any) -> str:
    """``e``'s hash recomputed; ValueError when its detail is not JSON."""
    detail = json.loads(e.detail_json, parse_int=_json_int, parse_constant=_json_constant)
    try:
        return audit_hash(e.prev_hash, audit_canonical(e, detail))
    except UnicodeEncodeError:  # a lone surrogate (\\ud800), which serde_json refuses
        raise ValueError("a string in it is not Unicode") from None


def _missing(first: int, last: int) -> str:
    return f"event {first} is missing" if first == last else f"events {first} to {last} are missing"


def verify_audit(
    events: Iterable[Any],
    head_seq: Optional[int] = None,
    head_hash: Optional[str] = None,
    *,
    first_seq: Optional[int] = None,
) -> AuditVerification:
    """Checks a run of audit events (oldest first; :class:`AuditEvent` or ``airlock.v1``
    messages), as the daemon chained them, without asking the daemon anything:

    * each event's ``hash`` recomputed from its content and ``prev_hash``
      (:func:`audit_hash`): an edited event no longer matches;
    * the seqs follow one another without gaps, and each ``prev_hash`` is the hash of the event
      before: a removed event breaks both;
    * an event of seq 1 starts the chain (``prev_hash`` 64 zeroes); a later first event is
      anchored by its own ``prev_hash`` (retention removed those before it);
    * with ``first_seq`` (the daemon's first kept event, :attr:`AuditLog.first_seq`), the run
      starts there: nothing was removed at its start;
    * with ``head_seq`` and ``head_hash`` (the daemon's head, :attr:`AuditLog.head_seq`), the
      run reaches the head and its event of that seq has that hash: nothing was removed at its
      end (events appended after the head was read may follow it).

    A filtered list (``kinds=``, ``sandbox_id=``, times) has gaps by design: verify the whole
    trail (:meth:`~airlock.Client.audit_trail`). Returns an :class:`AuditVerification`; its
    ``problems`` name each event (by seq) and what is wrong with it.
    """
    problems: List[AuditProblem] = []
    events = list(events)
    prev = None
    for e in events:
        try:
            if _event_hash(e) != e.hash:
                problems.append(AuditProblem(e.seq, "its hash does not match its content (edited)"))
        except (ValueError, TypeError) as err:
            problems.append(AuditProblem(e.seq, f"its detail is not JSON: {err}"))
        if prev is None:
            if e.seq == 1 and e.prev_hash != ZERO_HASH:
                problems.append(AuditProblem(e.seq, "the first event does not start the chain"))
            if first_seq and e.seq != first_seq:
                if e.seq > first_seq:
                    problems.append(AuditProblem(e.seq, _missing(first_seq, e.seq - 1)))
                else:
                    problems.append(AuditProblem(e.seq, f"the daemon's first kept event is {first_seq}"))
        elif e.seq <= prev.seq:
            problems.append(AuditProblem(e.seq, f"out of order: it follows event {prev.seq}"))
        elif e.seq != prev.seq + 1:
            problems.append(AuditProblem(e.seq, _missing(prev.seq + 1, e.seq - 1)))
        elif e.prev_hash != prev.hash:
            problems.append(AuditProblem(e.seq, f"its prev_hash is not the hash of event {prev.seq}"))
        prev = e
    if head_seq:
        last = events[-1].seq if events else 0
        at_head = [e for e in events if e.seq == head_seq]
        if last < head_seq:
            problems.append(
                AuditProblem(head_seq, f"the trail does not reach the daemon's head: {_missing(last + 1, head_seq)}")
            )
        elif head_hash is not None and at_head and at_head[-1].hash != head_hash:
            problems.append(AuditProblem(head_seq, "its hash is not the daemon's head hash"))
    return AuditVerification(
        events=len(events),
        first_seq=events[0].seq if events else 0,
        last_seq=events[-1].seq if events else 0,
        problems=tuple(problems),
    )



#: The HTTP header in which a caller of an exposed port presents its token.
TOKEN_HEADER = "X-Airlock-Token"


@dataclass(frozen=True)
class Exposure:
    """A guest port exposed on a host address of the daemon's (:meth:`~airlock.Sandbox.expose_port`),
    until ``expires_unix_ms`` or the end of the sandbox.

    Each connection to ``address`` (``HOST:PORT``) presents ``token`` first: raw TCP sends the
    token and a newline, HTTP/1 sends the header ``X-Airlock-Token: TOKEN`` (:attr:`headers`)
    in the connection's first request. Without it the connection is closed.
    """

    sandbox_id: str
    guest_port: int
    address: str  # HOST:PORT
    token: str
    expires_unix_ms: int

    @property
    def headers(self) -> Dict[str, str]:
        """The HTTP header that presents the token: ``{"X-Airlock-Token": token}``."""
        return {TOKEN_HEADER: self.token}

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, for an HTTP server behind the port."""
        return f"http://{self.address}"

    @classmethod
    def from_pb(cls, e: "pb.Exposure") -> "Exposure":
        return cls(
            sandbox_id=e.sandbox_id,
            guest_port=e.guest_port,
            address=e.address,
            token=e.token,
            expires_unix_ms=e.expires_unix_ms,
        )


def expose_request(sandbox_id: str, port: int, ttl: Optional[float]) -> "pb.ExposePortRequest":
    """``ttl`` in seconds (``None``: the daemon's default; it caps it at its maximum)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise errors.InvalidArgument(f"port must be a number from 1 to 65535: {port!r}", "INVALID_ARGUMENT")
    return pb.ExposePortRequest(sandbox_id=sandbox_id, guest_port=port, ttl_s=_seconds(ttl))


def set_network_request(sandbox_id: str, network: NetworkSpec) -> "pb.SetNetworkPolicyRequest":
    """``None`` sends the empty policy: deny-all."""
    return pb.SetNetworkPolicyRequest(sandbox_id=sandbox_id, network=network_policy(network) or pb.NetworkPolicy())


def execution_state(state: int) -> str:
    name = pb.ExecutionState.Name(state) if state in pb.ExecutionState.values() else "UNKNOWN"
    return name.replace("EXECUTION_STATE_", "").lower()


def sandbox_state(state: int) -> str:
    name = pb.SandboxState.Name(state) if state in pb.SandboxState.values() else "UNKNOWN"
    return name.replace("SANDBOX_STATE_", "").lower()


def sandbox_states(states: Optional[Iterable[str]]) -> List[int]:
    out = []
    for s in states or ():
        key = "SANDBOX_STATE_" + s.upper()
        if key not in pb.SandboxState.keys():
            raise errors.InvalidArgument(f"unknown sandbox state {s!r}", "INVALID_ARGUMENT")
        out.append(pb.SandboxState.Value(key))
    return out


class SandboxInfo:
    """Fields of a sandbox record shared by :class:`~airlock.Sandbox` and the async one."""

    _info: "pb.Sandbox"

    @property
    def info(self) -> "pb.Sandbox":
        """The record as the daemon last answered it (``airlock.v1.Sandbox``)."""
        return self._info

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def state(self) -> str:
        """``running``, ``paused``, ``dead``, ``destroyed`` or ``starting``."""
        return sandbox_state(self._info.state)

    @property
    def template(self) -> str:
        return self._info.template

    @property
    def vcpus(self) -> int:
        return self._info.vcpus

    @property
    def memory_mib(self) -> int:
        return self._info.memory_mib

    @property
    def labels(self) -> Dict[str, str]:
        return dict(self._info.labels)

    @property
    def end_reason(self) -> str:
        return self._info.end_reason

    @property
    def node(self) -> str:
        """Cluster mode: the node that runs it (empty on a single host)."""
        return self._info.node

    @property
    def create_ms(self) -> float:
        """The whole CreateSandbox call, as the daemon measured it."""
        return self._info.create_ms

    @property
    def network(self) -> Network:
        """Its egress policy, as the daemon last answered it."""
        return Network.from_pb(self._info.network if self._info.HasField("network") else None)

    @property
    def packages(self) -> Packages:
        """Its package policy in force (the tenant's ceiling and the request's combined), as the
        daemon last answered it."""
        return Packages.from_pb(self._info.packages if self._info.HasField("packages") else None)

    @property
    def volumes(self) -> List[Mount]:
        """The volumes it has mounted."""
        return [Mount(v.name, v.mount_path, v.read_only) for v in self._info.volumes]

    @property
    def secrets(self) -> List["SecretInfo"]:
        """Its secrets, as the daemon last answered: names, delivery, targets, expiry and
        whether they were removed (never their values)."""
        return [SecretInfo.from_pb(s) for s in self._info.secrets]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.state} template={self.template}>"


# ---- requests ----

Command = Union[str, Sequence[str]]


def create_request(
    template: str,
    vcpus: int,
    memory_mib: int,
    disk_mib: int,
    env: Optional[Mapping[str, str]],
    files: Optional[Mapping[str, Union[bytes, str]]],
    labels: Optional[Mapping[str, str]],
    timeout: Optional[float],
    idle_timeout: Optional[float],
    writable: Optional[Sequence[str]],
    exportable: Optional[Sequence[str]],
    network: NetworkSpec = None,
    volumes: VolumesSpec = None,
    export: "Optional[ExportPolicy]" = None,
    packages: "Optional[Packages]" = None,
    secrets: "SecretsSpec" = None,
    no_root: bool = False,
) -> "pb.CreateSandboxRequest":
    req = pb.CreateSandboxRequest(
        template=template,
        vcpus=vcpus,
        memory_mib=memory_mib,
        disk_mib=disk_mib,
        env=dict(env or {}),
        labels=dict(labels or {}),
        max_lifetime_s=_seconds(timeout),
        idle_ttl_s=_seconds(idle_timeout),
        no_root=no_root,
    )
    for path, content in (files or {}).items():
        data = content.encode() if isinstance(content, str) else bytes(content)
        req.files.append(pb.FileToPlace(path=path, content=data))
    if writable is not None or exportable is not None:
        req.file_policy.writable.extend(writable or [])
        req.file_policy.exportable.extend(exportable or [])
    if export is not None:
        req.file_policy.max_export_file_bytes = export.max_file_bytes
        req.file_policy.max_export_total_bytes = export.max_total_bytes
        req.file_policy.export_denied.extend(export.denied)
    policy = network_policy(network)
    if policy is not None:
        req.network.CopyFrom(policy)
    pkg = package_policy(packages)
    if pkg is not None:
        req.packages.CopyFrom(pkg)
    req.volumes.extend(volume_attachments(volumes))
    req.secrets.extend(secret_list(secrets))
    return req


def exec_request(
    sandbox_id: str,
    cmd: Command,
    cwd: Optional[str],
    env: Optional[Mapping[str, str]],
    timeout: Optional[float],
    stdin: Union[bytes, str, None],
    language: Optional[str] = None,
    memory_limit_mib: Optional[int] = None,
    user: Optional[str] = None,
    secrets: "SecretsSpec" = None,
    stdin_open: bool = False,
) -> "pb.ExecRequest":
    """``cmd`` as a list is an argv; a string is a shell script (``/bin/sh -c``), or source code
    when ``language`` is given. ``user`` is the guest account (``None``: the unprivileged
    ``user``; ``"root"`` for root). ``secrets`` of an execution are environment variables only
    (:meth:`Secret.env`). ``stdin_open`` keeps stdin open after ``stdin`` for
    ``Execution.write_stdin``."""
    req = pb.ExecRequest(
        sandbox_id=sandbox_id,
        cwd=cwd or "",
        user=user or "",
        env=dict(env or {}),
        timeout_ms=int(timeout * 1000) if timeout else 0,
        stdin=stdin.encode() if isinstance(stdin, str) else (stdin or b""),
        memory_limit_mib=memory_limit_mib or 0,
        stdin_open=stdin_open,
    )
    req.secrets.extend(secret_list(secrets, env_only=True))
    if language is not None:
        if not isinstance(cmd, str):
            raise errors.InvalidArgument("code must be a string", "INVALID_ARGUMENT")
        req.code.language = language
        req.code.source = cmd
    elif isinstance(cmd, str):
        req.shell = cmd
    else:
        args = list(cmd)
        if not args or not all(isinstance(a, str) for a in args):
            raise errors.InvalidArgument("argv must be a non-empty list of strings", "INVALID_ARGUMENT")
        req.argv.args.extend(args)
    return req


def write_requests(
    sandbox_id: str, path: str, data: Union[bytes, str], mode: int, user: Optional[str] = None
):
    payload = data.encode() if isinstance(data, str) else bytes(data)
    header = pb.WriteFileHeader(sandbox_id=sandbox_id, path=path, mode=mode, user=user or "")
    yield pb.WriteFileRequest(header=header)
    for i in range(0, len(payload), CHUNK):
        yield pb.WriteFileRequest(data=payload[i : i + CHUNK])


def output_chunk(ev: "pb.ExecutionEvent") -> OutputChunk:
    kind = "stderr" if ev.output.stream == pb.STREAM_KIND_STDERR else "stdout"
    return OutputChunk(kind, ev.output.offset, ev.output.data)


class StreamCursor:
    """Where an output stream of an execution stands, so that a broken stream resumes there."""

    MAX_RETRIES = 3

    def __init__(self, execution_id: str, stdout_offset: int, stderr_offset: int) -> None:
        self.execution_id = execution_id
        self.offsets = {"stdout": stdout_offset, "stderr": stderr_offset}
        self.attempts = 0

    def request(self) -> "pb.StreamExecutionRequest":
        return pb.StreamExecutionRequest(
            execution_id=self.execution_id,
            stdout_offset=self.offsets["stdout"],
            stderr_offset=self.offsets["stderr"],
        )

    def advance(self, ev: "pb.ExecutionEvent") -> Tuple[Optional[OutputChunk], Optional[ExecResult]]:
        """The chunk or the final record an event carries."""
        if ev.HasField("output"):
            chunk = output_chunk(ev)
            self.offsets[chunk.stream] = chunk.offset + len(chunk.data)
            self.attempts = 0
            return chunk, None
        if ev.HasField("exit"):
            return None, ExecResult.from_pb(ev.exit)
        return None, None

    def retry_delay(self, error: "errors.AirlockError") -> float:
        """Seconds to wait before resuming after ``error`` (re-raised after a few tries)."""
        self.attempts += 1
        if self.attempts > self.MAX_RETRIES:
            raise error
        return 0.2 * self.attempts

    @staticmethod
    def ended_early() -> "errors.AirlockError":
        return errors.AirlockError("the output stream ended without the exit record", "INTERNAL")


class OutputCollector:
    """Collects an execution's output for :class:`ExecResult` and feeds the callbacks."""

    def __init__(self, on_stdout, on_stderr) -> None:
        self.parts: Dict[str, List[bytes]] = {"stdout": [], "stderr": []}
        self.callbacks = {"stdout": on_stdout, "stderr": on_stderr}

    def add(self, chunk: OutputChunk):
        """Stores the chunk; returns what its callback returned (an awaitable, for async ones)."""
        self.parts[chunk.stream].append(chunk.data)
        cb = self.callbacks[chunk.stream]
        return cb(chunk) if cb is not None else None

    def result(self, final: ExecResult, check: bool) -> ExecResult:
        final.stdout_bytes = b"".join(self.parts["stdout"])
        final.stderr_bytes = b"".join(self.parts["stderr"])
        return final.raise_for_platform() if check else final


def _seconds(t: Optional[float]) -> int:
    if t is None:
        return 0
    if t < 0:
        raise errors.InvalidArgument("a timeout cannot be negative", "INVALID_ARGUMENT")
    return max(1, int(round(t))) if t else 0
