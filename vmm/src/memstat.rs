//! The VMM's own memory footprint: resident memory of the process outside guest RAM.

/// Sums `Rss:` of every mapping in `smaps` (the text of `/proc/<pid>/smaps`) that does not
/// overlap one of `excluded` (host `[start, start + len)` ranges, i.e. guest memory). KiB.
pub fn rss_excluding_kib(smaps: &str, excluded: &[(u64, u64)]) -> u64 {
    let mut total = 0;
    let mut skip = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((a, b)) = range.split_once('-')
            && let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            skip = excluded.iter().any(|&(s, l)| start < s + l && s < end);
            continue;
        }
        if !skip
            && let Some(rest) = line.strip_prefix("Rss:")
            && let Some(kib) = rest
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        {
            total += kib;
        }
    }
    total
}

/// This process's resident KiB outside `excluded`, or `None` if `/proc/self/smaps` is unreadable.
pub fn self_rss_excluding_kib(excluded: &[(u64, u64)]) -> Option<u64> {
    std::fs::read_to_string("/proc/self/smaps")
        .ok()
        .map(|s| rss_excluding_kib(&s, excluded))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0a0000000-55d0a0100000 r-xp 00000000 fd:01 123 /usr/bin/airlock-vmm
Size:               1024 kB
Rss:                 800 kB
7f0000000000-7f0010000000 rw-p 00000000 00:00 0
Size:             262144 kB
Rss:              100000 kB
7fff00000000-7fff00021000 rw-p 00000000 00:00 0 [stack]
Rss:                  12 kB
";

    #[test]
    fn guest_memory_mapping_is_excluded() {
        let guest = [(0x7f00_0000_0000, 0x1000_0000)];
        assert_eq!(rss_excluding_kib(SMAPS, &guest), 812);
        assert_eq!(rss_excluding_kib(SMAPS, &[]), 100_812);
    }

    #[test]
    fn garbage_input_counts_nothing() {
        assert_eq!(rss_excluding_kib("Rss: lots\nnonsense", &[]), 0);
    }
}
