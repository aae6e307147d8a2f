//! A hostile registry for the package proxy's SSRF checks: a PyPI index on loopback whose one
//! project, `bait`, lists files the proxy must never fetch: one on another loopback port (an
//! "internal service" that counts what it is asked), one on `localhost` at that port, and one
//! on the registry's own host that redirects there. Self-contained (std threads, no other
//! module of the package tests): a test file includes it with
//! `#[path = "packages/offregistry.rs"] mod offregistry;`, puts [`OffRegistry::config`] into its
//! daemon's settings and calls [`OffRegistry::assert_refused`] on a sandbox.
#![allow(dead_code)] // each test file uses its part

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use airlock_api::v1::Sandbox;
use airlock_system_tests::harness::GuestNet;

/// The registry's name in the daemon's settings.
pub const NAME: &str = "offreg";

/// The registry and the internal service its links point at.
#[derive(Debug)]
pub struct OffRegistry {
    pub port: u16,
    inner_port: u16,
    inner_hits: Arc<AtomicUsize>,
}

/// The registry of this test process, started on first use.
pub fn off_registry() -> &'static OffRegistry {
    static ONE: OnceLock<OffRegistry> = OnceLock::new();
    ONE.get_or_init(|| {
        let inner_hits = Arc::new(AtomicUsize::new(0));
        let hits = inner_hits.clone();
        let inner_port = listen(move |_| {
            hits.fetch_add(1, Ordering::SeqCst);
            ("200 OK".into(), b"internal secret".to_vec())
        });
        let port = listen(move |path| match path {
            "/simple/bait/" => ("200 OK\r\nContent-Type: text/html".into(), page(inner_port)),
            "/moved" => (
                format!("302 Found\r\nLocation: http://localhost:{inner_port}/secret"),
                Vec::new(),
            ),
            _ => ("404 Not Found".into(), Vec::new()),
        });
        OffRegistry {
            port,
            inner_port,
            inner_hits,
        }
    })
}

/// `bait`'s PEP 503 page: each file with a digest of its own (what the proxy lists).
fn page(inner: u16) -> Vec<u8> {
    let links = [
        (
            format!("http://127.0.0.1:{inner}/secret"),
            "bait-1.0-py3-none-any.whl",
            1,
        ),
        (
            format!("http://localhost:{inner}/secret"),
            "bait-2.0-py3-none-any.whl",
            2,
        ),
        ("/moved".to_owned(), "bait-3.0-py3-none-any.whl", 3),
    ];
    let mut html = String::from("<!DOCTYPE html><html><body>\n");
    for (url, name, n) in links {
        html.push_str(&format!(
            "<a href=\"{url}#sha256={}\">{name}</a><br>\n",
            format!("{n:x}").repeat(64)
        ));
    }
    html.push_str("</body></html>\n");
    html.into_bytes()
}

/// An HTTP/1.1 server on 127.0.0.1 answering each request's path with `answer` (the status
/// line's tail with any headers, and the body); returns its port.
fn listen(answer: impl Fn(&str) -> (String, Vec<u8>) + Send + Sync + 'static) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let answer = Arc::new(answer);
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let answer = answer.clone();
            std::thread::spawn(move || serve_one(c, &*answer));
        }
    });
    port
}

fn serve_one(mut c: TcpStream, answer: &dyn Fn(&str) -> (String, Vec<u8>)) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    let (status, body) = answer(text.split(' ').nth(1).unwrap_or(""));
    let _ = write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = c.write_all(&body);
}

impl OffRegistry {
    /// The daemon's settings for it: registry [`NAME`], a PyPI index on loopback, which only
    /// `private_addresses` opens (for the registry's own host and port: its links elsewhere
    /// stay refused).
    pub fn config(&self) -> String {
        format!(
            "[packages.registries.{NAME}]\nkind = \"pypi\"\n\
             url = \"http://127.0.0.1:{}/simple/\"\nprivate_addresses = [\"127.0.0.1/32\"]\n",
            self.port
        )
    }

    /// Through `sb`'s own network, as its pip would: `bait`'s index page, then each file it
    /// links. Every file is refused (502, the reason naming why) and the internal service is
    /// never asked. `sb`'s package policy must allow registry [`NAME`] and package `bait`.
    pub fn assert_refused(&self, sb: &Sandbox) {
        let net = GuestNet::of(sb.vmm_pid);
        let proxy = "http://100.96.0.1:3141";
        let before = self.inner_hits.load(Ordering::SeqCst);
        let page = net.get(&format!("{proxy}/r/{NAME}/simple/bait/"), &[]);
        assert_eq!(page.status, 200, "{page:?}");
        let html = String::from_utf8_lossy(&page.body).into_owned();
        let links: Vec<&str> = html
            .split("href=\"")
            .skip(1)
            .filter_map(|h| h.split(['"', '#']).next())
            .collect();
        assert_eq!(links.len(), 3, "{html}");
        for link in links {
            let file = net.get(&format!("{proxy}{link}"), &[]);
            assert_eq!(file.status, 502, "{link}: {file:?}");
            assert!(
                file.reason.contains("is not on a host of registry")
                    || file.reason.contains("to another host"),
                "{link}: {file:?}"
            );
        }
        assert_eq!(
            self.inner_hits.load(Ordering::SeqCst),
            before,
            "the internal service at 127.0.0.1:{} was asked",
            self.inner_port
        );
    }
}
