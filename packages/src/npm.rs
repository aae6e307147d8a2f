//! npm packuments: the registry's JSON document of a package, read from a registry (bounded,
//! hostile input) and rewritten for a sandbox: every version's tarball URL points at the proxy,
//! and versions whose tarball has no SHA-512 integrity are left out (nothing could verify
//! them, or key them in the cache).

use base64::Engine as _;
use serde_json::Value;
use url::Url;

use crate::{MAX_FILES, ParseError};

/// What the proxy asks a registry for (npm's abbreviated form, else the full one).
pub const ACCEPT: &str = "application/vnd.npm.install-v1+json; q=1.0, application/json; q=0.8, */*";

/// One version's tarball.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tarball {
    pub version: String,
    pub filename: String,
    /// Where the registry has it (absolute).
    pub url: Url,
    /// Its SHA-512 from `dist.integrity`, lowercase hex.
    pub sha512: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-512 of an SRI string (`sha512-BASE64`, possibly among other algorithms), hex.
pub fn sha512_of_integrity(sri: &str) -> Option<String> {
    sri.split_whitespace().find_map(|part| {
        let b64 = part.strip_prefix("sha512-")?;
        let b64 = b64.split('?').next()?;
        let raw = base64::engine::general_purpose::STANDARD.decode(b64).ok()?;
        (raw.len() == 64).then(|| hex(&raw))
    })
}

/// The SRI string of a SHA-512 given in hex.
pub fn integrity_of_sha512(sha512_hex: &str) -> Option<String> {
    if sha512_hex.len() != 128 {
        return None;
    }
    let raw: Option<Vec<u8>> = (0..64)
        .map(|i| u8::from_str_radix(sha512_hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect();
    Some(format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD.encode(raw?)
    ))
}

/// Rewrites packument `body` of package `name` (fetched from `page`): each kept version's
/// `dist.tarball` becomes `url_for(tarball)`. Returns the new document and the tarballs kept.
pub fn rewrite(
    body: &[u8],
    name: &str,
    page: &Url,
    url_for: impl Fn(&Tarball) -> String,
) -> Result<(Vec<u8>, Vec<Tarball>), ParseError> {
    let mut doc: Value =
        serde_json::from_slice(body).map_err(|e| ParseError::Malformed("JSON", e.to_string()))?;
    let Some(obj) = doc.as_object_mut() else {
        return Err(ParseError::Malformed("packument", "not an object".into()));
    };
    if let Some(n) = obj.get("name").and_then(Value::as_str)
        && n != name
    {
        return Err(ParseError::Malformed(
            "packument",
            format!("it is of {n:?}, not {name:?}"),
        ));
    }
    let Some(versions) = obj.get_mut("versions").and_then(Value::as_object_mut) else {
        return Err(ParseError::Malformed(
            "packument",
            "no versions object".into(),
        ));
    };
    if versions.len() > MAX_FILES {
        return Err(ParseError::TooManyFiles);
    }
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    for (version, meta) in versions.iter_mut() {
        let dist = meta.get_mut("dist").and_then(Value::as_object_mut);
        let Some(dist) = dist else {
            dropped.push(version.clone());
            continue;
        };
        let integrity = dist.get("integrity").and_then(Value::as_str);
        let sha512 = integrity.and_then(sha512_of_integrity);
        let url = dist
            .get("tarball")
            .and_then(Value::as_str)
            .and_then(|t| page.join(t).ok());
        let (Some(sha512), Some(url)) = (sha512, url) else {
            dropped.push(version.clone());
            continue;
        };
        let filename = url
            .path_segments()
            .and_then(|mut s| s.next_back())
            .filter(|f| !f.is_empty())
            .map_or_else(|| format!("{version}.tgz"), str::to_owned);
        let t = Tarball {
            version: version.clone(),
            filename,
            url,
            sha512,
        };
        dist.insert("tarball".into(), Value::String(url_for(&t)));
        kept.push(t);
    }
    for v in dropped {
        versions.remove(&v);
    }
    let out = serde_json::to_vec(&doc).map_err(|e| ParseError::Malformed("JSON", e.to_string()))?;
    Ok((out, kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page() -> Url {
        Url::parse("http://127.0.0.1:4873/left-pad").unwrap()
    }

    const SRI: &str = "sha512-z4PhNX7vuL3xVChQ1m2AB9Yg5AULVxXcg/SpIdNs6c5H0NE8XYXysP+DGNKHfuwvY7kxvUdBeoGlODJ6+SfaPg==";

    #[test]
    fn tarballs_rewritten_and_unverifiable_versions_dropped() {
        let body = format!(
            r#"{{"name":"left-pad","dist-tags":{{"latest":"1.0.0"}},"versions":{{
              "1.0.0":{{"name":"left-pad","version":"1.0.0","dist":{{"integrity":"{SRI}",
                "shasum":"x","tarball":"http://127.0.0.1:4873/left-pad/-/left-pad-1.0.0.tgz"}}}},
              "0.9.0":{{"name":"left-pad","version":"0.9.0","dist":{{"shasum":"abc",
                "tarball":"/left-pad/-/left-pad-0.9.0.tgz"}}}}}}}}"#
        );
        let (out, kept) = rewrite(body.as_bytes(), "left-pad", &page(), |t| {
            format!("http://proxy/f/sha512-{}/{}", t.sha512, t.filename)
        })
        .unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].filename, "left-pad-1.0.0.tgz");
        assert_eq!(kept[0].sha512.len(), 128);
        let doc: Value = serde_json::from_slice(&out).unwrap();
        let tarball = doc["versions"]["1.0.0"]["dist"]["tarball"]
            .as_str()
            .unwrap();
        assert!(tarball.starts_with("http://proxy/f/sha512-"), "{tarball}");
        assert!(doc["versions"].get("0.9.0").is_none());
        assert_eq!(integrity_of_sha512(&kept[0].sha512).as_deref(), Some(SRI));
    }

    #[test]
    fn hostile_packuments_are_errors() {
        for b in [
            &b"[]"[..],
            b"{",
            b"{\"versions\": 1}",
            b"{\"name\":\"other\",\"versions\":{}}",
            b"\xff\xfe",
        ] {
            assert!(rewrite(b, "left-pad", &page(), |_| String::new()).is_err());
        }
        let deep = format!(
            "{{\"versions\":{}{}}}",
            "[".repeat(50_000),
            "]".repeat(50_000)
        );
        assert!(rewrite(deep.as_bytes(), "left-pad", &page(), |_| String::new()).is_err());
        // Versions with nonsense dists are dropped, not fatal.
        let odd = br#"{"versions":{"1":{"dist":{"integrity":"sha512-!!!","tarball":"x"}},"2":3}}"#;
        let (_, kept) = rewrite(odd, "left-pad", &page(), |_| String::new()).unwrap();
        assert!(kept.is_empty());
        assert_eq!(sha512_of_integrity("sha1-abc"), None);
        assert_eq!(integrity_of_sha512("zz"), None);
    }
}
