//! System tests of brokered secrets through airlockd, in real VMs: the egress proxy adds a
//! secret as a header to the sandbox's requests to the hosts it names, over HTTP and (opted in)
//! HTTPS with the sandbox's own CA, while the guest never holds the value. The upstream is a
//! namespace the test makes (`egress/upstream.rs`); traffic stays on this machine.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use airlock_api::v1::{
    CreateSandboxRequest, ListAuditEventsRequest, RemoveSecretsRequest, Secret, SecretBroker,
    SecretEnv, secret,
};
use airlock_system_tests::harness::run_as;
use airlock_system_tests::shared::scenario;

#[path = "egress/upstream.rs"]
mod upstream;
use upstream::*;

/// A value no one guesses, of the shape the guest's scan looks for (`brk-` and 32 hex digits).
fn broker_value(salt: u64) -> String {
    use sha2::Digest as _;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let d = sha2::Sha256::digest(format!("{now} {} {salt}", std::process::id()));
    let hex: String = d.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("brk-{hex}")
}

fn sha256_hex(s: &str) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn broker(name: &str, value: &str, header: &str, format: &str, https: bool) -> Secret {
    Secret {
        name: name.into(),
        value: value.into(),
        delivery: Some(secret::Delivery::Broker(SecretBroker {
            hosts: vec!["allowed.test".into()],
            header: header.into(),
            format: format.into(),
            https,
        })),
        ttl_s: 0,
    }
}

/// The guest's side: requests to a brokered host over HTTP (with a header of its own that the
/// secret replaces) and HTTPS (trusting the system bundle only, where the sandbox's CA is),
/// and to a host no secret names; then a search for the secrets' values in every process's
/// environment, the files under /etc, /run, /tmp, /home, /root and /usr/local (but the base
/// image's Node.js and npm there, ~130 MB of read-only image content that would take minutes to
/// read through the emulated guest kernel of the build machines), and its own memory. The code
/// holds only the values' digests; CONTROL, an environment secret, shows that the search finds
/// what is there.
const BROKER_GUEST: &str = r#"
import hashlib, os, re, urllib.request
def get(url, headers={}):
    req = urllib.request.Request(url, headers=headers)
    print(url, urllib.request.urlopen(req, timeout=60).read().decode())
get('http://allowed.test/one', {'Authorization': 'the-guests-own'})
get('https://allowed.test/two')
get('http://a.wild.test/three')
pat = re.compile(rb'brk-[0-9a-f]{32}')
def hits(data, digests):
    return sum(1 for m in pat.findall(data) if hashlib.sha256(m).hexdigest() in digests)
def search(digests):
    n = 0
    for pid in os.listdir('/proc'):
        if pid.isdigit():
            try:
                n += hits(open(f'/proc/{pid}/environ', 'rb').read(), digests)
            except OSError:
                pass
    for top in ['/etc', '/run', '/tmp', '/home', '/root', '/usr/local']:
        for d, dirs, files in os.walk(top):
            if d == '/usr/local/lib':
                dirs[:] = [x for x in dirs if x != 'node_modules']
            for f in files:
                if os.path.join(d, f) == '/usr/local/bin/node':
                    continue
                try:
                    n += hits(open(os.path.join(d, f), 'rb').read(), digests)
                except OSError:
                    pass
    with open('/proc/self/mem', 'rb', 0) as mem:
        for line in open('/proc/self/maps'):
            parts = line.split()
            if not parts[1].startswith('rw') or (len(parts) > 5 and parts[5] != '[heap]'):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split('-'))
            try:
                mem.seek(lo)
                n += hits(mem.read(hi - lo), digests)
            except OSError:
                pass
    return n
print('traces', search(BROKERED), search(CONTROL) > 0)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn brokered_secrets_reach_the_upstream_as_headers_and_never_the_guest() {
    let up = upstream();
    let (_serial, s) = scenario(&config(up)).await;
    s.clean(&[]).await;
    let mut c = s.client(None).await;
    let (plain, tls, control) = (broker_value(1), broker_value(2), broker_value(3));
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network: Some(domains(&["allowed.test", "a.wild.test"], &[])),
            secrets: vec![
                // Plain HTTP only, as Authorization: Bearer.
                broker("API", &plain, "", "", false),
                // HTTPS too (the proxy terminates TLS with the sandbox's CA), its own header.
                broker("TLSKEY", &tls, "X-Api-Key", "key {value}", true),
                Secret {
                    name: "CONTROL".into(),
                    value: control.clone(),
                    delivery: Some(secret::Delivery::Env(SecretEnv::default())),
                    ttl_s: 0,
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    let before = up.seen().lines().count();
    let code = BROKER_GUEST
        .replace(
            "search(BROKERED)",
            &format!(
                "search({{'{}', '{}'}})",
                sha256_hex(&plain),
                sha256_hex(&tls)
            ),
        )
        .replace(
            "search(CONTROL)",
            &format!("search({{'{}'}})", sha256_hex(&control)),
        );
    let out = python(&mut c, &sb.id, &code, s).await;
    assert_eq!(
        out,
        [
            "http://allowed.test/one hello allowed.test",
            "https://allowed.test/two hello allowed.test",
            "http://a.wild.test/three hello a.wild.test",
            "traces 0 True",
        ],
        "the brokered values are nowhere in the guest; the control is in the environ and the \
         memory of the process"
    );
    let seen: Vec<String> = up.seen().lines().skip(before).map(str::to_owned).collect();
    assert_eq!(
        seen,
        [
            // A secret brokered over HTTPS is added to plain HTTP to its hosts as well.
            format!("http 80 allowed.test auth=Bearer {plain} key=key {tls}"),
            format!("http 443 allowed.test auth=None key=key {tls}"),
            "http 80 a.wild.test auth=None key=None".to_owned(),
        ],
        "each header only where its secret names the host and the scheme, replacing the \
         guest's own"
    );
    let log = log_of(&mut c, &sb.id).await;
    let brokered = log
        .iter()
        .filter(|e| e.allowed && e.verdict.ends_with("; brokered"))
        .count();
    assert_eq!(brokered, 2, "{log:#?}");
    let uses = c
        .list_audit_events(ListAuditEventsRequest {
            sandbox_id: sb.id.clone(),
            kinds: vec!["secret.use".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    let broker_uses: Vec<&str> = uses
        .iter()
        .filter(|e| e.detail_json.contains("\"broker\""))
        .map(|e| e.detail_json.as_str())
        .collect();
    assert_eq!(broker_uses.len(), 2, "{uses:#?}");
    assert!(
        uses.iter()
            .all(|e| !e.detail_json.contains(&plain) && !e.detail_json.contains(&tls)),
        "names only in the audit trail"
    );
    // Removed, the secret is no longer added.
    c.remove_secrets(RemoveSecretsRequest {
        sandbox_id: sb.id.clone(),
        names: vec!["API".into()],
    })
    .await
    .unwrap();
    let (_, err, rec) = run_as(
        &mut c,
        &sb.id,
        "",
        &["wget", "-q", "-O", "/dev/null", "http://allowed.test/four"],
    )
    .await;
    assert_eq!(rec.exit_code, 0, "{err}");
    let last = up.seen().lines().last().unwrap_or_default().to_owned();
    assert_eq!(
        last,
        format!("http 80 allowed.test auth=None key=key {tls}")
    );
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
        sandbox_id: sb.id.clone(),
    })
    .await
    .unwrap();
}
