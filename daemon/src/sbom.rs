//! What a template is made of (an SBOM): its Debian or Alpine packages, its Python and global
//! npm packages, with versions, and the guest kernel and agent it runs. Found once per template
//! by reading its package databases in a sandbox restored from it (through the agent's file
//! calls: no shell needed, so distroless images work too), kept beside the template
//! (`sbom.json`), and given as CycloneDX 1.5 or SPDX 2.3 JSON.
//!
//! What the guest hands back is untrusted: every file is read under a cap, parsed leniently,
//! and names and versions are kept only when short and printable.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, OnceLock};

use airlock_api::v1::{
    CreateSandboxRequest, FilePolicy, GetTemplateSbomResponse, SbomPackage, Template,
};
use serde_json::{Value, json};

use crate::daemon::Daemon;
use crate::error::{ApiError, ApiResult};
use crate::files::{self, FileTarget};
use crate::templates::{TemplateRt, reference};

/// The kept package list in a template's directory.
pub const SBOM_FILE: &str = "sbom.json";
/// The most read of one package database.
const MAX_DB_BYTES: u64 = 32 << 20;
/// The most read of one package.json.
const MAX_MANIFEST_BYTES: u64 = 256 << 10;
/// The most npm packages read (each a file read).
const MAX_NPM_PACKAGES: usize = 2000;

/// The formats a document can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    CycloneDx,
    Spdx,
}

impl Format {
    pub fn parse(s: &str) -> ApiResult<Self> {
        match s.to_ascii_lowercase().as_str() {
            "" | "cyclonedx" | "cdx" => Ok(Self::CycloneDx),
            "spdx" => Ok(Self::Spdx),
            other => Err(ApiError::InvalidArgument(format!(
                "SBOM format {other:?}: cyclonedx or spdx"
            ))),
        }
    }
}

/// GetTemplateSbom: the template `name`'s packages and their document in `format`.
pub async fn of_template(
    d: &Arc<Daemon>,
    tenant: &str,
    name: &str,
    format: &str,
) -> ApiResult<GetTemplateSbomResponse> {
    let format = Format::parse(format)?;
    let t = d.templates.find(tenant, name)?;
    let packages = match read_kept(&t) {
        Some(p) => p,
        None => {
            // One scan at a time on this host: a second caller waits and finds it kept.
            static SCANS: OnceLock<tokio::sync::Mutex<()>> = OnceLock::new();
            let _one = SCANS.get_or_init(Default::default).lock().await;
            match read_kept(&t) {
                Some(p) => p,
                None => {
                    let p = scan(d, tenant, &t).await?;
                    keep(&t, &p);
                    p
                }
            }
        }
    };
    let document = document(&t.record, &packages, format, crate::ids::now_ms());
    Ok(GetTemplateSbomResponse {
        document: serde_json::to_string_pretty(&document)
            .map_err(|e| ApiError::Internal(format!("the SBOM's JSON: {e}")))?,
        packages,
    })
}

fn read_kept(t: &TemplateRt) -> Option<Vec<SbomPackage>> {
    let text = std::fs::read_to_string(t.dir.join(SBOM_FILE)).ok()?;
    let list: Vec<Value> = serde_json::from_str(&text).ok()?;
    let field = |v: &Value, k: &str| v[k].as_str().unwrap_or_default().to_owned();
    Some(
        list.iter()
            .map(|v| SbomPackage {
                ecosystem: field(v, "ecosystem"),
                name: field(v, "name"),
                version: field(v, "version"),
                purl: field(v, "purl"),
            })
            .collect(),
    )
}

fn keep(t: &TemplateRt, packages: &[SbomPackage]) {
    let list: Vec<Value> = packages
        .iter()
        .map(|p| json!({"ecosystem": p.ecosystem, "name": p.name, "version": p.version, "purl": p.purl}))
        .collect();
    if let Err(e) = std::fs::write(t.dir.join(SBOM_FILE), Value::Array(list).to_string()) {
        tracing::warn!(template = %t.record.id, "keeping its SBOM: {e}");
    }
}

