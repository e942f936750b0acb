//! Asks the kernel to back a large pre-sized key table with transparent huge pages.
//!
//! At 10M timers the key table is 240 MB. Mapped in 4 KiB pages, filling it costs one minor
//! page fault per 170 records, about 1.5 µs each on the VMs we measure: an insert into a new
//! 10M wheel cost 2.0–2.4× an insert into a new 10k one. Linux distributions commonly ship
//! transparent huge pages in `madvise` mode, where a region gets 2 MiB pages only if it asks.
//! With the advice, filling a new `Wheel::with_capacity(10M)` took 0.66× the time (criterion
//! `flatness/insert/10M`, alternating builds: 244 and 250 ms against 373 and 365 ms) with a
//! fifth of the faults, and cancelling its timers 0.83× (fewer TLB misses).
//!
//! Only a table sized up front by `with_capacity` is advised. A table that grows from empty
//! moves on every doubling (glibc `realloc` of a large block is an `mremap`), and advised, it
//! filled 1.3–2× *slower* in the same alternating runs (10M inserts from `Wheel::new`: 42–70
//! ns against 29–35 ns per insert), so such growth is left to the kernel's defaults. (A
//! pre-sized table that outgrows its capacity is moved the same way and keeps the advice.)
//!
//! Only tables of at least 32 MiB (1.4M timers of `u64`) are advised: glibc serves smaller
//! blocks from its heap once its mmap threshold has risen, and advice given there would stay
//! on that part of the heap after the wheel is gone. From 32 MiB glibc always gives a block a
//! mapping of its own, which the advice leaves with when it is freed. (Under another global
//! allocator, jemalloc or mimalloc, the region may be reused for other allocations after the
//! wheel frees it, and they would keep the advice: harmless, as it changes no contents.) The advice changes nothing
//! else: not the contents, not the layout. Where the kernel refuses it (no THP support) or the
//! system is not Linux, nothing happens.

/// glibc's largest mmap threshold: blocks of this size or more always get their own mapping.
const MIN_ADVISED: usize = 32 << 20;

/// The huge page size the advice aims at. Only ranges aligned to it can get huge pages, and it
/// is a multiple of every base page size (4, 16 or 64 KiB), so a range rounded inward to it
/// suits `madvise` on any of them.
const HUGE_PAGE: usize = 2 << 20;

/// Advises huge pages for the allocation behind `v` (the whole 2 MiB pages of its capacity),
/// when it is at least [`MIN_ADVISED`] bytes. Returns whether the kernel took the advice.
pub(crate) fn advise<E>(v: &Vec<E>) -> bool {
    let bytes = v.capacity().saturating_mul(std::mem::size_of::<E>());
    match whole_pages(v.as_ptr() as usize, bytes) {
        Some(pages) => advise_pages(pages),
        None => false,
    }
}

/// The whole huge pages inside `bytes` bytes at `start`, if that is worth advising.
fn whole_pages(start: usize, bytes: usize) -> Option<std::ops::Range<usize>> {
    if bytes < MIN_ADVISED {
        return None;
    }
    let first = start.checked_next_multiple_of(HUGE_PAGE)?;
    let end = start.checked_add(bytes)? & !(HUGE_PAGE - 1);
    (first < end).then_some(first..end)
}

#[cfg(all(target_os = "linux", not(miri)))]
#[allow(unsafe_code)]
fn advise_pages(pages: std::ops::Range<usize>) -> bool {
    // SAFETY: MADV_HUGEPAGE is advice only: whatever the range, it never changes, discards or
    // moves memory contents (unlike MADV_DONTNEED or MADV_FREE), creates no reference to the
    // memory, and at worst fails with an error code, which is returned as `false`. The range
    // lies inside a vector buffer this wheel owns (rounded inward to huge page boundaries);
    // advice that outlives the buffer (a global allocator that reuses the region) changes no
    // one's contents either.
    let rc = unsafe {
        libc::madvise(
            pages.start as *mut libc::c_void,
            pages.len(),
            libc::MADV_HUGEPAGE,
        )
    };
    rc == 0
}

#[cfg(not(all(target_os = "linux", not(miri))))]
fn advise_pages(_pages: std::ops::Range<usize>) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_huge_pages_of_large_regions_are_advised() {
        let h = HUGE_PAGE;
        assert_eq!(whole_pages(h, MIN_ADVISED - 1), None);
        assert_eq!(whole_pages(h, MIN_ADVISED), Some(h..h + MIN_ADVISED));
        // An unaligned buffer: its partial first and last huge pages are left out.
        assert_eq!(
            whole_pages(h + 16, MIN_ADVISED),
            Some(2 * h..h + MIN_ADVISED)
        );
        assert_eq!(whole_pages(usize::MAX - 10, MIN_ADVISED), None);
    }

    /// The `VmFlags` of the mapping in `/proc/self/smaps` that contains `addr`.
    #[cfg(target_os = "linux")]
    fn vm_flags_at(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
                return flags.split_whitespace().map(str::to_string).collect();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    /// A 40 MiB buffer is above glibc's largest mmap threshold: a fresh mapping of its own,
    /// which nothing has advised (checked first). After the advice, the kernel's flags for it
    /// say huge pages exactly when `madvise` reported success, and the contents are intact.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_buffer_is_advised_and_keeps_its_contents() {
        let mut v: Vec<u64> = (0..(40u64 << 20) / 8).collect();
        let mid = v.as_ptr() as usize + v.len() * 4;
        assert!(!vm_flags_at(mid).iter().any(|f| f == "hg"));
        let taken = advise(&v);
        assert_eq!(vm_flags_at(mid).iter().any(|f| f == "hg"), taken);
        // This machine's kernel has THP (as CI's does): the advice must have been given.
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            assert!(
                taken,
                "a kernel with transparent huge pages refused the advice"
            );
        }
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
        v.push(7);
        assert_eq!(v.last(), Some(&7));
    }
}
