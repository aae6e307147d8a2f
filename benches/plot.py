#!/usr/bin/env python3
"""Draws benchmark distributions as one PNG: a CDF per configuration, side by side.

Usage: plot.py OUT.png LABEL=RESULT.json [LABEL=RESULT.json ...]

Each RESULT.json is the last line a bench printed (`benches/run.sh create`, `exec` or `settle`), for
example one run before a change and one after. Every distribution found in them gets a panel
(create -> ready at each concurrency, with its guest's share; exec round trip of `true`;
stdout throughput), with one curve per LABEL, so before and after compare at a glance.
Needs matplotlib (`benches/run.sh plot` installs it into a venv of its own).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def distributions(result):
    """(panel title, unit, samples, curve suffix) for every distribution in one bench result."""
    out = []
    if result.get("bench") == "create" or any(k.startswith("create_ms_c") for k in result):
        for key in sorted(k for k in result if k.startswith("create_ms_c")):
            level = key[len("create_ms_c"):]
            r = result[key]
            out.append((f"create -> ready, concurrency {level}", "ms", r.get("samples", []), ""))
            out.append((f"guest's share, concurrency {level}", "ms", r.get("guest_samples", []),
                        ""))
        d = result.get("daemon_exec", {})
        if d:
            out.append(("exec of `true` through airlockd", "ms",
                        d.get("exec_true_ms", {}).get("samples", []), ""))
            out.append(("ReadFile through airlockd", "ms",
                        d.get("read_file_ms", {}).get("samples", []), ""))
    if result.get("bench") == "settle":
        for kind in ("unsettled", "settled"):
            r = result.get(kind, {})
            out.append(("restore -> agent Ready of a clone", "ms",
                        r.get("restore_to_ready_ms", {}).get("samples", []), f" {kind}"))
    if result.get("bench") == "exec":
        out.append(("exec round trip of `true`", "ms", result["exec_true_ms"].get("samples", []),
                    ""))
        connect = result.get("connect_ready_ms", {}).get("samples", [])
        out.append(("a fresh agent connection (handshake + Ready)", "ms", connect, ""))
        runs = result.get("stdout_mib_s_runs", {})
        out.append((f"stdout ({result.get('stdout_mib', '?')} MiB)", "MiB/s",
                    runs.get("samples", []), ""))
    return [d for d in out if d[2]]


def main(argv):
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        sys.exit(__doc__)
    out_png = argv[1]
    series = []  # (label, [(title, unit, samples, suffix)])
    for arg in argv[2:]:
        label, path = arg.split("=", 1)
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.strip().startswith("{")]
        series.append((label, distributions(json.loads(lines[-1]))))
    titles = []
    for _, dists in series:
        for title, unit, _, _ in dists:
            if (title, unit) not in titles:
                titles.append((title, unit))
    if not titles:
        sys.exit("no distributions with samples in the given results")
    cols = min(3, len(titles))
    rows = (len(titles) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for i, (title, unit) in enumerate(titles):
        ax = axes[i // cols][i % cols]
        for label, dists in series:
            for t, u, samples, suffix in dists:
                if (t, u) != (title, unit):
                    continue
                xs = sorted(samples)
                ys = [(k + 1) / len(xs) for k in range(len(xs))]
                p50 = xs[(len(xs) - 1) // 2]
                ax.step([xs[0]] + xs, [0.0] + ys, where="post", label=f"{label}{suffix} (p50 {p50:.4g} {unit}, n={len(xs)})")
        ax.set_title(title)
        ax.set_xlabel(unit)
        ax.set_ylabel("fraction of runs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    for j in range(len(titles), rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(out_png)


if __name__ == "__main__":
    main(sys.argv)
