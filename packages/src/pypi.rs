//! PyPI's simple repository API: a project's page as PEP 503 HTML or PEP 691 JSON, read from a
//! registry (bounded, hostile input) and written for a sandbox with the proxy's own file URLs.

use serde::Deserialize;
use url::Url;

use crate::{MAX_FILES, ParseError};

/// The media type of PEP 691's JSON form.
pub const JSON_TYPE: &str = "application/vnd.pypi.simple.v1+json";
/// What the proxy asks a registry for: JSON first, HTML otherwise.
pub const ACCEPT: &str = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1";

/// One file of a project as its registry lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexFile {
    pub filename: String,
    /// Absolute (resolved against the page's URL), without its fragment.
    pub url: Url,
    /// The SHA-256 the registry states for it, lowercase hex; files without one are not
    /// served (nothing could be verified or cached by content).
    pub sha256: Option<String>,
    pub requires_python: Option<String>,
    /// Yanked, with its reason (possibly empty).
    pub yanked: Option<String>,
}

/// Whether `s` is 64 hex digits; returns it lowercase.
pub fn hex64(s: &str) -> Option<String> {
    (s.len() == 64 && s.bytes().all(|c| c.is_ascii_hexdigit())).then(|| s.to_ascii_lowercase())
}

/// A project page in either form, by its media type.
pub fn parse(body: &[u8], content_type: &str, page: &Url) -> Result<Vec<IndexFile>, ParseError> {
    if content_type.to_ascii_lowercase().starts_with(JSON_TYPE) {
        parse_json(body, page)
    } else {
        let text = std::str::from_utf8(body)
            .map_err(|e| ParseError::Malformed("HTML", format!("not UTF-8: {e}")))?;
        parse_html(text, page)
    }
}

// ---- PEP 691 ----

#[derive(Deserialize)]
struct JsonPage {
    files: Vec<JsonFile>,
}

#[derive(Deserialize)]
struct JsonFile {
    filename: String,
    url: String,
    #[serde(default)]
    hashes: std::collections::HashMap<String, String>,
    #[serde(rename = "requires-python", default)]
    requires_python: Option<String>,
    #[serde(default)]
    yanked: Option<serde_json::Value>,
}

pub fn parse_json(body: &[u8], page: &Url) -> Result<Vec<IndexFile>, ParseError> {
    let p: JsonPage =
        serde_json::from_slice(body).map_err(|e| ParseError::Malformed("JSON", e.to_string()))?;
    if p.files.len() > MAX_FILES {
        return Err(ParseError::TooManyFiles);
    }
    let mut out = Vec::with_capacity(p.files.len());
    for f in p.files {
        let Ok(mut url) = page.join(&f.url) else {
            continue;
        };
        url.set_fragment(None);
        let yanked = match f.yanked {
            Some(serde_json::Value::Bool(true)) => Some(String::new()),
            Some(serde_json::Value::String(s)) => Some(s),
            _ => None,
        };
        out.push(IndexFile {
            filename: f.filename,
            url,
            sha256: f.hashes.get("sha256").and_then(|h| hex64(h)),
            requires_python: f.requires_python,
            yanked,
        });
    }
    Ok(out)
}

// ---- PEP 503 ----

/// Every `<a href=...>` of a page, with the attributes PEP 503 defines. Linear in the page's
/// size; tags that are not anchors and malformed anchors are skipped.
pub fn parse_html(page_text: &str, page: &Url) -> Result<Vec<IndexFile>, ParseError> {
    let mut out = Vec::new();
    let lower = page_text.to_ascii_lowercase();
    let mut at = 0;
    while let Some(i) = lower[at..].find("<a") {
        let start = at + i;
        let after = start + 2;
        // `<a` must be the whole tag name.
        let next = lower.as_bytes().get(after).copied();
        if !matches!(next, Some(b' ' | b'\t' | b'\n' | b'\r' | b'>')) {
            at = after;
            continue;
        }
        let Some(end_rel) = lower[after..].find('>') else {
            break;
        };
        let tag_end = after + end_rel;
        let attrs = attributes(&page_text[after..tag_end]);
        let close = lower[tag_end..]
            .find("</a")
            .map_or(page_text.len(), |c| tag_end + c);
        let text = unescape(page_text[tag_end + 1..close].trim());
        at = tag_end + 1;
        let Some(href) = attrs.iter().find(|(k, _)| k == "href").map(|(_, v)| v) else {
            continue;
        };
        let Ok(mut url) = page.join(href) else {
            continue;
        };
        let sha256 = url
            .fragment()
            .and_then(|f| f.strip_prefix("sha256="))
            .and_then(hex64);
        url.set_fragment(None);
        let filename = if text.is_empty() {
            url.path_segments()
                .and_then(|mut s| s.next_back())
                .unwrap_or_default()
                .to_owned()
        } else {
            text
        };
        let attr = |name: &str| {
            attrs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        out.push(IndexFile {
            filename,
            url,
            sha256,
            requires_python: attr("data-requires-python"),
            yanked: attr("data-yanked"),
        });
        if out.len() > MAX_FILES {
            return Err(ParseError::TooManyFiles);
        }
    }
    Ok(out)
}

/// `name="value"`, `name='value'`, `name=value` and bare `name`, names lowercased, values
/// unescaped.
fn attributes(s: &str) -> Vec<(String, String)> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        while i < b.len() && (b[i].is_ascii_whitespace() || b[i] == b'/') {
            i += 1;
        }
        let ns = i;
        while i < b.len() && !b[i].is_ascii_whitespace() && b[i] != b'=' {
            i += 1;
        }
        if ns == i {
            i += 1;
            continue;
        }
        let name = s[ns..i].to_ascii_lowercase();
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if i < b.len() && b[i] == b'=' {
            i += 1;
            while i < b.len() && b[i].is_ascii_whitespace() {
                i += 1;
            }
            let (vs, ve);
            if i < b.len() && (b[i] == b'"' || b[i] == b'\'') {
                let q = b[i];
                vs = i + 1;
                let mut j = vs;
                while j < b.len() && b[j] != q {
                    j += 1;
                }
                ve = j;
                i = (j + 1).min(b.len());
            } else {
                vs = i;
                while i < b.len() && !b[i].is_ascii_whitespace() {
                    i += 1;
                }
                ve = i;
            }
            out.push((name, unescape(&s[vs..ve])));
        } else {
            out.push((name, String::new()));
        }
    }
    out
}

