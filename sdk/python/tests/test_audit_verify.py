"""Unit tests of the SDK's secrets and audit helpers: no daemon (they use none of conftest's
fixtures), only the generated stubs.

The audit chain is built here with the formula itself (``hash = sha256(prev_hash + "\\n" +
canonical JSON)``), independently of the SDK's code, and then checked by it.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import hashlib
import json

import pytest

import airlock
from airlock import AuditEvent, AuditLog, Secret, verify_audit
from airlock import _common as c
from airlock._proto import airlock_pb2 as pb

ZERO = "0" * 64


def chain(details, tenant="default", first_seq=1, prev_hash=ZERO):
    """Events of ``details`` (dicts), hashed as the daemon hashes them."""
    events = []
    for i, detail in enumerate(details):
        seq = first_seq + i
        fields = {
            "seq": seq,
            "time_unix_ms": 1_700_000_000_000 + seq,
            "tenant": tenant,
            "kind": "exec.start" if seq % 2 else "sandbox.create",
            "sandbox_id": "sb-0123456789abcdef",
            "execution_id": f"ex-{seq:016x}" if seq % 2 else "",
        }
        canonical = json.dumps(
            dict(fields, detail=detail), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )
        h = hashlib.sha256((prev_hash + "\n" + canonical).encode()).hexdigest()
        # The daemon stores the detail as serde_json writes it (keys sorted, compact), but any
        # spelling of the same object verifies: the hash covers the parsed detail.
        events.append(AuditEvent(detail_json=json.dumps(detail), prev_hash=prev_hash, hash=h, **fields))
        prev_hash = h
    return events


DETAILS = [
    {"template": "base", "labels": {"z": "1", "a": "2"}, "secrets": ["API_KEY"]},
    {"command": {"argv": ["python3", "-c"], "code": {"sha256": "ab" * 32, "bytes": 17}}, "user": ""},
    {"path": "/tmp/é ü.txt", "digest": {"bytes": 3, "sha256": "cd" * 32}, "note": 'a "quoted"\n\ttab \x01'},
    {"names": ["API_KEY"], "delivery": "env", "nested": [{"b": 1, "a": [True, False, None]}]},
    {"exit_code": -1, "signal": 9, "big": 2**63, "neg": -(2**63), "float": 0.5, "emoji": "\U0001f512"},
]


def problems(result):
    return [(p.seq, p.problem) for p in result.problems]


def test_an_intact_chain_verifies():
    events = chain(DETAILS)
    result = verify_audit(events, head_seq=5, head_hash=events[-1].hash, first_seq=1)
    assert result.ok and bool(result) and problems(result) == []
    assert (result.events, result.first_seq, result.last_seq) == (5, 1, 5)
    assert str(result) == "ok: 5 events, seq 1 to 5, chain intact"
    # The SDK's canonical form is the formula's, and each hash is recomputed the same.
    for e, d in zip(events, DETAILS):
        assert c.audit_hash(e.prev_hash, c.audit_canonical(e, e.detail)) == e.hash
        assert e.detail == d
    # Nothing to check is no problem; an AuditLog verifies against its own head.
    assert verify_audit([]).ok
    log = AuditLog(events, next_after_seq=0, head_seq=5, head_hash=events[-1].hash, first_seq=1)
    assert log.verify().ok


def test_a_chain_that_retention_cut_is_anchored_by_its_first_prev_hash():
    full = chain(DETAILS)
    kept = full[2:]  # events 1 and 2 removed by retention
    assert verify_audit(kept, head_seq=5, head_hash=full[-1].hash, first_seq=3).ok
    # A chain starting at 1 must start from zeroes.
    forged = [dataclasses.replace(full[0], prev_hash="f" * 64)]
    assert (1, "the first event does not start the chain") in problems(verify_audit(forged))


def test_the_generated_messages_verify_too():
    events = chain(DETAILS)
    msgs = [pb.AuditEvent(**e.to_dict()) for e in events]
    assert verify_audit(msgs).ok
    assert [AuditEvent.from_pb(m) for m in msgs] == events
    resp = pb.ListAuditEventsResponse(events=msgs, next_after_seq=0, head_seq=5, head_hash=events[-1].hash, first_seq=1)
    log = AuditLog.from_pb(resp)
    assert list(log) == events and (log.head_seq, log.head_hash, log.first_seq) == (5, events[-1].hash, 1)
    assert log.verify().ok


def test_an_edited_event_is_reported():
    events = chain(DETAILS)
    edited = list(events)
    detail = dict(DETAILS[2], path="/tmp/innocent.txt")
    edited[2] = dataclasses.replace(events[2], detail_json=json.dumps(detail))
    result = verify_audit(edited)
    assert not result.ok and not result
    assert problems(result) == [(3, "its hash does not match its content (edited)")]
    assert "event 3: its hash does not match its content (edited)" in str(result)
    assert str(result).endswith("FAILED: 1 problems in 5 events")
    # Other fields are covered too.
    for change in ({"kind": "file.read"}, {"time_unix_ms": 1}, {"sandbox_id": "sb-x"}, {"tenant": "acme"}):
        r = verify_audit(events[:2] + [dataclasses.replace(events[2], **change)] + events[3:])
        assert problems(r) == [(3, "its hash does not match its content (edited)")], change
    # An edit whose hash is recomputed breaks the next event's link instead.
    e3 = dataclasses.replace(events[2], detail_json=json.dumps(detail))
    e3 = dataclasses.replace(e3, hash=c.audit_hash(e3.prev_hash, c.audit_canonical(e3, detail)))
    r = verify_audit(events[:2] + [e3] + events[3:])
    assert problems(r) == [(4, "its prev_hash is not the hash of event 3")]
    # A detail that is no JSON is reported, not raised.
    r = verify_audit(events[:1] + [dataclasses.replace(events[1], detail_json="{not json")] + events[2:])
    assert [p[0] for p in problems(r)] == [2] and "not JSON" in problems(r)[0][1]


def test_the_same_detail_spelled_otherwise_still_verifies():
    events = chain(DETAILS)
    respelled = [
        dataclasses.replace(e, detail_json=json.dumps(d, indent=2, ensure_ascii=True)) for e, d in zip(events, DETAILS)
    ]
    assert verify_audit(respelled).ok


def test_a_deleted_event_is_reported():
    events = chain(DETAILS)
    # In the middle: a gap in the seqs.
    r = verify_audit(events[:2] + events[3:])
    assert problems(r) == [(4, "event 3 is missing")]
    r = verify_audit(events[:1] + events[4:])
    assert problems(r) == [(5, "events 2 to 4 are missing")]
    # Renumbered to hide the gap: the links (and the hashes) no longer hold.
    renumbered = events[:2] + [dataclasses.replace(e, seq=e.seq - 1) for e in events[3:]]
    r = verify_audit(renumbered)
    assert (3, "its prev_hash is not the hash of event 2") in problems(r)
    assert (3, "its hash does not match its content (edited)") in problems(r)
    # At the end: only the daemon's head shows it.
    assert verify_audit(events[:4]).ok
    r = verify_audit(events[:4], head_seq=5, head_hash=events[4].hash)
    assert problems(r) == [(5, "the trail does not reach the daemon's head: event 5 is missing")]
    r = verify_audit(events[:4], head_seq=4, head_hash=events[4].hash)
    assert problems(r) == [(4, "its hash is not the daemon's head hash")]
    # Events appended after the head was read are no problem.
    assert verify_audit(events, head_seq=4, head_hash=events[3].hash).ok
    # At the start: only the daemon's first kept seq shows it.
    assert verify_audit(events[1:]).ok
    assert problems(verify_audit(events[1:], first_seq=1)) == [(2, "event 1 is missing")]
    # Out of order.
    r = verify_audit([events[0], events[2], events[1]])
    assert (2, "out of order: it follows event 3") in problems(r)


def test_canonical_json_is_serde_jsons():
    # Floats as serde_json (ryu) writes them, ints beyond i64/u64 as floats, -0 as -0.0.
    cases = {
        "1.0": "1.0",
        "1e2": "100.0",
        "0.1": "0.1",
        "1.5e-5": "0.000015",
        "1e-7": "1e-7",
        "1e16": "1e16",
        "1234567.0e10": "1.234567e16",
        "123456789012345.6": "123456789012345.6",
        "-2.5e300": "-2.5e300",
        "-0": "-0.0",
        "-0.0": "-0.0",
        "18446744073709551615": "18446744073709551615",
        "18446744073709551616": "1.8446744073709552e19",
        "-9223372036854775809": "-9.223372036854776e18",
        '"\\u00e9\\u0001\\b\\/"': '"é\\u0001\\b/"',
        '{"b":{"d":1,"c":2},"a":[]}': '{"a":[],"b":{"c":2,"d":1}}',
    }
    for text, want in cases.items():
        value = json.loads(text, parse_int=c._json_int)
        assert c._canonical_json(value) == want, text
    for bad in ("NaN", "[Infinity]", "1e400", '"\\ud800"'):
        e = chain([{}])[0]
        r = verify_audit([dataclasses.replace(e, detail_json=bad)])
        assert not r.ok and "not JSON" in r.problems[0].problem, bad


# ---- secrets ----

VALUE = "sk-test-abcdef123456"


def test_a_secrets_repr_never_shows_its_value():
    b64 = base64.b64encode(VALUE.encode()).decode()
    for s in (
        Secret("API_KEY", VALUE),
        Secret.env("API_KEY", VALUE, var="OPENAI_API_KEY", ttl=60),
        Secret.file("API_KEY", VALUE, "/home/user/.key", user="root"),
        Secret.broker("API_KEY", VALUE, ["api.example.com", "*.example.org"], https=True),
    ):
        for shown in (repr(s), str(s), f"{s}", repr([s]), repr({"k": s})):
            assert VALUE not in shown and b64 not in shown and "<hidden>" in shown, shown
        assert s.value == VALUE and s.name == "API_KEY"
    assert repr(Secret.env("API_KEY", VALUE, var="K")) == "Secret('API_KEY', delivery='env', target='K', value=<hidden>)"


def test_secrets_convert_to_the_proto():
    env = Secret.env("API_KEY", VALUE, ttl=90).to_pb()
    assert (env.name, env.value, env.WhichOneof("delivery"), env.env.var, env.ttl_s) == ("API_KEY", VALUE, "env", "", 90)
    assert Secret("A", "abcd").to_pb().WhichOneof("delivery") == "env"
    f = Secret.file("TOKEN", "abcd", "/run/x", user="root").to_pb()
    assert (f.WhichOneof("delivery"), f.file.path, f.file.user, f.ttl_s) == ("file", "/run/x", "root", 0)
    assert Secret.file("TOKEN", "abcd").to_pb().file.path == ""
    b = Secret.broker("GH", "abcd", ["api.github.com"], header="X-Key", format="{value}", https=True).to_pb()
    assert b.WhichOneof("delivery") == "broker"
    assert (list(b.broker.hosts), b.broker.header, b.broker.format, b.broker.https) == (["api.github.com"], "X-Key", "{value}", True)
    d = Secret.broker("GH", "abcd", ["api.github.com"]).to_pb().broker
    assert (d.header, d.format, d.https) == ("Authorization", "Bearer {value}", False)

    req = c.create_request(
        "base", 0, 0, 0, None, None, None, None, None, None, None,
        secrets=[Secret.env("A", "aaaa"), Secret.file("B", "bbbb"), Secret.broker("C", "cccc", ["h.test"])],
    )
    assert [(s.name, s.WhichOneof("delivery")) for s in req.secrets] == [("A", "env"), ("B", "file"), ("C", "broker")]
    # {name: value} is environment variables.
    req = c.create_request("base", 0, 0, 0, None, None, None, None, None, None, None, secrets={"API_KEY": VALUE})
    assert [(s.name, s.value, s.WhichOneof("delivery")) for s in req.secrets] == [("API_KEY", VALUE, "env")]
    assert len(c.create_request("base", 0, 0, 0, None, None, None, None, None, None, None).secrets) == 0


def test_an_executions_secrets_are_environment_variables_only():
    req = c.exec_request("sb-1", ["true"], None, None, None, None, secrets=[Secret.env("ONE", "abcd", var="V")])
    assert [(s.name, s.env.var) for s in req.secrets] == [("ONE", "V")]
    req = c.exec_request("sb-1", "print(1)", None, None, None, None, "python", secrets={"ONE": "abcd"})
    assert [s.name for s in req.secrets] == ["ONE"]
    for s in (Secret.file("F", "abcd"), Secret.broker("B", "abcd", ["h.test"])):
        with pytest.raises(airlock.InvalidArgument) as e:
            c.exec_request("sb-1", ["true"], None, None, None, None, secrets=[s])
        assert "environment variables only" in str(e.value) and "abcd" not in str(e.value)


def test_malformed_secrets_are_refused_before_any_call():
    for bad in (
        lambda: Secret("9LIVES", "abcd"),
        lambda: Secret("has-dash", "abcd"),
        lambda: Secret("A" * 65, "abcd"),
        lambda: Secret("A", b"bytes"),
        lambda: Secret("A", "abcd", delivery="smoke"),
        lambda: Secret.broker("A", "abcd", []),
        lambda: Secret.broker("A", "abcd", "api.example.com"),  # a string, not a list
        lambda: Secret("A", "abcd", path="/x"),  # a path is for file secrets
        lambda: Secret.env("A", "abcd", ttl=-1),
        lambda: c.secret_list(Secret.env("A", "abcd")),  # one secret, not a list
        lambda: c.secret_list(["A"]),
    ):
        with pytest.raises(airlock.InvalidArgument):
            bad()
    assert Secret("_" + "a" * 63, "abcd").name


def test_sandbox_secret_info_and_execution_names():
    info = pb.Sandbox(
        id="sb-1",
        secrets=[
            pb.SecretInfo(name="API_KEY", delivery="env", targets=["API_KEY"]),
            pb.SecretInfo(name="GH", delivery="broker", targets=["api.github.com"], expires_unix_ms=5, removed=True),
        ],
    )

    class Fake(c.SandboxInfo):
        def __init__(self, i):
            self._info = i

    secrets = Fake(info).secrets
    assert secrets == [
        airlock.SecretInfo("API_KEY", "env", ("API_KEY",), 0, False),
        airlock.SecretInfo("GH", "broker", ("api.github.com",), 5, True),
    ]
    r = airlock.ExecResult.from_pb(pb.Execution(id="ex-1", secret_names=["API_KEY", "ONE"]))
    assert r.secret_names == ["API_KEY", "ONE"]
    req = c.remove_secrets_request("sb-1", ("A", "B"))
    assert (req.sandbox_id, list(req.names)) == ("sb-1", ["A", "B"])
    assert list(c.remove_secrets_request("sb-1", ()).names) == []


def test_secrets_present_is_its_own_error():
    assert airlock.errors.error_class("SECRETS_PRESENT") is airlock.SecretsPresent
    assert "SecretsPresent" in airlock.__all__ and issubclass(airlock.SecretsPresent, airlock.AirlockError)

    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2
    import grpc

    info = error_details_pb2.ErrorInfo(reason="SECRETS_PRESENT", domain="airlock.dev", metadata={"sandbox_id": "sb-1"})
    detail = any_pb2.Any()
    detail.Pack(info)
    blob = status_pb2.Status(code=9, message="no", details=[detail]).SerializeToString()

    class Err(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self):
            return "sandbox sb-1 cannot be snapshotted: it holds secrets (API_KEY)"

        def trailing_metadata(self):
            return (("grpc-status-details-bin", blob),)

    e = airlock.errors.from_rpc_error(Err())
    assert isinstance(e, airlock.SecretsPresent) and e.reason == "SECRETS_PRESENT"
    assert e.metadata["sandbox_id"] == "sb-1"


def test_audit_requests():
    req = c.audit_request(7, 50, ["exec.start", "sandbox.create"], "sb-1", 1_700_000_000.5, None)
    assert (req.after_seq, req.limit, list(req.kinds), req.sandbox_id) == (7, 50, ["exec.start", "sandbox.create"], "sb-1")
    assert (req.since_unix_ms, req.until_unix_ms) == (1_700_000_000_500, 0)
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    req = c.audit_request(0, 0, None, None, None, when)
    assert req.until_unix_ms == int(when.timestamp() * 1000) and list(req.kinds) == [] and req.sandbox_id == ""
    for bad in (
        lambda: c.audit_request(-1, 0, None, None, None, None),
        lambda: c.audit_request(0, 0, "exec.start", None, None, None),
        lambda: c.audit_request(0, 0, None, None, "yesterday", None),
    ):
        with pytest.raises(airlock.InvalidArgument):
            bad()


def test_every_log_is_queried_alike():
    """The egress and install logs take the audit trail's filters, built by one function."""
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    for build in (c.egress_log_request, c.install_log_request):
        req = build("sb-1", 3, 10, ["dns", "tcp"], 1_700_000_000, when)
        assert (req.sandbox_id, req.after_seq, req.limit, list(req.kinds)) == ("sb-1", 3, 10, ["dns", "tcp"])
        assert (req.since_unix_ms, req.until_unix_ms) == (1_700_000_000_000, int(when.timestamp() * 1000))
        assert list(build("sb-1", 0, 0).kinds) == [] and build("sb-1", 0, 0).since_unix_ms == 0
        for bad in (
            lambda: build("sb-1", -1, 0),
            lambda: build("sb-1", 0, 0, "dns"),
            lambda: build("sb-1", 0, 0, None, "an hour ago"),
        ):
            with pytest.raises(airlock.InvalidArgument):
                bad()
    log = c.EgressLog.from_pb(pb.GetEgressLogResponse(events=[pb.EgressEvent(seq=4, name="a.example")], dropped=2))
    assert isinstance(log, c.SandboxLog) and log[0].seq == 4 and log.dropped == 2
    log = c.InstallLog.from_pb(pb.GetInstallLogResponse(events=[pb.InstallEvent(seq=1, package="demo")]))
    assert isinstance(log[0], airlock.InstallEvent) and log.dropped == 0


