//! The cluster of the test process: a three-member etcd cluster and three `airlockd` nodes
//! ("a", "b", "c") coordinated through it, started by the first scenario and shared by all of
//! them, one scenario at a time ([`scenario`]); everything is stopped when the process exits
//! (an `atexit` handler; processes get SIGTERM from the kernel if the process dies without
//! exiting).
//!
//! Each node is started as the harness starts a daemon (`harness::daemon_setup`: its own
//! directory, data directory, Unix socket and cgroup parent) plus a plaintext TCP listener on
//! loopback (`allow_insecure_tcp`), which the scenarios' clients and the other nodes use; its
//! own `[jail]` uid range; `adopt_on_restart` (a killed node's VMMs keep running and are
//! adopted again); two tenants (one with a quota of 2 sandboxes); and the `[cluster]` section.
//! Node "a" starts with the template `base` (imported from this run's test-template cache, as
//! `shared.rs` does, else built once and put there); b and c start without any.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use airlock_api::v1::*;
use airlock_system_tests::harness::{self, Client, tail};
use airlock_system_tests::shared::{EXPORT_RECORD, export_template, template_cache_dir};

use super::etcd::Etcd;
use super::procs;

/// The tenant of most scenarios, and one whose quota is 2 sandboxes at once.
pub const TOKEN: &str = "token-of-acme-in-the-cluster";
pub const CAPPED_TOKEN: &str = "token-of-capped-in-the-cluster";
pub const CAPPED_MAX: usize = 2;
/// `[cluster] lease_ttl_s`: how long a node that stopped renewing its lease is still counted.
pub const LEASE_TTL_S: u64 = 3;
/// The nodes' names.
pub const NAMES: [&str; 3] = ["a", "b", "c"];
const ETCD_MEMBERS: usize = 3;
/// The nodes' jail uid ranges: `UID_BASE + UID_STRIDE * i ..+ UID_STRIDE`, apart from each
/// other and from the other tests' daemons (the default range 1.9e9.., tests/jail.rs 1.8e9..).
const UID_BASE: u32 = 700_000;
const UID_STRIDE: u32 = 10_000;

/// One airlockd of the cluster.
#[derive(Debug)]
pub struct Node {
    pub name: &'static str,
    pub dir: PathBuf,
    /// Its TCP listener on 127.0.0.1 (also its `[cluster] advertise`).
    pub port: u16,
    pub cgroup_parent: String,
    /// Its settings beyond the harness's.
    extra: String,
    run: Mutex<Running>,
}

#[derive(Debug, Default)]
struct Running {
    pid: Option<i32>,
    log: PathBuf,
}

