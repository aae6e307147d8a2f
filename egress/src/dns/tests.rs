#![allow(clippy::unwrap_used)]

use hickory_proto::rr::Name;

use super::*;

fn query(name: &str, qtype: RecordType) -> Vec<u8> {
    let mut m = Message::new(0x1234, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
    m.to_vec().unwrap()
}

#[test]
fn an_a_query_is_parsed_and_answered_with_its_id_and_question() {
    let q = parse(&query("API.Example.com.", RecordType::A)).unwrap();
    assert_eq!(q.name.as_deref(), Some("api.example.com"));
    assert_eq!(q.qtype, QueryType::A);
    assert_eq!(q.refused_shape(), None);
    let bytes = q.answer(&DnsAnswer::Addresses(
        vec![Ipv4Addr::new(10, 213, 0, 2)],
        30,
    ));
    let r = Message::from_vec(&bytes).unwrap();
    assert_eq!(r.metadata.id, 0x1234);
    assert_eq!(r.metadata.message_type, MessageType::Response);
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert_eq!(r.queries.len(), 1);
    assert_eq!(r.answers.len(), 1);
    assert_eq!(
        r.answers[0].data,
        RData::A(rdata::A(Ipv4Addr::new(10, 213, 0, 2)))
    );
    let refused = Message::from_vec(&q.answer(&DnsAnswer::Refused)).unwrap();
    assert_eq!(refused.metadata.response_code, ResponseCode::Refused);
    assert!(refused.answers.is_empty());
}

#[test]
fn tunnel_shaped_names_and_other_types_are_refused_by_shape() {
    let long_label = format!("{}.t.example.com", "a".repeat(MAX_LABEL + 1));
    let q = parse(&query(&long_label, RecordType::A)).unwrap();
    assert_eq!(q.refused_shape(), Some(Shape::LongLabel(MAX_LABEL + 1)));
    let many = format!(
        "{}example.com",
        "abcdefghijklmnopqrstuvwxyz012345.".repeat(5)
    );
    let q = parse(&query(&many, RecordType::A)).unwrap();
    assert!(
        matches!(q.refused_shape(), Some(Shape::LongName(_))),
        "{:?}",
        q.refused_shape()
    );
    let q = parse(&query("t.example.com", RecordType::TXT)).unwrap();
    assert!(matches!(
        q.refused_shape(),
        Some(Shape::Type(QueryType::Other(16)))
    ));
    assert!(q.refused_shape().unwrap().to_string().contains("TXT"));
    let q = parse(&query("t.example.com", RecordType::AAAA)).unwrap();
    assert_eq!(q.refused_shape(), None);
}

#[test]
fn garbage_truncated_oversized_and_response_messages_get_no_answer() {
    let good = query("example.com", RecordType::A);
    for cut in 0..good.len() {
        // Truncated: no panic; parsed or not, never an answer to a question it lacks.
        if let Some(q) = parse(&good[..cut]) {
            let _ = q.answer(&DnsAnswer::Refused);
        }
    }
    assert!(parse(&[0xff; 3]).is_none());
    assert!(parse(&vec![0u8; MAX_QUERY + 1]).is_none());
    let mut response = Message::response(1, OpCode::Query);
    response.add_query(Query::query(
        Name::from_ascii("x.com").unwrap(),
        RecordType::A,
    ));
    assert!(parse(&response.to_vec().unwrap()).is_none());
    // No question: parsed, refused by shape, and the answer carries the id.
    let empty = Message::new(7, MessageType::Query, OpCode::Query)
        .to_vec()
        .unwrap();
    let q = parse(&empty).unwrap();
    assert_eq!(q.refused_shape(), Some(Shape::NotAQuery));
    assert_eq!(
        Message::from_vec(&q.answer(&DnsAnswer::Refused))
            .unwrap()
            .metadata
            .id,
        7
    );
}
