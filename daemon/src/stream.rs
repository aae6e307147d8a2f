//! An execution's output as StreamExecution sends it: the stored output from the client's
//! offsets, then, while the execution runs, whatever is stored next (woken by the execution's
//! change signal), and its final record last. The same files serve a replay after the fact.

use std::path::Path;
use std::sync::Arc;

use airlock_api::v1::{ExecutionEvent, Output, StreamKind, execution_event};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::mpsc::Sender;
use tonic::Status;

use crate::exec::{ExecRt, Executions};

type Events = Sender<Result<ExecutionEvent, Status>>;

/// Largest output event.
const CHUNK: usize = 64 << 10;

/// Streams execution `id` (found running as `live`, or ended) from `offsets` into `tx`.
pub async fn follow(
    executions: Arc<Executions>,
    id: String,
    live: Option<Arc<ExecRt>>,
    mut offsets: [u64; 2],
    tx: Events,
) {
    let paths = executions.output_paths(&id);
    let mut changed = live.as_ref().map(|l| l.changed.subscribe());
    loop {
        // What is stored now, and whether it is the end.
        let (ends, finished) = match &live {
            Some(l) => (l.stored(), l.is_finished()),
            None => ([file_len(&paths[0]), file_len(&paths[1])], true),
        };
        if !send_both(&tx, &paths, &mut offsets, ends).await {
            return;
        }
        if finished {
            // Output stored between the check and the end.
            let ends = [file_len(&paths[0]), file_len(&paths[1])];
            if !send_both(&tx, &paths, &mut offsets, ends).await {
                return;
            }
            let event = match executions.record(&id) {
                Ok(record) => Ok(ExecutionEvent {
                    event: Some(execution_event::Event::Exit(record)),
                }),
                Err(e) => Err(e.into()),
            };
            let _ = tx.send(event).await;
            return;
        }
        match changed.as_mut() {
            Some(c) => {
                tokio::select! {
                    _ = c.changed() => {}
                    _ = tx.closed() => return,
                }
            }
            None => return,
        }
    }
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

async fn send_both(
    tx: &Events,
    paths: &[std::path::PathBuf; 2],
    offsets: &mut [u64; 2],
    ends: [u64; 2],
) -> bool {
    for (i, kind) in [(0, StreamKind::Stdout), (1, StreamKind::Stderr)] {
        if !send_range(tx, &paths[i], kind, &mut offsets[i], ends[i]).await {
            return false;
        }
    }
    true
}

/// Sends `[offset, end)` of a file in chunks, each as an Output event.
async fn send_range(
    tx: &Events,
    path: &Path,
    stream: StreamKind,
    offset: &mut u64,
    end: u64,
) -> bool {
    if *offset >= end {
        return true;
    }
    let Ok(mut f) = tokio::fs::File::open(path).await else {
        return false;
    };
    if f.seek(std::io::SeekFrom::Start(*offset)).await.is_err() {
        return false;
    }
    while *offset < end {
        let n = ((end - *offset) as usize).min(CHUNK);
        let mut buf = vec![0u8; n];
        let Ok(got) = f.read(&mut buf).await else {
            return false;
        };
        if got == 0 {
            break;
        }
        buf.truncate(got);
        let ev = ExecutionEvent {
            event: Some(execution_event::Event::Output(Output {
                stream: stream as i32,
                offset: *offset,
                data: buf,
            })),
        };
        *offset += got as u64;
        if tx.send(Ok(ev)).await.is_err() {
            return false;
        }
    }
    true
}
