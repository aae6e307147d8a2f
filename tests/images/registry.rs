//! A real, local OCI registry for the image tests: Debian's `docker-registry` (distribution
//! 2.8) on `127.0.0.1:<free port>` with filesystem storage in a temporary directory of its own,
//! killed and removed on drop. Anonymous, HTTP basic (`htpasswd`, bcrypt) or the distribution
//! bearer-token flow, whose token server ([`TokenServer`]) runs in the test process and signs
//! ES256 JWTs with a key whose self-signed certificate is the registry's `rootcertbundle`.
//! Images get there with `skopeo copy --all oci:DIR:TAG docker://...` ([`Registry::push`]) from
//! a layout of `images/layout.rs`; [`Registry::corrupt_blob`] damages a stored blob in place.
//! Everything stays on this machine.
#![allow(dead_code)] // each test binary uses a part of it

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use serde_json::json;

/// The registry program (Debian's docker-registry).
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";
/// `service` of the token flow (the JWT's `aud`).
pub const TOKEN_SERVICE: &str = "airlock-test-registry";
/// `issuer` of the token flow (the JWT's `iss`).
pub const TOKEN_ISSUER: &str = "airlock-test-token-issuer";
/// How long the registry may take to answer `GET /v2/`.
const START_DEADLINE: Duration = Duration::from_secs(20);

/// How the registry authenticates clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Auth {
    /// Anonymous pull and push.
    None,
    /// HTTP basic against an htpasswd file of one account.
    Basic { user: String, password: String },
    /// Bearer tokens from the test's [`TokenServer`], which takes these basic credentials.
    Token { user: String, password: String },
}

impl Auth {
    pub fn basic(user: &str, password: &str) -> Self {
        Auth::Basic {
            user: user.into(),
            password: password.into(),
        }
    }

    pub fn token(user: &str, password: &str) -> Self {
        Auth::Token {
            user: user.into(),
            password: password.into(),
        }
    }

    /// `(user, password)`, unless anonymous.
    pub fn credentials(&self) -> Option<(&str, &str)> {
        match self {
            Auth::None => None,
            Auth::Basic { user, password } | Auth::Token { user, password } => {
                Some((user.as_str(), password.as_str()))
            }
        }
    }
}

/// A fresh directory under the system's temporary directory, unique in this process.
fn temp_dir(tag: &str) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "airlock-{tag}-{}-{n}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.0.0.1")
        .port()
}

/// One `GET path` over HTTP/1.0 to `127.0.0.1:port`: the status code.
fn http_status(port: u16, path: &str) -> std::io::Result<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let head = String::from_utf8_lossy(&buf);
    head.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not HTTP: {head:?}")))
}

/// A `docker-registry serve` child process and its storage; killed and removed on drop.
#[derive(Debug)]
pub struct Registry {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    auth: Auth,
    token_server: Option<TokenServer>,
}

impl Registry {
    /// Starts a registry with `auth` and waits until it answers `GET /v2/`.
    pub fn start(auth: Auth) -> Self {
        assert!(
            Path::new(REGISTRY_BIN).is_file(),
            "{REGISTRY_BIN} is missing: `scripts/install-deps.sh --tests` installs docker-registry"
        );
        let dir = temp_dir("registry");
        let storage = dir.join("storage");
        std::fs::create_dir_all(&storage).expect("registry storage dir");
        let port = free_port();
        let mut token_server = None;
        let auth_section = match &auth {
            Auth::None => String::new(),
            Auth::Basic { user, password } => {
                // Cost 4: the registry checks the hash on every request.
                let hash = bcrypt::hash_with_result(password, 4)
                    .expect("bcrypt")
                    .format_for_version(bcrypt::Version::TwoY);
                let htpasswd = dir.join("htpasswd");
                std::fs::write(&htpasswd, format!("{user}:{hash}\n")).expect("write htpasswd");
                format!(
                    "auth:\n  htpasswd:\n    realm: airlock-test\n    path: {}\n",
                    htpasswd.display()
                )
            }
            Auth::Token { user, password } => {
                let server = TokenServer::start(user, password);
                let bundle = dir.join("token.crt");
                std::fs::write(&bundle, &server.cert_pem).expect("write rootcertbundle");
                let section = format!(
                    "auth:\n  token:\n    realm: {}\n    service: {TOKEN_SERVICE}\n    \
                     issuer: {TOKEN_ISSUER}\n    rootcertbundle: {}\n",
                    server.realm(),
                    bundle.display()
                );
                token_server = Some(server);
                section
            }
        };
        let config = format!(
            "version: 0.1\n\
             log:\n  level: info\n  formatter: text\n\
             storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n  \
             maintenance:\n    uploadpurging:\n      enabled: false\n\
             http:\n  addr: 127.0.0.1:{port}\n  secret: airlock-test-registry-secret\n\
             {auth_section}",
            storage.display()
        );
        let config_path = dir.join("config.yml");
        std::fs::write(&config_path, config).expect("write registry config");
        let log = std::fs::File::create(dir.join("registry.log")).expect("registry log");
        let child = Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {REGISTRY_BIN}: {e}"));
        let mut registry = Self {
            child: Some(child),
            port,
            dir,
            auth,
            token_server,
        };
        registry.wait_ready();
        registry
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + START_DEADLINE;
        let expected = if self.auth == Auth::None { 200 } else { 401 };
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!(
                    "docker-registry exited ({status}) before answering:\n{}",
                    self.log()
                );
            }
            let last = match http_status(self.port, "/v2/") {
                Ok(code) if code == expected => return,
                Ok(code) => format!("GET /v2/ answered {code}, not {expected}"),
                Err(e) => format!("GET /v2/: {e}"),
            };
            if Instant::now() > deadline {
                panic!(
                    "docker-registry on 127.0.0.1:{} not ready in {START_DEADLINE:?} ({last}):\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:PORT/REPO:TAG` (or `...@sha256:...`) for `repo_ref`.
    pub fn reference(&self, repo_ref: &str) -> String {
        format!("{}/{repo_ref}", self.host())
    }

    /// `http://127.0.0.1:PORT` + `path` (such as `/v2/REPO/manifests/TAG`).
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.host())
    }

