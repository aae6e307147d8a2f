//! The gRPC frames the cluster's router reads and makes: a call's id peeked from the start of
//! its first message (the rest streams on), whole requests held within one budget shared by
//! every call, answers decoded and made here.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::{BufMut as _, Bytes, BytesMut};
use futures_util::StreamExt as _;
use http_body_util::BodyExt as _;
use prost::Message;
use tonic::Status;
use tonic::body::Body;

/// The largest request held whole (a CreateSandbox with its files is the largest; the
/// daemon's own cap on a message applies after).
pub const MAX_REQUEST: usize = 64 << 20;

/// The largest small request held whole (ListSandboxes, ListTemplates, DeleteTemplate).
pub const MAX_SMALL_REQUEST: usize = 1 << 20;
/// Bytes of requests the router of one node holds at once, at most (four of the largest).
pub const BUDGET: usize = 4 * MAX_REQUEST;

type Response = http::Response<Body>;

/// Bytes of requests the router may hold at once, across all calls.
#[derive(Clone, Debug)]
pub struct Budget {
    bytes: usize,
    free: Arc<tokio::sync::Semaphore>,
}

impl Budget {
    pub fn new(bytes: usize) -> Self {
        Self {
            bytes,
            free: Arc::new(tokio::sync::Semaphore::new(bytes)),
        }
    }
}

/// A held request's share of the [`Budget`] (given back when dropped).
#[derive(Debug)]
pub struct Held(#[allow(dead_code)] Option<tokio::sync::OwnedSemaphorePermit>);

/// Reads `body` whole (at most `limit` bytes), drawing on `budget` for as long as the
/// answer's [`Held`] is kept: past either, the call is refused at once (RESOURCE_EXHAUSTED).
pub async fn collect(
    mut body: Body,
    limit: usize,
    budget: &Budget,
) -> Result<(Bytes, Held), Status> {
    let mut buf = BytesMut::new();
    let mut held: Option<tokio::sync::OwnedSemaphorePermit> = None;
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| Status::invalid_argument(format!("reading the request: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if buf.len() + data.len() > limit {
            return Err(Status::resource_exhausted(format!(
                "the request is over {} MiB, the most the cluster's router holds of one call",
                limit >> 20
            )));
        }
        let more = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let permit = budget
            .free
            .clone()
            .try_acquire_many_owned(more)
            .map_err(|_| {
                Status::resource_exhausted(format!(
                    "the cluster's router holds {} MiB of requests already: try again",
                    budget.bytes >> 20
                ))
            })?;
        match held.as_mut() {
            Some(h) => h.merge(permit),
            None => held = Some(permit),
        }
        buf.put(data);
    }
    Ok((buf.freeze(), Held(held)))
}

/// The request again from its parts and body bytes.
pub fn rebuild(parts: &http::request::Parts, body: Bytes) -> http::Request<Body> {
    let mut req = http::Request::new(Body::new(http_body_util::Full::new(body)));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    req
}

/// The first gRPC message in `bytes` (uncompressed; `None` otherwise or incomplete).
pub fn first_message(bytes: &[u8]) -> Option<&[u8]> {
    if bytes.len() < 5 || bytes[0] != 0 {
        return None;
    }
    let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
    bytes.get(5..5 + len)
}

/// Whether a create's response sends it to the next node: CAPACITY_EXHAUSTED or
/// TEMPLATE_NOT_FOUND (a trailers-only answer).
pub fn moves_on(headers: &http::HeaderMap) -> bool {
    use tonic_types::StatusExt as _;
    Status::from_header_map(headers).is_some_and(|s| {
        s.get_details_error_info()
            .is_some_and(|i| i.reason == "CAPACITY_EXHAUSTED" || i.reason == "TEMPLATE_NOT_FOUND")
    })
}

/// The message of a unary gRPC answer, or its error.
pub async fn unary_answer<M: Message + Default>(resp: Response) -> Result<M, Status> {
    if let Some(s) = Status::from_header_map(resp.headers())
        && s.code() != tonic::Code::Ok
    {
        return Err(s);
    }
    let collected = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Status::unavailable(format!("a node's answer: {e}")))?;
    if let Some(trailers) = collected.trailers()
        && let Some(s) = Status::from_header_map(trailers)
        && s.code() != tonic::Code::Ok
    {
        return Err(s);
    }
    let bytes = collected.to_bytes();
    let msg = first_message(&bytes)
        .ok_or_else(|| Status::internal("a node's answer is no gRPC message"))?;
    M::decode(msg).map_err(|e| Status::internal(format!("a node's answer: {e}")))
}

