//! Prometheus metrics: counters, gauges and histograms kept in memory and rendered as text
//! (`server/metrics.rs` serves them on `GET /metrics`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// Bucket bounds in seconds for latency histograms.
const BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len()];
        }
        for (i, b) in BUCKETS.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

/// Per-sandbox usage for the exported gauges.
#[derive(Debug, Clone)]
pub struct SandboxUsage {
    pub id: String,
    pub tenant: String,
    pub cpu_usage_us: u64,
    pub memory_bytes: u64,
}

#[derive(Debug, Default)]
struct Inner {
    create_seconds: Histogram,
    create_host_seconds: Histogram,
    restore_seconds: Histogram,
    vmm_spawn_seconds: Histogram,
    vmm_ready_seconds: Histogram,
    executions: BTreeMap<String, u64>,
    creates_failed: BTreeMap<String, u64>,
    /// Egress events by (tenant, kind, verdict) and bytes by (tenant, direction).
    egress: BTreeMap<(String, &'static str, &'static str), u64>,
    egress_bytes: BTreeMap<(String, &'static str), u64>,
    /// Package proxy requests and bytes by (tenant, registry, outcome).
    packages: BTreeMap<(String, String, &'static str), (u64, u64)>,
}

/// The daemon's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn observe_create(&self, total_s: f64, host_s: f64, restore_s: f64) {
        let mut i = self.inner();
        i.create_seconds.observe(total_s);
        i.create_host_seconds.observe(host_s);
        i.restore_seconds.observe(restore_s);
    }

    /// A warm VMM started: `spawn_s` until it had exec'd in its jail (clone, mounts, limits,
    /// credentials), `ready_s` until its control socket answered (its KVM VM prepared).
    pub fn observe_vmm_start(&self, spawn_s: f64, ready_s: f64) {
        let mut i = self.inner();
        i.vmm_spawn_seconds.observe(spawn_s);
        i.vmm_ready_seconds.observe(ready_s);
    }

    pub fn create_failed(&self, reason: &str) {
        *self
            .inner()
            .creates_failed
            .entry(reason.to_owned())
            .or_default() += 1;
    }

    /// An execution ended with `outcome` (exited, timed_out, killed, oom_killed, failed).
    pub fn execution_ended(&self, outcome: &str) {
        *self
            .inner()
            .executions
            .entry(outcome.to_owned())
            .or_default() += 1;
    }

    /// A sandbox of `tenant` made a DNS query or a TCP connection (`kind`: dns, tcp).
    pub fn egress_event(
        &self,
        tenant: &str,
        kind: &'static str,
        allowed: bool,
        out: u64,
        inn: u64,
    ) {
        let mut i = self.inner();
        let verdict = if allowed { "allowed" } else { "denied" };
        *i.egress
            .entry((tenant.to_owned(), kind, verdict))
            .or_default() += 1;
        if out > 0 {
            *i.egress_bytes
                .entry((tenant.to_owned(), "out"))
                .or_default() += out;
        }
        if inn > 0 {
            *i.egress_bytes.entry((tenant.to_owned(), "in")).or_default() += inn;
        }
    }

    /// The package proxy answered a request of a sandbox of `tenant` (`outcome`: cached,
    /// fetched, denied, hash_mismatch, over_cap, upstream_error), serving `bytes`.
    pub fn package_event(&self, tenant: &str, registry: &str, outcome: &'static str, bytes: u64) {
        let mut i = self.inner();
        let e = i
            .packages
            .entry((tenant.to_owned(), registry.to_owned(), outcome))
            .or_default();
        e.0 += 1;
        e.1 += bytes;
    }

