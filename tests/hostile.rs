//! A hostile tenant (and a careless operator) against the shared daemon, the cheap checks of
//! the security review together: a second daemon sharing a part of the first is refused and
//! kills nothing; a create refused at admission leaves no trace of its secret; the daemon
//! dumps no core; a symlink does not export a denied file under another name; the broker
//! refuses a request with two `Host` headers before its secret goes anywhere; the package
//! proxy fetches no file an index links off its registry's hosts; the E2B gateway
//! closes a socket that never speaks and refuses a declared 1 GiB body without reading it.
//! Each part's own tests go further (daemon/src/instance.rs, lifecycle_tests.rs).
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use airlock_api::v1::{
    CreateSandboxRequest, GetSandboxRequest, ListSandboxesRequest, PackagePolicy, ReadFileRequest,
    Secret, SecretBroker, SecretEnv, secret,
};
use airlock_system_tests::harness::{cgroups_left, read_all, reason, run};
use airlock_system_tests::shared::{Shared, scenario};
use airlock_system_tests::{binary, kernel, rootfs};

#[path = "packages/offregistry.rs"]
mod offregistry;
#[path = "egress/upstream.rs"]
mod upstream;

const TOKEN: &str = "hostile-test-token-mallory";

/// The shared daemon's settings: short listener timeouts, the upstream's host map and CA
/// (`egress/upstream.rs`), a tenant at one sandbox, an E2B gateway on a port of its own, a
/// hostile package registry (`packages/offregistry.rs`).
fn config() -> &'static str {
    static CONFIG: OnceLock<String> = OnceLock::new();
    CONFIG.get_or_init(|| {
        format!(
            "idle_timeout_ms = 1500\ntls_handshake_timeout_ms = 1000\n{}\n\
             [tenants.mallory]\ntokens = [\"{TOKEN}\"]\n\
             [tenants.mallory.quota]\nmax_sandboxes = 1\n\
             [e2b]\nlisten = \"{}\"\ndomain = \"e2b.hostile.test\"\n{}",
            upstream::config(upstream::upstream()),
            gateway_addr(),
            offregistry::off_registry().config(),
        )
    })
}

/// The E2B gateway's address (a free loopback port, picked once).
fn gateway_addr() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
    })
}

/// A second `airlockd` with `data_dir`, `socket`, `cgroup_parent` and uid range: how it ended
/// (it must not start) and its log.
fn second_daemon(
    dir: &Path,
    data_dir: &Path,
    socket: &Path,
    cgroup_parent: &str,
    uid_base: u32,
) -> (std::process::ExitStatus, String) {
    std::fs::create_dir_all(dir).unwrap();
    let config = dir.join("second.toml");
    std::fs::write(
        &config,
        format!(
            "cgroup_parent = \"{cgroup_parent}\"\nkernel = \"{}\"\nrootfs = \"{}\"\n\
             vmm_binary = \"{}\"\n[jail]\nuid_base = {uid_base}\nuid_count = 1000\n",
            kernel().display(),
            rootfs().display(),
            binary("airlock-vmm").display(),
        ),
    )
    .unwrap();
    let log = dir.join("second.log");
    let mut child = Command::new(binary("airlockd"))
        .arg("--config")
        .arg(&config)
        .arg("--listen")
        .arg(format!("unix://{}", socket.display()))
        .arg("--data-dir")
        .arg(data_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the second daemon kept running: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, std::fs::read_to_string(&log).unwrap_or_default())
}

