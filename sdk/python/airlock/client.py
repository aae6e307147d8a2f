"""The synchronous client."""

from __future__ import annotations

import os

import time
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import grpc

from . import _common as c
from . import _interp as ci
from ._interp import CodeContext, CodeExecution, ContextSpec
from ._common import (
    AuditEvent,
    AuditLog,
    EgressLog,
    ExecResult,
    InstallLog,
    Exposure,
    FileEntry,
    OutputChunk,
    Template,
    TemplateProgress,
    template_request,
    Volume,
)
from ._proto import airlock_pb2 as pb
from ._proto import airlock_pb2_grpc as pb_grpc
from .errors import AirlockError, FileNotFound, Unavailable, from_rpc_error

OutputCallback = Callable[[OutputChunk], None]


class Client:
    """A connection to ``airlockd``.

    Args:
        address: ``unix:///PATH``, an absolute socket path, or ``HOST:PORT`` /
            ``tcp://HOST:PORT``. Default: ``$AIRLOCK_ADDR``, else the daemon's default socket
            ``/run/airlock/airlockd.sock``.
        token: the tenant token (sent as ``authorization: Bearer TOKEN``). Default:
            ``$AIRLOCK_TOKEN``; without one, the Unix socket acts as the default tenant.
        timeout: deadline in seconds for each unary call (``None``: none; creates and template
            builds wait as long as they take).

    Example::

        with Client() as client, client.sandboxes.create() as sandbox:
            print(sandbox.exec(["python3", "-c", "print(6*7)"]).stdout)
    """

    def __init__(
        self,
        address: Optional[str] = None,
        token: Optional[str] = None,
        *,
        timeout: Optional[float] = None,
    ) -> None:
        self.address = c.resolve_address(address)
        if c.is_tls(address):
            creds = c.tls_credentials(grpc)
            self._channel = grpc.secure_channel(self.address, creds, options=c.channel_options(self.address))
        else:
            self._channel = grpc.insecure_channel(self.address, options=c.channel_options(self.address))
        self._stub = pb_grpc.AirlockStub(self._channel)
        self._metadata = c.call_metadata(token)
        self._timeout = timeout
        self.sandboxes = Sandboxes(self)
        self.templates = Templates(self)
        self.volumes = Volumes(self)
        self.executions = Executions(self)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def nodes(self) -> List[c.Node]:
        """The daemon's nodes (cluster mode: every node of the cluster) with their load,
        capacity and templates; addresses only for an operator."""
        resp = self._unary("ListNodes", pb.ListNodesRequest())
        return [c.Node.from_pb(n) for n in resp.nodes]

    def usage(self) -> c.Usage:
        """What the caller's tenant holds now against its quota, and the retention."""
        return c.Usage.from_pb(self._unary("GetUsage", pb.GetUsageRequest()))

    def audit_events(
        self,
        after_seq: int = 0,
        limit: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        sandbox_id: Optional[str] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
    ) -> AuditLog:
        """A page of the tenant's audit trail, oldest first: the events after sequence number
        ``after_seq``, at most ``limit`` of them (0: the daemon's default, 1000; it caps it at
        10,000), only of ``kinds`` (``["sandbox.create", "exec.start"]``; default: all), of
        ``sandbox_id``, at or after ``since`` and before ``until`` (datetimes, or Unix time in
        seconds). A list of :class:`~airlock.AuditEvent`; its ``next_after_seq`` is the
        ``after_seq`` of the next page (0: no more), its ``head_seq``/``head_hash`` the
        tenant's last event (see :func:`~airlock.verify_audit`)."""
        req = c.audit_request(after_seq, limit, kinds, sandbox_id, since, until)
        return AuditLog.from_pb(self._unary("ListAuditEvents", req))

    def iter_audit_events(
        self,
        after_seq: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        sandbox_id: Optional[str] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
        page_size: int = 0,
    ) -> Iterator[AuditEvent]:
        """Every event of :meth:`audit_events` after ``after_seq``, page after page
        (``page_size`` a page; 0: the daemon's default), as they are fetched."""
        while True:
            page = self.audit_events(
                after_seq, page_size, kinds=kinds, sandbox_id=sandbox_id, since=since, until=until
            )
            yield from page
            if not page.next_after_seq:
                return
            after_seq = page.next_after_seq

    def audit_trail(self, after_seq: int = 0, *, page_size: int = 10_000) -> AuditLog:
        """The whole trail after ``after_seq`` (every page, unfiltered) as one
        :class:`~airlock.AuditLog` with the head of the last page: ``audit_trail().verify()``
        checks it from the first kept event to the head (:func:`~airlock.verify_audit`)."""
        trail = AuditLog()
        while True:
            page = self.audit_events(after_seq, page_size)
            trail.extend_page(page)
            if not page.next_after_seq:
                return trail
            after_seq = page.next_after_seq

    # -- plumbing --

    def _unary(self, method: str, request, timeout: Optional[float] = None):
        try:
            return getattr(self._stub, method)(
                request, metadata=self._metadata, timeout=timeout or self._timeout
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _server_stream(self, method: str, request) -> Iterator:
        try:
            yield from getattr(self._stub, method)(request, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


class Templates:
    """``client.templates``: build, list and delete templates."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def create(
        self,
        name: str,
        *,
        image: str = "",
        kernel_path: str = "",
        rootfs_path: str = "",
        vcpus: int = 0,
        memory_mib: int = 0,
        warmup: str = "",
        no_warmup: bool = False,
        on_progress: Optional[Callable[[TemplateProgress], None]] = None,
        oci_image: str = "",
        registry_auth: Optional[Tuple[str, str]] = None,
        replace: bool = False,
    ) -> Template:
        """Boots the kernel and image once, runs ``warmup`` (a shell command whose files end
        up in the snapshot's page cache; default: the daemon's, which loads Python;
        ``no_warmup`` skips it) and snapshots the VM (tens of seconds on nested KVM).
        ``on_progress`` sees each progress event. ``image`` names an image the operator
        registered (default: ``default``); ``kernel_path``/``rootfs_path`` name host files, which
        only an operator may. ``oci_image`` imports an OCI image from its registry instead (a
        reference as ``docker pull`` takes it; ``registry_auth=(user, password)`` for a private
        one): its Env, WorkingDir and User become every execution's defaults, and there is no
        warm-up unless ``warmup`` names one. Refusals raise :class:`~airlock.ImageRefused` or
        :class:`~airlock.RegistryUnavailable`."""
        req = template_request(
            name,
            image=image,
            kernel_path=kernel_path,
            rootfs_path=rootfs_path,
            vcpus=vcpus,
            memory_mib=memory_mib,
            warmup=warmup,
            no_warmup=no_warmup,
            oci_image=oci_image,
            registry_auth=registry_auth,
            replace=replace,
        )
        for ev in self._c._server_stream("CreateTemplate", req):
            if on_progress is not None:
                on_progress(TemplateProgress(ev.phase, ev.elapsed_ms, ev.message))
            if ev.HasField("template"):
                return Template.from_pb(ev.template)
        raise AirlockError("the template build ended without a template", "INTERNAL")

    def build(
        self,
        name: str,
        dockerfile: str,
        *,
        context: Union[bytes, str, "os.PathLike[str]", None] = None,
        build_args: Optional[Mapping[str, str]] = None,
        network: c.NetworkSpec = None,
        start: str = "",
        ready_command: str = "",
        ready_url: str = "",
        ready_timeout: int = 0,
        no_cache: bool = False,
        registry_auth: Optional[Tuple[str, str]] = None,
        on_progress: Optional[Callable[[TemplateProgress], None]] = None,
        replace: bool = False,
    ) -> Template:
        """Builds a template from a Dockerfile (its text): FROM a template or an OCI image, each
        RUN in a sandbox under ``network`` (deny-all by default) with its output to
        ``on_progress`` (phase ``"output"``), COPY/ADD from ``context`` (a directory, sent as a
        tar, or the tar's bytes; at most 3 MiB), ENV, ARG (``build_args``), WORKDIR, USER,
        ENTRYPOINT, CMD; then ``start`` left running and the ready check (``ready_command`` or
        ``ready_url``) before the snapshot. Steps are cached (templates ``cache-HEX``), so a
        changed line re-runs from there on (``no_cache``: every step). Raises
        :class:`~airlock.BuildStepFailed` naming a failed step's line, and
        :class:`~airlock.InvalidArgument` for an unsupported instruction before anything runs."""
        req = c.build_request(
            name,
            dockerfile,
            context=context,
            build_args=build_args,
            network=network,
            start=start,
            ready_command=ready_command,
            ready_url=ready_url,
            ready_timeout=ready_timeout,
            no_cache=no_cache,
            registry_auth=registry_auth,
            replace=replace,
        )
        for ev in self._c._server_stream("BuildTemplate", req):
            if on_progress is not None:
                on_progress(TemplateProgress(ev.phase, ev.elapsed_ms, ev.message))
            if ev.HasField("template"):
                return Template.from_pb(ev.template)
        raise AirlockError("the template build ended without a template", "INTERNAL")

    def list(self) -> List[Template]:
        resp = self._c._unary("ListTemplates", pb.ListTemplatesRequest())
        return [Template.from_pb(t) for t in resp.templates]

    def delete(self, name: str) -> None:
        """Deletes one version: ``name:tag``, or ``name`` for its ``latest`` (or only)
        version. Raises :class:`~airlock.TemplateInUse` while live sandboxes run from it."""
        self._c._unary("DeleteTemplate", pb.DeleteTemplateRequest(name=name))

    def sbom(self, name: str, format: str = "cyclonedx") -> Dict[str, Any]:
        """What template ``name`` is made of (its Debian or Alpine, Python and global npm
        packages with versions, its kernel and agent), as a CycloneDX 1.5 (``format=
        "cyclonedx"``) or SPDX 2.3 (``"spdx"``) document, parsed. Found once in a sandbox of
        the template (a few seconds), then kept."""
        import json

        req = pb.GetTemplateSbomRequest(name=name, format=format)
        r = self._c._unary("GetTemplateSbom", req)
        return json.loads(r.document)

    def log(self, name: str) -> c.TemplateLog:
        """The kept log of the build of ``name`` (``name:tag``)."""
        r = self._c._unary("GetTemplateLog", pb.GetTemplateLogRequest(name=name))
        return c.TemplateLog(log=r.log, truncated=r.truncated)

    def rebuild(
        self,
        name: str,
        *,
        tag: str = "",
        registry_auth: Optional[Tuple[str, str]] = None,
        on_progress: Optional[Callable[[TemplateProgress], None]] = None,
    ) -> Template:
        """Builds ``name`` (``name:tag``) again the way it was made, on the base image, kernel
        and image tags of now, as a new version tagged ``tag`` (default: the old version's tag,
        which moves to the new one; the old version stays, tagged with its id, for its
        sandboxes). A template snapshotted from a sandbox has no recipe:
        :class:`~airlock.InvalidArgument`."""
        req = c.rebuild_request(name, tag, registry_auth)
        for ev in self._c._server_stream("RebuildTemplate", req):
            if on_progress is not None:
                on_progress(TemplateProgress(ev.phase, ev.elapsed_ms, ev.message))
            if ev.HasField("template"):
                return Template.from_pb(ev.template)
        raise AirlockError("the template build ended without a template", "INTERNAL")


class Volumes:
    """``client.volumes``: file systems of the caller's that outlive sandboxes, daemon restarts
    and reboots; mounted with ``client.sandboxes.create(volumes=[Mount(name, path)])``."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def create(self, name: str, size_mib: int = 1024) -> Volume:
        """A new, empty volume (ext4, its root owned by the guest's ``user``)."""
        req = pb.CreateVolumeRequest(name=name, size_mib=size_mib)
        return Volume.from_pb(self._c._unary("CreateVolume", req))

    def list(self) -> List[Volume]:
        resp = self._c._unary("ListVolumes", pb.ListVolumesRequest())
        return [Volume.from_pb(v) for v in resp.volumes]

    def delete(self, name: str) -> bool:
        """Deletes it and frees its space (:class:`~airlock.VolumeInUse` while mounted);
        False if there was none."""
        return self._c._unary("DeleteVolume", pb.DeleteVolumeRequest(name=name)).deleted


class Sandboxes:
    """``client.sandboxes``: create, find and list sandboxes."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def create(
        self,
        template: str = "base",
        *,
        vcpus: int = 0,
        memory_mib: int = 0,
        disk_mib: int = 0,
        env: Optional[Mapping[str, str]] = None,
        files: Optional[Mapping[str, Union[bytes, str]]] = None,
        labels: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        idle_timeout: Optional[float] = None,
        writable: Optional[Sequence[str]] = None,
        exportable: Optional[Sequence[str]] = None,
        network: c.NetworkSpec = None,
        volumes: c.VolumesSpec = None,
        export: Optional[c.ExportPolicy] = None,
        packages: Optional[c.Packages] = None,
        secrets: c.SecretsSpec = None,
        no_root: bool = False,
    ) -> "Sandbox":
        """Starts a sandbox from ``template`` and returns once its agent is ready.

        Args:
            vcpus, memory_mib: 0 or the template's shape (a snapshot's shape is fixed).
            env: environment of every execution in it.
            files: ``{path: content}`` placed before it is answered.
            labels: to find it again with :meth:`list`.
            timeout: lifetime in seconds, after which the daemon destroys it.
            idle_timeout: seconds without calls after which the daemon destroys it.
            writable, exportable: path prefixes that file calls may write / read.
            network: what it may reach over its network: ``None`` (the default) nothing,
                ``"internet"`` every public address, or a :class:`~airlock.Network` such as
                ``Network(domains=["api.example.com"], ports=[443])`` (a list of
                :class:`~airlock.Rule` also works). Beyond the operator's ceiling for the
                tenant: :class:`~airlock.NetworkNotAllowed`.
            volumes: volumes to mount: ``[Mount("work", "/data"), Mount("ref", "/ref",
                read_only=True)]`` or ``{"/data": "work"}``. One read-write user at a time,
                or many read-only ones (:class:`~airlock.VolumeInUse`).
            disk_mib: what it may write to its root (its writable space).
            export: an :class:`~airlock.ExportPolicy` narrowing what file reads may take out
                (:class:`~airlock.ExportDenied` beyond it).
            packages: what its pip and npm may install through the daemon's package proxy: a
                :class:`~airlock.Packages` such as ``Packages(allow=["requests"],
                max_download_bytes=50 << 20)`` or ``Packages(offline=True)`` (``None``, the
                default: what the operator's ceiling for the tenant allows). A registry beyond
                the ceiling: :class:`~airlock.PackagesNotAllowed`.
            secrets: secrets of every execution in it (at most 32): a list of
                :class:`~airlock.Secret` (``Secret.env("API_KEY", value)``,
                ``Secret.file(...)``, ``Secret.broker(...)``), or ``{name: value}`` for
                environment variables. Their values stay in the daemon's memory, redacted from
                every output as ``[REDACTED:NAME]``; :attr:`Sandbox.secrets` shows their names.
            no_root: keep root out of reach: executions and file calls as ``"root"`` raise
                :class:`~airlock.RootNotAllowed`, and ``sudo`` in the sandbox is refused. By
                default root is allowed: ``user="root"``, and ``sudo`` for the default user
                (passwordless, as in E2B's base image).
        """
        req = c.create_request(
            template, vcpus, memory_mib, disk_mib, env, files, labels, timeout, idle_timeout,
            writable, exportable, network, volumes, export, packages, secrets, no_root,
        )
        return Sandbox(self._c, self._c._unary("CreateSandbox", req))

    def get(self, sandbox_id: str) -> "Sandbox":
        return Sandbox(self._c, self._c._unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=sandbox_id)))

    def list(
        self,
        labels: Optional[Mapping[str, str]] = None,
        states: Optional[Sequence[str]] = None,
    ) -> List["Sandbox"]:
        """The caller's sandboxes with all of ``labels``, in ``states`` (default: running,
        paused and starting)."""
        req = pb.ListSandboxesRequest(labels=dict(labels or {}), states=c.sandbox_states(states))
        return [Sandbox(self._c, s) for s in self._c._unary("ListSandboxes", req).sandboxes]


class Executions:
    """``client.executions``: records of executions by id."""

    def __init__(self, client: Client) -> None:
        self._c = client

    def get(self, execution_id: str, *, include_output: bool = True) -> ExecResult:
        resp = self._c._unary(
            "GetExecution",
            pb.GetExecutionRequest(execution_id=execution_id, include_output=include_output),
        )
        return ExecResult.from_pb(resp.execution, resp.stdout, resp.stderr)

    def attach(self, execution_id: str) -> "Execution":
        """A handle on a (possibly still running) execution, for :meth:`Execution.stream`."""
        return Execution(self._c, execution_id)


class Execution:
    """A started execution: stream its output, wait for it, kill it."""

    def __init__(self, client: Client, execution_id: str) -> None:
        self._c = client
        self.id = execution_id

    def stream(self, stdout_offset: int = 0, stderr_offset: int = 0) -> Iterator[OutputChunk]:
        """Yields output as it arrives (from the given offsets); the generator's return value
        (``StopIteration.value``) is the final :class:`ExecResult` without output. A stream
        that breaks is resumed from where it stopped."""
        cursor = c.StreamCursor(self.id, stdout_offset, stderr_offset)
        while True:
            try:
                for ev in self._c._server_stream("StreamExecution", cursor.request()):
                    chunk, final = cursor.advance(ev)
                    if final is not None:
                        return final
                    if chunk is not None:
                        yield chunk
            except Unavailable as e:
                time.sleep(cursor.retry_delay(e))
                continue
            raise cursor.ended_early()

    def wait(
        self,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        *,
        check: bool = True,
    ) -> ExecResult:
        """Waits for the end, collecting the output (and passing each chunk to the callbacks).
        With ``check`` (the default), a timeout, an out-of-memory kill or a lost sandbox raise
        :class:`~airlock.ExecTimeout`, :class:`~airlock.OomKilled`, ... carrying the result."""
        collector = c.OutputCollector(on_stdout, on_stderr)
        gen = self.stream()
        while True:
            try:
                collector.add(next(gen))
            except StopIteration as stop:
                return collector.result(stop.value, check)

    def write_stdin(self, data: Union[bytes, str], eof: bool = False) -> None:
        """More stdin for an execution started with ``stdin_open=True`` (at most 1 MiB a
        call); ``eof`` closes it after ``data``. Returns once the guest wrote it to the pipe."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        self._c._unary("WriteStdin", pb.WriteStdinRequest(execution_id=self.id, data=raw, eof=eof))

    def close_stdin(self) -> None:
        """Closes the execution's stdin (the program reads end of file)."""
        self.write_stdin(b"", eof=True)

    def kill(self, signal: int = 0) -> bool:
        """Sends ``signal`` (0: SIGKILL); False when it had already ended."""
        resp = self._c._unary("KillExecution", pb.KillExecutionRequest(execution_id=self.id, signal=signal))
        return resp.signalled

    def result(self) -> ExecResult:
        """The record and stored output now (it may still be running)."""
        return self._c.executions.get(self.id)


class Files:
    """``sandbox.files``: move files in and out under the sandbox's policy."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._s = sandbox

    def write(
        self, path: str, data: Union[bytes, str], mode: int = 0, user: Optional[str] = None
    ) -> int:
        """Writes ``data`` to ``path`` (parents are created); returns the bytes written."""
        try:
            resp = self._s._c._stub.WriteFile(
                c.write_requests(self._s.id, path, data, mode, user),
                metadata=self._s._c._metadata,
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return resp.bytes_written

    def read(self, path: str, user: Optional[str] = None) -> bytes:
        req = pb.ReadFileRequest(sandbox_id=self._s.id, path=path, user=user or "")
        return b"".join(chunk.data for chunk in self._s._c._server_stream("ReadFile", req))

    def read_text(self, path: str, encoding: str = "utf-8", user: Optional[str] = None) -> str:
        return self.read(path, user).decode(encoding)

    def list(
        self,
        path: str,
        user: Optional[str] = None,
        *,
        recursive: bool = False,
        max_entries: int = 0,
    ) -> List[FileEntry]:
        """The entries of a directory (``recursive``: below it too, named by their path
        relative to it), at most ``max_entries`` (0: 10,000)."""
        req = c.list_request(self._s.id, path, user, recursive, max_entries)
        resp = self._s._c._unary("ListFiles", req)
        return [FileEntry.from_pb(e) for e in resp.entries]

    def stat(self, path: str, user: Optional[str] = None) -> FileEntry:
        """Describes ``path`` (a symlink itself); :class:`~airlock.FileNotFound` if absent."""
        req = pb.StatFileRequest(sandbox_id=self._s.id, path=path, user=user or "")
        return FileEntry.from_pb(self._s._c._unary("StatFile", req))

    def exists(self, path: str, user: Optional[str] = None) -> bool:
        try:
            self.stat(path, user)
            return True
        except FileNotFound:
            return False

    def make_dir(self, path: str, *, parents: bool = True, mode: int = 0, user: Optional[str] = None) -> None:
        req = pb.MakeDirRequest(sandbox_id=self._s.id, path=path, parents=parents, mode=mode, user=user or "")
        self._s._c._unary("MakeDir", req)

    def remove(self, path: str, *, recursive: bool = False, user: Optional[str] = None) -> None:
        req = pb.RemoveFileRequest(sandbox_id=self._s.id, path=path, recursive=recursive, user=user or "")
        self._s._c._unary("RemoveFile", req)

    def rename(self, src: str, dst: str, *, user: Optional[str] = None) -> None:
        req = pb.RenameFileRequest(sandbox_id=self._s.id, to=dst, user=user or "")
        setattr(req, "from", src)
        self._s._c._unary("RenameFile", req)


class Sandbox(c.SandboxInfo):
    """A sandbox: one microVM. As a context manager it is destroyed on exit."""

    def __init__(self, client: Client, info: "pb.Sandbox") -> None:
        self._c = client
        self._info = info
        self.files = Files(self)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def refresh(self) -> "Sandbox":
        """Fetches the record again (state, usage)."""
        self._info = self._c._unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=self.id))
        return self

    def start(
        self,
        cmd: c.Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Union[bytes, str, None] = None,
        language: Optional[str] = None,
        memory_limit_mib: Optional[int] = None,
        user: Optional[str] = None,
        secrets: c.SecretsSpec = None,
        stdin_open: bool = False,
    ) -> Execution:
        """Starts ``cmd`` and returns at once. ``cmd`` is an argv list, or a string run by
        ``/bin/sh -c`` (source code in ``language`` when that is given). ``timeout`` in
        seconds is enforced by the daemon even if this client goes away; ``memory_limit_mib``
        bounds the program's memory (going over it raises :class:`~airlock.OomKilled` from
        :meth:`Execution.wait`, and the sandbox lives on). ``secrets`` are this execution's
        only, environment variables (:meth:`~airlock.Secret.env`, or ``{name: value}``),
        redacted from its output and record like the sandbox's."""
        req = c.exec_request(
            self.id, cmd, cwd, env, timeout, stdin, language, memory_limit_mib, user, secrets,
            stdin_open,
        )
        return Execution(self._c, self._c._unary("Exec", req).execution_id)

    def exec(
        self,
        cmd: c.Command,
        *,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        stdin: Union[bytes, str, None] = None,
        memory_limit_mib: Optional[int] = None,
        user: Optional[str] = None,
        secrets: c.SecretsSpec = None,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        check: bool = True,
    ) -> ExecResult:
        """Runs ``cmd`` to its end and returns its :class:`ExecResult` (``stdout``, ``stderr``,
        ``exit_code``, timings). Output goes to the callbacks as it arrives. A non-zero exit
        code is returned, not raised; a timeout raises :class:`~airlock.ExecTimeout` (unless
        ``check=False``)."""
        return self.start(
            cmd,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin,
            memory_limit_mib=memory_limit_mib,
            user=user,
            secrets=secrets,
        ).wait(
            on_stdout, on_stderr, check=check
        )

    def exec_code(
        self,
        source: str,
        *,
        language: str = "python",
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        memory_limit_mib: Optional[int] = None,
        user: Optional[str] = None,
        secrets: c.SecretsSpec = None,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        check: bool = True,
    ) -> ExecResult:
        """Runs source code as a fresh process of the guest's interpreter (``python`` or
        ``sh``), as :meth:`exec` runs a command: no state between calls, any template. (This
        was ``run_code`` before the code interpreter; :meth:`run_code` now runs a cell in the
        interpreter's stateful kernel.)"""
        ex = self.start(
            source,
            env=env,
            timeout=timeout,
            language=language,
            memory_limit_mib=memory_limit_mib,
            user=user,
            secrets=secrets,
        )
        return ex.wait(on_stdout, on_stderr, check=check)

    # -- the code interpreter (a template with one, e.g. code-interpreter) --

    def run_code(
        self,
        code: str,
        language: Optional[str] = None,
        context: ContextSpec = None,
        env: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        on_stdout: Optional[Callable[[ci.OutputMessage], Any]] = None,
        on_stderr: Optional[Callable[[ci.OutputMessage], Any]] = None,
        on_result: Optional[Callable[[ci.Result], Any]] = None,
        on_error: Optional[Callable[[ci.ExecutionError], Any]] = None,
        *,
        check: bool = True,
    ) -> CodeExecution:
        """Runs a cell in the sandbox's code interpreter, in ``context`` (a
        :class:`~airlock.CodeContext` or its id) or else in the default context of
        ``language`` (``"python"``, the default; ``"javascript"``, ``"typescript"``,
        ``"bash"``): variables persist between cells of a context. ``env``: variables for this
        cell only; ``timeout`` in seconds (``None``: the daemon's, 300), past which the cell is
        interrupted and the context lives on.

        Output and results go to the callbacks as they come (``on_stdout``/``on_stderr`` get
        :class:`~airlock.OutputMessage` s, ``on_result`` :class:`~airlock.Result` s,
        ``on_error`` the :class:`~airlock.ExecutionError`). Returns the
        :class:`~airlock.CodeExecution`: ``results``, ``logs``, ``error``,
        ``execution_count``, ``text``.

        An exception of the code is returned in ``.error``, not raised (as ``exec`` returns a
        non-zero exit code). With ``check`` (the default) a cell that did not run to its end
        raises, carrying the execution as ``.result``: :class:`~airlock.ExecTimeout` (its
        timeout), :class:`~airlock.OomKilled` (the memory limit killed the kernel; the context
        restarts on its next cell), :class:`~airlock.InterpreterUnavailable` (no interpreter in
        this sandbox), ...; ``check=False`` returns it with ``.state`` saying so. Leaving early
        (an exception in a callback, Ctrl-C) interrupts the cell."""
        req = ci.run_code_request(self.id, code, language, context, env, timeout)
        collector = ci.CodeCollector(on_stdout, on_stderr, on_result, on_error)
        call = self._c._stub.RunCode(req, metadata=self._c._metadata)
        try:
            for ev in call:
                collector.add(ev)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()
        return collector.finish(check)

    def create_code_context(self, language: Optional[str] = None, cwd: Optional[str] = None) -> CodeContext:
        """A new context of the interpreter (its own kernel) for ``language`` (default
        ``"python"``), working in ``cwd`` (default ``/home/user``)."""
        req = ci.create_context_request(self.id, language, cwd)
        return CodeContext.from_pb(self._c._unary("CreateCodeContext", req))

    def list_code_contexts(self) -> List[CodeContext]:
        """Its contexts, the default ones included once used."""
        resp = self._c._unary("ListCodeContexts", pb.ListCodeContextsRequest(sandbox_id=self.id))
        return [CodeContext.from_pb(x) for x in resp.contexts]

    def restart_code_context(self, context: Union[CodeContext, str]) -> CodeContext:
        """Restarts a context's kernel: its variables are gone, its id stays."""
        req = pb.RestartCodeContextRequest(sandbox_id=self.id, context_id=ci.context_id(context))
        return CodeContext.from_pb(self._c._unary("RestartCodeContext", req))

    def remove_code_context(self, context: Union[CodeContext, str]) -> None:
        """Ends a context and its kernel."""
        req = pb.RemoveCodeContextRequest(sandbox_id=self.id, context_id=ci.context_id(context))
        self._c._unary("RemoveCodeContext", req)

    def pause(self) -> "Sandbox":
        self._info = self._c._unary("PauseSandbox", pb.PauseSandboxRequest(sandbox_id=self.id))
        return self

    def resume(self) -> "Sandbox":
        self._info = self._c._unary("ResumeSandbox", pb.ResumeSandboxRequest(sandbox_id=self.id))
        return self

    def snapshot(self, template_name: str, *, shared: bool = False) -> Template:
        """Snapshots the sandbox into a new template of the caller's; it goes on running. Not
        of a sandbox that holds secrets or whose guest was given any
        (:class:`~airlock.SecretsPresent`). ``shared``: every tenant may use it (the default
        tenant, the operator, only)."""
        req = pb.SnapshotSandboxRequest(
            sandbox_id=self.id, template_name=template_name, shared=shared
        )
        return Template.from_pb(self._c._unary("SnapshotSandbox", req))

    def destroy(self) -> bool:
        """Destroys it (idempotent); False when it had already ended."""
        resp = self._c._unary("DestroySandbox", pb.DestroySandboxRequest(sandbox_id=self.id))
        return resp.destroyed

    def set_network(self, network: c.NetworkSpec) -> "Sandbox":
        """Replaces its egress policy (running or paused) with ``network``, as in
        :meth:`Sandboxes.create` (``None``: deny-all). New connections and DNS queries follow it
        at once; open connections are not cut. :attr:`network` shows the new policy."""
        self._info = self._c._unary("SetNetworkPolicy", c.set_network_request(self.id, network))
        return self

    def remove_secrets(self, *names: str) -> "Sandbox":
        """Removes its secrets ``names`` (none named: every one) at once, before their TTL:
        their files are deleted in the guest, later executions no longer get their variables,
        the proxy no longer adds their headers. Their values stay redacted from output until
        the sandbox ends. :attr:`secrets` shows them as ``removed``."""
        self._info = self._c._unary("RemoveSecrets", c.remove_secrets_request(self.id, names))
        return self

    def egress_log(
        self,
        after_seq: int = 0,
        limit: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
    ) -> EgressLog:
        """Its egress log, oldest first: every DNS query and connection attempt (allowed or
        not) after sequence number ``after_seq``, at most ``limit`` of them (0: the daemon's
        default, 1000), only of ``kinds`` (``"dns"``, ``"tcp"``, ``"expose"``; default: all),
        at or after ``since`` and before ``until`` (datetimes, or Unix time in seconds), as
        :meth:`Client.audit_events` filters the audit trail. A list of
        :class:`~airlock.EgressEvent`; its ``dropped`` counts the events beyond what the log
        keeps. Kept after the sandbox ended, with its record."""
        req = c.egress_log_request(self.id, after_seq, limit, kinds, since, until)
        return EgressLog.from_pb(self._c._unary("GetEgressLog", req))

    def install_log(
        self,
        after_seq: int = 0,
        limit: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
    ) -> InstallLog:
        """Its install log, oldest first: every package file (and every refused index page)
        its pip or npm asked the daemon's package proxy for, with the outcome (``"cached"``,
        ``"fetched"``, ``"denied"``, ``"hash_mismatch"``, ``"over_cap"``,
        ``"upstream_error"``, ``"bad_signature"``), after sequence number ``after_seq``, at most
        ``limit`` of them (0: the daemon's default, 1000), only of the outcomes ``kinds``
        (default: all), at or after ``since`` and before ``until``. A list of
        :class:`~airlock.InstallEvent`; its ``dropped`` counts the events beyond what the log
        keeps. Kept with its record."""
        req = c.install_log_request(self.id, after_seq, limit, kinds, since, until)
        return InstallLog.from_pb(self._c._unary("GetInstallLog", req))

    def expose_port(self, port: int, ttl: Optional[float] = None) -> Exposure:
        """Exposes the guest's TCP ``port`` (the sandbox running) on a host address of the
        daemon's for ``ttl`` seconds (``None``: the daemon's default, capped at its maximum), or
        until the sandbox ends. Returns the :class:`~airlock.Exposure`: its ``address``
        (``HOST:PORT``) and the ``token`` that each connection presents first (HTTP: the
        header in :attr:`~airlock.Exposure.headers`; raw TCP: the token and a newline). Each
        connection shows in :meth:`egress_log` as an event of kind ``"expose"``."""
        return Exposure.from_pb(self._c._unary("ExposePort", c.expose_request(self.id, port, ttl)))
