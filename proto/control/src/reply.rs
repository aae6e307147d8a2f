//! Control-socket replies: one JSON object per line, `{"ok":true, ...fields of the reply}` or
//! `{"ok":false,"error":"..."}`.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where a VM is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    /// A warm pool process: KVM VM and vCPUs made, no guest yet.
    Prepared,
    Running,
    Paused,
}

/// The answer to `pause` and `resume`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateReply {
    pub state: VmState,
}

/// The answer to `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    pub state: VmState,
    pub vcpus: u32,
    /// Guest memory; absent for a pool process that has no guest yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_mib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uptime_ms: Option<u64>,
    /// Whether the guest printed `airlock: userspace up` (after a restore: whether the
    /// snapshotted guest had).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userspace_up: Option<bool>,
}

/// The answer to `snapshot DIR`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReply {
    pub dir: String,
    pub memory_bytes_written: u64,
    pub state_bytes: u64,
    pub snapshot_ms: f64,
    pub memory_ms: f64,
    /// Bytes of the copy-on-write root disk's layer written (0 without one).
    #[serde(default)]
    pub layer_bytes: u64,
    /// How the guest settled before the pause, where the snapshot's taker waited for it
    /// (`airlock-vmm snapshot`); the control socket's `snapshot DIR` leaves it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settle: Option<SettleReply>,
}

/// The answer to `settle MS`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SettleReply {
    /// The guest went quiet before the time was up.
    pub settled: bool,
    /// How long the VMM waited.
    pub waited_ms: f64,
    /// CPU time the VMM's threads used meanwhile.
    pub busy_ms: f64,
}

/// The answer to `restore DIR`: sent once the clone's vCPUs run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreReply {
    pub state: VmState,
    /// From the request's arrival to the vCPUs running.
    pub running_after_us: u64,
}

/// The answer to `stop`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopReply {}

/// Any successful answer, as the VMM sends it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Reply {
    State(StateReply),
    Status(StatusReply),
    Snapshot(SnapshotReply),
    Restore(RestoreReply),
    Stop(StopReply),
    Settle(SettleReply),
    /// A test hook's findings (free-form: tests read them).
    Probe(Value),
}

/// What went wrong with a control call.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("the VMM closed the control connection without an answer")]
    Closed,
    #[error("the VMM's answer is not what was expected: {0}")]
    Malformed(String),
    /// The VMM answered `ok: false`.
    #[error("the VMM refused: {0}")]
    Refused(String),
}

/// The line a VMM sends for `reply` (with its newline).
pub fn reply_line(reply: &Result<Reply, String>) -> String {
    let v = match reply {
        Ok(r) => match serde_json::to_value(r) {
            Ok(Value::Object(mut map)) => {
                map.insert("ok".into(), Value::Bool(true));
                Value::Object(map)
            }
            Ok(other) => serde_json::json!({"ok": true, "result": other}),
            Err(e) => {
                serde_json::json!({"ok": false, "error": format!("encoding the answer: {e}")})
            }
        },
        Err(e) => serde_json::json!({"ok": false, "error": e}),
    };
    format!("{v}\n")
}

/// Reads a reply line as `T`, or the VMM's refusal.
pub fn parse_reply<T: DeserializeOwned>(line: &str) -> Result<T, ControlError> {
    let v: Value = serde_json::from_str(line.trim())
        .map_err(|e| ControlError::Malformed(format!("{e}: {:?}", truncate(line))))?;
    match v.get("ok") {
        Some(Value::Bool(true)) => {}
        Some(Value::Bool(false)) => {
            let error = v
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("no reason given");
            return Err(ControlError::Refused(error.to_owned()));
        }
        _ => {
            return Err(ControlError::Malformed(format!(
                "no `ok`: {:?}",
                truncate(line)
            )));
        }
    }
    serde_json::from_value(v)
        .map_err(|e| ControlError::Malformed(format!("{e}: {:?}", truncate(line))))
}

fn truncate(s: &str) -> &str {
    let mut end = s.len().min(200);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn replies_read_back_as_their_types() {
        let restored = Reply::Restore(RestoreReply {
            state: VmState::Running,
            running_after_us: 812,
        });
        let line = reply_line(&Ok(restored));
        assert!(line.ends_with('\n'));
        let r: RestoreReply = parse_reply(&line).unwrap();
        assert_eq!(r.running_after_us, 812);
        let status = StatusReply {
            state: VmState::Prepared,
            vcpus: 2,
            mem_mib: None,
            cpu_template: None,
            uptime_ms: None,
            userspace_up: None,
        };
        let line = reply_line(&Ok(Reply::Status(status.clone())));
        assert_eq!(parse_reply::<StatusReply>(&line).unwrap(), status);
        let stop = reply_line(&Ok(Reply::Stop(StopReply {})));
        assert_eq!(stop, "{\"ok\":true}\n");
        parse_reply::<StopReply>(&stop).unwrap();
    }

    #[test]
    fn refusals_and_garbage_are_errors() {
        let refused = reply_line(&Err("the VM is not paused".into()));
        match parse_reply::<StateReply>(&refused) {
            Err(ControlError::Refused(m)) => assert_eq!(m, "the VM is not paused"),
            other => panic!("{other:?}"),
        }
        for bad in ["", "not json", "{}", "{\"ok\":\"yes\"}", "{\"ok\":true}"] {
            assert!(
                matches!(
                    parse_reply::<RestoreReply>(bad),
                    Err(ControlError::Malformed(_))
                ),
                "{bad:?}"
            );
        }
    }
}
