//! Compiles the seccomp filters in `seccomp/<arch>.json` to BPF at build time (seccompiler), one
//! `<class>.bpf` file per thread class in `$OUT_DIR/seccomp/`, which `src/seccomp.rs` embeds.
//!
//! The JSON is seccompiler's format plus one key of our own: `common`, whose `filter` rules are
//! appended to every other filter (the Rust runtime and glibc need the same few calls on every
//! thread), and a `comment` on each filter. Each instruction is written as 8 little-endian bytes
//! (`code: u16, jt: u8, jf: u8, k: u32`), the layout of `struct sock_filter`.

use std::path::PathBuf;

use serde_json::Value;

fn main() {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let target = match arch.as_str() {
        "x86_64" => seccompiler::TargetArch::x86_64,
        other => panic!("no seccomp filters for target architecture {other:?}"),
    };
    let json_path = format!("seccomp/{arch}.json");
    println!("cargo:rerun-if-changed={json_path}");
    let text = std::fs::read_to_string(&json_path).expect("read the seccomp filters");
    let merged = merge_common(serde_json::from_str(&text).expect("seccomp JSON syntax"));
    let programs = seccompiler::compile_from_json(merged.to_string().as_bytes(), target)
        .unwrap_or_else(|e| panic!("{json_path}: {e}"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("seccomp");
    std::fs::create_dir_all(&out).expect("create $OUT_DIR/seccomp");
    for (class, program) in programs {
        let mut bytes = Vec::with_capacity(program.len() * 8);
        for insn in &program {
            bytes.extend_from_slice(&insn.code.to_le_bytes());
            bytes.push(insn.jt);
            bytes.push(insn.jf);
            bytes.extend_from_slice(&insn.k.to_le_bytes());
        }
        std::fs::write(out.join(format!("{class}.bpf")), bytes).expect("write a BPF program");
    }
}

/// Appends the `common` rules to every filter and drops the keys seccompiler does not know.
fn merge_common(mut doc: Value) -> Value {
    let map = doc.as_object_mut().expect("the top level is an object");
    let common = map
        .remove("common")
        .and_then(|c| c.get("filter").cloned())
        .and_then(|f| f.as_array().cloned())
        .unwrap_or_default();
    for (name, filter) in map.iter_mut() {
        let f = filter
            .as_object_mut()
            .unwrap_or_else(|| panic!("filter {name} is not an object"));
        f.remove("comment");
        let rules = f
            .get_mut("filter")
            .and_then(Value::as_array_mut)
            .unwrap_or_else(|| panic!("filter {name} has no rule list"));
        rules.extend(common.iter().cloned());
    }
    doc
}
