//! What the commands print: the JSON records (`--json`) and the text tables.

use std::fmt::Write as _;

use airlock_api::v1::{
    EgressEvent, EgressKind, EgressRule, Exposure, FileEntry, InstallEvent, InstallOutcome,
    NetworkPolicy, Node, PackagePolicy, Sandbox, SandboxState, Template, Volume, egress_rule,
};
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
        "restore_ms": s.restore_ms, "network": network_json(s.network.as_ref()),
        "packages": packages_json(s.packages.as_ref()),
        "secrets": s.secrets.iter().map(|x| json!({
            "name": x.name, "delivery": x.delivery, "targets": x.targets,
            "expires_unix_ms": x.expires_unix_ms, "removed": x.removed,
        })).collect::<Vec<_>>(),
        "disk_mib": s.disk_mib,
        "node": s.node,
        "volumes": s.volumes.iter().map(|v| json!({
            "name": v.name, "mount_path": v.mount_path, "read_only": v.read_only,
        })).collect::<Vec<_>>(),
    })
}

/// An egress policy's JSON record: `{"allow_internet": bool, "allow": [{"domain"|"cidr",
/// "ports"}]}` (deny-all: no rules, no internet).
pub fn network_json(p: Option<&NetworkPolicy>) -> Value {
    let p = p.cloned().unwrap_or_default();
    let rules: Vec<Value> = p
        .allow
        .iter()
        .map(|r| match &r.target {
            Some(egress_rule::Target::Domain(d)) => json!({"domain": d, "ports": r.ports}),
            Some(egress_rule::Target::Cidr(c)) => json!({"cidr": c, "ports": r.ports}),
            None => json!({"ports": r.ports}),
        })
        .collect();
    json!({"allow_internet": p.allow_internet, "allow": rules})
}

/// One rule as text: `*.example.com`, `api.example.com:80,443`, `203.0.113.0/24:443`,
/// `[2001:db8::/32]:443`.
fn rule_text(r: &EgressRule) -> String {
    let target = match &r.target {
        Some(egress_rule::Target::Domain(d)) => d.clone(),
        Some(egress_rule::Target::Cidr(c)) if c.contains(':') && !r.ports.is_empty() => {
            format!("[{c}]")
        }
        Some(egress_rule::Target::Cidr(c)) => c.clone(),
        None => "?".into(),
    };
    if r.ports.is_empty() {
        return target;
    }
    let ports: Vec<String> = r.ports.iter().map(u32::to_string).collect();
    format!("{target}:{}", ports.join(","))
}

/// An egress policy as text: `deny-all`, `allow-internet`, or its rules separated by spaces.
pub fn network_text(p: Option<&NetworkPolicy>) -> String {
    match p {
        Some(p) if p.allow_internet => "allow-internet".into(),
        Some(p) if !p.allow.is_empty() => {
            let rules: Vec<String> = p.allow.iter().map(rule_text).collect();
            rules.join(" ")
        }
        _ => "deny-all".into(),
    }
}

/// A package policy's JSON record: `{"registries", "allow", "deny", "offline",
/// "max_download_bytes"}` (none: every field empty, what the tenant's ceiling allows).
pub fn packages_json(p: Option<&PackagePolicy>) -> Value {
    let p = p.cloned().unwrap_or_default();
    json!({
        "registries": p.registries, "allow": p.allow, "deny": p.deny, "offline": p.offline,
        "max_download_bytes": p.max_download_bytes,
    })
}

/// A package policy as text: `offline`, or what it sets of `registries=pypi,npm`,
/// `allow=requests,types-*`, `deny=evil-*` and `max-download=50MiB`, separated by spaces;
/// `any` when it sets nothing (every registry and package, no cap of its own).
pub fn packages_text(p: Option<&PackagePolicy>) -> String {
    let Some(p) = p else {
        return "any".into();
    };
    if p.offline {
        return "offline".into();
    }
    let mut parts = Vec::new();
    for (key, list) in [
        ("registries", &p.registries),
        ("allow", &p.allow),
        ("deny", &p.deny),
    ] {
        if !list.is_empty() {
            parts.push(format!("{key}={}", list.join(",")));
        }
    }
    match p.max_download_bytes {
        0 => {}
        b if b % (1 << 20) == 0 => parts.push(format!("max-download={}MiB", b >> 20)),
        b => parts.push(format!("max-download={b}B")),
    }
    if parts.is_empty() {
        return "any".into();
    }
    parts.join(" ")
}