    /// The exposition text, with the sandbox gauges given by the caller.
    // Long: one block per metric family, in exposition order; split, a reader would have to
    // collect the families from helpers to see what is exported.
    pub fn render(&self, by_state: &BTreeMap<String, u64>, usage: &[SandboxUsage]) -> String {
        let i = self.inner();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP airlock_sandboxes Sandboxes by state.\n# TYPE airlock_sandboxes gauge"
        );
        for (state, n) in by_state {
            let _ = writeln!(out, "airlock_sandboxes{{state=\"{state}\"}} {n}");
        }
        hist(
            &mut out,
            "airlock_create_seconds",
            "CreateSandbox calls, request to ready.",
            &i.create_seconds,
        );
        hist(
            &mut out,
            "airlock_create_host_seconds",
            "Host share of CreateSandbox (without the wait for the guest).",
            &i.create_host_seconds,
        );
        hist(
            &mut out,
            "airlock_restore_seconds",
            "VMM restore, request to vCPUs running.",
            &i.restore_seconds,
        );
        hist(
            &mut out,
            "airlock_vmm_spawn_seconds",
            "Warm VMM start, spawn to exec'd in its jail (the jail's setup).",
            &i.vmm_spawn_seconds,
        );
        hist(
            &mut out,
            "airlock_vmm_ready_seconds",
            "Warm VMM start, spawn to its control socket answering (KVM VM prepared).",
            &i.vmm_ready_seconds,
        );
        let _ = writeln!(
            out,
            "# HELP airlock_agent_connections_total Connections opened to guest agents (one per sandbox, shared by its calls, unless one broke).\n# TYPE airlock_agent_connections_total counter\nairlock_agent_connections_total {}",
            crate::agent::CONNECTIONS.load(std::sync::atomic::Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP airlock_executions_total Executions by outcome.\n# TYPE airlock_executions_total counter"
        );
        for (o, n) in &i.executions {
            let _ = writeln!(out, "airlock_executions_total{{outcome=\"{o}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP airlock_create_failures_total Failed CreateSandbox calls by reason.\n# TYPE airlock_create_failures_total counter"
        );
        for (r, n) in &i.creates_failed {
            let _ = writeln!(out, "airlock_create_failures_total{{reason=\"{r}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "# HELP airlock_egress_events_total Sandbox DNS queries and TCP connections by verdict.\n# TYPE airlock_egress_events_total counter"
        );
        for ((tenant, kind, verdict), n) in &i.egress {
            let _ = writeln!(
                out,
                "airlock_egress_events_total{{tenant=\"{tenant}\",kind=\"{kind}\",verdict=\"{verdict}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP airlock_egress_bytes_total Bytes through the sandboxes' egress proxies (out: sent by the guest).\n# TYPE airlock_egress_bytes_total counter"
        );
        for ((tenant, dir), n) in &i.egress_bytes {
            let _ = writeln!(
                out,
                "airlock_egress_bytes_total{{tenant=\"{tenant}\",direction=\"{dir}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP airlock_package_requests_total Package files (and refused index pages) asked of the package proxy, by outcome.\n# TYPE airlock_package_requests_total counter"
        );
        for ((tenant, registry, outcome), (n, _)) in &i.packages {
            let _ = writeln!(
                out,
                "airlock_package_requests_total{{tenant=\"{tenant}\",registry=\"{registry}\",outcome=\"{outcome}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP airlock_package_bytes_total Bytes of package files served to sandboxes, by outcome (cached, fetched).\n# TYPE airlock_package_bytes_total counter"
        );
        for ((tenant, registry, outcome), (_, b)) in &i.packages {
            if *b > 0 {
                let _ = writeln!(
                    out,
                    "airlock_package_bytes_total{{tenant=\"{tenant}\",registry=\"{registry}\",outcome=\"{outcome}\"}} {b}"
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP airlock_sandbox_cpu_seconds_total CPU time of a sandbox's VMM (guest included).\n# TYPE airlock_sandbox_cpu_seconds_total counter"
        );
        for u in usage {
            let _ = writeln!(
                out,
                "airlock_sandbox_cpu_seconds_total{{sandbox=\"{}\",tenant=\"{}\"}} {}",
                u.id,
                u.tenant,
                u.cpu_usage_us as f64 / 1e6
            );
        }
        let _ = writeln!(
            out,
            "# HELP airlock_sandbox_memory_bytes Peak memory of a sandbox's cgroup.\n# TYPE airlock_sandbox_memory_bytes gauge"
        );
        for u in usage {
            let _ = writeln!(
                out,
                "airlock_sandbox_memory_bytes{{sandbox=\"{}\",tenant=\"{}\"}} {}",
                u.id, u.tenant, u.memory_bytes
            );
        }
        out
    }
}

fn hist(out: &mut String, name: &str, help: &str, h: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (i, b) in BUCKETS.iter().enumerate() {
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"{b}\"}} {}",
            h.counts.get(i).copied().unwrap_or(0)
        );
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum {}", h.sum);
    let _ = writeln!(out, "{name}_count {}", h.count);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative() {
        let m = Metrics::default();
        m.observe_create(0.004, 0.003, 0.0015);
        m.observe_create(0.3, 0.01, 0.002);
        m.execution_ended("exited");
        let text = m.render(&BTreeMap::from([("running".to_string(), 2)]), &[]);
        assert!(text.contains("airlock_create_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("airlock_create_seconds_bucket{le=\"0.5\"} 2"));
        assert!(text.contains("airlock_create_seconds_count 2"));
        assert!(text.contains("airlock_sandboxes{state=\"running\"} 2"));
        assert!(text.contains("airlock_executions_total{outcome=\"exited\"} 1"));
    }
}
