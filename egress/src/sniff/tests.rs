use super::*;

/// A ClientHello record with `exts` as its extensions.
fn client_hello(exts: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&[3, 3]); // legacy_version
    body.extend_from_slice(&[7; 32]); // random
    body.push(32);
    body.extend_from_slice(&[9; 32]); // session id
    body.extend_from_slice(&[0, 4, 0x13, 0x01, 0x13, 0x02]); // two cipher suites
    body.extend_from_slice(&[1, 0]); // null compression
    body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
    body.extend_from_slice(exts);
    let mut hs = vec![1];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![0x16, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

fn ext(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut e = kind.to_be_bytes().to_vec();
    e.extend_from_slice(&(body.len() as u16).to_be_bytes());
    e.extend_from_slice(body);
    e
}

fn sni(name: &str) -> Vec<u8> {
    let mut entry = vec![0];
    entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
    entry.extend_from_slice(name.as_bytes());
    let mut list = (entry.len() as u16).to_be_bytes().to_vec();
    list.extend_from_slice(&entry);
    ext(0, &list)
}

fn hello_for(name: &str) -> Vec<u8> {
    let mut exts = ext(10, &[0, 2, 0, 29]); // supported_groups first
    exts.extend(sni(name));
    exts.extend(ext(43, &[2, 3, 4])); // supported_versions after
    client_hello(&exts)
}

#[test]
fn the_server_name_of_a_client_hello_is_found() {
    let hello = hello_for("Api.Example.com");
    assert_eq!(
        sniff(&hello),
        Sniff::Done(Sniffed::Tls(Some("api.example.com".into())))
    );
    // Bytes after the record (the rest of the stream) change nothing.
    let mut more = hello.clone();
    more.extend_from_slice(&[0x17; 100]);
    assert_eq!(sniff(&more), sniff(&hello));
}

#[test]
fn every_truncation_asks_for_more_and_byte_by_byte_input_ends_in_the_answer() {
    let hello = hello_for("example.com");
    for n in 0..hello.len() {
        assert_eq!(sniff(&hello[..n]), Sniff::NeedMore, "prefix of {n} bytes");
    }
    let req = b"GET /x HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\n\r\n";
    for n in 1..req.len() {
        assert_eq!(sniff(&req[..n]), Sniff::NeedMore, "prefix of {n} bytes");
    }
    assert_eq!(
        sniff(req),
        Sniff::Done(Sniffed::Http(Some("example.com".into())))
    );
}

#[test]
fn a_hello_without_a_usable_name_names_nothing() {
    assert_eq!(
        sniff(&client_hello(&ext(10, &[0, 2, 0, 29]))),
        Sniff::Done(Sniffed::Tls(None))
    );
    assert_eq!(
        sniff(&hello_for("bad name!")),
        Sniff::Done(Sniffed::Tls(None))
    );
    assert_eq!(sniff(&hello_for("")), Sniff::Done(Sniffed::Tls(None)));
    // An extension length that runs past the hello.
    let mut broken = hello_for("example.com");
    let n = broken.len();
    broken[n - 5] = 0xff;
    assert!(matches!(sniff(&broken), Sniff::Done(Sniffed::Tls(_))));
    // Not a handshake record, or an impossible length.
    assert_eq!(
        sniff(&[0x16, 3, 1, 0xff, 0xff]),
        Sniff::Done(Sniffed::Other)
    );
    assert_eq!(
        sniff(&[0x17, 3, 3, 0, 5, 1, 2, 3, 4, 5]),
        Sniff::Done(Sniffed::Other)
    );
}

#[test]
fn http_hosts_that_are_addresses_or_junk_name_nothing() {
    for (head, want) in [
        ("GET / HTTP/1.1\r\nhost: 10.0.0.1\r\n\r\n", None),
        ("GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", None),
        ("GET / HTTP/1.1\r\nHost: a b\r\n\r\n", None),
        ("GET / HTTP/1.1\r\nHost: x.com:notaport\r\n\r\n", None),
        ("GET / HTTP/1.1\r\nAccept: */*\r\n\r\n", None),
        (
            "CONNECT x.com:443 HTTP/1.1\r\nHost: X.com:443\r\n\r\n",
            Some("x.com"),
        ),
    ] {
        assert_eq!(
            sniff(head.as_bytes()),
            Sniff::Done(Sniffed::Http(want.map(str::to_owned))),
            "{head:?}"
        );
    }
    assert_eq!(
        sniff(b"SSH-2.0-OpenSSH_9.2\r\n"),
        Sniff::Done(Sniffed::Other)
    );
    assert_eq!(sniff(b"\x00\x01binary"), Sniff::Done(Sniffed::Other));
}

#[test]
fn an_endless_head_is_cut_off_at_the_limit() {
    let mut head = b"GET / HTTP/1.1\r\n".to_vec();
    while head.len() < MAX_HEAD + 100 {
        head.extend_from_slice(b"X-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
    }
    // Too many headers decides it before the limit; a single endless header does not.
    assert_eq!(sniff(&head), Sniff::Done(Sniffed::Http(None)));
    let mut long = b"GET / HTTP/1.1\r\nX-Long: ".to_vec();
    long.resize(MAX_HEAD + 1000, b'a');
    assert_eq!(sniff(&long), Sniff::TooLarge);
    assert_eq!(sniff(&long[..MAX_HEAD - 1]), Sniff::NeedMore);
}

#[test]
fn garbage_never_panics() {
    // A small deterministic generator: every byte pattern class, many lengths.
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let hello = hello_for("example.com");
    for round in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % 600) as usize;
        let mut buf: Vec<u8> = (0..len).map(|i| (x >> (i % 56)) as u8).collect();
        if round % 3 == 0 {
            // Mutate a valid hello instead, at one position.
            buf = hello.clone();
            let at = (x as usize) % buf.len();
            buf[at] = (x >> 8) as u8;
        } else if round % 3 == 1 && !buf.is_empty() {
            buf[0] = 0x16;
        }
        let _ = sniff(&buf);
    }
}
