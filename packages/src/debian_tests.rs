use std::io::Write as _;

use super::*;

const SHA_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const SHA_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

fn release_text() -> String {
    format!(
        "Origin: Debian\nSuite: stable\nCodename: bookworm\nAcquire-By-Hash: yes\n\
         MD5Sum:\n 0123 10 main/binary-amd64/Packages\n\
         SHA256:\n {SHA_A} 1234 main/binary-amd64/Packages\n {SHA_B} 345 main/binary-amd64/Packages.xz\n"
    )
}

#[test]
fn a_release_lists_its_files_and_answers_by_path_and_by_hash() {
    let r = parse_release(&release_text()).unwrap();
    assert!(r.is_of("bookworm") && r.is_of("stable") && !r.is_of("trixie"));
    assert_eq!(r.files.len(), 2);
    let (path, l) = r.lookup("main/binary-amd64/Packages.xz").unwrap();
    assert_eq!((path, l.size), ("main/binary-amd64/Packages.xz", 345));
    let (path, _) = r
        .lookup(&format!("main/binary-amd64/by-hash/SHA256/{SHA_A}"))
        .unwrap();
    assert_eq!(path, "main/binary-amd64/Packages");
    // A digest listed in another directory does not answer for this one.
    assert!(
        r.lookup(&format!("contrib/binary-amd64/by-hash/SHA256/{SHA_A}"))
            .is_none()
    );
    assert!(r.lookup("main/binary-amd64/Release").is_none());
}

#[test]
fn a_release_without_sha256_or_with_a_bad_line_is_refused() {
    assert!(parse_release("Suite: x\nMD5Sum:\n 01 1 main/x\n").is_err());
    for line in [
        format!(" {SHA_A} 12 ../../etc/passwd"),
        format!(" {SHA_A} twelve main/x"),
        " nothex 12 main/x".to_owned(),
        format!(" {SHA_A} 12 main/x extra"),
    ] {
        let t = format!("Suite: x\nSHA256:\n{line}\n");
        assert!(parse_release(&t).is_err(), "{line}");
    }
}

#[test]
fn packages_give_each_deb_its_file_and_digest() {
    let text = format!(
        "Package: hello\nVersion: 2.10-3\nArchitecture: amd64\nDescription: greets\n the world\n\
         Filename: pool/main/h/hello/hello_2.10-3_amd64.deb\nSize: 53000\nSHA256: {SHA_A}\n\n\
         Package: libstdc++6\nVersion: 12.2\nArchitecture: amd64\n\
         Filename: pool/main/g/gcc-12/libstdc++6_12.2_amd64.deb\nSize: 7\nSHA256: {SHA_B}\n\n\
         Package: virtual-only\nVersion: 1\n"
    );
    let debs = parse_packages(&text).unwrap();
    assert_eq!(debs.len(), 2);
    assert_eq!(debs[0].package, "hello");
    assert_eq!(debs[0].version, "2.10-3");
    assert_eq!(debs[0].filename, "pool/main/h/hello/hello_2.10-3_amd64.deb");
    assert_eq!(debs[0].size, 53000);
    assert_eq!(debs[1].package, "libstdc++6");
    assert_eq!(debs[1].sha256, SHA_B);
}

#[test]
fn a_deb_outside_the_pool_or_with_a_bad_name_is_refused() {
    for (name, file) in [
        ("hello", "../../etc/shadow"),
        ("hello", "dists/x/hello.deb"),
        ("hello", "pool/main/../../x.deb"),
        ("Hello", "pool/main/h/hello.deb"),
    ] {
        let t = format!("Package: {name}\nFilename: {file}\nSize: 1\nSHA256: {SHA_A}\n");
        assert!(parse_packages(&t).is_err(), "{name} {file}");
    }
}

#[test]
fn names_and_paths() {
    assert!(valid_name("g++"));
    assert!(valid_name("libc6"));
    assert!(!valid_name("x"));
    assert!(!valid_name("-x"));
    assert!(!valid_name("Upper"));
    assert!(valid_path("main/binary-amd64/Packages.xz"));
    assert!(!valid_path("main/../x"));
    assert!(!valid_path("/main"));
    assert!(!valid_path("main//x"));
    assert!(is_packages_index("main/binary-amd64/Packages.xz"));
    assert!(is_packages_index("main/binary-all/Packages"));
    assert!(!is_packages_index("main/i18n/Translation-en"));
    assert!(!is_packages_index("main/source/Sources.xz"));
}

#[test]
fn only_a_single_clearsigned_message_passes() {
    let ok = "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA256\n\nSuite: x\n\
              -----BEGIN PGP SIGNATURE-----\n\nabc\n-----END PGP SIGNATURE-----\n";
    assert!(check_clearsigned(ok.as_bytes()).is_ok());
    assert!(check_clearsigned(format!("Suite: evil\n{ok}").as_bytes()).is_err());
    assert!(check_clearsigned(format!("{ok}Suite: evil\n").as_bytes()).is_err());
    assert!(check_clearsigned(format!("{ok}{ok}").as_bytes()).is_err());
    assert!(check_clearsigned(b"Suite: x\n").is_err());
}

#[test]
fn the_signature_verdict_follows_gpgv_status_lines() {
    let valid = |hash: u32| {
        format!(
            "[GNUPG:] NEWSIG\n[GNUPG:] GOODSIG A58 Test\n\
             [GNUPG:] VALIDSIG 7E19 2026-12-06 1796578989 0 4 0 22 {hash} 01 7E19\n"
        )
    };
    assert_eq!(signature_verdict(&valid(8)).unwrap(), vec!["7E19"]);
    let e = signature_verdict(&valid(2)).unwrap_err();
    assert!(e.contains("weak digest"), "{e}");
    let e = signature_verdict("[GNUPG:] NEWSIG\n[GNUPG:] BADSIG A58 Test\n").unwrap_err();
    assert!(e.contains("BAD signature"), "{e}");
    let e = signature_verdict("[GNUPG:] ERRSIG A58 22 8 01 1 9 X\n[GNUPG:] NO_PUBKEY A58\n")
        .unwrap_err();
    assert!(e.contains("outside the registry's keyring"), "{e}");
    // Debian signs with several keys: one unknown beside a good one is passed over.
    let two = format!("[GNUPG:] NO_PUBKEY B00\n{}", valid(10));
    assert!(signature_verdict(&two).is_ok());
    let e = signature_verdict(&format!("{}[GNUPG:] EXPKEYSIG A58 T\n", valid(8))).unwrap_err();
    assert!(e.contains("expired key"), "{e}");
    assert!(signature_verdict("").is_err());
}

#[test]
fn indexes_unpack_by_suffix_within_the_limit() {
    let text = b"Package: hello\n".repeat(1000);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&text).unwrap();
    let gz = gz.finish().unwrap();
    assert_eq!(decompress("x/Packages.gz", &gz, 1 << 20).unwrap(), text);
    let mut xz = Vec::new();
    lzma_rs::xz_compress(&mut &text[..], &mut xz).unwrap();
    assert_eq!(decompress("x/Packages.xz", &xz, 1 << 20).unwrap(), text);
    assert_eq!(decompress("x/Packages", &text, 1 << 20).unwrap(), text);
    // A bomb stops at the limit.
    for (name, body) in [("x/Packages.gz", &gz), ("x/Packages.xz", &xz)] {
        let e = decompress(name, body, 1000).unwrap_err();
        assert!(
            e.to_string().contains("more than 1000 bytes"),
            "{name}: {e}"
        );
    }
    assert!(decompress("x/Packages.xz", b"not xz", 1 << 20).is_err());
}