/// The roots the scan reads.
const ROOTS: [&str; 5] = [
    "/var/lib/dpkg",
    "/lib/apk",
    "/usr/lib",
    "/usr/local/lib",
    "/opt",
];

/// Restores a sandbox of `t` (no network), reads its package databases, destroys it.
async fn scan(d: &Arc<Daemon>, tenant: &str, t: &TemplateRt) -> ApiResult<Vec<SbomPackage>> {
    let sb = d
        .sandboxes
        .create(
            tenant,
            CreateSandboxRequest {
                template: reference(&t.record),
                file_policy: Some(FilePolicy {
                    exportable: ROOTS.map(String::from).to_vec(),
                    max_export_total_bytes: 256 << 20,
                    max_export_file_bytes: MAX_DB_BYTES,
                    ..Default::default()
                }),
                labels: HashMap::from([("airlock.sbom".to_string(), t.record.id.clone())]),
                ..Default::default()
            },
        )
        .await?;
    let found = async {
        let target = d
            .sandboxes
            .running(tenant, &sb.id)?
            .file_target(MAX_DB_BYTES)?;
        Ok::<_, ApiError>(read_guest(&target).await)
    }
    .await;
    let _ = d.sandboxes.destroy(tenant, &sb.id).await;
    let mut packages = found?;
    packages.extend(platform(&t.record));
    Ok(packages)
}

/// The file `path` of the guest, at most `cap` bytes; `None` when it is not there (or
/// larger, or unreadable).
async fn read(target: &FileTarget, path: &str, cap: u64) -> Option<Vec<u8>> {
    let mut rx = files::read(target.clone(), path.to_owned()).ok()?;
    let mut out = Vec::new();
    while let Some(chunk) = rx.recv().await {
        let chunk = chunk.ok()?;
        out.extend_from_slice(&chunk.data);
        if out.len() as u64 > cap {
            return None;
        }
    }
    Some(out)
}

/// The names in the guest's directory `path` (directories only with `dirs`).
async fn list(target: &FileTarget, path: &str, dirs: bool) -> Vec<String> {
    match files::list(target.clone(), path.to_owned(), false, 0).await {
        Ok((entries, _)) => entries
            .into_iter()
            .filter(|e| !dirs || e.is_dir)
            .map(|e| e.name)
            .collect(),
        Err(_) => Vec::new(),
    }
}

async fn read_guest(target: &FileTarget) -> Vec<SbomPackage> {
    let mut out = Vec::new();
    if let Some(status) = read(target, "/var/lib/dpkg/status", MAX_DB_BYTES).await {
        out.extend(parse_dpkg(&String::from_utf8_lossy(&status)));
    }
    if let Some(db) = read(target, "/lib/apk/db/installed", MAX_DB_BYTES).await {
        out.extend(parse_apk(&String::from_utf8_lossy(&db)));
    }
    // Python: the dist-info and egg-info directories of every interpreter's package
    // directories under /usr/lib and /usr/local/lib.
    let mut py_dirs = vec!["/usr/lib/python3/dist-packages".to_owned()];
    for lib in ["/usr/lib", "/usr/local/lib"] {
        for name in list(target, lib, true).await {
            if name.starts_with("python3") {
                for sub in ["site-packages", "dist-packages"] {
                    py_dirs.push(format!("{lib}/{name}/{sub}"));
                }
            }
        }
    }
    let mut seen = BTreeSet::new();
    for dir in py_dirs {
        for name in list(target, &dir, false).await {
            if let Some(p) = parse_python_dist(&name)
                && seen.insert((p.name.clone(), p.version.clone()))
            {
                out.push(p);
            }
        }
    }
    // npm: the global packages (scoped ones one level down).
    let mut manifests = Vec::new();
    for root in ["/usr/local/lib/node_modules", "/usr/lib/node_modules"] {
        for name in list(target, root, true).await {
            if name.starts_with('@') {
                for inner in list(target, &format!("{root}/{name}"), true).await {
                    manifests.push(format!("{root}/{name}/{inner}/package.json"));
                }
            } else if !name.starts_with('.') {
                manifests.push(format!("{root}/{name}/package.json"));
            }
        }
    }
    for path in manifests.into_iter().take(MAX_NPM_PACKAGES) {
        if let Some(bytes) = read(target, &path, MAX_MANIFEST_BYTES).await
            && let Some(p) = parse_npm_manifest(&bytes)
        {
            out.push(p);
        }
    }
    out
}

