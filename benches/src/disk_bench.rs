//! `airlock-create-bench --compare-disk`: two daemons side by side, one building its template
//! with a writable root (a copy-on-write disk over the base image: the default) and one with
//! `writable_root = false` (a read-only root, /tmp a tmpfs). `runs` creates each, alternating,
//! as `--compare-jail` does (the host's share with and without the writable layer); then, in
//! one sandbox of each, `DD_RUNS` times: `dd` writes `DD_MIB` MiB (`conv=fsync`) where the
//! sandbox writes (`/root` on the writable root, `/tmp` on the tmpfs), drops the guest's page
//! cache and reads it back, each rate as `dd` reports it (MB/s in the guest); and the same on a
//! volume (`volume`: a sandbox of the writable-root daemon with a volume mounted at /data).

use super::net_run::guest_exec;
use super::*;

/// Writes and reads back `mib` MiB at `path` in the guest; prints `write MB/s` and `read MB/s`
/// as `dd` reports them (its last line: `... copied, T s, R MB/s`).
fn dd_script(path: &str, mib: usize) -> String {
    format!(
        "rate() {{ tail -n1 | sed 's/.*, //'; }}
dd if=/dev/zero of={path} bs=1M count={mib} conv=fsync 2>&1 | rate
sync; echo 3 > /proc/sys/vm/drop_caches
dd if={path} of=/dev/null bs=1M 2>&1 | rate
rm -f {path}"
    )
}

/// `12.3 MB/s` (or kB/s, GB/s) in MiB/s.
fn mib_per_s(line: &str) -> Option<f64> {
    let (n, unit) = line.trim().split_once(' ')?;
    let n: f64 = n.replace(',', ".").parse().ok()?;
    let scale = match unit {
        "kB/s" => 1e3,
        "MB/s" => 1e6,
        "GB/s" => 1e9,
        "B/s" => 1.0,
        _ => return None,
    };
    Some((n * scale / f64::from(1u32 << 20) * 1000.0).round() / 1000.0)
}

/// The bench: two daemons, with and without a writable root; their creates side by side, then
/// `dd` where each sandbox writes and on a volume.
pub async fn compare_disk(a: Args) -> Result<serde_json::Value, String> {
    let dir = std::env::temp_dir().join(format!("airlock-disk-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let common = "pool_size = 2\nmax_sandboxes = 8\n";
    let layered = start_daemon(&a, &dir.join("layer"), "layer", common).await?;
    let tmpfs = start_daemon(
        &a,
        &dir.join("tmpfs"),
        "tmpfs",
        &format!("{common}writable_root = false\n"),
    )
    .await?;
    make_template(&layered.1).await?;
    make_template(&tmpfs.1).await?;
    let sides = [("writable_root", &layered), ("read_only_root", &tmpfs)];
    let mut out = serde_json::Map::new();
    out.insert("bench".into(), "create_disk".into());
    let p50 = alternate(a.runs, &sides, &mut out).await?;
    out.insert("layer_overhead_ms_p50".into(), p50_diff(&p50, 0));
    out.insert("layer_host_overhead_ms_p50".into(), p50_diff(&p50, 1));
    let on_volume = volume_request(&layered.1, a.dd_mib).await?;
    let runs = [
        (
            "writable_root",
            &layered.1,
            "/root/dd.bin",
            CreateSandboxRequest::default(),
        ),
        (
            "read_only_root",
            &tmpfs.1,
            "/tmp/dd.bin",
            CreateSandboxRequest::default(),
        ),
        ("volume", &layered.1, "/data/dd.bin", on_volume),
    ];
    for (name, c, path, req) in runs {
        let mut c = c.clone();
        let sb = c
            .create_sandbox(req)
            .await
            .map_err(|e| format!("create: {}", e.message()))?
            .into_inner();
        let (write, read) = dd_rates(&mut c, &sb.id, name, path, &a).await?;
        destroy_all(&c, std::slice::from_ref(&sb)).await;
        let side = out
            .entry(name)
            .or_insert_with(|| serde_json::json!({}))
            .as_object_mut()
            .ok_or("no side")?;
        side.insert("dd_path".into(), path.into());
        side.insert("dd_mib".into(), a.dd_mib.into());
        side.insert("write_mib_s".into(), summary(&write));
        side.insert("read_mib_s".into(), summary(&read));
    }
    out.insert("host".into(), host_facts());
    drop(layered);
    drop(tmpfs);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(serde_json::Value::Object(out))
}

/// Bench step: the volume `bench` of the writable-root daemon `c`, made; a create that mounts
/// it at /data.
async fn volume_request(c: &Client, dd_mib: usize) -> Result<CreateSandboxRequest, String> {
    let mut lc = c.clone();
    lc.create_volume(CreateVolumeRequest {
        name: "bench".into(),
        size_mib: (dd_mib as u32 * 4).max(64),
    })
    .await
    .map_err(|e| format!("create volume: {}", e.message()))?;
    Ok(CreateSandboxRequest {
        volumes: vec![VolumeAttachment {
            name: "bench".into(),
            mount_path: "/data".into(),
            read_only: false,
        }],
        ..Default::default()
    })
}

/// Bench step: `a.dd_runs` runs of `dd` at `path` in sandbox `id` of side `name`; their write
/// and read rates.
async fn dd_rates(
    c: &mut Client,
    id: &str,
    name: &str,
    path: &str,
    a: &Args,
) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (mut write, mut read) = (Vec::new(), Vec::new());
    for run in 0..a.dd_runs {
        let mut text = Vec::new();
        let argv = ["sh", "-c", &dd_script(path, a.dd_mib)].map(String::from);
        let code = guest_exec(c, id, &argv, |d| text.extend_from_slice(d)).await?;
        let text = String::from_utf8_lossy(&text).into_owned();
        let rates: Vec<f64> = text.lines().filter_map(mib_per_s).collect();
        if code != 0 || rates.len() != 2 {
            return Err(format!("dd in {name} (exit {code}): {text}"));
        }
        log(&format!("{name} dd {}/{}: {text:?}", run + 1, a.dd_runs));
        write.push(rates[0]);
        read.push(rates[1]);
    }
    Ok((write, read))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dd_rates_are_read_in_mib_per_second() {
        assert_eq!(mib_per_s("3.1 MB/s"), Some(2.956));
        assert_eq!(mib_per_s("950 kB/s"), Some(0.906));
        assert_eq!(mib_per_s("1,2 GB/s"), Some(1144.409));
        assert_eq!(mib_per_s("16777216 bytes (17 MB, 16 MiB) copied"), None);
    }
}
