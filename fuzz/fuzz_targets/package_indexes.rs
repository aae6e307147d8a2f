//! What registries send the package proxy: PyPI index pages (PEP 503 HTML, PEP 691 JSON) and
//! npm packuments, and the names and patterns a sandbox's requests carry. None may panic;
//! whatever parses must render back into a page that parses again.
#![no_main]

use airlock_packages::{name, npm, pypi};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let page = url::Url::parse("http://127.0.0.1:8080/simple/demo/").expect("a URL");
    match which % 4 {
        0 => {
            if let Ok(files) = pypi::parse_html(&String::from_utf8_lossy(body), &page) {
                let served: Vec<_> = files
                    .iter()
                    .filter_map(|f| {
                        f.sha256.as_deref().map(|sha| pypi::Served {
                            file: f,
                            sha256: sha,
                            url: format!("/f/sha256-{sha}/x"),
                        })
                    })
                    .collect();
                let html = pypi::render_html("demo", &served);
                let back = pypi::parse_html(&html, &page).expect("our own page parses");
                assert_eq!(back.len(), served.len());
                let json = pypi::render_json("demo", &served);
                pypi::parse_json(json.as_bytes(), &page).expect("our own JSON parses");
            }
        }
        1 => {
            let _ = pypi::parse_json(body, &page);
        }
        2 => {
            let _ = npm::rewrite(body, "demo", &page, |t| format!("/f/sha512-{}", t.sha512));
        }
        _ => {
            let text = String::from_utf8_lossy(body);
            let (pat, subject) = text.split_once('\n').unwrap_or((&text, "demo"));
            let _ = name::valid_pypi(subject) && name::valid_npm(subject);
            if let Ok(p) = name::Pattern::new(pat, true) {
                let _ = p.matches(&name::normalize_pypi(subject));
            }
            let _ = npm::sha512_of_integrity(subject);
            let _ = pypi::version_of(subject);
        }
    }
});