/// The guest kernel and agent the template runs (from its record and this daemon).
fn platform(t: &Template) -> Vec<SbomPackage> {
    let mut out = Vec::new();
    if !t.kernel_version.is_empty() {
        out.push(package("airlock", "guest-kernel", &t.kernel_version, None));
    }
    let agent = format!(
        "{}+protocol.{}",
        env!("CARGO_PKG_VERSION"),
        if t.agent_protocol == 0 {
            airlock_proto::PROTOCOL_VERSION
        } else {
            t.agent_protocol
        }
    );
    out.push(package("airlock", "airlock-agent", &agent, None));
    out
}

/// Whether a name or version from the guest is kept: short, printable, no spaces.
fn plausible(s: &str) -> bool {
    !s.is_empty() && s.len() <= 200 && s.chars().all(|c| c.is_ascii_graphic())
}

fn package(ecosystem: &str, name: &str, version: &str, arch: Option<&str>) -> SbomPackage {
    let purl_name = match ecosystem {
        "pypi" => name.to_ascii_lowercase().replace('_', "-"),
        _ => name.to_owned(),
    };
    let namespace = match ecosystem {
        "deb" => "debian/",
        "apk" => "alpine/",
        _ => "",
    };
    let kind = match ecosystem {
        "airlock" => "generic",
        e => e,
    };
    let mut purl = format!(
        "pkg:{kind}/{namespace}{}@{}",
        encode(&purl_name),
        encode(version)
    );
    if let Some(a) = arch.filter(|a| !a.is_empty()) {
        purl.push_str(&format!("?arch={}", encode(a)));
    }
    SbomPackage {
        ecosystem: ecosystem.into(),
        name: name.into(),
        version: version.into(),
        purl,
    }
}

/// Percent-encoding of a purl segment (an npm scope's `@` included; its `/` kept).
fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The installed packages of a dpkg `status` file.
pub fn parse_dpkg(text: &str) -> Vec<SbomPackage> {
    stanzas(text, ':')
        .filter(|f| {
            f.get("Status")
                .is_some_and(|s| s.ends_with(" installed") && s.starts_with("install"))
        })
        .filter_map(|f| {
            let (name, version) = (f.get("Package")?, f.get("Version")?);
            (plausible(name) && plausible(version)).then(|| {
                package(
                    "deb",
                    name,
                    version,
                    f.get("Architecture").map(String::as_str),
                )
            })
        })
        .collect()
}

/// The packages of an apk `installed` database.
pub fn parse_apk(text: &str) -> Vec<SbomPackage> {
    stanzas(text, ':')
        .filter_map(|f| {
            let (name, version) = (f.get("P")?, f.get("V")?);
            (plausible(name) && plausible(version))
                .then(|| package("apk", name, version, f.get("A").map(String::as_str)))
        })
        .collect()
}

/// Blank-line separated stanzas of `Key<sep> value` lines (continuation lines skipped).
fn stanzas(text: &str, sep: char) -> impl Iterator<Item = HashMap<String, String>> + '_ {
    text.split("\n\n").map(move |stanza| {
        stanza
            .lines()
            .filter(|l| !l.starts_with([' ', '\t']))
            .filter_map(|l| l.split_once(sep))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect()
    })
}

/// A Python distribution from its metadata directory's name: `NAME-VERSION.dist-info` or
/// `NAME-VERSION[-pyX.Y].egg-info`.
pub fn parse_python_dist(entry: &str) -> Option<SbomPackage> {
    let stem = entry
        .strip_suffix(".dist-info")
        .or_else(|| entry.strip_suffix(".egg-info"))?;
    let (name, rest) = stem.split_once('-')?;
    let version = rest.split("-py").next()?;
    (plausible(name) && plausible(version)).then(|| package("pypi", name, version, None))
}