/// The lowercase name of an `InstallOutcome`: `cached`, `fetched`, `denied`, `hash_mismatch`,
/// `over_cap`, `upstream_error`, `bad_signature` (`unknown` for anything else).
pub fn install_outcome_name(o: i32) -> &'static str {
    match InstallOutcome::try_from(o) {
        Ok(InstallOutcome::Cached) => "cached",
        Ok(InstallOutcome::Fetched) => "fetched",
        Ok(InstallOutcome::Denied) => "denied",
        Ok(InstallOutcome::HashMismatch) => "hash_mismatch",
        Ok(InstallOutcome::OverCap) => "over_cap",
        Ok(InstallOutcome::UpstreamError) => "upstream_error",
        Ok(InstallOutcome::BadSignature) => "bad_signature",
        _ => "unknown",
    }
}

/// An install event's JSON record: its fields, the outcome by its lowercase name.
pub fn install_json(e: &InstallEvent) -> Value {
    json!({
        "seq": e.seq, "time_unix_ms": e.time_unix_ms, "tenant": e.tenant,
        "sandbox_id": e.sandbox_id, "registry": e.registry, "kind": e.kind,
        "package": e.package, "version": e.version, "file": e.file, "bytes": e.bytes,
        "sha256": e.sha256, "outcome": install_outcome_name(e.outcome), "message": e.message,
    })
}

/// The header of the install log's lines.
pub fn install_header() -> String {
    format!(
        "{:>6} {:<24} {:<10} {:<24} {:<12} {:<40} {:>10} {:<14} MESSAGE",
        "SEQ", "TIME (UTC)", "REGISTRY", "PACKAGE", "VERSION", "FILE", "BYTES", "OUTCOME"
    )
}

/// One install event as a line: sequence number, time, registry, package, version, file
/// (`-` for a refused index page's), bytes, outcome and message.
pub fn install_line(e: &InstallEvent) -> String {
    let line = format!(
        "{:>6} {:<24} {:<10} {:<24} {:<12} {:<40} {:>10} {:<14} {}",
        e.seq,
        utc_time(e.time_unix_ms),
        dash(&e.registry),
        dash(&e.package),
        dash(&e.version),
        dash(&e.file),
        e.bytes,
        install_outcome_name(e.outcome),
        e.message
    );
    line.trim_end().to_owned()
}

/// `s`, or `-` for an empty one (a table's empty cell).
fn dash(s: &str) -> String {
    if s.is_empty() {
        "-".to_owned()
    } else {
        s.to_owned()
    }
}

/// The lowercase name of an `EgressKind`.
pub fn egress_kind_name(k: i32) -> &'static str {
    match EgressKind::try_from(k) {
        Ok(EgressKind::Dns) => "dns",
        Ok(EgressKind::Tcp) => "tcp",
        Ok(EgressKind::Expose) => "expose",
        _ => "unknown",
    }
}

/// An egress event's JSON record.
pub fn egress_json(e: &EgressEvent) -> Value {
    json!({
        "seq": e.seq, "time_unix_ms": e.time_unix_ms, "kind": egress_kind_name(e.kind),
        "name": e.name, "address": e.address, "port": e.port, "bytes_out": e.bytes_out,
        "bytes_in": e.bytes_in, "duration_ms": e.duration_ms, "allowed": e.allowed,
        "verdict": e.verdict, "query_type": e.query_type, "answers": e.answers,
    })
}

/// The header of the egress log's lines.
pub fn egress_header() -> String {
    format!(
        "{:>6} {:<24} {:<8} {:<32} {:<24} {:>9} {:>9} {:>10} {:<7} VERDICT",
        "SEQ", "TIME (UTC)", "KIND", "NAME", "ADDRESS", "OUT", "IN", "DURATION", "RESULT"
    )
}

