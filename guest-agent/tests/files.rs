//! Protocol tests of the file requests against the real agent: chunked write/read, limits,
//! stat, listing, mkdir, remove, and confinement to `root`.

mod common;

use std::os::unix::fs::{PermissionsExt, symlink};

use airlock_proto::pb::{self, ErrorCode, FileKind, request, response};
use airlock_proto::{ClientError, MAX_DIR_ENTRIES, MAX_FILE_BYTES, MAX_FILE_CHUNK, Requests};
use common::*;

fn code(r: Result<impl std::fmt::Debug, ClientError>) -> ErrorCode {
    match r {
        Err(e) => e
            .agent_code()
            .unwrap_or_else(|| panic!("not an agent error: {e:?}")),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

fn write_req(path: &str, root: &str, data: &[u8]) -> request::Kind {
    request::Kind::WriteFile(pb::WriteFile {
        path: path.into(),
        data: data.to_vec(),
        truncate: true,
        root: root.into(),
        ..Default::default()
    })
}

#[test]
fn chunked_write_then_read_is_byte_identical() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let data: Vec<u8> = (0..(3 * MAX_FILE_CHUNK + 12345))
        .map(|i| (i * 7 + i / 251) as u8)
        .collect();
    let path = agent.dir.str("sub/dir/data.bin");
    c.write_file(&path, &data).unwrap();
    assert!(std::fs::read(agent.dir.join("sub/dir/data.bin")).unwrap() == data);
    assert!(c.read_file(&path).unwrap() == data);
}

#[test]
fn write_truncates_only_when_asked_and_writes_at_offsets() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let path = agent.dir.str("f.txt");
    c.write_file(&path, b"0123456789").unwrap();
    let patch = pb::WriteFile {
        path: path.clone(),
        offset: 2,
        data: b"ab".to_vec(),
        ..Default::default()
    };
    c.call(request::Kind::WriteFile(patch)).unwrap();
    assert_eq!(c.read_file(&path).unwrap(), b"01ab456789");
    c.write_file(&path, b"xy").unwrap();
    assert_eq!(c.read_file(&path).unwrap(), b"xy");
}

#[test]
fn new_file_gets_requested_mode_or_0644() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    c.write_file(&agent.dir.str("plain"), b"x").unwrap();
    let exe = pb::WriteFile {
        path: agent.dir.str("script.sh"),
        mode: 0o750,
        ..Default::default()
    };
    c.write_file_with(&exe, b"#!/bin/sh\necho ran\n").unwrap();
    let mode = |n| {
        std::fs::metadata(agent.dir.join(n))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode("plain"), 0o644);
    assert_eq!(mode("script.sh"), 0o750);
    let out = run(&mut c, argv(&[&agent.dir.str("script.sh")]));
    assert_eq!(out.stdout, b"ran\n");
}

#[test]
fn empty_file_roundtrips() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let path = agent.dir.str("empty");
    c.write_file(&path, b"").unwrap();
    assert_eq!(c.read_file(&path).unwrap(), b"");
}

#[test]
fn chunk_larger_than_one_mib_is_too_large() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let big = vec![0u8; MAX_FILE_CHUNK + 1];
    let r = c.call(write_req(&agent.dir.str("f"), "", &big));
    assert_eq!(code(r), ErrorCode::TooLarge);
    assert!(!agent.dir.join("f").exists());
}

#[test]
fn write_past_one_gib_is_too_large() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let req = pb::WriteFile {
        path: agent.dir.str("f"),
        offset: MAX_FILE_BYTES - 1,
        data: b"ab".to_vec(),
        ..Default::default()
    };
    assert_eq!(
        code(c.call(request::Kind::WriteFile(req))),
        ErrorCode::TooLarge
    );
}

#[test]
fn read_longer_than_one_mib_is_too_large() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let path = agent.dir.str("f");
    c.write_file(&path, b"abc").unwrap();
    let req = pb::ReadFile {
        path,
        length: MAX_FILE_CHUNK as u64 + 1,
        ..Default::default()
    };
    assert_eq!(
        code(c.call(request::Kind::ReadFile(req))),
        ErrorCode::TooLarge
    );
}

