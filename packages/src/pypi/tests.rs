use super::*;

fn page() -> Url {
    Url::parse("http://127.0.0.1:8080/simple/demo/").unwrap()
}

const SHA: &str = "aa11bb22cc33dd44ee55ff6600112233445566778899aabbccddeeff00112233";

#[test]
fn pep503_anchors_with_hashes_and_attributes() {
    let html = format!(
        "<html><body><h1>Links</h1>\n\
         <a href=\"../../packages/demo-1.0-py3-none-any.whl#sha256={SHA}\" \
            data-requires-python=\"&gt;=3.8\">demo-1.0-py3-none-any.whl</a><br>\n\
         <A HREF='https://files.example/demo-0.9.tar.gz#md5=abc' data-yanked>demo-0.9.tar.gz</A>\n\
         <abbr>not an anchor</abbr><a>no href</a>\n\
         </body></html>"
    );
    let files = parse_html(&html, &page()).unwrap();
    assert_eq!(files.len(), 2);
    assert_eq!(files[0].filename, "demo-1.0-py3-none-any.whl");
    assert_eq!(
        files[0].url.as_str(),
        "http://127.0.0.1:8080/packages/demo-1.0-py3-none-any.whl"
    );
    assert_eq!(files[0].sha256.as_deref(), Some(SHA));
    assert_eq!(files[0].requires_python.as_deref(), Some(">=3.8"));
    assert_eq!(files[1].sha256, None);
    assert_eq!(files[1].yanked.as_deref(), Some(""));
}

#[test]
fn pep691_json() {
    let body = format!(
        r#"{{"meta":{{"api-version":"1.1"}},"name":"demo","files":[
        {{"filename":"demo-1.0.tar.gz","url":"/f/demo-1.0.tar.gz","hashes":{{"sha256":"{}"}},
          "requires-python":">=3.7","yanked":"broken"}},
        {{"filename":"demo-0.1.tar.gz","url":"demo-0.1.tar.gz","hashes":{{}}}}]}}"#,
        SHA.to_uppercase()
    );
    let files = parse(body.as_bytes(), JSON_TYPE, &page()).unwrap();
    assert_eq!(files[0].sha256.as_deref(), Some(SHA));
    assert_eq!(
        files[0].url.as_str(),
        "http://127.0.0.1:8080/f/demo-1.0.tar.gz"
    );
    assert_eq!(files[0].yanked.as_deref(), Some("broken"));
    assert_eq!(files[1].sha256, None);
    assert!(parse(b"{not json", JSON_TYPE, &page()).is_err());
    assert!(parse(b"{\"files\": 3}", JSON_TYPE, &page()).is_err());
}

#[test]
fn rendered_pages_parse_back() {
    let f = IndexFile {
        filename: "demo-1.0-py3-none-any.whl".into(),
        url: Url::parse("http://up/x.whl").unwrap(),
        sha256: Some(SHA.into()),
        requires_python: Some(">=3.8".into()),
        yanked: None,
    };
    let served = [Served {
        file: &f,
        sha256: SHA,
        url: format!("/f/sha256-{SHA}/demo-1.0-py3-none-any.whl"),
    }];
    let html = render_html("demo", &served);
    let back = parse_html(
        &html,
        &Url::parse("http://100.96.0.1:3141/r/pypi/simple/demo/").unwrap(),
    )
    .unwrap();
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].sha256.as_deref(), Some(SHA));
    assert_eq!(back[0].requires_python.as_deref(), Some(">=3.8"));
    assert!(
        back[0]
            .url
            .as_str()
            .starts_with("http://100.96.0.1:3141/f/sha256-")
    );
    let json = render_json("demo", &served);
    let back = parse_json(json.as_bytes(), &page()).unwrap();
    assert_eq!(back[0].filename, "demo-1.0-py3-none-any.whl");
}

#[test]
fn hostile_pages_neither_panic_nor_blow_up() {
    for s in [
        "<a",
        "<a href",
        "<a href=",
        "<a href=\"",
        "<a href=\"x",
        "<a href='x'",
        "<a href=x>",
        "<a href=x>&",
        "<a href=x>&#xFFFFFFFF;</a>",
        "<a href=x>&#99999999999;</a>",
        "&&&&;",
        "<<<<a>>>>",
        "<a\u{0}href=x>",
        "<a href=\"http://[::1\">x</a>",
        "<a href=\"\u{1F600}\">",
    ] {
        let _ = parse_html(s, &page());
    }
    // A character reference cut by a multi-byte character (found by the fuzzer).
    let value = format!("&{}3", "\u{FFFD}".repeat(4));
    let cut = format!("<a href=\"x\" data-requires-python=\"{value}\">x</a>");
    let f = parse_html(&cut, &page()).unwrap();
    assert_eq!(f[0].requires_python.as_deref(), Some(value.as_str()));
    // Many anchors: capped.
    let many = "<a href=x>x</a>".repeat(MAX_FILES + 1);
    assert_eq!(parse_html(&many, &page()), Err(ParseError::TooManyFiles));
    // A huge page of one unterminated tag: linear, no result.
    let huge = format!("<a href=\"{}", "x".repeat(8 << 20));
    assert!(parse_html(&huge, &page()).unwrap().is_empty());
    // Deep JSON is refused by the parser's recursion limit, not a stack overflow.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert!(parse_json(deep.as_bytes(), &page()).is_err());
    assert!(parse(&[0xff, 0xfe, 0x00], "text/html", &page()).is_err());
}

#[test]
fn versions_from_file_names() {
    assert_eq!(version_of("demo-1.0-py3-none-any.whl"), "1.0");
    assert_eq!(version_of("foo_bar-2.3.1.tar.gz"), "2.3.1");
    assert_eq!(version_of("old-style-name-0.4.zip"), "0.4");
    assert_eq!(version_of("weird"), "");
}
