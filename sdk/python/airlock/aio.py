"""The asyncio client: the same calls as :mod:`airlock.client`, as coroutines.

Example::

    from airlock.aio import AsyncClient

    async with AsyncClient() as client:
        async with await client.sandboxes.create() as sandbox:
            result = await sandbox.exec(["python3", "-c", "print(6*7)"])
"""

from __future__ import annotations

import os

import asyncio
from typing import (
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import grpc
import grpc.aio

from . import _common as c
from . import _interp as ci
from ._interp import CodeContext, CodeExecution, ContextSpec
from ._common import (
    AuditEvent,
    AuditLog,
    EgressLog,
    ExecResult,
    Exposure,
    FileEntry,
    InstallLog,
    OutputChunk,
    Template,
    TemplateProgress,
    template_request,
)
from ._proto import airlock_pb2 as pb
from ._proto import airlock_pb2_grpc as pb_grpc
from .errors import AirlockError, FileNotFound, Unavailable, from_rpc_error

OutputCallback = Callable[[OutputChunk], Union[None, Awaitable[None]]]


class AsyncClient:
    """A connection to ``airlockd`` for asyncio code; arguments as for
    :class:`airlock.Client`."""

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
            self._channel = grpc.aio.secure_channel(self.address, creds, options=c.channel_options(self.address))
        else:
            self._channel = grpc.aio.insecure_channel(self.address, options=c.channel_options(self.address))
        self._stub = pb_grpc.AirlockStub(self._channel)
        self._metadata = c.call_metadata(token)
        self._timeout = timeout
        self.sandboxes = AsyncSandboxes(self)
        self.templates = AsyncTemplates(self)
        self.volumes = AsyncVolumes(self)
        self.executions = AsyncExecutions(self)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def nodes(self) -> List[c.Node]:
        """The daemon's nodes (cluster mode: every node of the cluster) with their load,
        capacity and templates; addresses only for an operator."""
        resp = await self._unary("ListNodes", pb.ListNodesRequest())
        return [c.Node.from_pb(n) for n in resp.nodes]

    async def usage(self) -> c.Usage:
        """What the caller's tenant holds now against its quota, and the retention."""
        return c.Usage.from_pb(await self._unary("GetUsage", pb.GetUsageRequest()))

    async def audit_events(
        self,
        after_seq: int = 0,
        limit: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        sandbox_id: Optional[str] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
    ) -> AuditLog:
        """As :meth:`airlock.Client.audit_events`."""
        req = c.audit_request(after_seq, limit, kinds, sandbox_id, since, until)
        return AuditLog.from_pb(await self._unary("ListAuditEvents", req))

    async def iter_audit_events(
        self,
        after_seq: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        sandbox_id: Optional[str] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
        page_size: int = 0,
    ) -> AsyncIterator[AuditEvent]:
        """As :meth:`airlock.Client.iter_audit_events` (``async for``)."""
        while True:
            page = await self.audit_events(
                after_seq, page_size, kinds=kinds, sandbox_id=sandbox_id, since=since, until=until
            )
            for e in page:
                yield e
            if not page.next_after_seq:
                return
            after_seq = page.next_after_seq

    async def audit_trail(self, after_seq: int = 0, *, page_size: int = 10_000) -> AuditLog:
        """As :meth:`airlock.Client.audit_trail`."""
        trail = AuditLog()
        while True:
            page = await self.audit_events(after_seq, page_size)
            trail.extend_page(page)
            if not page.next_after_seq:
                return trail
            after_seq = page.next_after_seq

    async def _unary(self, method: str, request, timeout: Optional[float] = None):
        try:
            return await getattr(self._stub, method)(
                request, metadata=self._metadata, timeout=timeout or self._timeout
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def _server_stream(self, method: str, request) -> AsyncIterator:
        call = getattr(self._stub, method)(request, metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()


class AsyncTemplates:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(
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
        async for ev in self._c._server_stream("CreateTemplate", req):
            if on_progress is not None:
                on_progress(TemplateProgress(ev.phase, ev.elapsed_ms, ev.message))
            if ev.HasField("template"):
                return Template.from_pb(ev.template)
        raise AirlockError("the template build ended without a template", "INTERNAL")

    async def build(
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
        async for ev in self._c._server_stream("BuildTemplate", req):
            if on_progress is not None:
                on_progress(TemplateProgress(ev.phase, ev.elapsed_ms, ev.message))
            if ev.HasField("template"):
                return Template.from_pb(ev.template)
        raise AirlockError("the template build ended without a template", "INTERNAL")

    async def list(self) -> List[Template]:
        resp = await self._c._unary("ListTemplates", pb.ListTemplatesRequest())
        return [Template.from_pb(t) for t in resp.templates]

    async def delete(self, name: str) -> None:
        """Deletes one version: ``name:tag``, or ``name`` for its ``latest`` (or only)
        version. Raises :class:`~airlock.TemplateInUse` while live sandboxes run from it."""
        await self._c._unary("DeleteTemplate", pb.DeleteTemplateRequest(name=name))

    async def sbom(self, name: str, format: str = "cyclonedx") -> Dict[str, Any]:
        """What template ``name`` is made of (its Debian or Alpine, Python and global npm
        packages with versions, its kernel and agent), as a CycloneDX 1.5 (``format=
        "cyclonedx"``) or SPDX 2.3 (``"spdx"``) document, parsed. Found once in a sandbox of
        the template (a few seconds), then kept."""
        import json

        req = pb.GetTemplateSbomRequest(name=name, format=format)
        r = await self._c._unary("GetTemplateSbom", req)
        return json.loads(r.document)

    async def log(self, name: str) -> c.TemplateLog:
        """The kept log of the build of ``name`` (``name:tag``)."""
        r = await self._c._unary("GetTemplateLog", pb.GetTemplateLogRequest(name=name))
        return c.TemplateLog(log=r.log, truncated=r.truncated)

    async def rebuild(
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
        async for ev in self._c._server_stream("RebuildTemplate", req):
            if on_progress is not None:
                on_progress(TemplateProgress(ev.phase, ev.elapsed_ms, ev.message))
            if ev.HasField("template"):
                return Template.from_pb(ev.template)
        raise AirlockError("the template build ended without a template", "INTERNAL")


class AsyncVolumes:
    """As :class:`airlock.client.Volumes`."""

    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(self, name: str, size_mib: int = 1024) -> c.Volume:
        req = pb.CreateVolumeRequest(name=name, size_mib=size_mib)
        return c.Volume.from_pb(await self._c._unary("CreateVolume", req))

    async def list(self) -> List[c.Volume]:
        resp = await self._c._unary("ListVolumes", pb.ListVolumesRequest())
        return [c.Volume.from_pb(v) for v in resp.volumes]

    async def delete(self, name: str) -> bool:
        resp = await self._c._unary("DeleteVolume", pb.DeleteVolumeRequest(name=name))
        return resp.deleted


class AsyncSandboxes:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def create(
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
    ) -> "AsyncSandbox":
        """As :meth:`airlock.client.Sandboxes.create`."""
        req = c.create_request(
            template, vcpus, memory_mib, disk_mib, env, files, labels, timeout, idle_timeout,
            writable, exportable, network, volumes, export, packages, secrets, no_root,
        )
        return AsyncSandbox(self._c, await self._c._unary("CreateSandbox", req))

    async def get(self, sandbox_id: str) -> "AsyncSandbox":
        info = await self._c._unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=sandbox_id))
        return AsyncSandbox(self._c, info)

    async def list(
        self,
        labels: Optional[Mapping[str, str]] = None,
        states: Optional[Sequence[str]] = None,
    ) -> List["AsyncSandbox"]:
        req = pb.ListSandboxesRequest(labels=dict(labels or {}), states=c.sandbox_states(states))
        resp = await self._c._unary("ListSandboxes", req)
        return [AsyncSandbox(self._c, s) for s in resp.sandboxes]


class AsyncExecutions:
    def __init__(self, client: AsyncClient) -> None:
        self._c = client

    async def get(self, execution_id: str, *, include_output: bool = True) -> ExecResult:
        resp = await self._c._unary(
            "GetExecution",
            pb.GetExecutionRequest(execution_id=execution_id, include_output=include_output),
        )
        return ExecResult.from_pb(resp.execution, resp.stdout, resp.stderr)

    def attach(self, execution_id: str) -> "AsyncExecution":
        return AsyncExecution(self._c, execution_id)


class AsyncExecution:
    """A started execution (asyncio)."""

    def __init__(self, client: AsyncClient, execution_id: str) -> None:
        self._c = client
        self.id = execution_id
        self.final: Optional[ExecResult] = None

    async def stream(self, stdout_offset: int = 0, stderr_offset: int = 0) -> AsyncIterator[OutputChunk]:
        """Yields output as it arrives; afterwards :attr:`final` holds the record (without
        output). A broken stream is resumed from where it stopped."""
        cursor = c.StreamCursor(self.id, stdout_offset, stderr_offset)
        while True:
            try:
                async for ev in self._c._server_stream("StreamExecution", cursor.request()):
                    chunk, final = cursor.advance(ev)
                    if final is not None:
                        self.final = final
                        return
                    if chunk is not None:
                        yield chunk
            except Unavailable as e:
                await asyncio.sleep(cursor.retry_delay(e))
                continue
            raise cursor.ended_early()

    async def wait(
        self,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        *,
        check: bool = True,
    ) -> ExecResult:
        """As :meth:`airlock.client.Execution.wait`; callbacks may be coroutines."""
        collector = c.OutputCollector(on_stdout, on_stderr)
        async for chunk in self.stream():
            r = collector.add(chunk)
            if asyncio.iscoroutine(r):
                await r
        assert self.final is not None
        return collector.result(self.final, check)

    async def write_stdin(self, data: Union[bytes, str], eof: bool = False) -> None:
        """As :meth:`airlock.client.Execution.write_stdin`."""
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await self._c._unary("WriteStdin", pb.WriteStdinRequest(execution_id=self.id, data=raw, eof=eof))

    async def close_stdin(self) -> None:
        await self.write_stdin(b"", eof=True)

    async def kill(self, signal: int = 0) -> bool:
        resp = await self._c._unary("KillExecution", pb.KillExecutionRequest(execution_id=self.id, signal=signal))
        return resp.signalled

    async def result(self) -> ExecResult:
        return await self._c.executions.get(self.id)


class AsyncFiles:
    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._s = sandbox

    async def write(
        self, path: str, data: Union[bytes, str], mode: int = 0, user: Optional[str] = None
    ) -> int:
        try:
            resp = await self._s._c._stub.WriteFile(
                c.write_requests(self._s.id, path, data, mode, user),
                metadata=self._s._c._metadata,
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return resp.bytes_written

    async def read(self, path: str, user: Optional[str] = None) -> bytes:
        req = pb.ReadFileRequest(sandbox_id=self._s.id, path=path, user=user or "")
        return b"".join([chunk.data async for chunk in self._s._c._server_stream("ReadFile", req)])

    async def read_text(self, path: str, encoding: str = "utf-8", user: Optional[str] = None) -> str:
        return (await self.read(path, user)).decode(encoding)

    async def list(
        self,
        path: str,
        user: Optional[str] = None,
        *,
        recursive: bool = False,
        max_entries: int = 0,
    ) -> List[FileEntry]:
        req = c.list_request(self._s.id, path, user, recursive, max_entries)
        resp = await self._s._c._unary("ListFiles", req)
        return [FileEntry.from_pb(e) for e in resp.entries]

    async def stat(self, path: str, user: Optional[str] = None) -> FileEntry:
        req = pb.StatFileRequest(sandbox_id=self._s.id, path=path, user=user or "")
        return FileEntry.from_pb(await self._s._c._unary("StatFile", req))

    async def exists(self, path: str, user: Optional[str] = None) -> bool:
        try:
            await self.stat(path, user)
            return True
        except FileNotFound:
            return False

    async def make_dir(self, path: str, *, parents: bool = True, mode: int = 0, user: Optional[str] = None) -> None:
        req = pb.MakeDirRequest(sandbox_id=self._s.id, path=path, parents=parents, mode=mode, user=user or "")
        await self._s._c._unary("MakeDir", req)

    async def remove(self, path: str, *, recursive: bool = False, user: Optional[str] = None) -> None:
        req = pb.RemoveFileRequest(sandbox_id=self._s.id, path=path, recursive=recursive, user=user or "")
        await self._s._c._unary("RemoveFile", req)

    async def rename(self, src: str, dst: str, *, user: Optional[str] = None) -> None:
        req = pb.RenameFileRequest(sandbox_id=self._s.id, to=dst, user=user or "")
        setattr(req, "from", src)
        await self._s._c._unary("RenameFile", req)


class AsyncSandbox(c.SandboxInfo):
    """A sandbox (asyncio). ``async with`` destroys it on exit."""

    def __init__(self, client: AsyncClient, info: "pb.Sandbox") -> None:
        self._c = client
        self._info = info
        self.files = AsyncFiles(self)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.destroy()

    async def refresh(self) -> "AsyncSandbox":
        self._info = await self._c._unary("GetSandbox", pb.GetSandboxRequest(sandbox_id=self.id))
        return self

    async def start(
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
    ) -> AsyncExecution:
        req = c.exec_request(
            self.id, cmd, cwd, env, timeout, stdin, language, memory_limit_mib, user, secrets,
            stdin_open,
        )
        return AsyncExecution(self._c, (await self._c._unary("Exec", req)).execution_id)

    async def exec(
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
        ex = await self.start(
            cmd,
            cwd=cwd,
            env=env,
            timeout=timeout,
            stdin=stdin,
            memory_limit_mib=memory_limit_mib,
            user=user,
            secrets=secrets,
        )
        return await ex.wait(on_stdout, on_stderr, check=check)

    async def exec_code(
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
        """As :meth:`airlock.Sandbox.exec_code`."""
        ex = await self.start(
            source,
            env=env,
            timeout=timeout,
            language=language,
            memory_limit_mib=memory_limit_mib,
            user=user,
            secrets=secrets,
        )
        return await ex.wait(on_stdout, on_stderr, check=check)

    async def run_code(
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
        """As :meth:`airlock.Sandbox.run_code`; callbacks may be coroutines."""
        req = ci.run_code_request(self.id, code, language, context, env, timeout)
        collector = ci.CodeCollector(on_stdout, on_stderr, on_result, on_error)
        call = self._c._stub.RunCode(req, metadata=self._c._metadata)
        try:
            async for ev in call:
                r = collector.add(ev)
                if asyncio.iscoroutine(r):
                    await r
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()
        return collector.finish(check)

    async def create_code_context(self, language: Optional[str] = None, cwd: Optional[str] = None) -> CodeContext:
        """As :meth:`airlock.Sandbox.create_code_context`."""
        req = ci.create_context_request(self.id, language, cwd)
        return CodeContext.from_pb(await self._c._unary("CreateCodeContext", req))

    async def list_code_contexts(self) -> List[CodeContext]:
        """As :meth:`airlock.Sandbox.list_code_contexts`."""
        resp = await self._c._unary("ListCodeContexts", pb.ListCodeContextsRequest(sandbox_id=self.id))
        return [CodeContext.from_pb(x) for x in resp.contexts]

    async def restart_code_context(self, context: Union[CodeContext, str]) -> CodeContext:
        """As :meth:`airlock.Sandbox.restart_code_context`."""
        req = pb.RestartCodeContextRequest(sandbox_id=self.id, context_id=ci.context_id(context))
        return CodeContext.from_pb(await self._c._unary("RestartCodeContext", req))

    async def remove_code_context(self, context: Union[CodeContext, str]) -> None:
        """As :meth:`airlock.Sandbox.remove_code_context`."""
        req = pb.RemoveCodeContextRequest(sandbox_id=self.id, context_id=ci.context_id(context))
        await self._c._unary("RemoveCodeContext", req)

    async def pause(self) -> "AsyncSandbox":
        self._info = await self._c._unary("PauseSandbox", pb.PauseSandboxRequest(sandbox_id=self.id))
        return self

    async def resume(self) -> "AsyncSandbox":
        self._info = await self._c._unary("ResumeSandbox", pb.ResumeSandboxRequest(sandbox_id=self.id))
        return self

    async def snapshot(self, template_name: str, *, shared: bool = False) -> Template:
        req = pb.SnapshotSandboxRequest(
            sandbox_id=self.id, template_name=template_name, shared=shared
        )
        return Template.from_pb(await self._c._unary("SnapshotSandbox", req))

    async def destroy(self) -> bool:
        resp = await self._c._unary("DestroySandbox", pb.DestroySandboxRequest(sandbox_id=self.id))
        return resp.destroyed

    async def set_network(self, network: c.NetworkSpec) -> "AsyncSandbox":
        """As :meth:`airlock.client.Sandbox.set_network`."""
        self._info = await self._c._unary("SetNetworkPolicy", c.set_network_request(self.id, network))
        return self

    async def remove_secrets(self, *names: str) -> "AsyncSandbox":
        """As :meth:`airlock.client.Sandbox.remove_secrets`."""
        self._info = await self._c._unary("RemoveSecrets", c.remove_secrets_request(self.id, names))
        return self

    async def egress_log(
        self,
        after_seq: int = 0,
        limit: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
    ) -> EgressLog:
        """As :meth:`airlock.client.Sandbox.egress_log`."""
        req = c.egress_log_request(self.id, after_seq, limit, kinds, since, until)
        return EgressLog.from_pb(await self._c._unary("GetEgressLog", req))

    async def install_log(
        self,
        after_seq: int = 0,
        limit: int = 0,
        *,
        kinds: Optional[Sequence[str]] = None,
        since: c.TimeSpec = None,
        until: c.TimeSpec = None,
    ) -> InstallLog:
        """As :meth:`airlock.client.Sandbox.install_log`."""
        req = c.install_log_request(self.id, after_seq, limit, kinds, since, until)
        return InstallLog.from_pb(await self._c._unary("GetInstallLog", req))

    async def expose_port(self, port: int, ttl: Optional[float] = None) -> Exposure:
        """As :meth:`airlock.client.Sandbox.expose_port`."""
        return Exposure.from_pb(await self._c._unary("ExposePort", c.expose_request(self.id, port, ttl)))