/// A successful unary gRPC answer carrying `m`.
pub fn grpc_ok<M: Message>(m: &M) -> Response {
    let msg = m.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + msg.len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(msg.len()).unwrap_or(u32::MAX));
    frame.put_slice(&msg);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let frames = futures_util::stream::iter([
        Ok::<_, Infallible>(http_body::Frame::data(frame.freeze())),
        Ok(http_body::Frame::trailers(trailers)),
    ]);
    let mut resp = http::Response::new(Body::new(http_body_util::StreamBody::new(frames)));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    resp
}

/// Reads the start of `req`'s first message until its field 1 (a string; with `nested`, the
/// field 1 of the message in field 1) is there, at most [`PEEK_LIMIT`] bytes of it; answers
/// the request with its body whole again (the rest streams on, unread) and that id (empty
/// when the start has none: the call is then served here).
pub async fn peek_id(
    req: http::Request<Body>,
    nested: bool,
) -> Result<(http::Request<Body>, String), Status> {
    let (parts, mut body) = req.into_parts();
    let mut buf = BytesMut::new();
    let id = loop {
        let ended = match scan(&buf, nested) {
            Peeked::Id(id) => break id,
            Peeked::Nothing => break String::new(),
            Peeked::More if buf.len() >= 5 + PEEK_LIMIT => break String::new(),
            Peeked::More => match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buf.put(data);
                    }
                    false
                }
                Some(Err(e)) => {
                    return Err(Status::invalid_argument(format!("the request: {e}")));
                }
                None => true,
            },
        };
        if ended {
            break match scan(&buf, nested) {
                Peeked::Id(id) => id,
                _ => String::new(),
            };
        }
    };
    let head = buf.freeze();
    let rest = body.into_data_stream();
    let stream = futures_util::stream::once(async move { Ok::<_, Status>(head) }).chain(
        futures_util::StreamExt::map(rest, |r| r.map_err(|e| Status::internal(e.to_string()))),
    );
    let stream = futures_util::StreamExt::map(stream, |r| r.map(http_body::Frame::data));
    let req = http::Request::from_parts(parts, Body::new(http_body_util::StreamBody::new(stream)));
    Ok((req, id))
}

/// The most of a first message read to find its id (ids come first: field 1).
pub const PEEK_LIMIT: usize = 64 << 10;

/// What the start of a body says of its call's id.
enum Peeked {
    Id(String),
    /// No id there (compressed, or a message without field 1 in its start).
    Nothing,
    /// Not known before more of the body comes.
    More,
}

/// The id in the first message's field 1 (`nested`: field 1 of field 1) of `buf`, the start
/// of a gRPC body.
fn scan(buf: &[u8], nested: bool) -> Peeked {
    if buf.len() < 5 {
        return Peeked::More;
    }
    if buf[0] != 0 {
        return Peeked::Nothing;
    }
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    let end = buf.len().min(5usize.saturating_add(len));
    let complete = buf.len() >= 5usize.saturating_add(len);
    let field = match field_1(&buf[5..end], complete) {
        Ok(Some(f)) if nested => field_1(f, true),
        other => other,
    };
    match field {
        Ok(Some(id)) => Peeked::Id(String::from_utf8(id.to_vec()).unwrap_or_default()),
        Ok(None) => Peeked::Nothing,
        Err(More) => Peeked::More,
    }
}

/// More of a message is needed.
struct More;

