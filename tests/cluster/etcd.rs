//! An etcd cluster of the test's own on loopback: members on free ports, data in the test's
//! directory, started with `--initial-cluster-state new` (a restarted member: `existing`, its
//! data directory kept), each killed and reaped by its pid. Clients reach it as the nodes of a
//! deployment do: TLS only, with a client certificate of the cluster's CA
//! (`--client-cert-auth`; [`Etcd::tls_settings`] are the nodes' `[cluster]` keys).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::procs;

/// Where the etcd binaries come from.
const INSTALL: &str = "scripts/install-deps.sh --tests";

/// `etcd` and `etcdctl`: on `$PATH`, else in /usr/bin. A missing one fails the test, naming
/// the script that installs them (Debian's etcd-server and etcd-client).
pub fn binaries() -> (PathBuf, PathBuf) {
    let find = |name: &str| {
        std::env::var_os("PATH")
            .iter()
            .flat_map(std::env::split_paths)
            .chain([PathBuf::from("/usr/bin")])
            .map(|d| d.join(name))
            .find(|p| p.is_file())
            .unwrap_or_else(|| {
                panic!(
                    "`{name}` is missing: the cluster tests run a three-member etcd cluster; \
                     install it with `{INSTALL}` (Debian packages etcd-server etcd-client)"
                )
            })
    };
    (find("etcd"), find("etcdctl"))
}

/// One member.
#[derive(Debug)]
pub struct Member {
    pub name: String,
    pub client_port: u16,
    pub peer_port: u16,
    pub data_dir: PathBuf,
    pub log: PathBuf,
    /// Its process while it runs.
    pub pid: Mutex<Option<i32>>,
}

impl Member {
    pub fn client_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.client_port)
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
    }

    pub fn pid(&self) -> Option<i32> {
        *self.pid.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The cluster's members (not started by [`Etcd::new`]).
#[derive(Debug)]
pub struct Etcd {
    pub members: Vec<Member>,
    etcd: PathBuf,
    etcdctl: PathBuf,
    token: String,
    /// The CA, the members' certificate and a client's (`etcd-tls/`).
    tls: PathBuf,
}

/// A CA (`ca.pem`), the members' server certificate for 127.0.0.1 (`server.pem`, `.key`) and
/// a client certificate (`client.pem`, `.key`), in `dir`.
fn certificates(dir: &Path) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    std::fs::create_dir_all(dir).expect("etcd's tls directory");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("CA key")).expect("CA");
    std::fs::write(dir.join("ca.pem"), ca.pem()).expect("ca.pem");
    for (name, san) in [("server", "127.0.0.1"), ("client", "airlock-node")] {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![san.to_owned()])
            .expect("certificate parameters")
            .signed_by(&key, &ca)
            .expect("certificate");
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).expect("certificate file");
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).expect("key file");
    }
}