def test_paging_collects_the_head_of_the_last_page():
    events = chain(DETAILS)
    trail = AuditLog()
    trail.extend_page(AuditLog(events[:2], next_after_seq=2, head_seq=5, head_hash=events[-1].hash, first_seq=1))
    assert not trail.verify().ok  # a page alone does not reach the head
    trail.extend_page(AuditLog(events[2:], next_after_seq=0, head_seq=5, head_hash=events[-1].hash, first_seq=1))
    assert list(trail) == events and trail.next_after_seq == 0 and trail.verify().ok


# ---- the clients' calls, against an in-process fake of the daemon's service ----


class FakeAirlock:
    """Serves ListAuditEvents (paged as the daemon pages), CreateSandbox, Exec and
    RemoveSecrets, and keeps the requests it got."""

    def __init__(self, events):
        self.events = [pb.AuditEvent(**e.to_dict()) for e in events]
        self.requests = []

    def ListAuditEvents(self, req, context):
        self.requests.append(req)
        wanted = [e for e in self.events if e.seq > req.after_seq and (not req.kinds or e.kind in req.kinds)]
        limit = req.limit or 1000
        page = wanted[:limit]
        last = self.events[-1]
        return pb.ListAuditEventsResponse(
            events=page,
            next_after_seq=page[-1].seq if len(wanted) > limit else 0,
            head_seq=last.seq,
            head_hash=last.hash,
            first_seq=self.events[0].seq,
        )

    def CreateSandbox(self, req, context):
        self.requests.append(req)
        infos = [
            pb.SecretInfo(name=s.name, delivery=s.WhichOneof("delivery"), targets=[s.env.var or s.name])
            for s in req.secrets
        ]
        return pb.Sandbox(id="sb-1", state=pb.SANDBOX_STATE_RUNNING, secrets=infos)

    def Exec(self, req, context):
        self.requests.append(req)
        return pb.ExecResponse(execution_id="ex-1")

    def RemoveSecrets(self, req, context):
        self.requests.append(req)
        return pb.Sandbox(
            id=req.sandbox_id, secrets=[pb.SecretInfo(name=n, delivery="env", removed=True) for n in req.names]
        )