/// The bytes of length-delimited field 1 in `msg` (its first occurrence), `None` when it has
/// none; `complete`: `msg` is the whole message, else only its start.
fn field_1(msg: &[u8], complete: bool) -> Result<Option<&[u8]>, More> {
    let short = || if complete { Ok(None) } else { Err(More) };
    let mut at = 0;
    while at < msg.len() {
        let Some((key, n)) = varint(&msg[at..]) else {
            return short();
        };
        at += n;
        let skip = match key & 7 {
            0 => match varint(&msg[at..]) {
                Some((_, n)) => n,
                None => return short(),
            },
            1 => 8,
            5 => 4,
            2 => {
                let Some((len, n)) = varint(&msg[at..]) else {
                    return short();
                };
                at += n;
                let len = usize::try_from(len).unwrap_or(usize::MAX);
                if key >> 3 == 1 {
                    return match msg.get(at..at.saturating_add(len)) {
                        Some(f) => Ok(Some(f)),
                        None => short(),
                    };
                }
                len
            }
            _ => return Ok(None), // groups: no id here
        };
        at = at.saturating_add(skip);
    }
    short()
}

/// A protobuf varint at the start of `b`, and its length.
fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::error::ApiError;
    use crate::rpc::{self, Routing};
    use airlock_api::v1::DestroySandboxResponse;

    /// Field 1 as a string (every sandbox and execution request has its id there).
    #[derive(Clone, PartialEq, Message)]
    struct IdField {
        #[prost(string, tag = "1")]
        id: String,
    }

    /// WriteFile's first message: its header (field 1) has the sandbox id in field 1.
    #[derive(Clone, PartialEq, Message)]
    struct WriteFileHead {
        #[prost(message, optional, tag = "1")]
        header: Option<IdField>,
    }

    fn framed(m: &impl Message) -> Bytes {
        let msg = m.encode_to_vec();
        let mut b = BytesMut::new();
        b.put_u8(0);
        b.put_u32(msg.len() as u32);
        b.put_slice(&msg);
        b.freeze()
    }

    #[test]
    fn a_frame_that_is_compressed_short_or_cut_is_not_decoded() {
        assert!(first_message(&[1, 0, 0, 0, 0]).is_none());
        assert!(first_message(&[0, 0, 0]).is_none());
        assert!(first_message(&[0, 0, 0, 0, 9, 1, 2]).is_none());
        assert_eq!(first_message(&[0, 0, 0, 0, 1, 7]), Some(&[7u8][..]));
    }

    #[tokio::test]
    async fn a_peeked_request_keeps_its_whole_body() {
        let msg = airlock_api::v1::GetSandboxRequest {
            sandbox_id: "sb-beef000000000001".into(),
        };
        let mut body = framed(&msg).to_vec();
        body.extend_from_slice(b"more");
        let req = http::Request::new(Body::new(http_body_util::Full::new(Bytes::from(
            body.clone(),
        ))));
        let (req, id) = peek_id(req, false).await.unwrap();
        assert_eq!(id, msg.sandbox_id);
        let all = req.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(all.to_vec(), body);
    }

    #[tokio::test]
    async fn an_answer_made_here_decodes_as_a_grpc_answer() {
        let r = grpc_ok(&DestroySandboxResponse { destroyed: true });
        let back: DestroySandboxResponse = unary_answer(r).await.unwrap();
        assert!(back.destroyed);
        let err: Status = ApiError::Capacity {
            what: "sandboxes",
            limit: 1,
            current: 1,
        }
        .into();
        assert!(moves_on(err.into_http::<Body>().headers()));
        let quota: Status = ApiError::Quota {
            tenant: "t".into(),
            what: "sandboxes",
            limit: 1,
            current: 1,
        }
        .into();
        assert!(!moves_on(quota.into_http::<Body>().headers()));
    }

    #[test]
    fn every_call_on_a_sandbox_or_an_execution_names_it_in_field_1() {
        use airlock_api::v1::*;
        let id = "sb-beef000000000001".to_owned();
        let requests: Vec<(&str, Bytes)> = vec![
            (
                "GetSandbox",
                framed(&GetSandboxRequest {
                    sandbox_id: id.clone(),
                }),
            ),
            (
                "Exec",
                framed(&ExecRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "ReadFile",
                framed(&ReadFileRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "ExposePort",
                framed(&ExposePortRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "StreamExecution",
                framed(&StreamExecutionRequest {
                    execution_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "WriteStdin",
                framed(&WriteStdinRequest {
                    execution_id: id.clone(),
                    ..Default::default()
                }),
            ),
        ];
        for (method, bytes) in requests {
            assert_ne!(
                rpc::by_name(method).unwrap().routing,
                Routing::Local,
                "{method}"
            );
            let got = IdField::decode(first_message(&bytes).unwrap()).unwrap();
            assert_eq!(got.id, id, "{method}");
            assert!(
                matches!(scan(&bytes, false), Peeked::Id(p) if p == id),
                "{method}"
            );
        }
        let wf = WriteFileRequest {
            part: Some(write_file_request::Part::Header(WriteFileHeader {
                sandbox_id: id.clone(),
                path: "/tmp/x".into(),
                ..Default::default()
            })),
        };
        let head = WriteFileHead::decode(first_message(&framed(&wf)).unwrap()).unwrap();
        assert!(matches!(scan(&framed(&wf), true), Peeked::Id(p) if p == id));
        assert_eq!(head.header.unwrap().id, id);
        assert_eq!(
            rpc::by_name("CreateTemplate").unwrap().routing,
            Routing::Local
        );
    }

    /// Issue 37, item 6: a call on a sandbox is routed on the start of its first message; the
    /// rest streams on to the node (no call makes the router hold 64 MiB).
    #[tokio::test]
    async fn a_call_is_routed_on_the_start_of_its_first_message() {
        use airlock_api::v1::{ExecRequest, WriteFileHeader, WriteFileRequest, write_file_request};
        let id = "sb-beef000000000001".to_owned();
        let huge = 100 << 20;
        let exec = ExecRequest {
            sandbox_id: id.clone(),
            ..Default::default()
        }
        .encode_to_vec();
        let header = WriteFileRequest {
            part: Some(write_file_request::Part::Header(WriteFileHeader {
                sandbox_id: id.clone(),
                path: "/tmp/x".into(),
                ..Default::default()
            })),
        }
        .encode_to_vec();
        for (start, nested) in [(exec, false), (header, true)] {
            // Declared 100 MiB long; only its start comes, the rest never does.
            let mut head = BytesMut::new();
            head.put_u8(0);
            head.put_u32(huge);
            head.put_slice(&start);
            let frames = futures_util::stream::iter([Ok::<_, Status>(http_body::Frame::data(
                head.freeze(),
            ))])
            .chain(futures_util::stream::pending());
            let req = http::Request::new(Body::new(http_body_util::StreamBody::new(frames)));
            let peeked =
                tokio::time::timeout(std::time::Duration::from_secs(5), peek_id(req, nested))
                    .await
                    .expect("routed before the rest of the message came");
            assert_eq!(peeked.unwrap().1, id);
        }
    }

    /// Issue 37, item 6: requests held whole (CreateSandbox, tried on one node after another)
    /// draw on one budget: past it a call is refused at once, clearly, and not held.
    #[tokio::test]
    async fn requests_held_whole_share_one_budget() {
        let budget = Budget::new(1 << 20);
        let body = |n: usize| Body::new(http_body_util::Full::new(Bytes::from(vec![0u8; n])));
        let (first, held) = collect(body(700 << 10), MAX_REQUEST, &budget)
            .await
            .unwrap();
        assert_eq!(first.len(), 700 << 10);
        let Err(err) = collect(body(700 << 10), MAX_REQUEST, &budget).await else {
            panic!("held past the budget");
        };
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        assert!(err.message().contains("try again"), "{err}");
        drop(held);
        let (_again, _held) = collect(body(700 << 10), MAX_REQUEST, &budget)
            .await
            .unwrap();
        // One request past the limit of one call.
        let Err(err) = collect(body(2 << 20), 1 << 20, &Budget::new(8 << 20)).await else {
            panic!("held past its limit");
        };
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    }
}
