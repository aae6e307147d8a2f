"""The asyncio client against the live daemon: every call, and errors."""

from __future__ import annotations

import asyncio

import pytest

import airlock
from airlock.aio import AsyncClient


def run(coro):
    return asyncio.run(coro)


def test_async_sandbox_lifecycle_exec_and_files(daemon):
    async def main():
        async with AsyncClient(daemon.address) as client:
            assert "base" in {t.name for t in await client.templates.list()}
            async with await client.sandboxes.create(labels={"suite": "async"}, env={"X": "1"}) as sb:
                assert sb.state == "running"
                assert [s.id for s in await client.sandboxes.list(labels={"suite": "async"})] == [sb.id]
                assert (await client.sandboxes.get(sb.id)).id == sb.id
                # Nothing installed, nothing logged; the package policy is the ceiling's (open).
                log = await sb.install_log()
                assert isinstance(log, airlock.InstallLog) and list(log) == [] and log.dropped == 0
                assert not sb.packages.offline

                # Output arrives through an async callback as it comes.
                seen = []

                async def on_out(chunk):
                    seen.append(chunk.text)

                r = await sb.exec(
                    ["sh", "-c", 'for i in 1 2; do echo "$X$i"; sleep 0.5; done; exit 4'], on_stdout=on_out
                )
                assert (r.state, r.exit_code, r.stdout) == ("exited", 4, "11\n12\n")
                assert "".join(seen) == r.stdout and len(seen) >= 2
                assert (await client.executions.get(r.execution_id)).stdout == r.stdout
                chunks = [c async for c in client.executions.attach(r.execution_id).stream(stdout_offset=3)]
                assert "".join(c.text for c in chunks) == "12\n"

                py = await sb.exec_code("print(6*7)")
                assert py.stdout == "42\n"

                with pytest.raises(airlock.ExecTimeout):
                    await sb.exec(["sleep", "30"], timeout=1)
                ex = await sb.start(["sleep", "30"])
                assert await ex.kill() is True
                assert (await ex.wait()).state == "killed"

                assert await sb.files.write("/tmp/a/b.txt", "async") == 5
                assert await sb.files.read_text("/tmp/a/b.txt") == "async"
                assert [e.name for e in await sb.files.list("/tmp/a")] == ["b.txt"]
                with pytest.raises(airlock.PathNotAllowed):
                    await sb.files.write("/etc/x", "no")

                assert (await sb.pause()).state == "paused"
                with pytest.raises(airlock.SandboxNotRunning):
                    await sb.exec(["true"])
                assert (await sb.resume()).state == "running"
                tpl = await sb.snapshot("async-snap")
                assert tpl.source_sandbox_id == sb.id
                await sb.refresh()
            assert sb.state == "running"  # the record of the last refresh
            assert await sb.destroy() is False  # already destroyed by the context manager
            await client.templates.delete("async-snap")

            with pytest.raises(airlock.SandboxNotFound):
                await client.sandboxes.get("sb-0000000000000000")
            with pytest.raises(airlock.TemplateExists):
                await client.templates.create("base")

    run(main())


def test_async_concurrent_creates(daemon):
    async def main():
        async with AsyncClient(daemon.address) as client:
            sbs = await asyncio.gather(*(client.sandboxes.create(labels={"suite": "gather"}) for _ in range(3)))
            try:
                assert len({s.id for s in sbs}) == 3
                assert all(s.state == "running" for s in sbs)
            finally:
                await asyncio.gather(*(s.destroy() for s in sbs))
        async with AsyncClient(daemon.address, token="wrong") as bad:
            with pytest.raises(airlock.Unauthenticated):
                await bad.sandboxes.list()

    run(main())


def test_async_secrets_and_the_audit_trail(daemon):
    async def main():
        async with AsyncClient(daemon.address) as client:
            async with await client.sandboxes.create(secrets={"TOKEN": "async-secret-value"}) as sb:
                assert [(s.name, s.delivery) for s in sb.secrets] == [("TOKEN", "env")]
                assert [s.removed for s in (await sb.remove_secrets()).secrets] == [True]
            kinds = [e.kind async for e in client.iter_audit_events(sandbox_id=sb.id, page_size=1)]
            assert "sandbox.create" in kinds, kinds
            page = await client.audit_events(sandbox_id=sb.id, kinds=["sandbox.create"])
            assert [e.sandbox_id for e in page] == [sb.id]
            trail = await client.audit_trail()
            assert trail.verify().ok, str(trail.verify())

    run(main())
