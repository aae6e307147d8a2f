//! A sampling profiler of guest RIPs, for finding where guest time goes (on the nested build
//! hosts every guest kernel instruction is emulated, so "where" matters).
//!
//! Enabled with `AIRLOCK_PROFILE=<path prefix>`: a sampler thread kicks each vCPU every
//! [`SAMPLE_PERIOD`]; the kicked vCPU records its RIP; at the end of the VM each vCPU writes
//! `<prefix>.vcpu<N>` with one `count rip` line per distinct RIP, most frequent first
//! (`addr2line -f -e vmlinux` or `nm` turns them into functions). `AIRLOCK_PROFILE_DELAY_S=N`
//! starts sampling N seconds after the vCPU starts (to skip the boot).

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Time between samples.
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(5);

/// The output path prefix, if profiling is enabled.
pub fn enabled() -> Option<String> {
    std::env::var("AIRLOCK_PROFILE")
        .ok()
        .filter(|p| !p.is_empty())
}

/// RIP counts of one vCPU.
#[derive(Debug, Default)]
pub struct Samples {
    counts: HashMap<u64, u64>,
}

impl Samples {
    /// Counts one sample at `rip`.
    pub fn record(&mut self, rip: u64) {
        *self.counts.entry(rip).or_default() += 1;
    }

    /// Writes the histogram, most frequent first.
    pub fn write(&self, path: &str) -> std::io::Result<()> {
        let mut v: Vec<(u64, u64)> = self.counts.iter().map(|(r, c)| (*c, *r)).collect();
        v.sort_unstable_by(|a, b| b.cmp(a));
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        for (count, rip) in v {
            writeln!(f, "{count} {rip:#x}")?;
        }
        f.flush()
    }
}

/// A running sampler; [`Sampler::stop`] must be called before the sampled thread ends.
#[derive(Debug)]
pub struct Sampler {
    stop: Arc<AtomicBool>,
    /// The samples and the file to write them to, handed over at the end.
    results: std::sync::mpsc::Sender<(Samples, String)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    /// Kicks the calling thread with `signal` every [`SAMPLE_PERIOD`].
    pub fn start(signal: i32) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let target = crate::kick::current_thread();
        let flag = stop.clone();
        let (results, rx) = std::sync::mpsc::channel::<(Samples, String)>();
        let thread = std::thread::Builder::new()
            .name("profiler".into())
            .spawn(move || {
                if let Err(e) = crate::seccomp::apply(crate::seccomp::ThreadClass::Profiler) {
                    log::error!("profiler: {e}; not sampling");
                    return;
                }
                let delay = std::env::var("AIRLOCK_PROFILE_DELAY_S")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .map_or(Duration::ZERO, Duration::from_secs);
                let start = std::time::Instant::now();
                while start.elapsed() < delay && !flag.load(Ordering::Acquire) {
                    std::thread::sleep(SAMPLE_PERIOD * 20);
                }
                while !flag.load(Ordering::Acquire) {
                    std::thread::sleep(SAMPLE_PERIOD);
                    if !flag.load(Ordering::Acquire) {
                        crate::kick::kick_thread(target, signal);
                    }
                }
                // Written here: the sampled vCPU thread's seccomp filter opens no files.
                if let Ok((samples, path)) = rx.recv()
                    && let Err(e) = samples.write(&path)
                {
                    log::warn!("write profile {path}: {e}");
                }
            })
            .ok();
        Self {
            stop,
            results,
            thread,
        }
    }

    /// Stops sampling, has the sampler thread write `samples` to `path`, and waits for it.
    pub fn stop(mut self, samples: Samples, path: String) {
        let _ = self.results.send((samples, path));
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
