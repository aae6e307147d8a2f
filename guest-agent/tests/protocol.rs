//! Protocol tests of the connection itself against the real agent: Ready, Ping, ids and kinds,
//! malformed and oversized frames, several connections, disconnects and PowerOff.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use airlock_proto::pb::{ErrorCode, Ping, Request, Response, request, response};
use airlock_proto::{AgentClient, PROTOCOL_VERSION, Requests, encode_frame, read_frame};
use common::*;

/// Reads frames until the agent closes; returns them.
fn read_until_closed(s: &mut std::os::unix::net::UnixStream) -> Vec<Response> {
    let mut frames = Vec::new();
    loop {
        match read_frame::<_, Response>(s) {
            Ok(Some(f)) => frames.push(f),
            // EOF, or a reset because the agent closed with our unread bytes pending.
            Ok(None) | Err(_) => return frames,
        }
    }
}

fn error_of(resp: &Response) -> (u64, i32) {
    match &resp.kind {
        Some(response::Kind::Error(e)) => (resp.id, e.code),
        other => panic!("expected Error, got {other:?}"),
    }
}

#[test]
fn ready_reports_version_capabilities_and_machine_facts() {
    let agent = AgentProcess::start();
    let c = agent.client();
    let ready = c.ready();
    assert_eq!(ready.protocol_version, PROTOCOL_VERSION);
    assert_eq!(ready.agent_version, env!("CARGO_PKG_VERSION"));
    for cap in ["exec", "stdin", "signal", "files", "process-groups"] {
        assert!(
            ready.capabilities.iter().any(|c| c == cap),
            "{cap}: {ready:?}"
        );
    }
    assert!(!ready.capabilities.iter().any(|c| c == "cgroups"));
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert_eq!(ready.hostname, hostname.trim());
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    let expected_cpus = online
        .trim()
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<u32>().unwrap() - a.parse::<u32>().unwrap() + 1,
            None => 1,
        })
        .sum::<u32>();
    assert_eq!(ready.cpus, expected_cpus);
    assert!(ready.mem_total_bytes > 64 << 20);
    let uptime_ms = std::fs::read_to_string("/proc/uptime").unwrap();
    let uptime_ms = (uptime_ms
        .split_whitespace()
        .next()
        .unwrap()
        .parse::<f64>()
        .unwrap()
        * 1000.0) as u64;
    assert!(ready.boot_time_ms > 0 && ready.boot_time_ms <= uptime_ms + 1000);
}

#[test]
fn every_connection_starts_with_the_same_ready() {
    let agent = AgentProcess::start();
    let a = agent.client();
    let b = agent.client();
    assert_eq!(a.ready(), b.ready());
}

#[test]
fn ping_answers_pong_with_uptime() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let boot = c.ready().boot_time_ms;
    let pong = c.ping().unwrap();
    assert!(pong.uptime_ms >= boot);
}

#[test]
fn request_id_zero_is_invalid_and_the_connection_goes_on() {
    let agent = AgentProcess::start();
    let mut s = agent.raw();
    let _ready: Response = read_frame(&mut s).unwrap().unwrap();
    let ping = |id| Request {
        id,
        kind: Some(request::Kind::Ping(Ping {})),
    };
    s.write_all(&encode_frame(&ping(0)).unwrap()).unwrap();
    let resp: Response = read_frame(&mut s).unwrap().unwrap();
    assert_eq!(error_of(&resp), (0, ErrorCode::InvalidArgument as i32));
    s.write_all(&encode_frame(&ping(5)).unwrap()).unwrap();
    let resp: Response = read_frame(&mut s).unwrap().unwrap();
    assert_eq!(resp.id, 5);
    assert!(matches!(resp.kind, Some(response::Kind::Pong(_))));
}

#[test]
fn unknown_request_kind_is_unsupported() {
    let agent = AgentProcess::start();
    let mut s = agent.raw();
    let _ready: Response = read_frame(&mut s).unwrap().unwrap();
    // id 9, then field 99 (a request kind from a newer protocol), varint 1.
    let body = [0x08, 9, 0x98, 0x06, 1];
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    s.write_all(&frame).unwrap();
    let resp: Response = read_frame(&mut s).unwrap().unwrap();
    assert_eq!(error_of(&resp), (9, ErrorCode::Unsupported as i32));
}

#[test]
fn oversize_frame_is_answered_with_an_error_and_closes_only_that_connection() {
    let agent = AgentProcess::start();
    let mut s = agent.raw();
    let _ready: Response = read_frame(&mut s).unwrap().unwrap();
    s.write_all(&(100u32 << 20).to_le_bytes()).unwrap();
    let frames = read_until_closed(&mut s);
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(error_of(&frames[0]), (0, ErrorCode::TooLarge as i32));
    let mut fresh = agent.client();
    fresh.ping().unwrap();
}

