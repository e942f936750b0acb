//! Asks the kernel to back a pre-sized key table with transparent huge pages.
//!
//! At 10M timers the key table is 240 MB. Mapped in 4 KiB pages, filling it costs one minor
//! page fault per 170 records, about 1.5 µs each on the VMs we measure: an insert into a new
//! 10M wheel cost 1.7–2.4× an insert into a new 10k one. Linux distributions commonly ship
//! transparent huge pages in `madvise` mode, where a region gets 2 MiB pages only if it asks.
//! With the advice, filling a new `Wheel::with_capacity(10M)` took 0.66× the time (criterion
//! `flatness/insert/10M`, alternating builds: 244 and 250 ms against 373 and 365 ms) with a
//! fifth of the faults, and cancelling its timers 0.83× (fewer TLB misses).
//!
//! Only a table sized up front by `with_capacity` is advised. A table that grows from empty
//! moves on every doubling (glibc `realloc` of a large block is an `mremap`), and advised, it
//! filled 1.3–2× *slower* in the same alternating runs (10M inserts from `Wheel::new`: 42–70
//! ns against 29–35 ns per insert), so growth is left to the kernel's defaults.
//!
//! The advice changes nothing else: not the contents, not the lifetime, not the layout. Where
//! the kernel refuses it (no THP support, other systems) nothing happens.

/// Regions smaller than this cannot hold an aligned 2 MiB huge page in every case, so they
/// are not advised (and small wheels never make the system call).
const MIN_ADVISED: usize = 4 << 20;

/// Advises huge pages for the allocation behind `v` (its whole capacity), when it is at least
/// [`MIN_ADVISED`] bytes.
pub(crate) fn advise<E>(v: &Vec<E>) {
    let bytes = v.capacity().saturating_mul(std::mem::size_of::<E>());
    if let Some(pages) = whole_pages(v.as_ptr() as usize, bytes) {
        advise_pages(pages);
    }
}

/// The whole 4 KiB pages inside `bytes` bytes at `start`, if that is worth advising.
fn whole_pages(start: usize, bytes: usize) -> Option<std::ops::Range<usize>> {
    const PAGE: usize = 4096;
    if bytes < MIN_ADVISED {
        return None;
    }
    let first = start.checked_next_multiple_of(PAGE)?;
    let end = start.checked_add(bytes)? & !(PAGE - 1);
    (first < end).then_some(first..end)
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn advise_pages(pages: std::ops::Range<usize>) {
    // SAFETY: `pages` lies inside one live allocation we own (a vector's buffer, shrunk inward
    // to page boundaries), so it is mapped. MADV_HUGEPAGE only sets the kernel's paging policy
    // for that range: unlike MADV_DONTNEED or MADV_FREE it never changes or discards the
    // memory's contents, and it creates no reference to it. A failure (EINVAL where the kernel
    // has no THP) is harmless and ignored.
    let _ = unsafe {
        libc::madvise(
            pages.start as *mut libc::c_void,
            pages.len(),
            libc::MADV_HUGEPAGE,
        )
    };
}

#[cfg(not(target_os = "linux"))]
fn advise_pages(_pages: std::ops::Range<usize>) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_pages_of_large_regions_are_advised() {
        assert_eq!(whole_pages(4096, MIN_ADVISED - 1), None);
        assert_eq!(
            whole_pages(4096, MIN_ADVISED),
            Some(4096..4096 + MIN_ADVISED)
        );
        // An unaligned buffer: its partial first and last pages are left out.
        assert_eq!(
            whole_pages(4096 + 16, MIN_ADVISED),
            Some(8192..4096 + MIN_ADVISED)
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

    /// 40 MiB is above glibc's largest mmap threshold, so the buffer is a fresh mapping of its
    /// own that nothing else has advised.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_buffer_is_advised_and_keeps_its_contents() {
        let mut v: Vec<u64> = (0..(40u64 << 20) / 8).collect();
        let mid = v.as_ptr() as usize + v.len() * 4;
        assert!(!vm_flags_at(mid).iter().any(|f| f == "hg"));
        advise(&v);
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        assert_eq!(
            vm_flags_at(mid).iter().any(|f| f == "hg"),
            thp,
            "a kernel with transparent huge pages takes the advice, one without ignores it"
        );
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u64));
        v.push(7);
        assert_eq!(v.last(), Some(&7));
    }
}
