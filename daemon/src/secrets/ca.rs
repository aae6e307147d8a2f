//! A sandbox's own certificate authority, for brokered secrets over HTTPS: made at create when
//! one of its secrets asks for HTTPS, its certificate placed in the guest's trust store, its
//! key only in the daemon's memory (gone with the sandbox). The egress proxy terminates the
//! guest's TLS to a brokered host with a leaf of this CA for that name.
//!
//! The trade-off (documented in docs/secrets.md): the proxy sees those requests in clear, and the
//! guest trusts a CA that can name any host — but only within its own sandbox, whose CA no
//! other sandbox trusts and whose key never leaves the daemon (but sealed, with the sandbox's
//! secrets, for a restarted daemon: [`super::seal`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use zeroize::Zeroizing;

/// Leaves kept per sandbox (one per brokered name it reached); more start the map again.
const MAX_LEAVES: usize = 64;

/// Where the guest finds the CA's certificate (and, appended, in its system bundle).
pub const GUEST_CA_PATH: &str = "/usr/local/share/ca-certificates/airlock-sandbox.crt";
/// Debian's bundle, which OpenSSL, Python's `ssl` and curl read by default.
pub const GUEST_BUNDLE_PATH: &str = "/etc/ssl/certs/ca-certificates.crt";

pub struct SandboxCa {
    issuer: Issuer<'static, KeyPair>,
    /// Its self-signed certificate, as the guest trusts it.
    cert: CertificateDer<'static>,
    leaves: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl std::fmt::Debug for SandboxCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCa").finish_non_exhaustive()
    }
}

impl SandboxCa {
    /// A new CA (an ECDSA P-256 key) for sandbox `id`.
    pub fn new(id: &str) -> Result<Self, rcgen::Error> {
        let params = Self::params(id)?;
        let key = KeyPair::generate()?;
        let cert = params.self_signed(&key)?.der().clone();
        Ok(Self {
            issuer: Issuer::new(params, key),
            cert,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA of sandbox `id` again, from its key ([`Self::key_der`]) and certificate
    /// ([`Self::cert_der`]): its leaves chain to the certificate its guest trusts.
    pub fn restore(id: &str, key_der: &[u8], cert_der: &[u8]) -> Result<Self, rcgen::Error> {
        let key = KeyPair::try_from(key_der)?;
        Ok(Self {
            issuer: Issuer::new(Self::params(id)?, key),
            cert: CertificateDer::from(cert_der.to_vec()),
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// What its certificate says, and what its issuer signs leaves as.
    fn params(id: &str) -> Result<CertificateParams, rcgen::Error> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.distinguished_name.push(
            DnType::CommonName,
            format!("Airlock sandbox {id} broker CA"),
        );
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        Ok(params)
    }

    /// The CA's certificate, PEM (what the guest trusts).
    pub fn pem(&self) -> String {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(self.cert.as_ref());
        let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(64) {
            pem.push_str(&String::from_utf8_lossy(line));
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
        pem
    }

    /// Its certificate, DER.
    pub fn cert_der(&self) -> &[u8] {
        self.cert.as_ref()
    }

    /// Its private key, PKCS#8 DER (to seal; zeroed when dropped).
    pub fn key_der(&self) -> Zeroizing<Vec<u8>> {
        Zeroizing::new(self.issuer.key().serialize_der())
    }

    /// A server certificate and key for `name`, made on first use.
    pub fn leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, LeafError> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = leaves.get(name) {
            return Ok(k.clone());
        }
        let made = self.make_leaf(name)?;
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(name.to_owned(), made.clone());
        Ok(made)
    }

    fn make_leaf(&self, name: &str) -> Result<Arc<CertifiedKey>, LeafError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![name.to_owned()])?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params.signed_by(&key, &self.issuer)?;
        let der_key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = rustls::crypto::ring::sign::any_supported_type(&der_key)?;
        let chain = vec![CertificateDer::from(cert.der().to_vec()), self.cert.clone()];
        Ok(Arc::new(CertifiedKey::new(chain, signing)))
    }
}

/// Why the CA made no certificate for a name.
#[derive(Debug, thiserror::Error)]
pub enum LeafError {
    #[error(transparent)]
    Certificate(#[from] rcgen::Error),
    #[error(transparent)]
    Key(#[from] rustls::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaf_is_made_once_per_name_and_chains_to_the_ca() {
        let ca = SandboxCa::new("sb-test").unwrap();
        assert!(ca.pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let a = ca.leaf("api.example.com").unwrap();
        let again = ca.leaf("api.example.com").unwrap();
        assert!(Arc::ptr_eq(&a, &again));
        assert_eq!(a.cert.len(), 2);
        assert_eq!(&a.cert[1], &ca.cert);
        let b = ca.leaf("other.example.com").unwrap();
        assert_ne!(a.cert[0], b.cert[0]);
    }

    #[test]
    fn a_restored_ca_signs_leaves_that_chain_to_the_certificate_the_guest_trusts() {
        let ca = SandboxCa::new("sb-test").unwrap();
        let again = SandboxCa::restore("sb-test", &ca.key_der(), ca.cert_der()).unwrap();
        assert_eq!(again.pem(), ca.pem());
        let leaf = again.leaf("api.example.com").unwrap();
        let root = CertificateDer::from(ca.cert_der().to_vec());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(root).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
        let name = rustls::pki_types::ServerName::try_from("api.example.com").unwrap();
        let now = rustls::pki_types::UnixTime::now();
        rustls::client::danger::ServerCertVerifier::verify_server_cert(
            verifier.as_ref(),
            &leaf.cert[0],
            &leaf.cert[1..],
            &name,
            &[],
            now,
        )
        .unwrap();
    }

    #[test]
    fn two_sandboxes_have_distinct_cas() {
        let a = SandboxCa::new("sb-a").unwrap();
        let b = SandboxCa::new("sb-b").unwrap();
        assert_ne!(a.pem(), b.pem());
    }
}
