#![allow(clippy::unwrap_used)]

use super::*;

fn req(method: &str, uri: &str, hosts: &[&str]) -> Request<()> {
    let mut b = Request::builder().method(method).uri(uri);
    for h in hosts {
        b = b.header(HOST, *h);
    }
    b.body(()).unwrap()
}

#[test]
fn the_host_is_lowercase_without_its_port() {
    let mut r = req("GET", "/x", &["API.Example.com:8080"]);
    assert_eq!(normalise(&mut r, "x", false).unwrap(), "api.example.com");
    assert_eq!(host_name("api.example.com").unwrap(), "api.example.com");
    assert_eq!(host_name(""), None);
    assert_eq!(host_name("user@api.example.com"), None);
    assert_eq!(host_name("api.example.com:x"), None);
}

#[test]
fn requests_are_refused_or_normalised() {
    let n = |m, uri, hosts: &[&str], pinned| normalise(&mut req(m, uri, hosts), "a.test", pinned);
    assert_eq!(n("GET", "/x", &["a.test"], true).unwrap(), "a.test");
    assert_eq!(
        n("TRACE", "/x", &["a.test"], false),
        Err(Refusal::Method(Method::TRACE))
    );
    assert!(matches!(
        n("CONNECT", "a.test:443", &["a.test"], false),
        Err(Refusal::Method(_))
    ));
    assert_eq!(n("GET", "/x", &[], false), Err(Refusal::HostCount(0)));
    assert_eq!(
        n("GET", "/x", &["a.test", "a.test"], false),
        Err(Refusal::HostCount(2))
    );
    assert_eq!(n("GET", "/x", &["a test"], false), Err(Refusal::BadHost));
    assert!(matches!(
        n("GET", "http://b.test/x", &["a.test"], false),
        Err(Refusal::Authority { .. })
    ));
    assert!(matches!(
        n("GET", "/x", &["b.test"], true),
        Err(Refusal::OtherHost { .. })
    ));
    assert_eq!(n("GET", "/x", &["b.test"], false).unwrap(), "b.test");
    // Absolute form for its own host: origin form upstream; HTTP/1.0 without Host gets one.
    let mut r = req("GET", "http://a.test:80/x?q=1", &[]);
    assert_eq!(normalise(&mut r, "a.test", true).unwrap(), "a.test");
    assert_eq!(r.uri(), "/x?q=1");
    assert_eq!(r.headers().get(HOST).unwrap(), "a.test:80");
}
