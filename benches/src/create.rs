//! `airlock-create-bench`: CreateSandbox → ready through a live `airlockd` and its gRPC API, at
//! several concurrency levels with a warm pool, and the host memory of many idle sandboxes.
//! Prints progress to stderr and one JSON object as the last line of stdout.
//!
//! Usage: airlock-create-bench --daemon PATH --vmm PATH --kernel PATH --rootfs PATH
//!        [--runs N] [--levels 1,10,50] [--idle N] [--compare-jail]
//!        [--exec-runs N] [--exec-mib M] [--compare-disk [--dd-runs N] [--dd-mib M]]
//!        [--compare-cluster --etcd PATH]
//!        [--compare-image [--create-runs N] [--image-mib M]]
//!
//! `--compare-image`: templates from OCI images, cold and warm imports from a local registry
//! and create → ready of sandboxes of an imported template against `base` (see
//! `image_bench.rs`).
//!
//! `--compare-cluster`: cluster mode's routing hop, create → ready through the node that runs
//! the sandbox and through another that forwards it (see `cluster_bench.rs`).
//!
//! `--compare-disk`: with and without a writable root, side by side (see `disk_bench.rs`).
//!
//! `--net-run [--config-extra TOML] [--allow-domain NAME]... -- ARGV...`: one daemon (pool of
//! one, `TOML` added to its configuration: say a `[network.hosts]` table), the template, one
//! sandbox whose network policy allows the domains NAME, and ARGV run in it as root; the
//! execution's stderr goes to stderr as it comes, its stdout to stdout; exits with its code
//! (benches/net.py: the guest's TCP through the daemon's egress proxy).
//!
//! `--compare-jail`: two daemons side by side, one jailing its VMMs (the default) and one with
//! `[jail] enabled = false, seccomp = false`, restoring the same template snapshot (built once,
//! by the jailed daemon); `runs` creates each, alternating one by one (the order flips every
//! round), each with a full warm pool. Reports `jailed` and `unjailed`
//! (`create_ms` percentiles, the host's share, restore, guest), the differences of their p50s,
//! and `vmm_spawn_ms`/`vmm_ready_ms` of each: a warm VMM's start, spawn to exec'd in its jail
//! and to its control socket answering (off the create path: the pool refills afterwards).
//!
//! For each level L: batches of L concurrent creates (at least `runs` creates in all, at least
//! one batch), each started once the warm pool holds L processes again. Per call: the client's
//! wall time, and the daemon's split into the host's share (`create_host_ms`: from the request
//! to the answer, without the wait for the guest) and the guest's. `creates_per_s`: creates of
//! the largest level's batches divided by their wall time. `queue_p50`: time creates waited
//! for one of the daemon's start slots (it runs twice the CPU count of restores at once).
//! `idle<N>_host_mib`: the summed PSS of the daemon and N idle sandboxes' VMM processes (guest
//! memory included), next to N × the guest memory size.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use airlock_api::v1::*;

type Client = airlock_client::AirlockClient<airlock_api::AuthChannel>;

#[derive(Debug)]
struct Args {
    daemon: PathBuf,
    vmm: PathBuf,
    kernel: PathBuf,
    rootfs: PathBuf,
    runs: usize,
    levels: Vec<usize>,
    idle: usize,
    /// Instead of the levels: create → ready with and without the jail, side by side.
    compare_jail: bool,
    /// Instead of the levels: with and without a writable root, side by side (disk_bench.rs).
    compare_disk: bool,
    /// Instead of the levels: local and forwarded calls of a two-node cluster
    /// (cluster_bench.rs), with the etcd binary `etcd`.
    compare_cluster: bool,
    etcd: PathBuf,
    /// Instead of the levels: OCI image imports and their templates' creates (image_bench.rs),
    /// `runs` imports, `create_runs` creates of each template, an image of `image_mib` MiB.
    compare_image: bool,
    create_runs: usize,
    image_mib: usize,
    dd_runs: usize,
    dd_mib: usize,
    /// Executions, file reads and stdout through the daemon (0: none).
    exec_runs: usize,
    exec_mib: usize,
    /// Instead of the levels: run `net_argv` in one sandbox allowed `allow_domains`.
    net_run: bool,
    config_extra: String,
    allow_domains: Vec<String>,
    net_argv: Vec<String>,
}