#[test]
fn garbage_frame_is_answered_with_an_error_and_closes_only_that_connection() {
    let agent = AgentProcess::start();
    let mut other = agent.client();
    let mut s = agent.raw();
    let _ready: Response = read_frame(&mut s).unwrap().unwrap();
    s.write_all(&[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).unwrap();
    let frames = read_until_closed(&mut s);
    assert_eq!(frames.len(), 1, "{frames:?}");
    assert_eq!(error_of(&frames[0]), (0, ErrorCode::InvalidArgument as i32));
    // Other connections are untouched, new ones work.
    other.ping().unwrap();
    agent.client().ping().unwrap();
}

#[test]
fn connection_dropped_mid_frame_leaves_the_agent_serving() {
    let agent = AgentProcess::start();
    {
        let mut s = agent.raw();
        let _ready: Response = read_frame(&mut s).unwrap().unwrap();
        s.write_all(&[200, 0, 0, 0, 1, 2]).unwrap();
    }
    {
        let mut s = agent.raw();
        s.write_all(&[1, 0]).unwrap();
    }
    agent.client().ping().unwrap();
}

#[test]
fn requests_on_several_connections_are_served_independently() {
    let agent = AgentProcess::start();
    let mut clients: Vec<_> = (0..4).map(|_| agent.client()).collect();
    let mut slow = agent.client();
    let slow_id = slow
        .send_kind(request::Kind::Exec(argv(&["sleep", "600"])))
        .unwrap();
    let slow_exec = slow.exec_started(slow_id).unwrap();
    for (i, c) in clients.iter_mut().enumerate() {
        let out = run(c, shell(&format!("echo conn{i}")));
        assert_eq!(out.stdout_str(), format!("conn{i}\n"));
    }
    // An execution is only visible from its own connection.
    let err = clients[0]
        .signal(slow_exec.exec_id, libc::SIGKILL)
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
    slow.signal(slow_exec.exec_id, libc::SIGKILL).unwrap();
}

#[test]
fn closing_a_connection_kills_its_executions() {
    let agent = AgentProcess::start();
    let pid = {
        let mut c = agent.client();
        let id = c
            .send_kind(request::Kind::Exec(shell("sleep 600 & sleep 600")))
            .unwrap();
        c.exec_started(id).unwrap().pid
    };
    assert!(
        eventually(Duration::from_secs(10), || group_members(pid).is_empty()),
        "processes of a closed connection survive: {:?}",
        group_members(pid)
    );
    agent.client().ping().unwrap();
}

#[test]
fn power_off_in_host_mode_answers_ok_and_exits() {
    let mut agent = AgentProcess::start();
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(argv(&["sleep", "600"])))
        .unwrap();
    let sleeper = c.exec_started(id).unwrap().pid;
    c.power_off().unwrap();
    let status = agent.wait_exit(Duration::from_secs(20));
    assert_eq!(status.and_then(|s| s.code()), Some(0));
    assert!(
        eventually(Duration::from_secs(10), || !alive(sleeper)),
        "execution survived power-off"
    );
    assert!(AgentClient::connect_unix(&agent.socket).is_err());
}

#[test]
fn a_client_that_reads_nothing_blocks_output_without_harming_others() {
    let agent = AgentProcess::start();
    let mut s = agent.raw();
    let _ready: Response = read_frame(&mut s).unwrap().unwrap();
    // 50 MB of output that nobody reads: the agent must block, not buffer it all.
    let mut exec = shell("head -c 50000000 /dev/zero; echo done >&2");
    exec.max_output_bytes = 100 << 20;
    let req = Request {
        id: 1,
        kind: Some(request::Kind::Exec(exec)),
    };
    s.write_all(&encode_frame(&req).unwrap()).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let rss_kib = |pid: u32| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    };
    assert!(rss_kib(agent.pid()) < 40_000, "agent buffers unread output");
    agent.client().ping().unwrap();
    // Draining it now delivers everything.
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut raw = Vec::new();
    loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed early");
        raw.extend_from_slice(&buf[..n]);
        let mut cursor = raw.as_slice();
        let mut consumed = 0;
        let mut exited = false;
        while let Ok(Some(resp)) = read_frame::<_, Response>(&mut cursor) {
            consumed = raw.len() - cursor.len();
            match resp.kind {
                Some(response::Kind::Output(o)) if o.stream == 1 => total += o.data.len() as u64,
                Some(response::Kind::ExecExit(_)) => exited = true,
                _ => {}
            }
        }
        raw.drain(..consumed);
        if exited {
            break;
        }
    }
    assert_eq!(total, 50_000_000);
}
