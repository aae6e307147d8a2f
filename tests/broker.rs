//! System tests of brokered secrets through airlockd, in real VMs: the egress proxy adds a
//! secret as a header to the sandbox's requests to the hosts it names, over HTTP and (opted in)
//! HTTPS with the sandbox's own CA, while the guest never holds the value. The upstream is a
//! namespace the test makes (`egress/upstream.rs`); traffic stays on this machine.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use airlock_api::v1::{
    CreateSandboxRequest, KillExecutionRequest, ListAuditEventsRequest, RemoveSecretsRequest,
    Secret, SecretBroker, SecretEnv, secret,
};
use airlock_system_tests::harness::{run_as, shell};
use airlock_system_tests::shared::scenario;

#[path = "egress/upstream.rs"]
mod upstream;
use upstream::*;

/// A value no one guesses (`brk-` and 32 hex digits).
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
/// and to a host no secret names.
const BROKER_GUEST: &str = r#"
import urllib.request
def get(url, headers={}):
    req = urllib.request.Request(url, headers=headers)
    print(url, urllib.request.urlopen(req, timeout=60).read().decode())
get('http://allowed.test/one', {'Authorization': 'the-guests-own'})
get('https://allowed.test/two')
get('http://a.wild.test/three')
"#;

/// How often each of `needles` occurs in what the guest has, searched on the host: all of the
/// guest's memory (every process's environment and memory, the page cache of every file it
/// read or wrote, its tmpfs), read through `/proc/PID/mem` from the VMM's mappings of its
/// template's memory file (`memory_inode`), and every sandbox's copy-on-write disk overlay
/// under the daemon's `run_dir` (what the guest wrote to its disks). The host reads in seconds
/// what a search inside the guest reads in minutes through the emulated guest kernel of the
/// build machines, and misses nothing the guest could hide from itself.
fn traces_in_guest(
    vmm_pid: u32,
    memory_inode: u64,
    run_dir: &Path,
    needles: &[&str],
) -> Vec<usize> {
    use std::io::Seek as _;
    let mut counts = vec![0; needles.len()];
    let mut scan = |r: &mut dyn std::io::Read, limit: u64| -> u64 {
        let keep = needles.iter().map(|n| n.len()).max().unwrap_or(1) - 1;
        let mut buf = vec![0u8; 8 << 20];
        let (mut carried, mut read) = (0usize, 0u64);
        while read < limit {
            let want = (buf.len() - carried).min(usize::try_from(limit - read).unwrap());
            let n = r.read(&mut buf[carried..carried + want]).unwrap_or(0);
            if n == 0 {
                break;
            }
            read += n as u64;
            let window = &buf[..carried + n];
            for (i, needle) in needles.iter().enumerate() {
                counts[i] += window
                    .windows(needle.len())
                    .enumerate()
                    .filter(|(at, w)| *w == needle.as_bytes() && at + needle.len() > carried)
                    .count();
            }
            carried = keep.min(window.len());
            let from = window.len() - carried;
            buf.copy_within(from..from + carried, 0);
        }
        read
    };
    let maps = std::fs::read_to_string(format!("/proc/{vmm_pid}/maps")).unwrap();
    let mut mem = std::fs::File::open(format!("/proc/{vmm_pid}/mem")).unwrap();
    let mut memory = 0;
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 5 || f[4].parse::<u64>().ok() != Some(memory_inode) {
            continue;
        }
        let (lo, hi) = f[0].split_once('-').unwrap();
        let (lo, hi) = (
            u64::from_str_radix(lo, 16).unwrap(),
            u64::from_str_radix(hi, 16).unwrap(),
        );
        mem.seek(std::io::SeekFrom::Start(lo)).unwrap();
        memory += scan(&mut mem, hi - lo);
    }
    assert!(
        memory >= 128 << 20,
        "the guest's memory (inode {memory_inode}) is not among VMM {vmm_pid}'s mappings:\n{maps}"
    );
    for vm in std::fs::read_dir(run_dir).unwrap().flatten() {
        if let Ok(mut f) = std::fs::File::open(vm.path().join("root.overlay")) {
            scan(&mut f, u64::MAX);
        }
    }
    counts
}

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
    let out = python(&mut c, &sb.id, BROKER_GUEST, s).await;
    assert_eq!(
        out,
        [
            "http://allowed.test/one hello allowed.test",
            "https://allowed.test/two hello allowed.test",
            "http://a.wild.test/three hello a.wild.test",
        ],
    );
    // The brokered values are nowhere in the guest; the control is, in the environment of the
    // process that holds it (kept running while the host looks).
    let holder = c
        .exec(shell(&sb.id, "sleep 600", 600_000))
        .await
        .unwrap()
        .into_inner();
    let memory = std::fs::metadata(
        s.data_dir
            .join("templates")
            .join(&sb.template_id)
            .join("memory"),
    )
    .unwrap()
    .ino();
    let found = traces_in_guest(
        sb.vmm_pid,
        memory,
        &s.data_dir.join("run"),
        &[&plain, &tls, &control],
    );
    assert_eq!(
        found[..2],
        [0, 0],
        "a brokered value is in the guest's memory or disk"
    );
    assert!(
        found[2] > 0,
        "the search finds the control secret: {found:?}"
    );
    c.kill_execution(KillExecutionRequest {
        execution_id: holder.execution_id,
        ..Default::default()
    })
    .await
    .unwrap();
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