impl Default for Args {
    /// Parse step: the value of each flag not given.
    fn default() -> Self {
        Self {
            daemon: PathBuf::new(),
            vmm: PathBuf::new(),
            kernel: PathBuf::new(),
            rootfs: PathBuf::new(),
            runs: 20,
            levels: vec![1, 10, 50],
            idle: 100,
            compare_jail: false,
            compare_disk: false,
            compare_cluster: false,
            etcd: PathBuf::new(),
            compare_image: false,
            create_runs: 10,
            image_mib: 200,
            dd_runs: 3,
            dd_mib: 16,
            exec_runs: 10,
            exec_mib: 2,
            net_run: false,
            config_extra: String::new(),
            allow_domains: Vec::new(),
            net_argv: Vec::new(),
        }
    }
}

/// The command line's flags, over their defaults.
fn parse_args() -> Result<Args, String> {
    let mut a = Args::default();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "--compare-jail" {
            a.compare_jail = true;
            continue;
        }
        if flag == "--compare-disk" {
            a.compare_disk = true;
            continue;
        }
        if flag == "--compare-cluster" {
            a.compare_cluster = true;
            continue;
        }
        if flag == "--compare-image" {
            a.compare_image = true;
            continue;
        }
        if flag == "--net-run" {
            a.net_run = true;
            continue;
        }
        if flag == "--" {
            a.net_argv = it.by_ref().cloned().collect();
            break;
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let n = |s: &str| {
            s.parse::<usize>()
                .map_err(|_| format!("{flag}: not a number"))
        };
        match flag.as_str() {
            "--daemon" => a.daemon = v.into(),
            "--vmm" => a.vmm = v.into(),
            "--kernel" => a.kernel = v.into(),
            "--rootfs" => a.rootfs = v.into(),
            "--etcd" => a.etcd = v.into(),
            "--runs" => a.runs = n(v)?,
            "--idle" => a.idle = n(v)?,
            "--dd-runs" => a.dd_runs = n(v)?,
            "--dd-mib" => a.dd_mib = n(v)?,
            "--exec-runs" => a.exec_runs = n(v)?,
            "--exec-mib" => a.exec_mib = n(v)?,
            "--create-runs" => a.create_runs = n(v)?,
            "--image-mib" => a.image_mib = n(v)?,
            "--levels" => a.levels = v.split(',').map(n).collect::<Result<_, _>>()?,
            "--config-extra" => a.config_extra = v.clone(),
            "--allow-domain" => a.allow_domains.push(v.clone()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    check_args(&a)?;
    Ok(a)
}

/// Parse step: the flags given together make a run (the binaries, the guest command, the
/// levels).
fn check_args(a: &Args) -> Result<(), String> {
    if a.daemon.as_os_str().is_empty() || a.vmm.as_os_str().is_empty() {
        return Err("usage: airlock-create-bench --daemon P --vmm P --kernel P --rootfs P".into());
    }
    if a.net_run && a.net_argv.is_empty() {
        return Err("--net-run: the guest command after `--`".into());
    }
    if a.levels.is_empty() || a.levels.contains(&0) {
        return Err("--levels: positive numbers".into());
    }
    Ok(())
}

fn log(msg: &str) {
    eprintln!("create: {msg}");
}

/// Percentile by linear interpolation between closest ranks (as benches/stats.py does).
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

fn summary(samples: &[f64]) -> serde_json::Value {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let r = |x: f64| (x * 1000.0).round() / 1000.0;
    serde_json::json!({
        "runs": s.len(),
        "p50": r(percentile(&s, 50.0)),
        "p90": r(percentile(&s, 90.0)),
        "p99": r(percentile(&s, 99.0)),
        "min": r(s.first().copied().unwrap_or(f64::NAN)),
        "max": r(s.last().copied().unwrap_or(f64::NAN)),
        // Every sample, sorted: benches/plot.py draws the distribution.
        "samples": s.iter().map(|x| r(*x)).collect::<Vec<_>>(),
    })
}

/// Proportional set size of a process, KiB.
fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Pss:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

struct Daemon {
    child: Child,
    metrics: String,
    cgroup_parent: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SIGTERM: the daemon ends every VMM it started.
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                self.remove_cgroups();
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    /// Removes the benchmark's (empty) parent cgroups once the daemon is gone.
    fn remove_cgroups(&self) {
        for h in ["", "memory", "cpu", "pids", "cpuacct"] {
            let _ = std::fs::remove_dir(
                std::path::Path::new("/sys/fs/cgroup")
                    .join(h)
                    .join(&self.cgroup_parent),
            );
        }
    }
}

/// The number in a metrics line `name{labels} N`.
async fn metric(addr: &str, line_prefix: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).await.ok()?;
    body.lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn wait_pool(d: &Daemon, n: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let warm = metric(&d.metrics, "airlock_sandboxes{state=\"warm_pool\"}")
            .await
            .unwrap_or(0.0);
        if warm as usize >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("the warm pool did not reach {n} (has {warm})"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

struct Created {
    wall_ms: f64,
    sandbox: Sandbox,
}

/// `n` concurrent creates of sandboxes of `template` (empty: `base`).
async fn create_batch(c: &Client, n: usize, template: &str) -> (Vec<Created>, usize, f64) {
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let mut c = c.clone();
        let req = CreateSandboxRequest {
            template: template.to_owned(),
            ..Default::default()
        };
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = c.create_sandbox(req).await;
            (t.elapsed().as_secs_f64() * 1000.0, r)
        }));
    }
    let mut ok = Vec::new();
    let mut failed = 0;
    for task in tasks {
        match task.await {
            Ok((wall_ms, Ok(s))) => ok.push(Created {
                wall_ms,
                sandbox: s.into_inner(),
            }),
            Ok((_, Err(e))) => {
                failed += 1;
                log(&format!(
                    "create failed: {:?} {}",
                    airlock_api::error_info(&e).map(|i| i.0),
                    e.message()
                ));
            }
            Err(e) => {
                failed += 1;
                log(&format!("create task: {e}"));
            }
        }
    }
    (ok, failed, t.elapsed().as_secs_f64())
}

async fn destroy_all(c: &Client, sandboxes: &[Sandbox]) {
    let mut tasks = Vec::new();
    for s in sandboxes {
        let mut c = c.clone();
        let id = s.id.clone();
        tasks.push(tokio::spawn(async move {
            let _ = c
                .destroy_sandbox(DestroySandboxRequest { sandbox_id: id })
                .await;
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// `config` with a `[jail]` uid range of its own (unless it names one): a bench may run two
/// daemons at once, and a daemon refuses a range another live daemon holds (the default one
/// is a production daemon's). Ranges of 10,000 from 1.65 * 10^9, apart from the system
/// tests' (below 1.54 * 10^9) and the image bench's (1.6 * 10^9).
fn with_uid_range(config: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    if config.contains("uid_base") {
        return config.to_owned();
    }
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 8;
    let slot = (std::process::id() % 1700) * 8 + n;
    let range = format!(
        "uid_base = {}\nuid_count = 10000\n",
        1_650_000_000 + slot * 10_000
    );
    match config.find("[jail]\n") {
        Some(i) => format!("{}[jail]\n{range}{}", &config[..i], &config[i + 7..]),
        None => format!("{config}\n[jail]\n{range}"),
    }
}

/// Starts an `airlockd` in `dir` with `config` (plus the benchmark's common settings); returns
/// it and a client.
async fn start_daemon(
    a: &Args,
    dir: &std::path::Path,
    name: &str,
    config: &str,
) -> Result<(Daemon, Client), String> {
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let config = with_uid_range(config);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let metrics = format!("127.0.0.1:{port}");
    let cgroup_parent = format!("airlock-bench-{name}-{}", std::process::id());
    let config_path = dir.join("airlockd.toml");
    std::fs::write(
        &config_path,
        format!(
            "cgroup_parent = \"{cgroup_parent}\"\n\
             kernel = \"{}\"\nrootfs = \"{}\"\nvmm_binary = \"{}\"\nready_timeout_ms = 180000\n\
             metrics_listen = \"{metrics}\"\nmax_committed_mib = 1048576\n\
             adopt_on_restart = false\n{config}\n\
             [default_quota]\nmax_sandboxes = 0\nmax_memory_mib = 0\n",
            a.kernel.display(),
            a.rootfs.display(),
            a.vmm.display()
        ),
    )
    .map_err(|e| e.to_string())?;
    let socket = dir.join("airlockd.sock");
    // A daemon that ran here before leaves its socket file.
    let _ = std::fs::remove_file(&socket);
    let child = Command::new(&a.daemon)
        .arg("--config")
        .arg(&config_path)
        .arg("--listen")
        .arg(format!("unix://{}", socket.display()))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("airlockd.log")).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", a.daemon.display()))?;
    let daemon = Daemon {
        child,
        metrics,
        cgroup_parent,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        if Instant::now() > deadline {
            return Err("airlockd did not start".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let c = airlock_api::client(Some(&format!("unix://{}", socket.display())), None)
        .await
        .map_err(|e| e.to_string())?;
    Ok((daemon, c))
}

/// Builds the template `base`: one cold boot and a snapshot.
async fn make_template(c: &Client) -> Result<Template, String> {
    log("template: cold boot + snapshot (tens of seconds on nested KVM)");
    let mut events = c
        .clone()
        .create_template(CreateTemplateRequest {
            name: "base".into(),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    let mut template = None;
    while let Some(ev) = events.message().await.map_err(|e| e.to_string())? {
        template = ev.template.or(template);
    }
    template.ok_or_else(|| "no template".to_owned())
}

async fn bench(a: Args) -> Result<serde_json::Value, String> {
    let dir = std::env::temp_dir().join(format!("airlock-create-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let max_level = a.levels.iter().copied().max().unwrap_or(1);
    let config = format!(
        "pool_size = {max_level}\nmax_sandboxes = {}\n",
        max_level.max(a.idle) + 8
    );
    let (daemon, c) = start_daemon(&a, &dir, "create", &config).await?;
    let template = make_template(&c).await?;

    let mut out = serde_json::Map::new();
    out.insert("bench".into(), "create".into());
    let mut creates_per_s = Vec::new();
    for &level in &a.levels {
        let s = measure_level(&daemon, &c, &a, level, max_level, &mut creates_per_s).await?;
        out.insert(format!("create_ms_c{level}"), s);
    }
    if a.exec_runs > 0 {
        out.insert(
            "daemon_exec".into(),
            daemon_exec::measure(&c, a.exec_runs, a.exec_mib).await?,
        );
    }
    let mut cps = creates_per_s.clone();
    cps.sort_by(f64::total_cmp);
    out.insert(
        "creates_per_s".into(),
        serde_json::json!((percentile(&cps, 50.0) * 100.0).round() / 100.0),
    );

    // Idle sandboxes: created in waves of the pool size, then left alone.
    measure_idle(&daemon, &c, &a, max_level, &template, &mut out).await?;
    out.insert("memory_mib".into(), template.memory_mib.into());
    out.insert("vcpus".into(), template.vcpus.into());
    out.insert("host".into(), host_facts());
    drop(daemon);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(serde_json::Value::Object(out))
}

/// Bench step: level `level`'s batches of concurrent creates, each once the pool holds them;
/// their percentiles (the largest level's rates go to `creates_per_s`).
async fn measure_level(
    daemon: &Daemon,
    c: &Client,
    a: &Args,
    level: usize,
    max_level: usize,
    creates_per_s: &mut Vec<f64>,
) -> Result<serde_json::Value, String> {
    let batches = a.runs.div_ceil(level).max(1);
    let (mut wall, mut host, mut guest, mut restore, mut queue) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut failures = 0;
    for b in 0..batches {
        wait_pool(daemon, level).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (ok, failed, secs) = create_batch(c, level, "").await;
        failures += failed;
        log(&format!(
            "c{level} batch {}/{batches}: {} ok, {failed} failed in {secs:.2} s",
            b + 1,
            ok.len()
        ));
        if level == max_level && !ok.is_empty() {
            creates_per_s.push(ok.len() as f64 / secs);
        }
        for x in &ok {
            wall.push(x.wall_ms);
            host.push(x.sandbox.create_host_ms);
            guest.push(x.sandbox.create_guest_ms);
            restore.push(x.sandbox.restore_ms);
            queue.push(x.sandbox.create_queue_ms);
        }
        let sandboxes: Vec<Sandbox> = ok.into_iter().map(|x| x.sandbox).collect();
        destroy_all(c, &sandboxes).await;
    }
    let mut s = summary(&wall);
    let hs = summary(&host);
    s["host_p50"] = hs["p50"].clone();
    s["host_p99"] = hs["p99"].clone();
    let gs = summary(&guest);
    s["guest_p50"] = gs["p50"].clone();
    s["guest_samples"] = gs["samples"].clone();
    s["restore_p50"] = summary(&restore)["p50"].clone();
    s["queue_p50"] = summary(&queue)["p50"].clone();
    s["failures"] = failures.into();
    Ok(s)
}

/// Bench step: `a.idle` idle sandboxes, created in waves of the pool size and left alone;
/// the host memory they and the daemon take, into `out`; then they go.
async fn measure_idle(
    daemon: &Daemon,
    c: &Client,
    a: &Args,
    max_level: usize,
    template: &Template,
    out: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<(), String> {
    let mut idle: Vec<Sandbox> = Vec::new();
    let mut idle_failures = 0;
    while idle.len() < a.idle {
        let wave = (a.idle - idle.len()).min(max_level);
        wait_pool(daemon, wave).await?;
        let (ok, failed, _) = create_batch(c, wave, "").await;
        idle_failures += failed;
        idle.extend(ok.into_iter().map(|x| x.sandbox));
        log(&format!("idle sandboxes: {}", idle.len()));
        if failed > 0 && idle_failures > a.idle / 10 {
            break;
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut pids: Vec<u32> = idle.iter().map(|s| s.vmm_pid).filter(|p| *p > 0).collect();
    pids.push(daemon.child.id());
    let host_kib: u64 = pids.iter().map(|p| pss_kib(*p)).sum();
    let n = idle.len();
    out.insert(
        format!("idle{}_host_mib", a.idle),
        serde_json::json!((host_kib as f64 / 1024.0 * 10.0).round() / 10.0),
    );
    out.insert("idle_sandboxes".into(), n.into());
    out.insert("idle_failures".into(), idle_failures.into());
    out.insert(
        "idle_guest_memory_total_mib".into(),
        serde_json::json!(n as u64 * u64::from(template.memory_mib)),
    );
    log(&format!(
        "{n} idle sandboxes: {:.1} MiB PSS on the host (guest memory {} MiB each)",
        host_kib as f64 / 1024.0,
        template.memory_mib
    ));
    destroy_all(c, &idle).await;
    Ok(())
}

/// What the numbers were measured on.
fn host_facts() -> serde_json::Value {
    serde_json::json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "kvm": if std::path::Path::new("/sys/module/kvm_pvm").exists() { "nested-pvm" } else { "host" },
    })
}

/// The mean of a histogram (`name_sum / name_count`) from the metrics endpoint, in ms.
async fn histogram_mean_ms(d: &Daemon, name: &str) -> Option<f64> {
    let sum = metric(&d.metrics, &format!("{name}_sum ")).await?;
    let count = metric(&d.metrics, &format!("{name}_count ")).await?;
    (count > 0.0).then(|| (sum / count * 1000.0 * 1000.0).round() / 1000.0)
}

/// Creates on two daemons, one by one, alternating (the order flips every round), each with
/// a full warm pool of 2, `runs` each; puts each side's summary into `out` under its name
/// (`create_ms` percentiles, the host's share, restore, guest, failures, a warm VMM's spawn
/// and ready times) and returns each side's (p50, host p50).
async fn alternate(
    runs: usize,
    sides: &[(&str, &(Daemon, Client)); 2],
    out: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<[serde_json::Value; 2], String> {
    alternate_templates(runs, sides, ["", ""], out).await
}

/// [`alternate`] with each side's sandboxes of its template in `templates` (empty: `base`).
/// Both sides may be the same daemon with one template each and a pool size of 1: each create
/// then waits until both templates' pools are full.
async fn alternate_templates(
    runs: usize,
    sides: &[(&str, &(Daemon, Client)); 2],
    templates: [&str; 2],
    out: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<[serde_json::Value; 2], String> {
    let mut samples: [Vec<Sandbox>; 2] = [Vec::new(), Vec::new()];
    let mut walls: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut failures = [0usize; 2];
    for round in 0..runs {
        for k in 0..2 {
            let i = if round % 2 == 0 { k } else { 1 - k };
            let (_, (daemon, c)) = sides[i];
            wait_pool(daemon, 2).await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (ok, failed, _) = create_batch(c, 1, templates[i]).await;
            failures[i] += failed;
            for x in ok {
                walls[i].push(x.wall_ms);
                destroy_all(c, std::slice::from_ref(&x.sandbox)).await;
                samples[i].push(x.sandbox);
            }
        }
        log(&format!("round {}/{runs}", round + 1));
    }
    let mut p50 = [serde_json::Value::Null, serde_json::Value::Null];
    for (i, (name, (daemon, _))) in sides.iter().enumerate() {
        let pick = |f: fn(&Sandbox) -> f64| samples[i].iter().map(f).collect::<Vec<_>>();
        let mut s = summary(&walls[i]);
        let host = summary(&pick(|x| x.create_host_ms));
        s["host_p50"] = host["p50"].clone();
        s["host_p99"] = host["p99"].clone();
        s["restore_p50"] = summary(&pick(|x| x.restore_ms))["p50"].clone();
        s["guest_p50"] = summary(&pick(|x| x.create_guest_ms))["p50"].clone();
        s["failures"] = failures[i].into();
        s["vmm_spawn_ms"] = histogram_mean_ms(daemon, "airlock_vmm_spawn_seconds")
            .await
            .into();
        s["vmm_ready_ms"] = histogram_mean_ms(daemon, "airlock_vmm_ready_seconds")
            .await
            .into();
        p50[i] = serde_json::json!([s["p50"].clone(), s["host_p50"].clone()]);
        out.insert((*name).into(), s);
    }
    Ok(p50)
}

/// The difference of two sides' p50s (index `k` of [`alternate`]'s pairs), in ms.
fn p50_diff(p50: &[serde_json::Value; 2], k: usize) -> serde_json::Value {
    match (p50[0][k].as_f64(), p50[1][k].as_f64()) {
        (Some(a), Some(b)) => serde_json::json!(((a - b) * 1000.0).round() / 1000.0),
        _ => serde_json::Value::Null,
    }
}

/// Create → ready with and without the jail, alternating (see the module doc).
async fn compare_jail(a: Args) -> Result<serde_json::Value, String> {
    let dir = std::env::temp_dir().join(format!("airlock-jail-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let common = "pool_size = 2\nmax_sandboxes = 8\n";
    let off = format!("{common}[jail]\nenabled = false\nseccomp = false\n");
    // One template for both: built by the jailed daemon, whose records (stopped cleanly: no
    // process rows) the other daemon starts from, so both restore the very same snapshot files.
    {
        let (_first, c) = start_daemon(&a, &dir.join("jailed"), "jailed", common).await?;
        make_template(&c).await?;
    }
    std::fs::create_dir_all(dir.join("unjailed/data")).map_err(|e| e.to_string())?;
    for entry in std::fs::read_dir(dir.join("jailed/data")).map_err(|e| e.to_string())? {
        let path = entry.map_err(|e| e.to_string())?.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if name.starts_with("airlock.db") {
            std::fs::copy(&path, dir.join("unjailed/data").join(&name))
                .map_err(|e| e.to_string())?;
        }
    }
    let jailed = start_daemon(&a, &dir.join("jailed"), "jailed", common).await?;
    let unjailed = start_daemon(&a, &dir.join("unjailed"), "unjailed", &off).await?;
    let sides = [("jailed", &jailed), ("unjailed", &unjailed)];
    let mut out = serde_json::Map::new();
    out.insert("bench".into(), "create_jail".into());
    let p50 = alternate(a.runs, &sides, &mut out).await?;
    out.insert("jail_overhead_ms_p50".into(), p50_diff(&p50, 0));
    out.insert("jail_host_overhead_ms_p50".into(), p50_diff(&p50, 1));
    out.insert("host".into(), host_facts());
    drop(jailed);
    drop(unjailed);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(serde_json::Value::Object(out))
}

mod cluster_bench;
mod daemon_exec;
mod disk_bench;
mod image_bench;
mod net_run;

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if args.net_run {
        return match rt.block_on(net_run::net_run(args)) {
            Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            Err(e) => {
                log(&format!("error: {e}"));
                ExitCode::FAILURE
            }
        };
    }
    let result = if args.compare_jail {
        rt.block_on(compare_jail(args))
    } else if args.compare_disk {
        rt.block_on(disk_bench::compare_disk(args))
    } else if args.compare_cluster {
        rt.block_on(cluster_bench::compare_cluster(args))
    } else if args.compare_image {
        rt.block_on(image_bench::compare_image(args))
    } else {
        rt.block_on(bench(args))
    };
    match result {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            log(&format!("error: {e}"));
            ExitCode::FAILURE
        }
    }
}