/// HTML character references: the five named ones and numeric ones; others stay as written.
fn unescape(s: &str) -> String {
    if !s.contains('&') {
        return s.to_owned();
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('&') {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        // A byte search: `;` is ASCII, so the index it gives is a char boundary (a slice of
        // the first 12 bytes might not be).
        let Some(semi) = rest.bytes().take(12).position(|b| b == b';') else {
            out.push('&');
            rest = &rest[1..];
            continue;
        };
        let ent = &rest[1..semi];
        let c = match ent {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => ent
                .strip_prefix("#x")
                .or_else(|| ent.strip_prefix("#X"))
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .or_else(|| ent.strip_prefix('#').and_then(|d| d.parse().ok()))
                .and_then(char::from_u32),
        };
        match c {
            Some(c) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

// ---- what the sandbox gets ----

/// A file as the proxy lists it: its registry entry and the proxy's own URL for it.
#[derive(Clone, Debug)]
pub struct Served<'a> {
    pub file: &'a IndexFile,
    pub sha256: &'a str,
    pub url: String,
}

/// A project page in PEP 503 HTML.
pub fn render_html(project: &str, files: &[Served<'_>]) -> String {
    let mut s = format!(
        "<!DOCTYPE html>\n<html><head><meta name=\"pypi:repository-version\" content=\"1.0\">\
         <title>Links for {0}</title></head><body><h1>Links for {0}</h1>\n",
        escape(project)
    );
    for f in files {
        s.push_str(&format!(
            "<a href=\"{}#sha256={}\"",
            escape(&f.url),
            f.sha256
        ));
        if let Some(rp) = &f.file.requires_python {
            s.push_str(&format!(" data-requires-python=\"{}\"", escape(rp)));
        }
        if let Some(y) = &f.file.yanked {
            s.push_str(&format!(" data-yanked=\"{}\"", escape(y)));
        }
        s.push_str(&format!(">{}</a><br/>\n", escape(&f.file.filename)));
    }
    s.push_str("</body></html>\n");
    s
}

/// A project page in PEP 691 JSON.
pub fn render_json(project: &str, files: &[Served<'_>]) -> String {
    let files: Vec<serde_json::Value> = files
        .iter()
        .map(|f| {
            let mut v = serde_json::json!({
                "filename": f.file.filename,
                "url": f.url,
                "hashes": {"sha256": f.sha256},
            });
            if let Some(rp) = &f.file.requires_python {
                v["requires-python"] = rp.clone().into();
            }
            if let Some(y) = &f.file.yanked {
                v["yanked"] = if y.is_empty() {
                    true.into()
                } else {
                    y.clone().into()
                };
            }
            v
        })
        .collect();
    serde_json::json!({
        "meta": {"api-version": "1.0"},
        "name": project,
        "files": files,
    })
    .to_string()
}

/// The version in a distribution's file name: a wheel's second field, an sdist's part after
/// the project's name (`foo_bar-1.2.tar.gz`), else empty.
pub fn version_of(filename: &str) -> String {
    if let Some(stem) = filename.strip_suffix(".whl") {
        return stem.split('-').nth(1).unwrap_or_default().to_owned();
    }
    for ext in [".tar.gz", ".tar.bz2", ".tar.xz", ".zip", ".tgz", ".egg"] {
        if let Some(stem) = filename.strip_suffix(ext) {
            // The name may hold dashes in old sdists; the version starts at the last dash
            // followed by a digit.
            return stem
                .rmatch_indices('-')
                .map(|(i, _)| &stem[i + 1..])
                .find(|v| v.starts_with(|c: char| c.is_ascii_digit()))
                .unwrap_or_default()
                .to_owned();
        }
    }
    String::new()
}

#[cfg(test)]
mod tests;
