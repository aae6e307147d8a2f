//! The network commands against the mock: the policy `create` and `net` send, the egress
//! log `egress` prints (paged, followed), the exposure `expose` prints.

use super::*;

#[tokio::test]
async fn create_and_net_send_the_policy() {
    let d = Daemon::start();
    let p = d
        .airlock(&[
            "create",
            "--allow-domain",
            "api.example.com",
            "--allow-cidr",
            "203.0.113.0/24",
            "--allow-port",
            "443",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let policy = d.seen().create.clone().unwrap().network.unwrap();
    assert_eq!(policy.allow.len(), 2);
    assert!(policy.allow.iter().all(|r| r.ports == [443]));

    let p = d
        .airlock(&[
            "net",
            "sb-1",
            "--allow-domain",
            "api.example.com",
            "--allow-domain",
            "*.example.com",
            "--allow-port",
            "443",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let out = text(&p.stdout);
    assert!(out.starts_with("id               sb-1\n"), "{out}");
    assert!(
        out.lines()
            .any(|l| l == "network          api.example.com:443 *.example.com:443"),
        "{out}"
    );
    let req = d.seen().net.clone().unwrap();
    assert_eq!(req.sandbox_id, "sb-1");
    assert_eq!(
        req.network.unwrap().allow[1].target,
        Some(egress_rule::Target::Domain("*.example.com".into()))
    );

    let p = d
        .airlock(&["--json", "net", "sb-1", "--allow-internet"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let v = json(&p.stdout);
    assert_eq!(
        (v["id"].as_str(), v["network"]["allow_internet"].as_bool()),
        (Some("sb-1"), Some(true))
    );

    // No policy named: a usage error, and no call.
    let p = d.airlock(&["net", "sb-1"]).await;
    assert_eq!(p.status.code(), Some(2));
    assert!(
        text(&p.stderr).contains("--deny-all"),
        "{}",
        text(&p.stderr)
    );
    assert!(
        d.seen()
            .net
            .as_ref()
            .unwrap()
            .network
            .as_ref()
            .unwrap()
            .allow_internet
    );

    let p = d.airlock(&["net", "sb-1", "--deny-all"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert!(
        text(&p.stdout)
            .lines()
            .any(|l| l == "network          deny-all")
    );
    assert_eq!(
        d.seen().net.clone().unwrap().network,
        Some(NetworkPolicy::default())
    );

    let p = d
        .airlock(&["net", "sb-1", "--allow-cidr", "10.0.0.0/8"])
        .await;
    assert_eq!(p.status.code(), Some(1));
    assert!(
        text(&p.stderr).contains("NETWORK_NOT_ALLOWED"),
        "{}",
        text(&p.stderr)
    );
}

#[tokio::test]
async fn egress_prints_the_log() {
    let d = Daemon::start();
    let p = d.airlock(&["egress", "sb-1"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let out = text(&p.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "a header and three events: {out}");
    assert!(lines[0].trim_start().starts_with("SEQ "), "{out}");
    for want in [
        "2023-11-14T22:13:20.001Z",
        "dns A",
        "api.example.com",
        "203.0.113.7:53",
        "ALLOWED",
    ] {
        assert!(lines[1].contains(want), "{want}: {}", lines[1]);
    }
    for want in ["tcp", "203.0.113.7:443", "517", "4096", "12.5ms"] {
        assert!(lines[2].contains(want), "{want}: {}", lines[2]);
    }
    for want in ["198.51.100.1:22", "DENIED", "no rule allows it"] {
        assert!(lines[3].contains(want), "{want}: {}", lines[3]);
    }
    assert!(
        text(&p.stderr).contains("5 egress events"),
        "{}",
        text(&p.stderr)
    );
    // Paged until an empty answer.
    let reqs = d.seen().egress.clone();
    assert_eq!(
        reqs.iter()
            .map(|r| (r.after_seq, r.limit))
            .collect::<Vec<_>>(),
        [(0, 0), (3, 0)]
    );

    let p = d
        .airlock(&["--json", "egress", "sb-1", "--after", "1"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let v = json(&p.stdout);
    let events = v.as_array().unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(
        (events[0]["seq"].as_u64(), events[0]["kind"].as_str()),
        (Some(2), Some("tcp"))
    );
    assert_eq!(events[1]["allowed"], false);
    assert_eq!(events[1]["port"], 22);

    d.seen().egress.clear();
    let p = d.airlock(&["egress", "sb-1", "--limit", "2"]).await;
    assert_eq!(text(&p.stdout).lines().count(), 3, "{}", text(&p.stdout));
    let reqs = d.seen().egress.clone();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].limit, 2);

    // Filters go with every page's request, as the audit trail's do.
    d.seen().egress.clear();
    let p = d
        .airlock(&[
            "egress",
            "sb-1",
            "--kind",
            "dns",
            "--kind",
            "tcp",
            "--since",
            "1733560000",
            "--until",
            "10m",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let reqs = d.seen().egress.clone();
    assert_eq!(reqs.len(), 2, "{reqs:?}");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for r in &reqs {
        assert_eq!(r.kinds, ["dns", "tcp"]);
        assert_eq!(r.since_unix_ms, 1_733_560_000_000);
        let ago = now_ms - r.until_unix_ms;
        assert!((590_000..=660_000).contains(&ago), "until: {ago} ms ago");
    }
    let p = d.airlock(&["egress", "sb-1", "--since", "soon"]).await;
    assert_eq!(p.status.code(), Some(2), "a bad time is a usage error");

    // --follow: new events as they come, until the sandbox has ended.
    let p = d
        .airlock(&["--json", "egress", "sb-ending", "--follow"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let seqs: Vec<u64> = text(&p.stdout)
        .lines()
        .map(|l| json(l.as_bytes())["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
    assert_eq!(d.seen().ending_polls, 2);

    let p = d.airlock(&["egress", "sb-1", "--after", "3"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout).lines().count(), 1, "the header alone");

    let p = d.airlock(&["egress", "sb-0"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(p.stdout.is_empty());
    assert!(text(&p.stderr).contains("SANDBOX_NOT_FOUND"));
    assert_eq!(
        d.airlock(&["egress", "sb-1", "--limit", "1", "--follow"])
            .await
            .status
            .code(),
        Some(2)
    );
}

#[tokio::test]
async fn expose_prints_the_address_token_and_expiry() {
    let d = Daemon::start();
    let p = d.airlock(&["expose", "sb-1", "8000"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(
        text(&p.stdout),
        "address          127.0.0.1:40123\n\
         token            tok-8f3a\n\
         expires          2023-11-14T22:18:20.000Z\n"
    );
    let req = d.seen().expose.clone().unwrap();
    assert_eq!(
        (req.sandbox_id.as_str(), req.guest_port, req.ttl_s),
        ("sb-1", 8000, 0)
    );

    let p = d
        .airlock(&["--json", "expose", "sb-1", "8080", "--ttl", "60"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(
        json(&p.stdout),
        serde_json::json!({
            "sandbox_id": "sb-1", "guest_port": 8080, "address": "127.0.0.1:40123",
            "token": "tok-8f3a", "expires_unix_ms": 1_700_000_060_000_i64,
        })
    );
    assert_eq!(d.seen().expose.as_ref().unwrap().ttl_s, 60);

    // The callers' connections show in the egress log as `expose`.
    let p = d.airlock(&["egress", "sb-1", "--after", "3"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let out = text(&p.stdout);
    let line = out.lines().nth(1).unwrap_or_default();
    for want in ["expose", "127.0.0.1:51234", "ALLOWED"] {
        assert!(line.contains(want), "{want}: {out}");
    }
    let v = json(
        &d.airlock(&["--json", "egress", "sb-1", "--after", "3"])
            .await
            .stdout,
    );
    assert_eq!(v[0]["kind"], "expose");

    let p = d.airlock(&["expose", "sb-0", "8000"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(p.stdout.is_empty());
    assert!(text(&p.stderr).contains("SANDBOX_NOT_FOUND"));
    for bad in [
        &["expose", "sb-1"][..],
        &["expose", "sb-1", "0"],
        &["expose", "sb-1", "70000"],
    ] {
        assert_eq!(d.airlock(bad).await.status.code(), Some(2), "{bad:?}");
    }
}