/// One egress event as a line: sequence number, time, kind (with the DNS query type), name,
/// address:port, bytes out and in, duration, ALLOWED or DENIED, and the verdict.
pub fn egress_line(e: &EgressEvent) -> String {
    let kind = match egress_kind_name(e.kind) {
        "dns" if !e.query_type.is_empty() => format!("dns {}", e.query_type),
        k => k.to_owned(),
    };
    // A DNS event's "address" is what its answer held.
    let answers = e.answers.join(",");
    let shown = if e.address.is_empty() {
        &answers
    } else {
        &e.address
    };
    let address = match (shown.as_str(), e.port) {
        ("", 0) => "-".to_owned(),
        (a, 0) => a.to_owned(),
        (a, p) if a.contains(':') && !a.contains(',') => format!("[{a}]:{p}"),
        (a, p) => format!("{}:{p}", dash(a)),
    };
    let result = if e.allowed { "ALLOWED" } else { "DENIED" };
    let line = format!(
        "{:>6} {:<24} {:<8} {:<32} {:<24} {:>9} {:>9} {:>10} {:<7} {}",
        e.seq,
        utc_time(e.time_unix_ms),
        kind,
        dash(&e.name),
        address,
        e.bytes_out,
        e.bytes_in,
        format!("{:.1}ms", e.duration_ms),
        result,
        e.verdict
    );
    line.trim_end().to_owned()
}

/// An exposure's JSON record.
pub fn exposure_json(e: &Exposure) -> Value {
    json!({
        "sandbox_id": e.sandbox_id, "guest_port": e.guest_port, "address": e.address,
        "token": e.token, "expires_unix_ms": e.expires_unix_ms,
    })
}

/// The text of `airlock expose`: the address, the token and the expiry (UTC), one `key value`
/// line each.
pub fn exposure_text(e: &Exposure) -> String {
    let rows = [
        ("address", e.address.clone()),
        ("token", e.token.clone()),
        ("expires", utc_time(e.expires_unix_ms)),
    ];
    let mut out = String::new();
    for (k, v) in rows {
        let _ = writeln!(out, "{k:<16} {v}");
    }
    out
}

pub use airlock_api::utc_time;

/// A template's JSON record.
pub fn template_json(t: &Template) -> Value {
    json!({
        "name": t.name, "id": t.id, "tenant": t.tenant, "vcpus": t.vcpus,
        "memory_mib": t.memory_mib, "kernel_path": t.kernel_path, "kernel_version": t.kernel_version,
        "rootfs_path": t.rootfs_path, "rootfs_version": t.rootfs_version,
        "source_sandbox_id": t.source_sandbox_id, "created_unix_ms": t.created_unix_ms,
        "image": t.image, "source": t.source, "tag": t.tag, "size_bytes": t.size_bytes,
        "snapshot_format": t.snapshot_format, "agent_protocol": t.agent_protocol,
        "live_sandboxes": t.live_sandboxes,
        "image_defaults": t.image_defaults.as_ref().map(|d| json!({
            "env": d.env, "working_dir": d.working_dir, "user": d.user,
            "entrypoint": d.entrypoint, "cmd": d.cmd,
        })),
    })
}

/// A file entry's JSON record.
pub fn file_entry_json(e: &FileEntry) -> Value {
    json!({
        "name": e.name, "is_dir": e.is_dir, "is_symlink": e.is_symlink, "size": e.size,
        "mode": format!("{:o}", e.mode), "mtime_unix_ms": e.mtime_unix_ms, "uid": e.uid,
        "gid": e.gid,
    })
}

/// The table of `airlock fs ls` and `fs stat`: kind, mode, owner, size, name.
pub fn file_table(list: &[FileEntry]) -> String {
    let mut out = String::new();
    for e in list {
        let kind = if e.is_dir {
            'd'
        } else if e.is_symlink {
            'l'
        } else {
            '-'
        };
        let _ = writeln!(
            out,
            "{kind}{:04o} {:>5}:{:<5} {:>12} {}",
            e.mode, e.uid, e.gid, e.size, e.name
        );
    }
    out
}

