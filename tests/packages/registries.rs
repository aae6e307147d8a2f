//! The registries of the package tests, on loopback: a real `pypiserver` serving wheels the
//! test builds, a static PEP 503 mirror (Python's `http.server`) whose index lies about one
//! file's digest, a Debian repository signed by a key of the test's own (`debrepo.rs`, served
//! by the same static server), and a real `verdaccio` the test publishes two npm packages to.
//! Started once per test process, killed at its exit.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Wheels the registries serve: (name, version, padding bytes).
const PYPI_WHEELS: &[(&str, &str, usize)] = &[
    ("airlock-demo", "1.0", 0),
    ("airlock-evil", "1.0", 0),
    ("airlock-big", "1.0", 3 << 20),
];

/// The registries of this test process.
pub struct Registries {
    pub dir: PathBuf,
    pypi_port: u16,
    mirror_port: u16,
    npm_port: u16,
    /// SHA-256 of each wheel by package name.
    pub sha: std::collections::HashMap<String, String>,
    /// The Debian repository (under the mirror's `debian/`).
    pub deb: crate::debrepo::DebRepo,
    _servers: Vec<Child>,
}

static PIDS: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

extern "C" fn stop_registries() {
    for pid in PIDS.lock().unwrap().drain(..) {
        // SAFETY: kill(2) of our own child, not yet reaped (the pid is still its).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// `N` distinct free ports: the listeners are all held until every port is known, so the
/// kernel cannot hand one port out twice (seen: the port picked for verdaccio was the one
/// picked a moment before for pypi-server, which had not bound it yet).
fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<_> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

fn wait_port(port: u16, what: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on {port}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `verdaccio`: AIRLOCK_VERDACCIO, else where tests/registries.sh puts it.
fn verdaccio() -> PathBuf {
    let p = std::env::var_os("AIRLOCK_VERDACCIO").map_or_else(
        || {
            PathBuf::from(
                std::env::var("AIRLOCK_CACHE_DIR").unwrap_or_else(|_| "/var/cache/airlock".into()),
            )
            .join("registries/verdaccio/node_modules/.bin/verdaccio")
        },
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "no verdaccio at {} (run tests/registries.sh, which installs it, or set \
         AIRLOCK_VERDACCIO)",
        p.display()
    );
    p
}

const VERDACCIO_CONFIG: &str = "storage: ./storage\n\
auth:\n  htpasswd:\n    file: ./htpasswd\n    max_users: 10\n\
uplinks: {}\n\
packages:\n  '**':\n    access: $all\n    publish: $authenticated\n\
log: { type: file, path: ./verdaccio.log, level: info }\n";

/// Publishes packages `airlock-left-pad` and `airlock-right-pad` 1.0.0 to the verdaccio on
/// `port` with the host's npm (a user made through the registry's own API); returns their
/// tarballs' SHA-256, by name.
fn publish_npm(dir: &Path, port: u16) -> Vec<(String, String)> {
    let py = |code: &str| {
        let o = Command::new("python3").args(["-c", code]).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap().trim().to_owned()
    };
    let token = py(&format!(
        "import json, urllib.request\n\
         r = urllib.request.Request('http://127.0.0.1:{port}/-/user/org.couchdb.user:tester', \
         data=json.dumps({{'name': 'tester', 'password': 'airlock-test-pass'}}).encode(), \
         method='PUT', headers={{'Content-Type': 'application/json'}})\n\
         print(json.load(urllib.request.urlopen(r))['token'])"
    ));
    let npmrc = dir.join("npmrc");
    std::fs::write(&npmrc, format!("//127.0.0.1:{port}/:_authToken={token}\n")).unwrap();
    [
        ("airlock-left-pad", "padStart"),
        ("airlock-right-pad", "padEnd"),
    ]
    .into_iter()
    .map(|(name, pad)| {
        let pkg = dir.join(format!("npm-{name}"));
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::write(
            pkg.join("package.json"),
            format!(r#"{{"name":"{name}","version":"1.0.0","main":"index.js","license":"MIT"}}"#),
        )
        .unwrap();
        std::fs::write(
            pkg.join("index.js"),
            format!("module.exports = (s, n) => String(s).{pad}(n, '.');\n"),
        )
        .unwrap();
        let o = Command::new("npm")
            .args([
                "publish",
                "--registry",
                &format!("http://127.0.0.1:{port}/"),
            ])
            .arg("--userconfig")
            .arg(&npmrc)
            .current_dir(&pkg)
            .output()
            .expect("npm (Node.js) on PATH");
        assert!(
            o.status.success(),
            "npm publish {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let sha = py(&format!(
            "import hashlib, urllib.request\n\
                 u = 'http://127.0.0.1:{port}/{name}/-/{name}-1.0.0.tgz'\n\
                 print(hashlib.sha256(urllib.request.urlopen(u).read()).hexdigest())"
        ));
        (name.to_owned(), sha)
    })
    .collect()
}

/// `pypi-server`: AIRLOCK_PYPISERVER, else where tests/registries.sh puts it.
fn pypiserver() -> PathBuf {
    let p = std::env::var_os("AIRLOCK_PYPISERVER").map_or_else(
        || {
            PathBuf::from(
                std::env::var("AIRLOCK_CACHE_DIR").unwrap_or_else(|_| "/var/cache/airlock".into()),
            )
            .join("registries/pypiserver/bin/pypi-server")
        },
        PathBuf::from,
    );
    assert!(
        p.is_file(),
        "no pypi-server at {} (run tests/registries.sh, which installs it, or set \
         AIRLOCK_PYPISERVER)",
        p.display()
    );
    p
}

fn mkwheel(out: &Path, name: &str, version: &str, pad: usize) -> (PathBuf, String) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("packages/mkwheel.py");
    let o = Command::new("python3")
        .arg(script)
        .arg(out)
        .args([name, version, &pad.to_string()])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "mkwheel: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let line = String::from_utf8(o.stdout).unwrap();
    let (path, sha) = line.trim().split_once(' ').unwrap();
    (PathBuf::from(path), sha.to_owned())
}

pub fn registries() -> &'static Registries {
    static R: OnceLock<Registries> = OnceLock::new();
    R.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("airlock-packages-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut sha = std::collections::HashMap::new();
        for (name, version, pad) in PYPI_WHEELS {
            let (_, s) = mkwheel(&dir.join("pypi"), name, version, *pad);
            sha.insert((*name).to_owned(), s);
        }
        // The mirror: a static PEP 503 tree whose index states a digest its file does not have
        // (the file was altered after the index was written), and a page over the proxy's limit.
        let (wheel, real) = mkwheel(&dir.join("mirror/files"), "airlock-tampered", "1.0", 0);
        let wrong: String = real
            .chars()
            .map(|c| if c == '0' { '1' } else { '0' })
            .collect();
        let page = dir.join("mirror/simple/airlock-tampered");
        std::fs::create_dir_all(&page).unwrap();
        std::fs::write(
            page.join("index.html"),
            format!(
                "<html><body><a href=\"../../files/{0}#sha256={wrong}\">{0}</a></body></html>\n",
                wheel.file_name().unwrap().to_str().unwrap()
            ),
        )
        .unwrap();
        let huge = dir.join("mirror/simple/airlock-huge");
        std::fs::create_dir_all(&huge).unwrap();
        std::fs::write(huge.join("index.html"), "<a href=x>x</a>\n".repeat(400_000)).unwrap();
        sha.insert("airlock-tampered".into(), real);
        let deb = crate::debrepo::build(&dir.join("mirror/debian"), &dir.join("debian-work"));

        let [pypi_port, mirror_port, npm_port] = free_ports();
        let log = dir.join("pypiserver.log");
        // SAFETY: registers a plain `extern "C"` function that runs at exit.
        unsafe { libc::atexit(stop_registries) };
        let pypi = Command::new(pypiserver())
            .args(["run", "-p", &pypi_port.to_string(), "-i", "127.0.0.1"])
            .arg("--disable-fallback")
            .arg("--log-file")
            .arg(&log)
            .arg("-v")
            .arg(dir.join("pypi"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pypi-server");
        PIDS.lock().unwrap().push(pypi.id() as i32);
        let mirror_log = dir.join("mirror.log");
        let mirror = Command::new("python3")
            .args([
                "-m",
                "http.server",
                &mirror_port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .arg("--directory")
            .arg(dir.join("mirror"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&mirror_log).unwrap())
            .spawn()
            .expect("start the mirror (python3 -m http.server)");
        PIDS.lock().unwrap().push(mirror.id() as i32);
        let vdir = dir.join("verdaccio");
        std::fs::create_dir_all(&vdir).unwrap();
        std::fs::write(vdir.join("config.yaml"), VERDACCIO_CONFIG).unwrap();
        let npm = Command::new(verdaccio())
            .args(["--config", "./config.yaml", "--listen"])
            .arg(format!("127.0.0.1:{npm_port}"))
            .current_dir(&vdir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(vdir.join("stderr.log")).unwrap())
            .spawn()
            .expect("start verdaccio");
        PIDS.lock().unwrap().push(npm.id() as i32);
        wait_port(pypi_port, "pypi-server", &log);
        wait_port(mirror_port, "the mirror", &mirror_log);
        wait_port(npm_port, "verdaccio", &vdir.join("stderr.log"));
        sha.extend(publish_npm(&dir, npm_port));
        Registries {
            dir,
            pypi_port,
            mirror_port,
            npm_port,
            sha,
            deb,
            _servers: vec![pypi, mirror, npm],
        }
    })
}

/// The registries are on loopback, an address the package proxy connects to only where a
/// registry's `private_addresses` opens it.
const LO: &str = "private_addresses = [\"127.0.0.1/32\"]\n";

impl Registries {
    pub fn config(&self) -> String {
        format!(
            "pool_size = 1\n\
             [packages]\nmax_index_mib = 2\n\
             [packages.registries.pypi]\nkind = \"pypi\"\nurl = \"http://127.0.0.1:{}/simple/\"\n{LO}\
             [packages.registries.mirror]\nkind = \"pypi\"\nurl = \"http://127.0.0.1:{}/simple/\"\n{LO}\
             [packages.registries.npm]\nkind = \"npm\"\nurl = \"http://127.0.0.1:{}/\"\n{LO}\
             [packages.registries.debian]\nkind = \"debian\"\n{LO}\
             url = \"http://127.0.0.1:{}/debian/\"\nkeyring = {:?}\n",
            self.pypi_port,
            self.mirror_port,
            self.npm_port,
            self.mirror_port,
            self.deb.keyring.display().to_string()
        )
    }

    /// How many times pypiserver served a file whose name starts with `file_prefix`.
    pub fn served(&self, file_prefix: &str) -> usize {
        std::fs::read_to_string(self.dir.join("pypiserver.log"))
            .unwrap_or_default()
            .lines()
            // The access log's line (pypiserver also logs each request as it arrives).
            .filter(|l| l.contains(&format!("\"GET /packages/{file_prefix}")))
            .count()
    }
}
