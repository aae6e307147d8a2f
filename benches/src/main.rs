//! `airlock-bench exec`: exec round trip and stdout throughput through the guest agent, in a
//! real VM (through virtio-vsock) and, side by side in the same run, with the same agent binary
//! running as an ordinary process on the host (through a Unix socket). Prints one JSON object.
//!
//! Usage: airlock-bench exec --vmm PATH --agent PATH --kernel PATH --rootfs PATH
//!        [--runs N] [--mib M] [--vcpus N] [--mem-mib M]
//!
//! `airlock-bench guest-exec --vsock PATH -- ARGV...`: runs ARGV through the agent of a VM
//! already up (its hybrid-vsock socket PATH), passing its stdout and stderr through as they
//! come, and exits with its exit code (benches/net.py runs its guest script so).
#![forbid(unsafe_code)]

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use airlock_proto::pb::{self, exec_exit};
use airlock_proto::{AGENT_VSOCK_PORT, AgentClient, ClientError, Requests};

type Client = AgentClient<UnixStream, UnixStream>;

#[derive(Debug)]
struct Args {
    vmm: PathBuf,
    agent: PathBuf,
    kernel: PathBuf,
    rootfs: PathBuf,
    runs: usize,
    mib: u64,
    vcpus: u32,
    mem_mib: u32,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        vmm: PathBuf::new(),
        agent: PathBuf::new(),
        kernel: PathBuf::new(),
        rootfs: PathBuf::new(),
        runs: 20,
        mib: 32,
        vcpus: 1,
        mem_mib: 512,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("exec") {
        return Err("usage: airlock-bench exec --vmm P --agent P --kernel P --rootfs P".into());
    }
    let mut it = args[1..].iter();
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let n = || {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: not a number"))
        };
        match flag.as_str() {
            "--vmm" => a.vmm = v.into(),
            "--agent" => a.agent = v.into(),
            "--kernel" => a.kernel = v.into(),
            "--rootfs" => a.rootfs = v.into(),
            "--runs" => a.runs = n()? as usize,
            "--mib" => a.mib = n()?,
            "--vcpus" => a.vcpus = n()? as u32,
            "--mem-mib" => a.mem_mib = n()? as u32,
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(a)
}

/// Kills the child on drop.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn shell(cmd: &str) -> pb::Exec {
    pb::Exec {
        command: Some(pb::exec::Command::Shell(cmd.to_owned())),
        ..Default::default()
    }
}

fn argv_exec(args: &[&str]) -> pb::Exec {
    let args = args.iter().map(|s| (*s).to_owned()).collect();
    pb::Exec {
        command: Some(pb::exec::Command::Argv(pb::Argv { args })),
        ..Default::default()
    }
}

fn ok_exit(exit: &pb::ExecExit) -> bool {
    matches!(exit.status, Some(exec_exit::Status::ExitCode(0)))
}

/// Round trips of `true`, in milliseconds.
fn exec_round_trips(c: &mut Client, runs: usize) -> Result<Vec<f64>, String> {
    let mut ms = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        let exit = c
            .exec_collect(argv_exec(&["true"]), |_, _| {})
            .map_err(|e| e.to_string())?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        eprintln!("exec true: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
        if !ok_exit(&exit) {
            return Err(format!("`true` failed: {exit:?}"));
        }
    }
    Ok(ms)
}

/// MiB/s of `head -c <mib>M /dev/zero` arriving as stdout, over `runs` runs.
fn stdout_throughput(c: &mut Client, mib: u64, runs: usize) -> Result<Vec<f64>, String> {
    let cmd = format!("head -c {mib}M /dev/zero");
    let mut rates = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut got = 0u64;
        let t = Instant::now();
        let exit = c
            .exec_collect(shell(&cmd), |_, d| got += d.len() as u64)
            .map_err(|e| e.to_string())?;
        let secs = t.elapsed().as_secs_f64();
        if !ok_exit(&exit) || got != mib << 20 {
            return Err(format!("{cmd}: {got} bytes, {exit:?}"));
        }
        rates.push(mib as f64 / secs);
        eprintln!("stdout {mib} MiB: {:.2} MiB/s", mib as f64 / secs);
    }
    Ok(rates)
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let k = (s.len() - 1) as f64 * p / 100.0;
    let (lo, hi) = (k.floor() as usize, k.ceil() as usize);
    s[lo] + (s[hi] - s[lo]) * (k - lo as f64)
}

fn summary(v: &[f64]) -> String {
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let samples: Vec<String> = v.iter().map(|x| format!("{x:.2}")).collect();
    format!(
        "{{\"runs\":{},\"p50\":{:.3},\"p90\":{:.3},\"p99\":{:.3},\"mean\":{:.3},\"min\":{:.3},\"max\":{:.3},\"samples\":[{}]}}",
        v.len(),
        percentile(v, 50.0),
        percentile(v, 90.0),
        percentile(v, 99.0),
        mean,
        percentile(v, 0.0),
        percentile(v, 100.0),
        samples.join(",")
    )
}

fn connect_retry(
    f: impl Fn() -> Result<Client, ClientError>,
    limit: Duration,
) -> Result<Client, String> {
    let deadline = Instant::now() + limit;
    loop {
        match f() {
            Ok(c) => return Ok(c),
            Err(ClientError::Handshake(_) | ClientError::Connect { .. })
                if Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("connect to the agent: {e}")),
        }
    }
}