    pub fn auth(&self) -> &Auth {
        &self.auth
    }

    /// The token server of [`Auth::Token`].
    pub fn token_server(&self) -> Option<&TokenServer> {
        self.token_server.as_ref()
    }

    /// The registry's temporary directory (config, log, `storage/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the registry logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("registry.log")).unwrap_or_default()
    }

    /// `skopeo copy --all` of the layout `layout_dir`'s tag (the tag of `repo_tag`, `latest`
    /// without one) to `REPO:TAG` here, with the registry's credentials; panics with skopeo's
    /// output when it fails.
    pub fn push(&self, layout_dir: &Path, repo_tag: &str) {
        let tag = match repo_tag.rsplit_once(':') {
            Some((_, tag)) if !tag.contains('/') => tag,
            _ => "latest",
        };
        self.push_tag(layout_dir, tag, repo_tag);
    }

    /// [`Registry::push`] of the layout's `layout_tag` to `repo_ref` (`REPO:TAG`).
    pub fn push_tag(&self, layout_dir: &Path, layout_tag: &str, repo_ref: &str) {
        let home = self.dir.join("skopeo-home");
        std::fs::create_dir_all(&home).expect("skopeo home");
        let mut cmd = Command::new("skopeo");
        cmd.env("HOME", &home)
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("XDG_CONFIG_HOME")
            .env_remove("XDG_DATA_HOME")
            .env_remove("REGISTRY_AUTH_FILE")
            .args([
                "--insecure-policy",
                "copy",
                "--all",
                "--dest-tls-verify=false",
            ])
            .arg("--dest-authfile")
            .arg(home.join("auth.json"));
        match self.auth.credentials() {
            Some((user, password)) => {
                cmd.arg("--dest-creds").arg(format!("{user}:{password}"));
            }
            None => {
                cmd.arg("--dest-no-creds");
            }
        }
        cmd.arg(format!("oci:{}:{layout_tag}", layout_dir.display()))
            .arg(format!("docker://{}", self.reference(repo_ref)));
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("run skopeo (scripts/install-deps.sh --tests): {e}"));
        assert!(
            out.status.success(),
            "{cmd:?} failed ({}):\n{}{}\n--- registry ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
    }

    /// Where the registry stores the blob `digest` (`sha256:HEX`).
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest
            .strip_prefix("sha256:")
            .unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
        self.dir
            .join("storage/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Overwrites the stored blob `digest` with other bytes of the same length (each byte
    /// inverted), so that what the registry serves no longer matches its digest.
    pub fn corrupt_blob(&self, digest: &str) {
        let path = self.blob_path(digest);
        let data = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("blob {digest} at {}: {e}", path.display()));
        let flipped: Vec<u8> = data.iter().map(|b| !b).collect();
        std::fs::write(&path, flipped).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The token server of the bearer-token flow: `GET /token?service=S&scope=S...` with the right
/// basic credentials gets `{"token": JWT, "access_token": JWT, "expires_in": 300}`, the JWT
/// granting every requested scope; anything else gets 401. A thread of the test process on
/// `127.0.0.1:<free port>`; stopped on drop.
#[derive(Debug)]
pub struct TokenServer {
    port: u16,
    /// The signing key's self-signed certificate (the registry's `rootcertbundle`).
    pub cert_pem: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    state: Arc<TokenState>,
}

#[derive(Debug)]
struct TokenState {
    user: String,
    password: String,
    key: ring::signature::EcdsaKeyPair,
    cert_der: Vec<u8>,
    /// (granted, scopes asked) of each request.
    requests: Mutex<Vec<(bool, Vec<String>)>>,
    counter: AtomicU64,
}

impl TokenServer {
    /// Starts a token server that accepts `user`:`password`.
    pub fn start(user: &str, password: &str) -> Self {
        let key = rcgen::KeyPair::generate().expect("token signing key");
        let cert = rcgen::CertificateParams::new(vec!["airlock-test-token".to_string()])
            .expect("certificate params")
            .self_signed(&key)
            .expect("self-signed certificate");
        let rng = ring::rand::SystemRandom::new();
        let signer = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &key.serialize_der(),
            &rng,
        )
        .expect("P-256 key");
        let state = Arc::new(TokenState {
            user: user.into(),
            password: password.into(),
            key: signer,
            cert_der: cert.der().to_vec(),
            requests: Mutex::new(Vec::new()),
            counter: AtomicU64::new(0),
        });
        let listener = TcpListener::bind("127.0.0.1:0").expect("token server listener");
        let port = listener.local_addr().expect("token server address").port();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (stop, state) = (stop.clone(), state.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let state = state.clone();
                    std::thread::spawn(move || {
                        let _ = state.serve(conn);
                    });
                }
            })
        };
        Self {
            port,
            cert_pem: cert.pem(),
            stop,
            thread: Some(thread),
            state,
        }
    }

    /// `http://127.0.0.1:PORT/token`.
    pub fn realm(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }

    /// Each request so far: whether it got a token, and the scopes it asked for.
    pub fn requests(&self) -> Vec<(bool, Vec<String>)> {
        self.state.requests.lock().expect("token log").clone()
    }

    /// A token for `scopes` signed by this server's key, as the server would grant it.
    pub fn issue(&self, scopes: &[String]) -> String {
        self.state.jwt(scopes)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl TokenState {
    fn serve(&self, mut conn: TcpStream) -> std::io::Result<()> {
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut chunk)?;
            if n == 0 {
                return Ok(()); // the wake-up connection of Drop, or a client that gave up
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.len() > 64 * 1024 {
                return Ok(());
            }
        }
        let head = String::from_utf8_lossy(&buf).into_owned();
        let mut lines = head.split("\r\n");
        let request = lines.next().unwrap_or_default();
        let mut parts = request.split_whitespace();
        let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let authorization = lines
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
            .map(|(_, v)| v.trim().to_string());
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let mut scopes = Vec::new();
        for pair in query.split('&') {
            if let Some(("scope", v)) = pair.split_once('=') {
                scopes.extend(percent_decode(v).split(' ').map(str::to_string));
            }
        }
        let authorized = authorization
            .as_deref()
            .and_then(|a| a.strip_prefix("Basic "))
            .and_then(|b| STANDARD.decode(b.trim()).ok())
            .is_some_and(|c| c == format!("{}:{}", self.user, self.password).into_bytes());
        let granted = method == "GET" && path == "/token" && authorized;
        self.requests
            .lock()
            .expect("token log")
            .push((granted, scopes.clone()));
        let (status, body) = if granted {
            let jwt = self.jwt(&scopes);
            (
                "200 OK",
                json!({"token": jwt, "access_token": jwt, "expires_in": 300}).to_string(),
            )
        } else {
            (
                "401 Unauthorized",
                json!({"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]})
                    .to_string(),
            )
        };
        write!(
            conn,
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
             WWW-Authenticate: Basic realm=\"airlock-test-token\"\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )?;
        conn.flush()
    }

    /// An ES256 JWT granting `scopes` (`TYPE:NAME:ACTION,...`), with `x5c` = our certificate.
    fn jwt(&self, scopes: &[String]) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let access: Vec<_> = scopes
            .iter()
            .filter_map(|s| {
                let (kind, rest) = s.split_once(':')?;
                let (name, actions) = rest.rsplit_once(':')?;
                Some(json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
            })
            .collect();
        let header =
            json!({"typ": "JWT", "alg": "ES256", "x5c": [STANDARD.encode(&self.cert_der)]});
        let claims = json!({
            "iss": TOKEN_ISSUER,
            "sub": self.user,
            "aud": TOKEN_SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": format!("airlock-{}", self.counter.fetch_add(1, Ordering::Relaxed)),
            "access": access,
        });
        let input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let sig = self
            .key
            .sign(&ring::rand::SystemRandom::new(), input.as_bytes())
            .expect("sign token");
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
    }
}
