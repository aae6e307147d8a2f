//! `airlock-test-template`: builds this run's shared test template (the one `shared.rs` hands
//! every test process whose settings do not change what a build makes) and keeps it in the
//! template cache, then exits. `tests/run.sh` starts it beside the unit tests and the fuzz
//! smoke, so that the template's cold boot (a minute or two on nested-KVM build machines) is
//! not spent at the head of a lane of system tests, which import it instead. Prints the cache
//! entry; does nothing where the cache is off (`AIRLOCK_TEST_TEMPLATE_CACHE=0`).
#![allow(clippy::unwrap_used)] // a failed step is a failed run

use airlock_system_tests::shared;

fn main() {
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