impl Node {
    /// `http://127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("airlockd.sock")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn pid(&self) -> Option<i32> {
        self.run.lock().unwrap_or_else(|e| e.into_inner()).pid
    }

    /// The log of its current (or last) process.
    pub fn log(&self) -> PathBuf {
        self.run
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .log
            .clone()
    }

    /// A client of this node over its TCP listener, as the tenant of `token`.
    pub async fn client(&self, token: &str) -> Client {
        airlock_api::client(Some(&self.address()), Some(token))
            .await
            .unwrap_or_else(|e| panic!("connect to node {}: {e}", self.name))
    }

    /// Starts its airlockd (on the same directory and settings as before, if it ran) and waits
    /// until both its listeners answer; fails at once with its log if it exits.
    pub fn start(&self) {
        assert!(self.pid().is_none(), "node {} runs already", self.name);
        let mut setup = harness::daemon_setup(&self.dir, &self.cgroup_parent, &self.extra);
        setup
            .command
            .arg("--listen")
            .arg(format!("tcp://127.0.0.1:{}", self.port));
        let log = setup.log.clone();
        let pid = procs::spawn(setup.command);
        *self.run.lock().unwrap_or_else(|e| e.into_inner()) = Running {
            pid: Some(pid),
            log: log.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(setup.socket.exists()
            && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok())
        {
            assert!(
                procs::running(pid),
                "airlockd of node {} exited at its start:\n{}",
                self.name,
                tail(&log)
            );
            assert!(
                Instant::now() < deadline,
                "airlockd of node {} does not listen after 60 s:\n{}",
                self.name,
                tail(&log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills its airlockd outright (SIGKILL; its VMMs keep running) and reaps it.
    pub fn kill(&self) {
        let pid = self
            .run
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pid
            .take();
        procs::kill(pid.unwrap_or_else(|| panic!("node {} does not run", self.name)));
    }

    /// Stops its airlockd (SIGTERM, then SIGKILL after `grace`).
    fn stop(&self, grace: Duration) {
        let pid = self
            .run
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pid
            .take();
        if let Some(pid) = pid {
            procs::stop(pid, grace);
        }
    }

    fn running(&self) -> bool {
        self.pid().is_some_and(procs::running)
    }
}

/// The cluster.
#[derive(Debug)]
pub struct Cluster {
    pub dir: PathBuf,
    pub etcd: Etcd,
    pub nodes: Vec<Node>,
    template: OnceLock<Template>,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();
/// Set while the cluster starts: a start that failed fails every later scenario at once.
static STARTING: AtomicBool = AtomicBool::new(false);
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The cluster (started by the first caller), whole (every etcd member and node running: a
/// scenario that failed half-way may have left one down) and clean (no live sandbox of either
/// tenant, every node counting none), and the lock that keeps scenarios one at a time.
pub async fn scenario() -> (tokio::sync::MutexGuard<'static, ()>, &'static Cluster) {
    let guard = SERIAL.lock().await;
    let cluster = match CLUSTER.get() {
        Some(c) => {
            assert!(
                !STARTING.load(Ordering::SeqCst),
                "the cluster did not start: see the first scenario's failure"
            );
            c
        }
        None => {
            airlock_system_tests::require_kvm();
            let c = CLUSTER.get_or_init(Cluster::new);
            // SAFETY: registers a plain `extern "C"` function that runs at exit.
            unsafe { libc::atexit(stop_at_exit) };
            STARTING.store(true, Ordering::SeqCst);
            let t = Instant::now();
            tokio::task::block_in_place(|| c.start());
            eprintln!("cluster started in {:.1} s", t.elapsed().as_secs_f64());
            STARTING.store(false, Ordering::SeqCst);
            c
        }
    };
    tokio::task::block_in_place(|| cluster.make_whole());
    cluster.clean().await;
    (guard, cluster)
}

impl Cluster {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("airlock-cluster-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let etcd = Etcd::new(&dir, ETCD_MEMBERS);
        // The shared secret of node-to-node calls: one file for all, 0600, >= 32 characters.
        let token_file = dir.join("cluster.token");
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&token_file)
                .expect("cluster token file");
            std::io::Write::write_all(
                &mut f,
                format!("cluster-secret-of-test-{:032}\n", std::process::id()).as_bytes(),
            )
            .expect("write the cluster token");
        }
        let cached = template_cache_dir();
        let ports = procs::free_ports(NAMES.len());
        let endpoints: Vec<String> = etcd
            .endpoints()
            .iter()
            .map(|e| format!("\"{e}\""))
            .collect();
        let nodes = NAMES
            .iter()
            .enumerate()
            .map(|(i, &name)| {
                let node_dir = dir.join(format!("node-{name}"));
                std::fs::create_dir_all(node_dir.join("data")).expect("node directory");
                // Node a starts with the template when this run has it already.
                let import = match &cached {
                    Some(d) if i == 0 && d.join(EXPORT_RECORD).is_file() => {
                        format!("import_templates = [{:?}]\n", d.display().to_string())
                    }
                    _ => String::new(),
                };
                let extra = format!(
                    "{import}pool_size = 1\nmax_sandboxes = 8\nadopt_on_restart = true\n\
                     allow_insecure_tcp = true\n\
                     [tenants.acme]\ntokens = [\"{TOKEN}\"]\n\
                     [tenants.capped]\ntokens = [\"{CAPPED_TOKEN}\"]\n\
                     [tenants.capped.quota]\nmax_sandboxes = {CAPPED_MAX}\n\
                     [jail]\nuid_base = {}\nuid_count = {UID_STRIDE}\n\
                     [cluster]\netcd = [{}]\n{}node = \"{name}\"\n\
                     advertise = \"http://127.0.0.1:{}\"\ntoken_file = \"{}\"\n\
                     placement = \"spread\"\nlease_ttl_s = {LEASE_TTL_S}\n",
                    UID_BASE + UID_STRIDE * i as u32,
                    endpoints.join(", "),
                    etcd.tls_settings(),
                    ports[i],
                    token_file.display(),
                );
                Node {
                    name,
                    dir: node_dir,
                    port: ports[i],
                    cgroup_parent: format!("airlock-cluster-{}-{name}", std::process::id()),
                    extra,
                    run: Mutex::new(Running::default()),
                }
            })
            .collect();
        Self {
            dir,
            etcd,
            nodes,
            template: OnceLock::new(),
        }
    }

    /// Etcd, then the three nodes, then the template on node a (imported or built), then the
    /// three nodes listed by each of them.
    fn start(&self) {
        let mut t = Instant::now();
        self.etcd.start();
        self.etcd.put_get(0, "/airlock-test/hello", "world");
        airlock_system_tests::step("etcd: 3 members healthy", &mut t);
        for n in &self.nodes {
            n.start();
        }
        airlock_system_tests::step("3 airlockd nodes listening", &mut t);
        let template = blocking(self.node("a").socket(), |mut c, _| async move {
            c.list_templates(ListTemplatesRequest {})
                .await
                .ok()?
                .into_inner()
                .templates
                .into_iter()
                .find(|t| t.name == "base")
        });
        let template = match template {
            Some(found) => {
                airlock_system_tests::step("template imported on node a", &mut t);
                found
            }
            None => {
                let a = self.node("a");
                let log = a.log();
                let built = blocking(a.socket(), |mut c, _| async move {
                    harness::build_template(&mut c, "base", &log).await
                });
                if let Some(to) = template_cache_dir() {
                    export_template(&a.data_dir().join("templates").join(&built.id), &built, &to);
                }
                airlock_system_tests::step("template built on node a", &mut t);
                built
            }
        };
        let _ = self.template.set(template);
        let want = NAMES.len();
        for n in &self.nodes {
            let names = blocking_tcp(n.address(), move |mut c| async move {
                wait_nodes(&mut c, want, Duration::from_secs(60)).await
            });
            assert_eq!(
                names,
                NAMES.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
                "ListNodes through {}\n{}",
                n.name,
                self.logs()
            );
        }
        airlock_system_tests::step("every node lists the 3 nodes", &mut t);
        // A node lists a template once it has its manifest (the SHA-256 of its files, which
        // the others fetch it by): until then no other node can get it.
        let listed = blocking_tcp(self.node("b").address(), |mut c| async move {
            let deadline = Instant::now() + Duration::from_secs(180);
            loop {
                let nodes = c
                    .list_nodes(ListNodesRequest {})
                    .await
                    .map(|r| r.into_inner().nodes)
                    .unwrap_or_default();
                let a_holds = nodes
                    .iter()
                    .any(|n| n.name == "a" && n.templates.iter().any(|t| t.ends_with("/base")));
                if a_holds || Instant::now() > deadline {
                    return (a_holds, nodes);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        assert!(
            listed.0,
            "node a does not list the template base 180 s after it had it: {:?}\n{}",
            listed.1,
            self.logs()
        );
        airlock_system_tests::step("node a lists the template", &mut t);
        for n in &listed.1 {
            eprintln!(
                "node {} tag {} at {}: {} sandboxes of {}, templates {:?}",
                n.name, n.tag, n.address, n.sandboxes, n.max_sandboxes, n.templates
            );
        }
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// The template `base` (on node a from the start).
    pub fn template(&self) -> &Template {
        self.template.get().expect("the cluster started")
    }

    /// The last lines of every node's log, for failure messages.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("--- node {} ---\n{}", n.name, tail(&n.log())))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Restarts whatever is down: etcd members, then nodes.
    fn make_whole(&self) {
        self.etcd.make_whole();
        for n in &self.nodes {
            if !n.running() {
                eprintln!("node {} was down: started again", n.name);
                let stale = n.run.lock().unwrap_or_else(|e| e.into_inner()).pid.take();
                if let Some(pid) = stale {
                    procs::kill(pid);
                }
                n.start();
            }
        }
    }

    /// Destroys every live sandbox of both tenants (what a failed scenario left) and waits until
    /// every node is listed, counting none (placement starts even).
    async fn clean(&self) {
        let a = self.node("a");
        for token in [TOKEN, CAPPED_TOKEN] {
            let mut c = a.client(token).await;
            let live = c
                .list_sandboxes(ListSandboxesRequest::default())
                .await
                .unwrap_or_else(|e| panic!("list through a: {e:?}\n{}", self.logs()))
                .into_inner()
                .sandboxes;
            for s in live {
                eprintln!("left by an earlier scenario: {} on {}", s.id, s.node);
                let _ = c
                    .destroy_sandbox(DestroySandboxRequest { sandbox_id: s.id })
                    .await;
            }
        }
        let mut c = a.client(TOKEN).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let nodes = c
                .list_nodes(ListNodesRequest {})
                .await
                .unwrap_or_else(|e| panic!("ListNodes through a: {e:?}\n{}", self.logs()))
                .into_inner()
                .nodes;
            if nodes.len() == NAMES.len() && nodes.iter().all(|n| n.sandboxes == 0) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster is not whole and empty after 30 s: {nodes:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// ListNodes through `c` until it lists `want` nodes (at most `within`); their names, sorted.
pub async fn wait_nodes(c: &mut Client, want: usize, within: Duration) -> Vec<String> {
    let deadline = Instant::now() + within;
    loop {
        let listed = c.list_nodes(ListNodesRequest {}).await;
        let mut names: Vec<String> = match &listed {
            Ok(r) => r.get_ref().nodes.iter().map(|n| n.name.clone()).collect(),
            Err(_) => Vec::new(),
        };
        names.sort();
        if names.len() == want || Instant::now() >= deadline {
            if let Err(e) = listed {
                panic!("ListNodes: {e:?}");
            }
            return names;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs `f` with an operator's client of the node at `socket` on a thread and runtime of its
/// own (the callers block).
fn blocking<T, F, Fut>(socket: PathBuf, f: F) -> T
where
    T: Send + 'static,
    F: FnOnce(Client, PathBuf) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let c = airlock_api::client(Some(&format!("unix://{}", socket.display())), None)
                .await
                .expect("connect to node a");
            f(c, socket).await
        })
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

/// [`blocking`] with a tenant's client over TCP.
fn blocking_tcp<T, F, Fut>(address: String, f: F) -> T
where
    T: Send + 'static,
    F: FnOnce(Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let c = airlock_api::client(Some(&address), Some(TOKEN))
                .await
                .unwrap_or_else(|e| panic!("connect to {address}: {e}"));
            f(c).await
        })
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

// ---- the test-template cache (the same entries as `shared.rs` keeps) ----

// ---- the end ----

/// At exit: destroys what is left (the nodes keep sandboxes over a stop: adopt_on_restart),
/// stops the nodes (SIGTERM, then SIGKILL), kills any VMM still running from their data
/// directories (by pid), removes their cgroups, stops etcd and removes the directory.
extern "C" fn stop_at_exit() {
    let Some(c) = CLUSTER.get() else { return };
    let live: Vec<(String, PathBuf)> = c
        .nodes
        .iter()
        .filter(|n| n.running())
        .map(|n| (n.address(), n.socket()))
        .collect();
    if let Some((address, _)) = live.first().cloned() {
        let done = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(60), async {
                    for token in [TOKEN, CAPPED_TOKEN] {
                        let Ok(mut cl) = airlock_api::client(Some(&address), Some(token)).await
                        else {
                            continue;
                        };
                        let Ok(list) = cl.list_sandboxes(ListSandboxesRequest::default()).await
                        else {
                            continue;
                        };
                        for s in list.into_inner().sandboxes {
                            let _ = cl
                                .destroy_sandbox(DestroySandboxRequest { sandbox_id: s.id })
                                .await;
                        }
                    }
                })
                .await;
            });
        });
        let _ = done.join();
    }
    for n in &c.nodes {
        n.stop(Duration::from_secs(30));
    }
    for n in &c.nodes {
        let data = n.data_dir().display().to_string();
        for pid in harness::processes_mentioning(&data) {
            let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmd| !String::from_utf8_lossy(&cmd).contains("airlockd"));
            if ours {
                eprintln!("node {}: VMM {pid} left running: killed", n.name);
                // SAFETY: kill(2) by pid, of a VMM one of our nodes started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    for n in &c.nodes {
        for dir in harness::cgroups_left(&n.cgroup_parent) {
            let _ = std::fs::remove_dir(dir);
        }
        harness::remove_parent_cgroups(&n.cgroup_parent);
    }
    c.etcd.stop();
    let _ = std::fs::remove_dir_all(&c.dir);
}
