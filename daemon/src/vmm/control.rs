//! A VMM's control socket, from the daemon's async runtime: the typed requests and replies of
//! `airlock_control`, one request per connection, every call bounded in time.

use std::path::Path;
use std::time::Duration;

use airlock_control::{
    ControlError, MAX_REPLY, Request, RestoreReply, SettleReply, SnapshotReply, StateReply,
    StatusReply, parse_reply,
};
use serde::de::DeserializeOwned;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// How long a call may take (a snapshot writes the guest's memory file).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a VMM's control socket may take to answer `status` while it starts.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Sends `request` and reads the answer as `T`.
pub async fn call<T: DeserializeOwned>(path: &Path, request: &Request) -> Result<T, ControlError> {
    call_within(path, request, CALL_TIMEOUT).await
}

async fn call_within<T: DeserializeOwned>(
    path: &Path,
    request: &Request,
    timeout: Duration,
) -> Result<T, ControlError> {
    let exchange = async {
        let mut s = UnixStream::connect(path).await?;
        s.write_all(format!("{}\n", request.to_line()).as_bytes())
            .await?;
        read_answer(s).await
    };
    bounded(exchange, request, timeout).await
}

/// The one answer line on `s`.
async fn read_answer<T: DeserializeOwned>(s: UnixStream) -> Result<T, ControlError> {
    let mut answer = String::new();
    BufReader::new(s.take(MAX_REPLY))
        .read_line(&mut answer)
        .await?;
    if answer.is_empty() {
        return Err(ControlError::Closed);
    }
    parse_reply(&answer)
}

async fn bounded<T>(
    exchange: impl std::future::Future<Output = Result<T, ControlError>>,
    request: &Request,
    timeout: Duration,
) -> Result<T, ControlError> {
    tokio::time::timeout(timeout, exchange).await.map_err(|_| {
        ControlError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the VMM did not answer `{request}` within {timeout:?}"),
        ))
    })?
}

/// Asks a pool process to restore `snapshot`; its copy-on-write root disk (if the snapshot
/// has one) may then take `disk_quota_mib` of the host's disk, and its first disk slots get
/// `media` (volumes' files, each read-only or not), whose descriptors go with the request
/// (SCM_RIGHTS: the VMM's jail holds no volume).
pub async fn restore(
    path: &Path,
    snapshot: &Path,
    disk_quota_mib: Option<u64>,
    media: &[(std::fs::File, bool)],
) -> Result<RestoreReply, ControlError> {
    use airlock_control::SlotMode;
    let req = Request::Restore(airlock_control::RestoreRequest {
        dir: snapshot.to_path_buf(),
        disk_quota_mib,
        slots: media
            .iter()
            .map(|(_, ro)| {
                if *ro {
                    SlotMode::ReadOnly
                } else {
                    SlotMode::ReadWrite
                }
            })
            .collect(),
    });
    if media.is_empty() {
        return call(path, &req).await;
    }
    let fds = media
        .iter()
        .map(|(f, _)| f.try_clone().map(std::os::fd::OwnedFd::from))
        .collect::<std::io::Result<Vec<_>>>()?;
    let (path, line) = (path.to_owned(), format!("{}\n", req.to_line()));
    let exchange = async move {
        let sent = tokio::task::spawn_blocking(move || {
            use std::os::fd::AsRawFd;
            use vmm_sys_util::sock_ctrl_msg::ScmSocket;
            let s = std::os::unix::net::UnixStream::connect(&path)?;
            let raw: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
            s.send_with_fds(&[line.as_bytes()], &raw)
                .map_err(std::io::Error::from)?;
            s.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(s)
        })
        .await
        .map_err(std::io::Error::other)??;
        read_answer(UnixStream::from_std(sent)?).await
    };
    bounded(exchange, &req, CALL_TIMEOUT).await
}

pub async fn pause(path: &Path) -> Result<StateReply, ControlError> {
    call(path, &Request::Pause).await
}

pub async fn resume(path: &Path) -> Result<StateReply, ControlError> {
    call(path, &Request::Resume).await
}

pub async fn snapshot(path: &Path, dir: &Path) -> Result<SnapshotReply, ControlError> {
    call(path, &Request::Snapshot(dir.to_path_buf())).await
}

/// Waits, at most `max`, until the VMM's guest is quiet.
pub async fn settle(path: &Path, max: Duration) -> Result<SettleReply, ControlError> {
    let ms = u64::try_from(max.as_millis()).unwrap_or(u64::MAX);
    call(path, &Request::Settle(ms)).await
}

pub async fn status(path: &Path) -> Result<StatusReply, ControlError> {
    call_within(path, &Request::Status, Duration::from_secs(10)).await
}

/// Why a starting VMM never answered.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// It ended first (the tail of its log).
    #[error("the VMM exited before it was ready: {0}")]
    Exited(String),
    #[error("the VMM did not come up within {:?}", START_TIMEOUT)]
    TimedOut,
}

/// Waits until a starting VMM's control socket answers `status` (its KVM VM is prepared);
/// `gone` says whether it has ended meanwhile (its log is then the error).
pub async fn wait_ready(path: &Path, gone: impl Fn() -> Option<String>) -> Result<(), NotReady> {
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    loop {
        if status(path).await.is_ok() {
            return Ok(());
        }
        if let Some(why) = gone() {
            return Err(NotReady::Exited(why));
        }
        if tokio::time::Instant::now() > deadline {
            return Err(NotReady::TimedOut);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
