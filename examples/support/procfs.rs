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

/// CPU time (user + system) used by this process so far, to the nanosecond
/// (`CLOCK_PROCESS_CPUTIME_ID`; procfs would give 10 ms ticks), or zero off Linux.
#[allow(dead_code)]
pub fn process_cpu() -> Duration {
    #[cfg(target_os = "linux")]
    {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        Duration::new(
            t.tv_sec.max(0) as u64,
            t.tv_nsec.clamp(0, 999_999_999) as u32,
        )
    }
    #[cfg(not(target_os = "linux"))]
    {
        Duration::ZERO
    }
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

/// CPU time (user + system) of process `pid` and of its children, live or reaped, one level
/// down (a PostgreSQL postmaster and its backends), from procfs in ticks of 10 ms (Linux's
/// `USER_HZ`); zero where procfs is unavailable.
#[allow(dead_code)]
pub fn tree_cpu(pid: u32) -> Duration {
    // After the command name: state ppid … utime (12th) stime cutime cstime (15th).
    let fields = |stat: &str| -> Option<(u32, u64)> {
        let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ppid = rest.get(1)?.parse().ok()?;
        let ticks = rest
            .get(11..15)?
            .iter()
            .filter_map(|f| f.parse::<u64>().ok())
            .sum();
        Some((ppid, ticks))
    };
    let mut ticks = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| fields(&s))
        .map_or(0, |(_, t)| t);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some((ppid, t)) = std::fs::read_to_string(format!("/proc/{child}/stat"))
            .ok()
            .and_then(|s| fields(&s))
        {
            if ppid == pid {
                ticks += t;
            }
        }
    }
    Duration::from_millis(ticks * 10)
}