#[test]
fn read_reports_size_and_eof_per_chunk() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let path = agent.dir.str("f");
    c.write_file(&path, b"abcdef").unwrap();
    let req = |offset, length| {
        request::Kind::ReadFile(pb::ReadFile {
            path: path.clone(),
            offset,
            length,
            ..Default::default()
        })
    };
    let data = |k| match k {
        response::Kind::FileData(d) => d,
        other => panic!("{other:?}"),
    };
    let first = data(c.call(req(0, 4)).unwrap());
    assert_eq!(
        (first.data.as_slice(), first.eof, first.size),
        (&b"abcd"[..], false, 6)
    );
    let second = data(c.call(req(4, 4)).unwrap());
    assert_eq!((second.data.as_slice(), second.eof), (&b"ef"[..], true));
    let past = data(c.call(req(100, 4)).unwrap());
    assert!(past.data.is_empty() && past.eof);
}

#[test]
fn read_of_proc_file_with_size_zero_returns_its_content() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let text = c.read_file("/proc/self/status").unwrap();
    assert!(String::from_utf8_lossy(&text).contains("Name:"));
}

#[test]
fn read_of_missing_file_is_not_found_and_of_a_directory_invalid() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    assert_eq!(
        code(c.read_file(&agent.dir.str("nope"))),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(c.read_file(&agent.dir.str(""))),
        ErrorCode::InvalidArgument
    );
}

#[test]
fn relative_path_without_root_is_invalid() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    assert_eq!(
        code(c.read_file("etc/hostname")),
        ErrorCode::InvalidArgument
    );
}

#[test]
fn stat_describes_file_dir_and_symlink_itself() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    std::fs::write(agent.dir.join("f"), b"12345").unwrap();
    symlink("/nonexistent/target", agent.dir.join("link")).unwrap();
    let f = c.stat(&agent.dir.str("f")).unwrap();
    assert_eq!(f.kind, FileKind::File as i32);
    assert_eq!(f.size, 5);
    assert_eq!(f.name, agent.dir.str("f"));
    assert_eq!(f.uid, 0);
    assert!(f.mtime_ms > 1_600_000_000_000);
    let d = c.stat(agent.dir.path().to_str().unwrap()).unwrap();
    assert_eq!(d.kind, FileKind::Dir as i32);
    let l = c.stat(&agent.dir.str("link")).unwrap();
    assert_eq!(l.kind, FileKind::Symlink as i32);
    assert_eq!(l.size, "/nonexistent/target".len() as u64);
    assert_eq!(code(c.stat(&agent.dir.str("missing"))), ErrorCode::NotFound);
}

#[test]
fn list_dir_returns_sorted_entries_with_kinds() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let d = agent.dir.join("list");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("b.txt"), b"bb").unwrap();
    std::fs::create_dir(d.join("a-dir")).unwrap();
    symlink("b.txt", d.join("c-link")).unwrap();
    let listing = c.list_dir(&agent.dir.str("list")).unwrap();
    assert!(!listing.truncated);
    let got: Vec<_> = listing
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e.kind, e.size))
        .collect();
    assert_eq!(
        got,
        [
            ("a-dir", FileKind::Dir as i32, got[0].2),
            ("b.txt", FileKind::File as i32, 2),
            ("c-link", FileKind::Symlink as i32, 5),
        ]
    );
}

#[test]
fn list_dir_stops_at_ten_thousand_entries() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let d = agent.dir.join("many");
    std::fs::create_dir(&d).unwrap();
    for i in 0..=MAX_DIR_ENTRIES {
        std::fs::File::create(d.join(format!("f{i:05}"))).unwrap();
    }
    let listing = c.list_dir(&agent.dir.str("many")).unwrap();
    assert!(listing.truncated);
    assert_eq!(listing.entries.len(), MAX_DIR_ENTRIES);
    assert!(listing.entries.windows(2).all(|w| w[0].name < w[1].name));
}

#[test]
fn list_dir_of_a_file_or_missing_dir_fails() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    std::fs::write(agent.dir.join("f"), b"").unwrap();
    assert_eq!(code(c.list_dir(&agent.dir.str("f"))), ErrorCode::NotFound);
    assert_eq!(
        code(c.list_dir(&agent.dir.str("none"))),
        ErrorCode::NotFound
    );
}

#[test]
fn mkdir_with_and_without_parents() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let deep = agent.dir.str("x/y/z");
    assert_eq!(code(c.mkdir(&deep, false)), ErrorCode::NotFound);
    c.mkdir(&deep, true).unwrap();
    assert!(agent.dir.join("x/y/z").is_dir());
    // Existing: fine with parents (mkdir -p), ALREADY_EXISTS without.
    c.mkdir(&deep, true).unwrap();
    assert_eq!(code(c.mkdir(&deep, false)), ErrorCode::AlreadyExists);
    let mode = std::fs::metadata(agent.dir.join("x/y"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o7777, 0o755);
}