@pytest.fixture
def fake(tmp_path):
    from concurrent import futures

    import grpc

    servicer = FakeAirlock(chain(DETAILS))
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=getattr(pb, req).FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )
        for name, req in (
            ("ListAuditEvents", "ListAuditEventsRequest"),
            ("CreateSandbox", "CreateSandboxRequest"),
            ("Exec", "ExecRequest"),
            ("RemoveSecrets", "RemoveSecretsRequest"),
        )
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("airlock.v1.Airlock", handlers),))
    address = f"unix://{tmp_path}/fake.sock"
    server.add_insecure_port(address)
    server.start()
    servicer.address = address
    yield servicer
    server.stop(None)


def test_the_sync_client_pages_the_trail_and_sends_secrets(fake):
    with airlock.Client(fake.address) as client:
        page = client.audit_events(2, 2, kinds=["exec.start", "sandbox.create"], since=1.0)
        assert [e.seq for e in page] == [3, 4] and page.next_after_seq == 4 and page.head_seq == 5
        req = fake.requests[-1]
        assert (req.after_seq, req.limit, list(req.kinds), req.since_unix_ms) == (2, 2, ["exec.start", "sandbox.create"], 1000)
        assert [e.seq for e in client.iter_audit_events(page_size=2)] == [1, 2, 3, 4, 5]
        assert [e.seq for e in client.iter_audit_events(kinds=["exec.start"], page_size=1)] == [1, 3, 5]
        trail = client.audit_trail(page_size=2)
        assert [e.seq for e in trail] == [1, 2, 3, 4, 5] and trail.verify().ok

        sb = client.sandboxes.create(secrets=[Secret.env("API_KEY", VALUE)])
        assert fake.requests[-1].secrets[0].value == VALUE
        assert [s.name for s in sb.secrets] == ["API_KEY"]
        ex = sb.start(["true"], secrets={"ONE": "abcd"})
        assert ex.id == "ex-1" and [s.name for s in fake.requests[-1].secrets] == ["ONE"]
        sent = len(fake.requests)
        with pytest.raises(airlock.InvalidArgument):
            sb.start(["true"], secrets=[Secret.file("F", "abcd")])
        assert len(fake.requests) == sent  # refused before any call
        assert sb.remove_secrets("API_KEY") is sb
        assert list(fake.requests[-1].names) == ["API_KEY"] and sb.secrets[0].removed


def test_the_async_client_pages_the_trail_and_sends_secrets(fake):
    import asyncio

    from airlock.aio import AsyncClient

    async def main():
        async with AsyncClient(fake.address) as client:
            page = await client.audit_events(limit=3)
            assert [e.seq for e in page] == [1, 2, 3] and page.next_after_seq == 3
            assert [e.seq async for e in client.iter_audit_events(page_size=2)] == [1, 2, 3, 4, 5]
            trail = await client.audit_trail(page_size=4)
            assert len(trail) == 5 and trail.verify().ok
            sb = await client.sandboxes.create(secrets={"API_KEY": VALUE})
            assert [s.name for s in sb.secrets] == ["API_KEY"]
            ex = await sb.start(["true"], secrets=[Secret.env("ONE", "abcd")])
            assert ex.id == "ex-1" and fake.requests[-1].secrets[0].name == "ONE"
            sent = len(fake.requests)
            with pytest.raises(airlock.InvalidArgument):
                await sb.start(["true"], secrets=[Secret.broker("B", "abcd", ["h.test"])])
            assert len(fake.requests) == sent
            await sb.remove_secrets()
            assert list(fake.requests[-1].names) == []

    asyncio.run(main())
