//! `airlock-test-template`: builds this run's shared test template (the one `shared.rs` hands
//! every test process whose settings do not change what a build makes) and keeps it in the
//! template cache, then exits. `tests/run.sh` starts it beside the unit tests and the fuzz
//! smoke, so that the template's cold boot (a minute or two on nested-KVM build machines) is
//! not spent at the head of a lane of system tests, which import it instead. Prints the cache
//! entry; does nothing where the cache is off (`AIRLOCK_TEST_TEMPLATE_CACHE=0`).
//!
//! With `--interpreter`, the `code-interpreter` template instead (`interp.rs`), kept across
//! runs: imported when kept, else built (tens of minutes on nested KVM), while `tests/run.sh`
//! goes on with the other tests; `tests/interpreter.rs` waits for it. `--interpreter-dir` prints
//! where it is kept.
#![allow(clippy::unwrap_used)] // a failed step is a failed run

use airlock_system_tests::{interp, shared};

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("--interpreter") => return interpreter(),
        // Where the code-interpreter template is kept for these sources, kernel and image.
        Some("--interpreter-dir") => {
            return println!("{}", interp::kept_dir().unwrap_or_default().display());
        }
        _ => {}
    }
    let Some(cache) = shared::template_cache_dir() else {
        println!(
            "the test template cache is off (AIRLOCK_TEST_TEMPLATE_CACHE=0): nothing to build"
        );
        return;
    };
    let t0 = std::time::Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_serial, s) = rt.block_on(shared::scenario(""));
    assert!(
        cache.join(shared::EXPORT_RECORD).is_file(),
        "template {} was not kept in {}:\n{}",
        s.template.id,
        cache.display(),
        s.log_tail()
    );
    println!(
        "template {} kept in {} ({:.1} s)",
        s.template.id,
        cache.display(),
        t0.elapsed().as_secs_f64()
    );
}

fn interpreter() {
    let Some(kept) = interp::kept_dir() else {
        println!("the template cache is off (AIRLOCK_TEST_TEMPLATE_CACHE=0): nothing to build");
        return;
    };
    let t0 = std::time::Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (_serial, s, t) = rt.block_on(interp::shared_with_template("", ""));
    assert!(
        kept.join(shared::EXPORT_RECORD).is_file(),
        "template {} was not kept in {}:\n{}",
        t.id,
        kept.display(),
        s.log_tail()
    );
    println!(
        "template {} ({}) kept in {} ({:.1} s)",
        t.name,
        t.id,
        kept.display(),
        t0.elapsed().as_secs_f64()
    );
}
