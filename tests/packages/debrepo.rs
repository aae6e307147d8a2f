//! A Debian repository of the test's own, as a mirror lays it out (`dists/`, `pool/`, apt's
//! `by-hash`), signed by a key the test makes: real `.deb`s (dpkg-deb), a real Packages index in
//! the three forms Debian publishes (plain, gzip, xz), and InRelease files clearsigned by gpg.
//! Beside the good suite (`bookworm`, what the base image's apt asks for) are the ways a mirror
//! can lie: a suite signed by a key outside the registry's keyring (`forged`), one altered after
//! signing (`altered`), a good suite's InRelease served as another suite's (`other`), and one
//! whose signed Release states a digest its Packages index does not have (`lying`). In the pool,
//! `airlock-tampered` was altered after the index was written.
#![allow(dead_code)] // each test file uses its part

use std::collections::HashMap;
use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest as _, Sha256};

/// Packages in the pool: (name, bytes of filler).
const DEBS: &[(&str, usize)] = &[
    ("airlock-hello", 0),
    ("airlock-denied", 0),
    ("airlock-tampered", 0),
    ("airlock-big", 3 << 20),
];

pub struct DebRepo {
    /// The keyring the registry is configured with (binary, as `gpg --export` writes it).
    pub keyring: PathBuf,
    /// Each `.deb`'s SHA-256 as the index states it, by package.
    pub sha: HashMap<String, String>,
    /// The Release text the good suite's InRelease signs.
    pub release: String,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn sh(cmd: &mut Command) -> Vec<u8> {
    let o = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o.stdout
}

fn gpg(home: &Path) -> Command {
    let mut c = Command::new("gpg");
    c.arg("--batch").arg("--homedir").arg(home);
    c
}

/// A signing key of its own in `home`.
fn make_key(home: &Path, who: &str) {
    std::fs::create_dir_all(home).unwrap();
    std::fs::set_permissions(home, std::fs::Permissions::from_mode(0o700)).unwrap();
    sh(gpg(home).args([
        "--passphrase",
        "",
        "--quick-gen-key",
        &format!("{who} <archive@airlock.invalid>"),
        "ed25519",
        "sign",
        "never",
    ]));
}

/// `text` clearsigned by the key in `home`.
fn clearsign(home: &Path, text: &str) -> Vec<u8> {
    let mut child = gpg(home)
        .args(["--yes", "--clearsign", "--output", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("gpg (Debian's gnupg package)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o.stdout
}

/// Filler that does not compress (a .deb's own compression would make zeros nothing).
fn filler(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A `.deb` of `name` 1.0 whose `/usr/bin/NAME` prints a greeting; returns its pool path.
fn make_deb(root: &Path, work: &Path, name: &str, pad: usize) -> String {
    let pkg = work.join(format!("pkg-{name}"));
    std::fs::create_dir_all(pkg.join("DEBIAN")).unwrap();
    std::fs::create_dir_all(pkg.join("usr/bin")).unwrap();
    std::fs::write(
        pkg.join("DEBIAN/control"),
        format!(
            "Package: {name}\nVersion: 1.0\nArchitecture: all\n\
             Maintainer: Airlock Test <test@airlock.invalid>\nDescription: {name} for the tests\n"
        ),
    )
    .unwrap();
    let bin = pkg.join("usr/bin").join(name);
    std::fs::write(&bin, format!("#!/bin/sh\necho \"hello from {name} 1.0\"\n")).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    if pad > 0 {
        std::fs::create_dir_all(pkg.join("usr/share").join(name)).unwrap();
        std::fs::write(pkg.join("usr/share").join(name).join("filler"), filler(pad)).unwrap();
    }
    let rel = format!("pool/main/a/{name}/{name}_1.0_all.deb");
    let out = root.join(&rel);
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    sh(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zgzip", "--build"])
        .arg(&pkg)
        .arg(&out));
    rel
}

/// A Release for `suite` listing `files` (path under the component, content).
fn release(suite: &str, files: &[(String, Vec<u8>)]) -> String {
    let date = String::from_utf8(sh(Command::new("date").env("LC_ALL", "C").args([
        "-u",
        "-d",
        "-1 hour",
        "+%a, %d %b %Y %H:%M:%S UTC",
    ])))
    .unwrap();
    let mut r = format!(
        "Origin: Airlock Test\nLabel: Airlock Test\nSuite: {suite}\nCodename: {suite}\n\
         Date: {}\nArchitectures: amd64\nComponents: main\nAcquire-By-Hash: yes\n\
         Description: the package tests' repository\nSHA256:\n",
        date.trim()
    );
    for (path, body) in files {
        r += &format!(" {} {} {path}\n", hex(&Sha256::digest(body)), body.len());
    }
    r
}

fn put(path: &Path, body: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, body).unwrap();
}

/// Builds the repository at `root` (served as the registry's URL), with keys and packages
/// made under `work`.
pub fn build(root: &Path, work: &Path) -> DebRepo {
    let (trusted, other) = (work.join("gpg-archive"), work.join("gpg-other"));
    make_key(&trusted, "Airlock Test Archive");
    make_key(&other, "Someone Else");
    let keyring = work.join("archive-keyring.gpg");
    std::fs::write(&keyring, sh(gpg(&trusted).arg("--export"))).unwrap();

    let mut sha = HashMap::new();
    let mut index = String::new();
    for (name, pad) in DEBS {
        let rel = make_deb(root, work, name, *pad);
        let body = std::fs::read(root.join(&rel)).unwrap();
        let digest = hex(&Sha256::digest(&body));
        index += &format!(
            "Package: {name}\nVersion: 1.0\nArchitecture: all\n\
             Maintainer: Airlock Test <test@airlock.invalid>\nFilename: {rel}\nSize: {}\n\
             SHA256: {digest}\nDescription: {name} for the tests\n\n",
            body.len()
        );
        sha.insert((*name).to_owned(), digest);
        if *name == "airlock-tampered" {
            // Altered after the index was written.
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(root.join(&rel))
                .unwrap();
            f.write_all(b"tampered").unwrap();
        }
    }
    let plain = index.into_bytes();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&plain).unwrap();
    let gz = gz.finish().unwrap();
    let mut xz = Command::new("xz")
        .args(["-c", "-T1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("xz (Debian's xz-utils package)");
    xz.stdin.take().unwrap().write_all(&plain).unwrap();
    let xz = xz.wait_with_output().unwrap();
    assert!(xz.status.success());
    let files: Vec<(String, Vec<u8>)> = [
        ("Packages", plain),
        ("Packages.gz", gz),
        ("Packages.xz", xz.stdout),
    ]
    .into_iter()
    .map(|(n, b)| (format!("main/binary-amd64/{n}"), b))
    .collect();

    // Each suite's indexes, by path and by hash, and its InRelease.
    let suite = |name: &str, signer: &Path, listed: &[(String, Vec<u8>)]| {
        let dists = root.join("dists").join(name);
        for (path, body) in &files {
            put(&dists.join(path), body);
            let by_hash = Path::new(path)
                .parent()
                .unwrap()
                .join("by-hash/SHA256")
                .join(hex(&Sha256::digest(body)));
            put(&dists.join(by_hash), body);
        }
        let text = release(name, listed);
        let signed = clearsign(signer, &text);
        put(&dists.join("InRelease"), &signed);
        (signed, text)
    };
    let (good, good_text) = suite("bookworm", &trusted, &files);
    suite("forged", &other, &files);
    let (altered, _) = suite("altered", &trusted, &files);
    let altered = String::from_utf8(altered)
        .unwrap()
        .replace("Origin: Airlock Test", "Origin: Airlock Evil");
    put(&root.join("dists/altered/InRelease"), altered.as_bytes());
    put(&root.join("dists/other/InRelease"), &good);
    // The signed Release states another digest for the plain index than the file has.
    let mut lying = files.clone();
    lying[0].1.extend_from_slice(b"\n");
    suite("lying", &trusted, &lying);

    for home in [&trusted, &other] {
        let _ = Command::new("gpgconf")
            .arg("--homedir")
            .arg(home)
            .args(["--kill", "gpg-agent"])
            .status();
    }
    DebRepo {
        keyring,
        sha,
        release: good_text,
    }
}