/// The shared daemon's jail uid base, from its settings file.
fn shared_uid_base(s: &Shared) -> u32 {
    let settings = std::fs::read_to_string(s.dir.join("airlockd.toml")).unwrap();
    settings
        .lines()
        .find_map(|l| l.strip_prefix("uid_base = "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The processes of the VMM cgroups under `parent`.
fn vmm_pids(parent: &str) -> Vec<(PathBuf, String)> {
    cgroups_left(parent)
        .into_iter()
        .map(|d| {
            let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
            (d, procs)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_sharing_any_part_is_refused_and_kills_nothing() {
    let (_guard, s) = scenario(config()).await;
    // The shared daemon's warm VMM (pool_size = 1), once it runs in its cgroups (a daemon just
    // started may still be starting it).
    let deadline = Instant::now() + Duration::from_secs(120);
    let before = loop {
        let pids = vmm_pids(&s.cgroup_parent);
        if !pids.is_empty() && pids.iter().all(|(_, procs)| !procs.trim().is_empty()) {
            break pids;
        }
        assert!(
            Instant::now() < deadline,
            "the shared daemon has a warm VMM: {pids:?}\n{}",
            s.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let dir = std::env::temp_dir().join(format!("airlock-hostile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let own_data = dir.join("data");
    let own_socket = dir.join("second.sock");
    let own_parent = format!("airlock-hostile-{}", std::process::id());
    let own_uids = 1_700_000_000 + (std::process::id() % 1000) * 1000;
    let first = format!("pid {}", s.pid);
    let cases = [
        (
            "the cgroup parent",
            own_data.clone(),
            own_socket.clone(),
            s.cgroup_parent.clone(),
            own_uids,
        ),
        (
            "the data directory",
            s.data_dir.clone(),
            own_socket.clone(),
            own_parent.clone(),
            own_uids,
        ),
        (
            "the socket",
            own_data.clone(),
            s.socket.clone(),
            own_parent.clone(),
            own_uids,
        ),
        (
            "uid range",
            own_data.clone(),
            own_socket.clone(),
            own_parent.clone(),
            shared_uid_base(s) + 10,
        ),
    ];
    for (what, data, socket, parent, uids) in cases {
        let (status, log) = second_daemon(&dir, &data, &socket, &parent, uids);
        assert!(!status.success(), "sharing {what}: it started\n{log}");
        assert!(
            log.contains(what) && log.contains(&first),
            "sharing {what}: the refusal names the part and the first daemon ({first})\n{log}"
        );
    }
    // The first daemon lost nothing: its socket answers, its VMMs run in their cgroups.
    let mut c = s.client(None).await;
    c.list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap();
    assert_eq!(vmm_pids(&s.cgroup_parent), before, "{}", s.log_tail());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_refused_by_the_quota_leaves_no_trace_of_its_secret() {
    let (_guard, s) = scenario(config()).await;
    s.clean(&[TOKEN]).await;
    let mut c = s.client(Some(TOKEN)).await;
    let first = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .unwrap()
        .into_inner();
    let value = format!("mallory-canary-{}", std::process::id());
    let with_secret = CreateSandboxRequest {
        secrets: vec![Secret {
            name: "KEY".into(),
            value: value.clone(),
            delivery: Some(secret::Delivery::Env(SecretEnv::default())),
            ttl_s: 0,
        }],
        ..Default::default()
    };
    let err = c.create_sandbox(with_secret).await.unwrap_err();
    assert_eq!(reason(&err).0, "QUOTA_EXCEEDED", "{err:?}");
    // A value the daemon still held would be redacted from the tenant's error messages.
    let err = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: value.clone(),
        })
        .await
        .unwrap_err();
    assert!(
        err.message().contains(&value),
        "the refused create's value is gone: {}",
        err.message()
    );
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
        sandbox_id: first.id,
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_holding_the_secrets_dumps_no_core() {
    let (_guard, s) = scenario(config()).await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", s.pid)).unwrap();
    let core = limits
        .lines()
        .find(|l| l.starts_with("Max core file size"))
        .unwrap();
    let fields: Vec<&str> = core.split_whitespace().collect();
    assert_eq!(fields[4..6], ["0", "0"], "{core}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_does_not_export_a_denied_file_under_another_name() {
    let (_guard, s) = scenario(config()).await;
    s.clean(&[TOKEN]).await;
    let mut c = s.client(Some(TOKEN)).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest::default())
        .await
        .unwrap()
        .into_inner();
    let script = "mkdir -p /tmp/.ssh && echo private-key > /tmp/.ssh/id_rsa && \
                  ln -s .ssh/id_rsa /tmp/notes && echo fine > /tmp/fine && ln -s fine /tmp/ok";
    let (_, err, ex) = run(&mut c, &sb.id, &["sh", "-c", script]).await;
    assert_eq!(ex.exit_code, 0, "{err}");
    assert_eq!(read_all(&mut c, &sb.id, "/tmp/ok").await, b"fine\n");
    let refused = c
        .read_file(ReadFileRequest {
            sandbox_id: sb.id.clone(),
            path: "/tmp/notes".into(),
            ..Default::default()
        })
        .await;
    let err = match refused {
        Err(e) => e,
        Ok(stream) => {
            let mut stream = stream.into_inner();
            match stream.message().await {
                Err(e) => e,
                Ok(m) => panic!("the link exported {m:?}"),
            }
        }
    };
    assert_eq!(reason(&err).0, "EXPORT_DENIED", "{err:?}");
    assert!(err.message().contains("/tmp/.ssh/id_rsa"), "{err:?}");
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest { sandbox_id: sb.id })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_refuses_a_second_host_header_before_the_secret_goes_anywhere() {
    let (_guard, s) = scenario(config()).await;
    s.clean(&[TOKEN]).await;
    let up = upstream::upstream();
    let value = format!("hostile-broker-{}", std::process::id());
    let mut c = s.client(Some(TOKEN)).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network: Some(upstream::domains(&["allowed.test"], &[80])),
            secrets: vec![Secret {
                name: "API".into(),
                value: value.clone(),
                delivery: Some(secret::Delivery::Broker(SecretBroker {
                    hosts: vec!["allowed.test".into()],
                    ..Default::default()
                })),
                ttl_s: 0,
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let seen = up.seen();
    // bash's /dev/tcp: a guest's Python start takes tens of seconds on nested hosts.
    let script = "exec 3<>/dev/tcp/allowed.test/80 && \
        printf 'GET /twice HTTP/1.1\\r\\nHost: allowed.test\\r\\nHost: denied.test\\r\\n\\r\\n' >&3 && \
        head -c 12 <&3";
    let (out, err, _) = run(&mut c, &sb.id, &["bash", "-c", script]).await;
    assert_eq!(out, "HTTP/1.1 400", "{err}\n{}", s.log_tail());
    assert_eq!(up.seen(), seen, "nothing reached the upstream");
    assert!(!up.seen().contains(&value));
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest { sandbox_id: sb.id })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_closes_a_silent_socket_and_refuses_a_1_gib_body() {
    let (_guard, s) = scenario(config()).await;
    airlock_system_tests::limits::gateway_closes_idle_and_refuses_huge_bodies(
        gateway_addr(),
        false,
        Duration::from_secs(3),
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", s.log_tail()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_package_proxy_fetches_no_file_linked_off_its_registry() {
    let (_guard, s) = scenario(config()).await;
    s.clean(&[TOKEN]).await;
    let mut c = s.client(Some(TOKEN)).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            packages: Some(PackagePolicy {
                registries: vec![offregistry::NAME.into()],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    offregistry::off_registry().assert_refused(&sb);
    c.destroy_sandbox(airlock_api::v1::DestroySandboxRequest { sandbox_id: sb.id })
        .await
        .unwrap();
}
