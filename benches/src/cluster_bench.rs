//! `airlock-create-bench --compare-cluster --etcd PATH`: what cluster mode's routing hop costs.
//! One etcd member and two airlockd nodes on this host (`a` and `b`, `[cluster] placement =
//! "pack"`, node a with the smaller capacity: pack places on the node with the fewest free
//! slots, so every sandbox lands on a, the only one holding the template); `runs` rounds, each
//! a create → ready through a (local: the node that runs it) and one through b (forwarded to
//! a), alternating (the order flips every round), each with a's warm pool full; then a
//! GetSandbox and the DestroySandbox of that sandbox through the same node. Both clients use
//! TCP with a tenant token, as a client of a cluster does.
//!
//! Reports `local` and `forwarded`: `create_ms` percentiles (the client's wall time, and the
//! daemon's host share), `get_ms` and `destroy_ms`; the ratios forwarded / local of their p50s
//! and the create's p50 difference (`create_hop_ms_p50`); `misplaced`: sandboxes that did not
//! land on a (not counted).

use super::*;

const TOKEN: &str = "bench-token-of-the-cluster-bench";

/// The etcd member of the bench; killed (by its pid: it is our child) on drop.
struct Etcd(Child);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// One etcd member in `dir`; its client URL once it answers `GET /health`.
async fn start_etcd(
    etcd: &std::path::Path,
    dir: &std::path::Path,
) -> Result<(Etcd, String), String> {
    let (client, peer) = (free_port()?, free_port()?);
    let url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = Command::new(etcd)
        .arg("--name")
        .arg("bench")
        .arg("--data-dir")
        .arg(dir.join("etcd"))
        .args([
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
        ])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .arg("--initial-cluster")
        .arg(format!("bench={peer_url}"))
        .args(["--initial-cluster-state", "new"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("etcd.log")).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", etcd.display()))?;
    let etcd = Etcd(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if http_get(&format!("127.0.0.1:{client}"), "/health")
            .await
            .is_some_and(|b| b.contains("\"health\":\"true\""))
        {
            return Ok((etcd, url));
        }
        if Instant::now() > deadline {
            return Err("etcd is not healthy after 60 s (see etcd.log)".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn http_get(addr: &str, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut body))
        .await
        .ok()?
        .ok()?;
    Some(body)
}

/// A node: an airlockd in `dir` with `config`, listening on its Unix socket and on
/// 127.0.0.1:`port`; the daemon, an operator's client (Unix socket) and the tenant's (TCP).
async fn start_node(
    a: &Args,
    dir: &std::path::Path,
    name: &str,
    port: u16,
    config: &str,
) -> Result<(Daemon, Client, Client), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let cgroup_parent = format!("airlock-bench-cluster-{name}-{}", std::process::id());
    let config_path = dir.join("airlockd.toml");
    std::fs::write(
        &config_path,
        format!(
            "cgroup_parent = \"{cgroup_parent}\"\n\
             kernel = \"{}\"\nrootfs = \"{}\"\nvmm_binary = \"{}\"\nready_timeout_ms = 180000\n\
             metrics_listen = \"{metrics}\"\nmax_committed_mib = 1048576\n\
             adopt_on_restart = false\nallow_insecure_tcp = true\n{config}\n\
             [default_quota]\nmax_sandboxes = 0\nmax_memory_mib = 0\n",
            a.kernel.display(),
            a.rootfs.display(),
            a.vmm.display()
        ),
    )
    .map_err(|e| e.to_string())?;
    let socket = dir.join("airlockd.sock");
    let _ = std::fs::remove_file(&socket);
    let log_path = dir.join("airlockd.log");
    let child = Command::new(&a.daemon)
        .arg("--config")
        .arg(&config_path)
        .arg("--listen")
        .arg(format!("unix://{}", socket.display()))
        .arg("--listen")
        .arg(format!("tcp://127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", a.daemon.display()))?;
    let mut daemon = Daemon {
        child,
        metrics,
        cgroup_parent,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(socket.exists() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()) {
        if let Ok(Some(status)) = daemon.child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!("node {name}: airlockd exited ({status}): {log}"));
        }
        if Instant::now() > deadline {
            return Err(format!("node {name}: airlockd did not listen"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let operator = airlock_api::client(Some(&format!("unix://{}", socket.display())), None)
        .await
        .map_err(|e| e.to_string())?;
    let tenant = airlock_api::client(Some(&format!("http://127.0.0.1:{port}")), Some(TOKEN))
        .await
        .map_err(|e| e.to_string())?;
    Ok((daemon, operator, tenant))
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

#[derive(Default)]
struct Side {
    create: Vec<f64>,
    host: Vec<f64>,
    get: Vec<f64>,
    destroy: Vec<f64>,
    failures: usize,
    misplaced: usize,
}

impl Side {
    fn report(&self) -> serde_json::Value {
        let mut create = summary(&self.create);
        let host = summary(&self.host);
        create["host_p50"] = host["p50"].clone();
        create["host_p99"] = host["p99"].clone();
        serde_json::json!({
            "create_ms": create,
            "get_ms": summary(&self.get),
            "destroy_ms": summary(&self.destroy),
            "failures": self.failures,
            "misplaced": self.misplaced,
        })
    }
}

/// p50 of forwarded / p50 of local.
fn ratio(local: &[f64], forwarded: &[f64]) -> serde_json::Value {
    let p = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        percentile(&s, 50.0)
    };
    let r = p(forwarded) / p(local);
    if r.is_finite() {
        serde_json::json!((r * 1000.0).round() / 1000.0)
    } else {
        serde_json::Value::Null
    }
}

/// One create → ready, get and destroy through `c`, into `side`.
async fn round_trip(c: &Client, side: &mut Side) {
    let mut c = c.clone();
    let t = Instant::now();
    let created = c.create_sandbox(CreateSandboxRequest::default()).await;
    let wall = ms(t);
    let s = match created {
        Ok(s) => s.into_inner(),
        Err(e) => {
            side.failures += 1;
            log(&format!(
                "create failed: {:?} {}",
                airlock_api::error_info(&e).map(|i| i.0),
                e.message()
            ));
            return;
        }
    };
    let placed = s.node == "a";
    if placed {
        side.create.push(wall);
        side.host.push(s.create_host_ms);
    } else {
        side.misplaced += 1;
        log(&format!("{} landed on node {:?}, not a", s.id, s.node));
    }
    let t = Instant::now();
    let got = c
        .get_sandbox(GetSandboxRequest {
            sandbox_id: s.id.clone(),
        })
        .await;
    if placed && got.is_ok() {
        side.get.push(ms(t));
    }
    let t = Instant::now();
    let destroyed = c
        .destroy_sandbox(DestroySandboxRequest {
            sandbox_id: s.id.clone(),
        })
        .await;
    match destroyed {
        Ok(_) if placed => side.destroy.push(ms(t)),
        Ok(_) => {}
        Err(e) => {
            side.failures += 1;
            log(&format!("destroy {}: {}", s.id, e.message()));
        }
    }
}

/// The bench: etcd and two nodes, `runs` rounds of a local and a forwarded round trip.
pub async fn compare_cluster(a: Args) -> Result<serde_json::Value, String> {
    if a.etcd.as_os_str().is_empty() {
        return Err("--compare-cluster needs --etcd PATH (scripts/install-deps.sh --tests)".into());
    }
    let dir = std::env::temp_dir().join(format!("airlock-cluster-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let (_etcd, etcd_url) = start_etcd(&a.etcd, &dir).await?;
    let token_file = dir.join("cluster.token");
    write_token(&token_file)?;
    let (port_a, port_b) = (free_port()?, free_port()?);
    let node = |name: &str, port: u16, capacity: usize, uid_base: u32| {
        format!(
            "pool_size = 2\nmax_sandboxes = {capacity}\n\
             [tenants.bench]\ntokens = [\"{TOKEN}\"]\n\
             [jail]\nuid_base = {uid_base}\nuid_count = 10000\n\
             [cluster]\netcd = [\"{etcd_url}\"]\nnode = \"{name}\"\n\
             advertise = \"http://127.0.0.1:{port}\"\ntoken_file = \"{}\"\n\
             placement = \"pack\"\nlease_ttl_s = 5\n",
            token_file.display()
        )
    };
    // Pack: the fewest free slots first, so a (4) before b (64).
    let node_a = start_node(
        &a,
        &dir.join("a"),
        "a",
        port_a,
        &node("a", port_a, 4, 760_000),
    )
    .await?;
    let node_b = start_node(
        &a,
        &dir.join("b"),
        "b",
        port_b,
        &node("b", port_b, 64, 770_000),
    )
    .await?;
    make_template(&node_a.1).await?;
    wait_listed([&node_a.2, &node_b.2]).await?;
    let mut sides = [Side::default(), Side::default()];
    let clients = [&node_a.2, &node_b.2];
    for round in 0..a.runs {
        for k in 0..2 {
            let i = if round % 2 == 0 { k } else { 1 - k };
            wait_pool(&node_a.0, 2).await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            round_trip(clients[i], &mut sides[i]).await;
        }
        log(&format!("round {}/{}", round + 1, a.runs));
    }
    let out = report(&sides);
    drop(node_b);
    drop(node_a);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(serde_json::Value::Object(out))
}

/// Bench step: the cluster's token, a secret of this run, in `path` (mode 0600).
fn write_token(path: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| e.to_string())?;
    std::io::Write::write_all(
        &mut f,
        format!("cluster-bench-secret-{:032}\n", std::process::id()).as_bytes(),
    )
    .map_err(|e| e.to_string())
}

/// Bench step: waits (up to 60 s) until both nodes are listed, by both.
async fn wait_listed(clients: [&Client; 2]) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    for c in clients {
        loop {
            let n = c
                .clone()
                .list_nodes(ListNodesRequest {})
                .await
                .map(|r| r.into_inner().nodes.len())
                .unwrap_or(0);
            if n == 2 {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("ListNodes lists {n} nodes, not 2, after 60 s"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(())
}

/// Bench step: the report of the local and the forwarded side, their ratios and the hop.
fn report(sides: &[Side; 2]) -> serde_json::Map<String, serde_json::Value> {
    let [local, forwarded] = sides;
    let mut out = serde_json::Map::new();
    out.insert("bench".into(), "cluster".into());
    out.insert("local".into(), local.report());
    out.insert("forwarded".into(), forwarded.report());
    out.insert(
        "create_ratio_p50".into(),
        ratio(&local.create, &forwarded.create),
    );
    let p50 = |v: &[f64]| {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        percentile(&s, 50.0)
    };
    let hop = p50(&forwarded.create) - p50(&local.create);
    out.insert(
        "create_hop_ms_p50".into(),
        if hop.is_finite() {
            serde_json::json!((hop * 1000.0).round() / 1000.0)
        } else {
            serde_json::Value::Null
        },
    );
    out.insert("get_ratio_p50".into(), ratio(&local.get, &forwarded.get));
    out.insert(
        "destroy_ratio_p50".into(),
        ratio(&local.destroy, &forwarded.destroy),
    );
    out.insert("host".into(), host_facts());
    out
}