/// A volume's JSON record.
pub fn volume_json(v: &Volume) -> Value {
    json!({
        "name": v.name, "size_mib": v.size_mib, "created_unix_ms": v.created_unix_ms,
        "used_bytes": v.used_bytes, "attached_to": v.attached_to,
    })
}

/// The table of `airlock volume ls`.
pub fn volume_table(list: &[Volume]) -> String {
    let mut out = format!(
        "{:<20} {:>9} {:>10} {}\n",
        "NAME", "SIZE_MIB", "USED_MIB", "MOUNTED_BY"
    );
    for v in list {
        let by = if v.attached_to.is_empty() {
            "-".to_owned()
        } else {
            v.attached_to.join(",")
        };
        let _ = writeln!(
            out,
            "{:<20} {:>9} {:>10} {}",
            v.name,
            v.size_mib,
            v.used_bytes >> 20,
            by
        );
    }
    out
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

/// A node's JSON record.
pub fn node_json(n: &Node) -> Value {
    json!({
        "name": n.name, "tag": n.tag, "address": n.address, "version": n.version,
        "sandboxes": n.sandboxes, "max_sandboxes": n.max_sandboxes,
        "committed_mib": n.committed_mib, "capacity_mib": n.capacity_mib,
        "templates": n.templates, "started_unix_ms": n.started_unix_ms,
    })
}

/// The table of `airlock nodes`.
pub fn node_table(list: &[Node]) -> String {
    let mut out = format!(
        "{:<16} {:<4} {:>11} {:>15} {:<24} {}\n",
        "NODE", "TAG", "SANDBOXES", "MEM_MIB", "ADDRESS", "TEMPLATES"
    );
    for n in list {
        let name = if n.name.is_empty() {
            "(single host)"
        } else {
            &n.name
        };
        let _ = writeln!(
            out,
            "{:<16} {:<4} {:>11} {:>15} {:<24} {}",
            name,
            n.tag,
            format!("{}/{}", n.sandboxes, n.max_sandboxes),
            format!("{}/{}", n.committed_mib, n.capacity_mib),
            n.address,
            n.templates.join(",")
        );
    }
    out
}

/// The table of `airlock template ls`.
pub fn template_table(list: &[Template]) -> String {
    let mut out = format!(
        "{:<16} {:<12} {:<22} {:>5} {:>7} {:>8} {:>4} {:<8} {}\n",
        "NAME", "TAG", "ID", "VCPUS", "MEM_MIB", "SIZE_MIB", "LIVE", "OWNER", "SOURCE"
    );
    let mut list: Vec<&Template> = list.iter().collect();
    list.sort_by(|a, b| {
        (&a.tenant, &a.name, b.created_unix_ms).cmp(&(&b.tenant, &b.name, a.created_unix_ms))
    });
    for t in list {
        let owner = if t.tenant.is_empty() {
            "shared"
        } else {
            &t.tenant
        };
        let _ = writeln!(
            out,
            "{:<16} {:<12} {:<22} {:>5} {:>7} {:>8} {:>4} {:<8} {}",
            t.name,
            if t.tag.is_empty() { "latest" } else { &t.tag },
            t.id,
            t.vcpus,
            t.memory_mib,
            t.size_bytes >> 20,
            t.live_sandboxes,
            owner,
            if t.source.is_empty() {
                &t.image
            } else {
                &t.source
            }
        );
    }
    out
}

/// The text of `airlock get`: one `key: value` line per field worth reading.
pub fn sandbox_text(s: &Sandbox) -> String {
    let mut labels: Vec<_> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    let mut out = String::new();
    let rows: [(&str, String); 15] = [
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
        ("network", network_text(s.network.as_ref())),
        ("packages", packages_text(s.packages.as_ref())),
        ("node", s.node.clone()),
        ("end", format!("{} {}", s.end_reason, s.end_message)),
    ];
    for (k, v) in rows {
        let line = format!("{k:<16} {v}");
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}
