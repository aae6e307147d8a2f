"""Statistics shared by the Python benchmarks: percentiles by linear interpolation and one
summary shape (runs, p50/p90/p99, mean, min, max, samples)."""
import statistics


def pct(values, p):
    s = sorted(values)
    if not s:
        return None
    k = (len(s) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(values, digits=1):
    return {
        "runs": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "mean": statistics.fmean(values) if values else None,
        "min": min(values) if values else None,
        "max": max(values) if values else None,
        "samples": [round(v, digits) for v in values],
    }
