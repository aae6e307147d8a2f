//! What the commands print: the JSON records (`--json`) and the text tables.

use std::fmt::Write as _;

use airlock_api::v1::{Sandbox, SandboxState, Template};
use serde_json::{Value, json};

/// Prints one JSON value on stdout.
pub fn print_json(v: &Value) {
    println!("{v}");
}

/// The lowercase name of a `SandboxState`.
pub fn state_name(s: i32) -> &'static str {
    match SandboxState::try_from(s) {
        Ok(SandboxState::Starting) => "starting",
        Ok(SandboxState::Running) => "running",
        Ok(SandboxState::Paused) => "paused",
        Ok(SandboxState::Dead) => "dead",
        Ok(SandboxState::Destroyed) => "destroyed",
        _ => "unknown",
    }
}

/// A sandbox's JSON record.
pub fn sandbox_json(s: &Sandbox) -> Value {
    json!({
        "id": s.id, "tenant": s.tenant, "template": s.template, "template_id": s.template_id,
        "state": state_name(s.state), "end_reason": s.end_reason, "end_message": s.end_message,
        "vcpus": s.vcpus, "memory_mib": s.memory_mib, "labels": s.labels,
        "created_unix_ms": s.created_unix_ms, "create_ms": s.create_ms,
        "create_host_ms": s.create_host_ms, "create_guest_ms": s.create_guest_ms,
        "restore_ms": s.restore_ms,
    })
}

/// A template's JSON record.
pub fn template_json(t: &Template) -> Value {
    json!({
        "name": t.name, "id": t.id, "tenant": t.tenant, "vcpus": t.vcpus,
        "memory_mib": t.memory_mib, "kernel_path": t.kernel_path, "kernel_version": t.kernel_version,
        "rootfs_path": t.rootfs_path, "rootfs_version": t.rootfs_version,
        "source_sandbox_id": t.source_sandbox_id, "created_unix_ms": t.created_unix_ms,
    })
}

/// The table of `airlock ls`.
pub fn sandbox_table(list: &[Sandbox]) -> String {
    let mut out = format!(
        "{:<20} {:<10} {:<12} {:>5} {:>7}\n",
        "ID", "STATE", "TEMPLATE", "VCPUS", "MEM_MIB"
    );
    for s in list {
        let _ = writeln!(
            out,
            "{:<20} {:<10} {:<12} {:>5} {:>7}",
            s.id,
            state_name(s.state),
            s.template,
            s.vcpus,
            s.memory_mib
        );
    }
    out
}

/// The table of `airlock template ls`.
pub fn template_table(list: &[Template]) -> String {
    let mut out = format!(
        "{:<16} {:<22} {:>5} {:>7} {:<8}\n",
        "NAME", "ID", "VCPUS", "MEM_MIB", "OWNER"
    );
    for t in list {
        let owner = if t.tenant.is_empty() {
            "shared"
        } else {
            &t.tenant
        };
        let _ = writeln!(
            out,
            "{:<16} {:<22} {:>5} {:>7} {:<8}",
            t.name, t.id, t.vcpus, t.memory_mib, owner
        );
    }
    out
}

/// The text of `airlock get`: one `key: value` line per field worth reading.
pub fn sandbox_text(s: &Sandbox) -> String {
    let mut labels: Vec<_> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    let mut out = String::new();
    let rows: [(&str, String); 12] = [
        ("id", s.id.clone()),
        ("state", state_name(s.state).to_owned()),
        ("template", format!("{} ({})", s.template, s.template_id)),
        ("vcpus", s.vcpus.to_string()),
        ("memory_mib", s.memory_mib.to_string()),
        ("disk_mib", s.disk_mib.to_string()),
        ("labels", labels.join(",")),
        ("idle_ttl_s", s.idle_ttl_s.to_string()),
        ("max_lifetime_s", s.max_lifetime_s.to_string()),
        ("created_unix_ms", s.created_unix_ms.to_string()),
        ("create_ms", format!("{:.1}", s.create_ms)),
        ("end", format!("{} {}", s.end_reason, s.end_message)),
    ];
    for (k, v) in rows {
        let line = format!("{k:<16} {v}");
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}
