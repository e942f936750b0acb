//! Process figures from Linux procfs, shared by the examples and benches (`#[path]` include).

use std::time::Duration;

/// The process's resident set size in bytes, or 0 where procfs is unavailable.
#[allow(dead_code)]
pub fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// CPU time (user + system) used by this process so far, from /proc/self/stat (10 ms
/// resolution), or zero where procfs is unavailable.
#[allow(dead_code)]
pub fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    // utime and stime, the 14th and 15th fields (11 and 12 after the command name).
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10)
}

/// Minor page faults this process has taken so far (the kernel mapping a fresh page on first
/// touch), from /proc/self/stat, or zero where procfs is unavailable.
#[allow(dead_code)]
pub fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // minflt, the 10th field (7th after the command name).
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7)?.parse().ok())
        .unwrap_or(0)
}
