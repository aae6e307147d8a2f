//! The event log's tests: its own store each, no daemon.

#![allow(clippy::unwrap_used)]
use super::*;

/// A store of its own for each test.
fn store() -> Arc<Store> {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "airlock-events-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Arc::new(Store::open(&dir.join("airlock.db")).unwrap())
}

fn dns(name: &str, time_unix_ms: i64) -> EgressEvent {
    EgressEvent {
        kind: EgressKind::Dns as i32,
        name: name.into(),
        time_unix_ms,
        ..Default::default()
    }
}

fn install(outcome: InstallOutcome) -> InstallEvent {
    InstallEvent {
        registry: "pypi".into(),
        package: "demo".into(),
        outcome: outcome as i32,
        ..Default::default()
    }
}

#[test]
fn appended_events_are_numbered_and_read_back_by_seq_time_and_kind() {
    let store = store();
    let log = SandboxLog::<EgressEvent>::new(store.clone(), "t", "sb-q", 100);
    log.append(dns("a.example", 1_000));
    log.append(EgressEvent {
        kind: EgressKind::Tcp as i32,
        time_unix_ms: 2_000,
        ..Default::default()
    });
    log.append(dns("b.example", 3_000));
    let all = Query::default();
    let (events, dropped) = read::<EgressEvent>(&store, "sb-q", &all).unwrap();
    assert_eq!(dropped, 0);
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    let q = |q: Query| -> Vec<u64> {
        let (events, _) = read::<EgressEvent>(&store, "sb-q", &q).unwrap();
        events.iter().map(|e| e.seq).collect()
    };
    let kinds = vec!["dns".to_owned()];
    assert_eq!(
        q(Query {
            kinds: kinds.clone(),
            ..all.clone()
        }),
        [1, 3]
    );
    assert_eq!(
        q(Query {
            kinds,
            after_seq: 1,
            ..all.clone()
        }),
        [3]
    );
    assert_eq!(
        q(Query {
            since_ms: 2_000,
            ..all.clone()
        }),
        [2, 3]
    );
    assert_eq!(
        q(Query {
            until_ms: 2_000,
            ..all.clone()
        }),
        [1]
    );
    assert_eq!(
        q(Query {
            limit: 2,
            ..all.clone()
        }),
        [1, 2]
    );
    // Another log of the same sandbox, and another sandbox's, are apart.
    let installs = SandboxLog::<InstallEvent>::new(store.clone(), "t", "sb-q", 100);
    installs.append(install(InstallOutcome::Denied));
    installs.append(install(InstallOutcome::Fetched));
    let (got, _) = read::<InstallEvent>(&store, "sb-q", &all).unwrap();
    assert_eq!(got.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(
        (got[0].tenant.as_str(), got[0].sandbox_id.as_str()),
        ("t", "sb-q")
    );
    let denied = Query {
        kinds: vec!["denied".into()],
        ..all.clone()
    };
    let (got, _) = read::<InstallEvent>(&store, "sb-q", &denied).unwrap();
    assert_eq!(got.len(), 1);
    assert!(
        read::<EgressEvent>(&store, "sb-other", &all)
            .unwrap()
            .0
            .is_empty()
    );
    // They go with the sandbox's record.
    store.delete_sandbox("sb-q").unwrap();
    assert!(
        read::<EgressEvent>(&store, "sb-q", &all)
            .unwrap()
            .0
            .is_empty()
    );
    assert!(
        read::<InstallEvent>(&store, "sb-q", &all)
            .unwrap()
            .0
            .is_empty()
    );
}

#[test]
fn a_full_log_counts_what_it_drops_and_an_adopted_one_goes_on() {
    let store = store();
    let log = SandboxLog::<InstallEvent>::new(store.clone(), "t", "sb-cap", 2);
    for _ in 0..5 {
        log.append(install(InstallOutcome::Cached));
    }
    let (events, dropped) = read::<InstallEvent>(&store, "sb-cap", &Query::default()).unwrap();
    assert_eq!(events.len(), 2);
    // The first drop is written at once, the rest when the log closes.
    assert_eq!(dropped, 1);
    drop(log);
    let (_, dropped) = read::<InstallEvent>(&store, "sb-cap", &Query::default()).unwrap();
    assert_eq!(dropped, 3);
    // Adopted: its seq goes on, and with a larger cap it has room again.
    let again = SandboxLog::<InstallEvent>::resume(store.clone(), "t", "sb-cap", 3);
    again.append(install(InstallOutcome::Fetched));
    again.append(install(InstallOutcome::Fetched));
    drop(again);
    let (events, dropped) = read::<InstallEvent>(&store, "sb-cap", &Query::default()).unwrap();
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(dropped, 4);
}

#[test]
fn select_pages_what_the_query_wants() {
    let events = (1..=5u64).map(|seq| {
        Ok(AuditEvent {
            seq,
            time_unix_ms: seq as i64 * 10,
            kind: if seq % 2 == 0 { "exec.start" } else { "egress" }.into(),
            ..Default::default()
        })
    });
    let q = Query {
        kinds: vec!["egress".into()],
        limit: 2,
        ..Default::default()
    };
    let (page, next) = select(&q, events.clone()).unwrap();
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(
        next, 3,
        "a full page with more to come names where to go on"
    );
    let q = Query { limit: 3, ..q };
    assert_eq!(select(&q, events).unwrap().1, 0);
    assert_eq!(Query::default().page(), DEFAULT_PAGE as usize);
    let huge = Query {
        limit: u32::MAX,
        ..Default::default()
    };
    assert_eq!(huge.page(), MAX_PAGE as usize);
}

#[test]
fn logs_of_an_older_daemon_are_migrated() {
    let store = store();
    {
        let db = store.db();
        db.execute_batch(
            "CREATE TABLE egress_events (sandbox_id TEXT NOT NULL, seq INTEGER NOT NULL, \
             event BLOB NOT NULL, PRIMARY KEY (sandbox_id, seq));
             CREATE TABLE egress_dropped (sandbox_id TEXT PRIMARY KEY, n INTEGER NOT NULL);
             CREATE TABLE install_events (sandbox_id TEXT NOT NULL, seq INTEGER NOT NULL, \
             event BLOB NOT NULL, PRIMARY KEY (sandbox_id, seq));
             CREATE TABLE install_dropped (sandbox_id TEXT PRIMARY KEY, n INTEGER NOT NULL);",
        )
        .unwrap();
        let mut e = dns("old.example", 5_000);
        e.seq = 7;
        db.execute(
            "INSERT INTO egress_events VALUES ('sb-old', 7, ?1)",
            params![e.encode_to_vec()],
        )
        .unwrap();
        db.execute("INSERT INTO egress_dropped VALUES ('sb-old', 9)", [])
            .unwrap();
        let mut i = install(InstallOutcome::Denied);
        i.seq = 1;
        db.execute(
            "INSERT INTO install_events VALUES ('sb-old', 1, ?1)",
            params![i.encode_to_vec()],
        )
        .unwrap();
    }
    assert_eq!(migrate(&store).unwrap(), 2);
    assert_eq!(migrate(&store).unwrap(), 0, "the old tables are gone");
    let dns_only = Query {
        kinds: vec!["dns".into()],
        since_ms: 5_000,
        ..Default::default()
    };
    let (events, dropped) = read::<EgressEvent>(&store, "sb-old", &dns_only).unwrap();
    assert_eq!(
        (events[0].seq, events[0].name.as_str(), dropped),
        (7, "old.example", 9)
    );
    let denied = Query {
        kinds: vec!["denied".into()],
        ..Default::default()
    };
    assert_eq!(
        read::<InstallEvent>(&store, "sb-old", &denied)
            .unwrap()
            .0
            .len(),
        1
    );
    // A resumed log goes on after the migrated tail.
    let log = SandboxLog::<EgressEvent>::resume(store.clone(), "t", "sb-old", 100);
    log.append(dns("new.example", 0));
    let (events, _) = read::<EgressEvent>(&store, "sb-old", &Query::default()).unwrap();
    assert_eq!(events.last().unwrap().seq, 8);
    assert!(events.last().unwrap().time_unix_ms > 0);
}