/// An npm package from its package.json.
pub fn parse_npm_manifest(bytes: &[u8]) -> Option<SbomPackage> {
    let v: Value = serde_json::from_slice(bytes).ok()?;
    let (name, version) = (v["name"].as_str()?, v["version"].as_str()?);
    (plausible(name) && plausible(version)).then(|| package("npm", name, version, None))
}

/// The SBOM of template `t` with `packages`, made at `now_ms`.
pub fn document(t: &Template, packages: &[SbomPackage], format: Format, now_ms: i64) -> Value {
    let created = airlock_api::utc_time(now_ms);
    let tool = format!("airlockd-{}", env!("CARGO_PKG_VERSION"));
    let subject = reference(t);
    match format {
        Format::CycloneDx => json!({
            "bomFormat": "CycloneDX",
            "specVersion": "1.5",
            "serialNumber": format!("urn:uuid:{}", uuid_of(&t.id, now_ms)),
            "version": 1,
            "metadata": {
                "timestamp": created,
                "tools": {"components": [{"type": "application", "name": "airlockd", "version": env!("CARGO_PKG_VERSION")}]},
                "component": {
                    "type": "container",
                    "bom-ref": t.id,
                    "name": subject,
                    "version": if t.tag.is_empty() { "latest" } else { &t.tag },
                    "properties": [
                        {"name": "airlock:template_id", "value": t.id},
                        {"name": "airlock:source", "value": t.source},
                    ],
                },
            },
            "components": packages.iter().map(|p| json!({
                "type": if p.ecosystem == "airlock" { "application" } else { "library" },
                "bom-ref": p.purl,
                "name": p.name,
                "version": p.version,
                "purl": p.purl,
            })).collect::<Vec<_>>(),
        }),
        Format::Spdx => {
            let root = "SPDXRef-Template";
            let mut spdx_packages = vec![json!({
                "name": subject,
                "SPDXID": root,
                "versionInfo": if t.tag.is_empty() { "latest" } else { &t.tag },
                "downloadLocation": "NOASSERTION",
                "filesAnalyzed": false,
                "comment": format!("Airlock template {} from {}", t.id, t.source),
            })];
            let mut relationships = vec![json!({
                "spdxElementId": "SPDXRef-DOCUMENT",
                "relationshipType": "DESCRIBES",
                "relatedSpdxElement": root,
            })];
            for (i, p) in packages.iter().enumerate() {
                let id = format!("SPDXRef-Package-{}-{i}", p.ecosystem);
                spdx_packages.push(json!({
                    "name": p.name,
                    "SPDXID": id,
                    "versionInfo": p.version,
                    "downloadLocation": "NOASSERTION",
                    "filesAnalyzed": false,
                    "externalRefs": [{
                        "referenceCategory": "PACKAGE-MANAGER",
                        "referenceType": "purl",
                        "referenceLocator": p.purl,
                    }],
                }));
                relationships.push(json!({
                    "spdxElementId": root,
                    "relationshipType": "CONTAINS",
                    "relatedSpdxElement": id,
                }));
            }
            json!({
                "spdxVersion": "SPDX-2.3",
                "dataLicense": "CC0-1.0",
                "SPDXID": "SPDXRef-DOCUMENT",
                "name": format!("airlock-template-{subject}"),
                "documentNamespace": format!("https://airlock.dev/spdx/{}/{}", t.id, now_ms),
                "creationInfo": {"created": created, "creators": [format!("Tool: {tool}")]},
                "packages": spdx_packages,
                "relationships": relationships,
            })
        }
    }
}