impl Etcd {
    /// `n` members in `dir` (`dir/etcd-I`), on free loopback ports.
    pub fn new(dir: &Path, n: usize) -> Self {
        let (etcd, etcdctl) = binaries();
        let ports = procs::free_ports(2 * n);
        let members = (0..n)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: ports[2 * i],
                peer_port: ports[2 * i + 1],
                data_dir: dir.join(format!("etcd-{i}")),
                log: dir.join(format!("etcd-{i}.log")),
                pid: Mutex::new(None),
            })
            .collect();
        let tls = dir.join("etcd-tls");
        certificates(&tls);
        Self {
            members,
            etcd,
            etcdctl,
            token: format!("airlock-test-{}", std::process::id()),
            tls,
        }
    }

    /// The nodes' `[cluster]` keys for etcd's TLS: its CA and their client certificate.
    pub fn tls_settings(&self) -> String {
        let f = |n: &str| format!("{:?}", self.tls.join(n).display().to_string());
        format!(
            "etcd_ca = {}\netcd_cert = {}\netcd_key = {}\n",
            f("ca.pem"),
            f("client.pem"),
            f("client.key")
        )
    }

    /// etcdctl with a member's endpoint and the client certificate.
    fn ctl(&self, m: &Member) -> Command {
        let mut cmd = Command::new(&self.etcdctl);
        cmd.env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(m.client_url())
            .arg("--cacert")
            .arg(self.tls.join("ca.pem"))
            .arg("--cert")
            .arg(self.tls.join("client.pem"))
            .arg("--key")
            .arg(self.tls.join("client.key"));
        cmd
    }

    /// The client URLs of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::client_url).collect()
    }

    /// Starts every member and waits until the cluster answers.
    pub fn start(&self) {
        for i in 0..self.members.len() {
            self.spawn(i, "new");
        }
        self.wait_healthy(
            &(0..self.members.len()).collect::<Vec<_>>(),
            Duration::from_secs(60),
        );
    }

    fn spawn(&self, i: usize, state: &str) {
        let m = &self.members[i];
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("etcd log file");
        let mut cmd = Command::new(&self.etcd);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .arg("--listen-client-urls")
            .arg(m.client_url())
            .arg("--advertise-client-urls")
            .arg(m.client_url())
            .arg("--listen-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-advertise-peer-urls")
            .arg(m.peer_url())
            .arg("--initial-cluster")
            .arg(initial.join(","))
            .arg("--initial-cluster-token")
            .arg(&self.token)
            .arg("--initial-cluster-state")
            .arg(state)
            // No metrics or pprof listeners beyond the client port; a small WAL/snapshot.
            .arg("--snapshot-count")
            .arg("10000")
            // Clients: TLS only, and only with a certificate of the cluster's CA.
            .arg("--cert-file")
            .arg(self.tls.join("server.pem"))
            .arg("--key-file")
            .arg(self.tls.join("server.key"))
            .arg("--trusted-ca-file")
            .arg(self.tls.join("ca.pem"))
            .arg("--client-cert-auth")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let pid = procs::spawn(cmd);
        *m.pid.lock().unwrap_or_else(|e| e.into_inner()) = Some(pid);
    }

    /// Kills member `i` outright (SIGKILL by its pid) and reaps it.
    pub fn kill(&self, i: usize) {
        let pid = self.members[i]
            .pid
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(pid) = pid {
            procs::kill(pid);
        }
    }

    /// Starts member `i` again on its data directory and waits until it is healthy.
    pub fn restart(&self, i: usize) {
        assert!(self.members[i].pid().is_none(), "member {i} still runs");
        self.spawn(i, "existing");
        self.wait_healthy(&[i], Duration::from_secs(60));
    }

    /// Starts every member that does not run (a scenario that failed half-way).
    pub fn make_whole(&self) {
        for (i, m) in self.members.iter().enumerate() {
            let dead = m.pid().is_none_or(|p| !procs::running(p));
            if dead {
                if let Some(p) = m.pid.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    procs::kill(p);
                }
                self.restart(i);
            }
        }
    }

    /// Stops every member (SIGTERM, then SIGKILL).
    pub fn stop(&self) {
        for m in &self.members {
            if let Some(pid) = m.pid.lock().unwrap_or_else(|e| e.into_inner()).take() {
                procs::stop(pid, Duration::from_secs(10));
            }
        }
    }

    /// Whether member `i` answers `endpoint health` (a read through the raft quorum).
    pub fn healthy(&self, i: usize) -> bool {
        self.ctl(&self.members[i])
            .arg("--command-timeout=3s")
            .arg("endpoint")
            .arg("health")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Waits until members `which` are healthy; fails with their logs after `within`.
    pub fn wait_healthy(&self, which: &[usize], within: Duration) {
        let deadline = Instant::now() + within;
        for &i in which {
            while !self.healthy(i) {
                let m = &self.members[i];
                let gone = m.pid().is_none_or(|p| !procs::running(p));
                assert!(
                    !gone && Instant::now() < deadline,
                    "etcd member {} ({}) is not healthy{}: {}",
                    m.name,
                    m.client_url(),
                    if gone { " (it exited)" } else { "" },
                    airlock_system_tests::harness::tail(&m.log)
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }

    /// Runs etcdctl `args` through member `i` (as anyone who can write etcd could).
    pub fn ctl_ok(&self, i: usize, args: &[&str]) {
        let out = self
            .ctl(&self.members[i])
            .arg("--command-timeout=5s")
            .args(args)
            .output()
            .expect("run etcdctl");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Writes `key` = `value` through member `i` and reads it back through every other live
    /// member: the cluster takes writes and replicates them.
    pub fn put_get(&self, i: usize, key: &str, value: &str) {
        let ctl = |m: &Member, args: &[&str]| {
            let out = self
                .ctl(m)
                .arg("--command-timeout=5s")
                .args(args)
                .output()
                .expect("run etcdctl");
            assert!(
                out.status.success(),
                "etcdctl {args:?} on {}: {}",
                m.name,
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        ctl(&self.members[i], &["put", key, value]);
        for m in self.members.iter().filter(|m| m.pid().is_some()) {
            let got = ctl(m, &["get", "--print-value-only", key]);
            assert_eq!(got.trim(), value, "read back through {}", m.name);
        }
    }
}