/// Measures one agent: warm-up, round trips, throughput.
fn measure(c: &mut Client, a: &Args) -> Result<(Vec<f64>, Vec<f64>), String> {
    // Warm the page cache and the agent's paths once.
    let t = Instant::now();
    c.exec_collect(argv_exec(&["true"]), |_, _| {})
        .map_err(|e| e.to_string())?;
    c.exec_collect(shell("head -c 1M /dev/zero"), |_, _| {})
        .map_err(|e| e.to_string())?;
    eprintln!("warm-up: {:.1} s", t.elapsed().as_secs_f64());
    let rt = exec_round_trips(c, a.runs)?;
    let tp = stdout_throughput(c, a.mib, a.runs.clamp(1, 5))?;
    Ok((rt, tp))
}

/// Round trips, throughputs and fresh connections of the agent in a VM.
type VmResults = (Vec<f64>, Vec<f64>, Vec<f64>);

fn bench_vm(a: &Args, dir: &Path) -> Result<VmResults, String> {
    let sock = dir.join("vsock.sock");
    let child = Command::new(&a.vmm)
        .arg("boot")
        .arg("--kernel")
        .arg(&a.kernel)
        .arg("--rootfs")
        .arg(&a.rootfs)
        .args([
            "--vcpus",
            &a.vcpus.to_string(),
            "--mem-mib",
            &a.mem_mib.to_string(),
        ])
        .arg("--vsock")
        .arg(&sock)
        .arg("--console")
        .arg(dir.join("console.txt"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start {}: {e}", a.vmm.display()))?;
    let _guard = Guard(child);
    let mut c = connect_retry(
        || AgentClient::connect_vsock(&sock, AGENT_VSOCK_PORT),
        Duration::from_secs(600),
    )?;
    eprintln!("vm agent ready; measuring");
    let r = measure(&mut c, a);
    // What a fresh agent connection costs (the vsock handshake and Ready), as airlockd pays
    // it once per execution.
    let mut connects = Vec::with_capacity(a.runs);
    for _ in 0..a.runs {
        let t = Instant::now();
        let fresh = AgentClient::connect_vsock(&sock, AGENT_VSOCK_PORT)
            .map_err(|e| format!("a fresh connection: {e}"))?;
        connects.push(t.elapsed().as_secs_f64() * 1e3);
        drop(fresh);
    }
    let _ = c.power_off();
    r.map(|(rt, tp)| (rt, tp, connects))
}

fn bench_host(a: &Args, dir: &Path) -> Result<(Vec<f64>, Vec<f64>), String> {
    let sock = dir.join("agent.sock");
    let child = Command::new(&a.agent)
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("start {}: {e}", a.agent.display()))?;
    let _guard = Guard(child);
    let mut c = connect_retry(|| AgentClient::connect_unix(&sock), Duration::from_secs(30))?;
    measure(&mut c, a)
}

/// `guest-exec --vsock PATH -- ARGV...` (see the module doc).
fn guest_exec(args: &[String]) -> ExitCode {
    use std::io::Write as _;
    let (sock, argv) = match args {
        [flag, sock, sep, argv @ ..] if flag == "--vsock" && sep == "--" && !argv.is_empty() => {
            (PathBuf::from(sock), argv)
        }
        _ => {
            eprintln!("usage: airlock-bench guest-exec --vsock PATH -- ARGV...");
            return ExitCode::from(2);
        }
    };
    let mut c = match connect_retry(
        || AgentClient::connect_vsock(&sock, AGENT_VSOCK_PORT),
        Duration::from_secs(120),
    ) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("airlock-bench: {e}");
            return ExitCode::from(1);
        }
    };
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let exit = c.exec_collect(argv_exec(&argv), |stream, data| {
        if stream == pb::StreamKind::Stdout {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(data);
            let _ = out.flush();
        } else {
            let _ = std::io::stderr().write_all(data);
        }
    });
    match exit {
        Ok(exit) => match exit.status {
            Some(exec_exit::Status::ExitCode(n)) => ExitCode::from(u8::try_from(n).unwrap_or(1)),
            other => {
                eprintln!("airlock-bench: guest command ended: {other:?}");
                ExitCode::from(1)
            }
        },
        Err(e) => {
            eprintln!("airlock-bench: exec: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let all: Vec<String> = std::env::args().skip(1).collect();
    if all.first().map(String::as_str) == Some("guest-exec") {
        return guest_exec(&all[1..]);
    }
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("airlock-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let dir = std::env::temp_dir().join(format!("airlock-bench-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("airlock-bench: {e}");
        return ExitCode::from(1);
    }
    let host = bench_host(&a, &dir);
    let vm = bench_vm(&a, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    match (vm, host) {
        (Ok((vm_rt, vm_tp, vm_connect)), Ok((host_rt, host_tp))) => {
            let kvm = if Path::new("/sys/module/kvm_pvm").exists() {
                "nested-pvm"
            } else {
                "bare-metal"
            };
            println!(
                "{{\"bench\":\"exec\",\"kvm\":\"{kvm}\",\"stdout_mib\":{},\"exec_true_ms\":{},\"stdout_mib_s\":{:.3},\"stdout_mib_s_runs\":{},\"connect_ready_ms\":{},\"host_agent\":{{\"exec_true_ms\":{},\"stdout_mib_s\":{:.3}}}}}",
                a.mib,
                summary(&vm_rt),
                percentile(&vm_tp, 50.0),
                summary(&vm_tp),
                summary(&vm_connect),
                summary(&host_rt),
                percentile(&host_tp, 50.0),
            );
            ExitCode::SUCCESS
        }
        (vm, host) => {
            if let Err(e) = vm {
                eprintln!("airlock-bench: vm: {e}");
            }
            if let Err(e) = host {
                eprintln!("airlock-bench: host agent: {e}");
            }
            ExitCode::from(1)
        }
    }
}
