//! DNS for a sandbox, as its gateway answers it: one question per query, A and AAAA only,
//! names checked for the shapes that carry data out (DNS tunnels) before anything else looks
//! at them. Parsing and answering are here (pure, on bounded input); what a name resolves to
//! and whether the policy allows it is the caller's.

use std::net::Ipv4Addr;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, RData, Record, RecordType, rdata};

use crate::policy::normalise_name;

/// The largest query read (a plain DNS message over UDP; a question needs far less).
pub const MAX_QUERY: usize = 512;
/// A label longer than this is tunnel-shaped (host names rarely pass 40; hashes and encoded
/// payloads do).
pub const MAX_LABEL: usize = 48;
/// A name longer than this is tunnel-shaped.
pub const MAX_NAME: usize = 160;

/// What the guest asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryType {
    A,
    Aaaa,
    /// Any other type, by its number (answered with a refusal).
    Other(u16),
}

impl std::fmt::Display for QueryType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::A => write!(f, "A"),
            Self::Aaaa => write!(f, "AAAA"),
            Self::Other(n) => write!(f, "{}", RecordType::from(*n)),
        }
    }
}

/// A parsed query.
#[derive(Debug, Clone)]
pub struct DnsQuery {
    /// The name, normalised (lowercase, no final dot); `None` if it is not a host name.
    pub name: Option<String>,
    /// The name as asked (for the log), cut to [`MAX_NAME`] + a few characters.
    pub raw_name: String,
    pub qtype: QueryType,
    message: Message,
}

/// How the gateway answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DnsAnswer {
    /// These addresses (A), each with `ttl`.
    Addresses(Vec<Ipv4Addr>, u32),
    /// The name exists, with no records of the type asked (AAAA: the guest has IPv4 only).
    NoData,
    /// REFUSED: the policy does not allow the name, or the query's shape.
    Refused,
    /// NXDOMAIN: an allowed name that does not resolve.
    NxDomain,
    /// SERVFAIL: resolving failed.
    ServFail,
}

/// Why a query is refused before its name is looked at by the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shape {
    /// Not one standard IN query (a response, another opcode, zero or several questions).
    NotAQuery,
    /// The name is not a valid host name.
    BadName,
    /// A label of this many characters.
    LongLabel(usize),
    /// A name of this many characters.
    LongName(usize),
    /// A type the gateway does not serve.
    Type(QueryType),
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotAQuery => write!(f, "not a single standard query"),
            Self::BadName => write!(f, "not a host name"),
            Self::LongLabel(n) => {
                write!(
                    f,
                    "tunnel-shaped: a label of {n} characters (at most {MAX_LABEL})"
                )
            }
            Self::LongName(n) => {
                write!(
                    f,
                    "tunnel-shaped: a name of {n} characters (at most {MAX_NAME})"
                )
            }
            Self::Type(t) => write!(f, "query type {t} is not served (only A and AAAA)"),
        }
    }
}

/// Parses a query; `None` for bytes that are not a DNS message at all (no answer is sent:
/// there is no id to answer to).
pub fn parse(buf: &[u8]) -> Option<DnsQuery> {
    if buf.len() > MAX_QUERY {
        return None;
    }
    let message = Message::from_vec(buf).ok()?;
    if message.metadata.message_type != MessageType::Query {
        return None;
    }
    let (raw_name, qtype, name) = match message.queries.first() {
        Some(q) => {
            let raw: String = q.name().to_ascii().chars().take(MAX_NAME + 8).collect();
            let qtype = match q.query_type() {
                RecordType::A => QueryType::A,
                RecordType::AAAA => QueryType::Aaaa,
                other => QueryType::Other(u16::from(other)),
            };
            let name = normalise_name(&raw);
            (raw, qtype, name)
        }
        None => (String::new(), QueryType::Other(0), None),
    };
    Some(DnsQuery {
        name,
        raw_name,
        qtype,
        message,
    })
}

impl DnsQuery {
    /// Whether the query's shape is refused whatever the policy: not one standard IN query, a
    /// name that is no host name or shaped like a tunnel, a type other than A and AAAA.
    pub fn refused_shape(&self) -> Option<Shape> {
        let m = &self.message;
        if m.metadata.op_code != OpCode::Query
            || m.queries.len() != 1
            || m.queries.first().map(Query::query_class) != Some(DNSClass::IN)
        {
            return Some(Shape::NotAQuery);
        }
        let raw = self.raw_name.trim_end_matches('.');
        if let Some(n) = raw.split('.').map(str::len).max()
            && n > MAX_LABEL
        {
            return Some(Shape::LongLabel(n));
        }
        if raw.len() > MAX_NAME {
            return Some(Shape::LongName(raw.len()));
        }
        if self.name.is_none() {
            return Some(Shape::BadName);
        }
        if let QueryType::Other(_) = self.qtype {
            return Some(Shape::Type(self.qtype.clone()));
        }
        None
    }

    /// The response to send.
    pub fn answer(&self, answer: &DnsAnswer) -> Vec<u8> {
        let mut r = Message::response(self.message.metadata.id, self.message.metadata.op_code);
        r.metadata.recursion_desired = self.message.metadata.recursion_desired;
        r.metadata.recursion_available = true;
        if let Some(q) = self.message.queries.first()
            && self.message.queries.len() == 1
        {
            r.add_query(q.clone());
        }
        r.metadata.response_code = match answer {
            DnsAnswer::Addresses(..) | DnsAnswer::NoData => ResponseCode::NoError,
            DnsAnswer::Refused => ResponseCode::Refused,
            DnsAnswer::NxDomain => ResponseCode::NXDomain,
            DnsAnswer::ServFail => ResponseCode::ServFail,
        };
        if let (DnsAnswer::Addresses(addrs, ttl), Some(q)) = (answer, self.message.queries.first())
        {
            for a in addrs {
                r.add_answer(Record::from_rdata(
                    q.name().clone(),
                    *ttl,
                    RData::A(rdata::A(*a)),
                ));
            }
        }
        // A response that cannot be encoded (it always can: one question, a few A records)
        // goes out as SERVFAIL with the id alone.
        r.to_vec().unwrap_or_else(|_| {
            let id = self.message.metadata.id.to_be_bytes();
            vec![id[0], id[1], 0x81, 0x82, 0, 0, 0, 0, 0, 0, 0, 0]
        })
    }
}

#[cfg(test)]
mod tests;