#[test]
fn mkdir_parents_through_a_file_is_already_exists() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    std::fs::write(agent.dir.join("file"), b"").unwrap();
    assert_eq!(
        code(c.mkdir(&agent.dir.str("file/sub"), true)),
        ErrorCode::AlreadyExists
    );
}

#[test]
fn remove_file_empty_dir_and_recursive_tree() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    std::fs::write(agent.dir.join("f"), b"x").unwrap();
    c.remove(&agent.dir.str("f"), false).unwrap();
    assert!(!agent.dir.join("f").exists());
    std::fs::create_dir(agent.dir.join("empty")).unwrap();
    c.remove(&agent.dir.str("empty"), false).unwrap();
    assert!(!agent.dir.join("empty").exists());
    std::fs::create_dir_all(agent.dir.join("tree/a/b")).unwrap();
    std::fs::write(agent.dir.join("tree/a/b/f"), b"x").unwrap();
    assert_eq!(
        code(c.remove(&agent.dir.str("tree"), false)),
        ErrorCode::InvalidArgument
    );
    assert!(agent.dir.join("tree/a/b/f").exists());
    c.remove(&agent.dir.str("tree"), true).unwrap();
    assert!(!agent.dir.join("tree").exists());
    assert_eq!(
        code(c.remove(&agent.dir.str("tree"), true)),
        ErrorCode::NotFound
    );
}

#[test]
fn recursive_remove_does_not_follow_symlinks_out_of_the_tree() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let outside = agent.dir.join("precious");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("keep"), b"x").unwrap();
    std::fs::create_dir(agent.dir.join("tree")).unwrap();
    symlink(&outside, agent.dir.join("tree/link")).unwrap();
    c.remove(&agent.dir.str("tree"), true).unwrap();
    assert!(outside.join("keep").exists());
}

#[test]
fn remove_of_a_symlink_removes_the_link_only() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    std::fs::create_dir(agent.dir.join("target")).unwrap();
    symlink(agent.dir.join("target"), agent.dir.join("link")).unwrap();
    c.remove(&agent.dir.str("link"), false).unwrap();
    assert!(agent.dir.join("target").is_dir());
    assert!(!agent.dir.join("link").exists());
}

#[test]
fn remove_of_the_root_directory_is_refused() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let req = pb::Remove {
        path: "/".into(),
        recursive: true,
        root: agent.dir.str("jail"),
        ..Default::default()
    };
    std::fs::create_dir(agent.dir.join("jail")).unwrap();
    assert_eq!(
        code(c.call(request::Kind::Remove(req))),
        ErrorCode::InvalidArgument
    );
    assert!(agent.dir.join("jail").is_dir());
}

/// A jail with a file, a symlink inside, and three ways out: `..`, an absolute symlink and a
/// relative one.
fn jail(agent: &AgentProcess) -> String {
    let j = agent.dir.join("jail");
    let setup = || -> std::io::Result<()> {
        std::fs::create_dir_all(j.join("sub"))?;
        std::fs::write(j.join("sub/inside.txt"), b"inside")?;
        std::fs::write(agent.dir.join("secret.txt"), b"secret")?;
        symlink("sub/inside.txt", j.join("ok-link"))?;
        symlink(agent.dir.path(), j.join("abs-escape"))?;
        symlink("../..", j.join("sub/rel-escape"))
    };
    setup().expect("build the jail");
    agent.dir.str("jail")
}

#[test]
fn with_root_paths_resolve_inside_it() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let root = jail(&agent);
    assert_eq!(c.read_file_in("sub/inside.txt", &root).unwrap(), b"inside");
    assert_eq!(c.read_file_in("/sub/inside.txt", &root).unwrap(), b"inside");
    assert_eq!(c.read_file_in("ok-link", &root).unwrap(), b"inside");
    assert_eq!(c.read_file_in("sub/../ok-link", &root).unwrap(), b"inside");
    // Without create_parents a missing directory is NOT_FOUND.
    assert_eq!(
        code(c.call(write_req("new/file", &root, b"w"))),
        ErrorCode::NotFound
    );
    let mut req = pb::WriteFile {
        path: "new/file".into(),
        data: b"w".to_vec(),
        create_parents: true,
        root: root.clone(),
        ..Default::default()
    };
    c.call(request::Kind::WriteFile(req.clone())).unwrap();
    assert_eq!(
        std::fs::read(agent.dir.join("jail/new/file")).unwrap(),
        b"w"
    );
    req.path = "/".into();
    assert_eq!(
        code(c.call(request::Kind::WriteFile(req))),
        ErrorCode::InvalidArgument
    );
}

