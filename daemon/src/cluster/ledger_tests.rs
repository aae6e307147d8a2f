//! The ledger against a real etcd (`etcd` from Debian's etcd-server, as the cluster system
//! tests use; `scripts/install-deps.sh --tests` installs it): TLS with client certificates.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

use super::*;

/// `etcd`: on `$PATH`, else in /usr/bin (a missing one fails the test, naming its package).
fn etcd_binary() -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .chain([PathBuf::from("/usr/bin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .expect(
            "`etcd` is missing: install it with `scripts/install-deps.sh --tests` (etcd-server)",
        )
}

/// A free loopback port (released: etcd binds it next).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A CA, etcd's server certificate for 127.0.0.1, and a node's client certificate; and a
/// second CA's client certificate (another cluster's, or anyone's).
fn certificates(dir: &Path) {
    let issuer = |name: &str| {
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), ca.pem()).unwrap();
        ca
    };
    let (ca, stranger) = (issuer("ca"), issuer("stranger-ca"));
    for (name, sans, by) in [
        ("etcd", vec!["127.0.0.1".to_owned()], &ca),
        ("node", vec!["node-a".to_owned()], &ca),
        ("stranger", vec!["node-a".to_owned()], &stranger),
    ] {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(sans)
            .unwrap()
            .signed_by(&key, by)
            .unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
    }
}

/// One etcd member serving TLS only, and only to clients with a certificate of `ca.pem`;
/// killed when dropped.
struct TlsEtcd {
    child: Child,
    url: String,
}

impl Drop for TlsEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_etcd(dir: &Path) -> TlsEtcd {
    let (client, peer) = (free_port(), free_port());
    let url = format!("https://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let child = Command::new(etcd_binary())
        .args(["--name", "m0", "--data-dir"])
        .arg(dir.join("data"))
        .args([
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
        ])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("m0={peer_url}")])
        .arg("--cert-file")
        .arg(dir.join("etcd.pem"))
        .arg("--key-file")
        .arg(dir.join("etcd.key"))
        .arg("--trusted-ca-file")
        .arg(dir.join("ca.pem"))
        .arg("--client-cert-auth")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    TlsEtcd { child, url }
}

fn settings(dir: &Path, url: &str, client: &str) -> ClusterConfig {
    ClusterConfig {
        etcd: vec![url.to_owned()],
        node: "node-a".into(),
        prefix: "/airlock-tls/".into(),
        etcd_ca: Some(dir.join("ca.pem")),
        etcd_cert: Some(dir.join(format!("{client}.pem"))),
        etcd_key: Some(dir.join(format!("{client}.key"))),
        ..Default::default()
    }
}

/// Connects and claims a tag (a write and reads), tried until etcd is up or `by`.
async fn claim(cfg: &ClusterConfig, by: Instant) -> Result<String, String> {
    loop {
        let key = RecordKey::from_token("a cluster token of 32 characters or more");
        let tried = match EtcdLedger::connect(cfg, Arc::new(Config::default()), key).await {
            Ok(l) => l.claim_tag("node-a").await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if tried.is_ok() || Instant::now() > by {
            return tried;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Issue 37, item 3: a node reaches etcd over TLS, verifying etcd's certificate against
/// `etcd_ca` and showing its own client certificate (`--client-cert-auth`); a client with a
/// certificate of another CA gets nothing.
#[tokio::test]
async fn a_node_speaks_tls_with_its_client_certificate_to_etcd() {
    let dir = std::env::temp_dir().join(format!("airlock-etcd-tls-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    certificates(&dir);
    let etcd = start_etcd(&dir);
    let by = Instant::now() + Duration::from_secs(30);
    let tag = claim(&settings(&dir, &etcd.url, "node"), by).await;
    let log = std::fs::read_to_string(dir.join("etcd.log")).unwrap_or_default();
    let tag = tag.unwrap_or_else(|e| panic!("{e}\netcd's log:\n{log}"));
    assert_eq!(tag.len(), 4);
    let soon = Instant::now() + Duration::from_secs(2);
    let refused = claim(&settings(&dir, &etcd.url, "stranger"), soon).await;
    assert!(refused.is_err(), "a stranger's certificate was let in");
    drop(etcd);
    let _ = std::fs::remove_dir_all(&dir);
}