/// A version-4-shaped UUID derived from the template and the time (a document's serial).
fn uuid_of(id: &str, now_ms: i64) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(format!("{id}/{now_ms}").as_bytes());
    let mut b: [u8; 16] = d[..16].try_into().unwrap_or([0; 16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn dpkg_status_gives_the_installed_packages_only() {
        let status = "Package: git\nStatus: install ok installed\nArchitecture: amd64\n\
                      Version: 1:2.39.5-0+deb12u1\nDescription: fast\n long text\n\n\
                      Package: gone\nStatus: deinstall ok config-files\nVersion: 1.0\n\n\
                      Package: bad name\nStatus: install ok installed\nVersion: 1\n\n\
                      Package: tzdata\nStatus: install ok installed\nArchitecture: all\nVersion: 2024a-0+deb12u1\n";
        let p = parse_dpkg(status);
        assert_eq!(p.len(), 2, "{p:?}");
        assert_eq!(
            (p[0].name.as_str(), p[0].version.as_str()),
            ("git", "1:2.39.5-0+deb12u1")
        );
        assert_eq!(
            p[0].purl,
            "pkg:deb/debian/git@1%3A2.39.5-0%2Bdeb12u1?arch=amd64"
        );
        assert_eq!(p[1].name, "tzdata");
    }

    #[test]
    fn apk_python_and_npm_entries_are_read_and_junk_is_not() {
        let apk = "C:Q1abc=\nP:musl\nV:1.2.4-r2\nA:x86_64\n\nP:busybox\nV:1.36.1-r5\n";
        let p = parse_apk(apk);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].purl, "pkg:apk/alpine/musl@1.2.4-r2?arch=x86_64");
        let wheel = parse_python_dist("Flask_Login-0.6.3.dist-info").unwrap();
        assert_eq!(
            (wheel.name.as_str(), wheel.version.as_str()),
            ("Flask_Login", "0.6.3")
        );
        assert_eq!(wheel.purl, "pkg:pypi/flask-login@0.6.3");
        let egg = parse_python_dist("six-1.16.0-py3.11.egg-info").unwrap();
        assert_eq!(egg.version, "1.16.0");
        assert!(parse_python_dist("README.txt").is_none());
        assert!(parse_python_dist("noversion.dist-info").is_none());
        let npm = parse_npm_manifest(br#"{"name":"@scope/tool","version":"2.0.1"}"#).unwrap();
        assert_eq!(npm.purl, "pkg:npm/%40scope/tool@2.0.1");
        assert!(parse_npm_manifest(b"{not json").is_none());
        assert!(parse_npm_manifest(br#"{"name":"x"}"#).is_none());
        let long = format!(r#"{{"name":"{}","version":"1"}}"#, "a".repeat(300));
        assert!(parse_npm_manifest(long.as_bytes()).is_none());
    }

    #[test]
    fn documents_are_cyclonedx_and_spdx_with_every_package() {
        let t = Template {
            name: "py".into(),
            tag: "v1".into(),
            id: "tpl-1".into(),
            source: "image:default@abc".into(),
            kernel_version: "0123456789abcdef".into(),
            ..Default::default()
        };
        let mut packages = parse_dpkg("Package: git\nStatus: install ok installed\nVersion: 1\n");
        packages.extend(platform(&t));
        let cdx = document(&t, &packages, Format::CycloneDx, 1_735_689_600_000);
        assert_eq!(cdx["bomFormat"], "CycloneDX");
        assert_eq!(cdx["metadata"]["component"]["name"], "py:v1");
        assert_eq!(cdx["components"].as_array().unwrap().len(), 3);
        assert_eq!(cdx["components"][0]["purl"], "pkg:deb/debian/git@1");
        let serial = cdx["serialNumber"].as_str().unwrap();
        assert_eq!(serial.len(), "urn:uuid:".len() + 36);
        let spdx = document(&t, &packages, Format::Spdx, 1_735_689_600_000);
        assert_eq!(spdx["spdxVersion"], "SPDX-2.3");
        assert_eq!(spdx["packages"].as_array().unwrap().len(), 4);
        assert_eq!(spdx["relationships"].as_array().unwrap().len(), 4);
        assert_eq!(
            spdx["packages"][2]["externalRefs"][0]["referenceLocator"],
            "pkg:generic/guest-kernel@0123456789abcdef"
        );
        assert!(Format::parse("xml").is_err());
        assert_eq!(Format::parse("SPDX").unwrap(), Format::Spdx);
    }
}