#[test]
fn with_root_dotdot_escape_is_path_escape() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let root = jail(&agent);
    assert_eq!(
        code(c.read_file_in("../secret.txt", &root)),
        ErrorCode::PathEscape
    );
    assert_eq!(
        code(c.read_file_in("sub/../../secret.txt", &root)),
        ErrorCode::PathEscape
    );
    let w = c.call(write_req("../planted", &root, b"x"));
    assert_eq!(code(w), ErrorCode::PathEscape);
    assert!(!agent.dir.join("planted").exists());
    let mk = pb::Mkdir {
        path: "../made".into(),
        parents: true,
        root: root.clone(),
        ..Default::default()
    };
    assert_eq!(
        code(c.call(request::Kind::Mkdir(mk))),
        ErrorCode::PathEscape
    );
    assert!(!agent.dir.join("made").exists());
}

#[test]
fn with_root_symlink_escape_is_path_escape() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let root = jail(&agent);
    for path in ["abs-escape/secret.txt", "sub/rel-escape/secret.txt"] {
        assert_eq!(
            code(c.read_file_in(path, &root)),
            ErrorCode::PathEscape,
            "{path}"
        );
    }
    let w = c.call(write_req("abs-escape/planted", &root, b"x"));
    assert_eq!(code(w), ErrorCode::PathEscape);
    assert!(!agent.dir.join("planted").exists());
    let list = request::Kind::ListDir(pb::ListDir {
        path: "abs-escape".into(),
        root: root.clone(),
        ..Default::default()
    });
    assert_eq!(code(c.call(list)), ErrorCode::PathEscape);
    let rm = request::Kind::Remove(pb::Remove {
        path: "abs-escape/secret.txt".into(),
        recursive: false,
        root: root.clone(),
        ..Default::default()
    });
    assert_eq!(code(c.call(rm)), ErrorCode::PathEscape);
    assert!(agent.dir.join("secret.txt").exists());
}

#[test]
fn with_root_an_escaping_symlink_itself_can_be_stat_and_removed() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let root = jail(&agent);
    let stat = request::Kind::Stat(pb::Stat {
        path: "abs-escape".into(),
        root: root.clone(),
        ..Default::default()
    });
    match c.call(stat).unwrap() {
        response::Kind::FileStat(s) => assert_eq!(s.kind, FileKind::Symlink as i32),
        other => panic!("{other:?}"),
    }
    let rm = request::Kind::Remove(pb::Remove {
        path: "abs-escape".into(),
        recursive: true,
        root,
        ..Default::default()
    });
    c.call(rm).unwrap();
    assert!(agent.dir.join("secret.txt").exists());
    assert!(agent.dir.join("jail/sub").exists());
}

#[test]
fn missing_root_is_not_found() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let r = c.read_file_in("f", &agent.dir.str("no-such-root"));
    assert_eq!(code(r), ErrorCode::NotFound);
}

#[test]
fn reading_a_fifo_is_refused_without_blocking() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let fifo = agent.dir.join("fifo");
    let status = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        code(c.read_file(fifo.to_str().unwrap())),
        ErrorCode::InvalidArgument
    );
    // The connection still answers.
    c.ping().unwrap();
}

#[test]
fn a_read_names_the_file_it_opened_symlinks_resolved() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    std::fs::create_dir_all(agent.dir.join("home/.ssh")).unwrap();
    std::fs::write(agent.dir.join("home/.ssh/id_rsa"), b"private").unwrap();
    symlink(".ssh/id_rsa", agent.dir.join("home/notes")).unwrap();
    let mut read = |root: &str, path: &str| match c.call(request::Kind::ReadFile(pb::ReadFile {
        path: path.into(),
        root: root.into(),
        ..Default::default()
    })) {
        Ok(response::Kind::FileData(d)) => d,
        other => panic!("{other:?}"),
    };
    let want = agent.dir.join("home/.ssh/id_rsa");
    let d = read("", &agent.dir.str("home/notes"));
    assert_eq!(
        (d.data.as_slice(), d.resolved.as_str()),
        (b"private".as_slice(), want.to_str().unwrap())
    );
    // Inside a root as well: the path is the guest's, not the root's.
    let d = read(&agent.dir.str("home"), "notes");
    assert_eq!(d.resolved, want.to_str().unwrap());
}
