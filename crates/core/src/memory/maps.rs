//! Whether host memory is mapped: a pageable range is checked against the process's own
//! mappings (`/proc/self/maps`) when it is registered, so an address that points nowhere is
//! refused then instead of faulting the process on the first transfer that touches it.

/// One mapping of the process: `[start, end)` and whether it is readable and writable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mapping {
    start: u64,
    end: u64,
    read_write: bool,
}

/// Parses one line of `/proc/self/maps` (`start-end perms offset dev inode [path]`). A mapping
/// of the NVIDIA driver's device files is not host memory, whatever its permissions.
fn mapping(line: &str) -> Option<Mapping> {
    let mut fields = line.split_ascii_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.as_bytes();
    let device = fields
        .nth(3)
        .is_some_and(|path| path.starts_with("/dev/nvidia"));
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        read_write: perms.first() == Some(&b'r') && perms.get(1) == Some(&b'w') && !device,
    })
}

/// The first byte of `[addr, addr + len)` that no readable and writable mapping of `maps`
/// (the text of `/proc/self/maps`, whose lines come in address order) covers; `None` when
/// they cover it all.
pub(crate) fn first_unmapped(maps: &str, addr: u64, len: u64) -> Option<u64> {
    let end = addr.saturating_add(len);
    let mut covered = addr;
    for mapping in maps.lines().filter_map(mapping) {
        if covered >= end {
            break;
        }
        if mapping.end <= covered {
            continue;
        }
        if mapping.start > covered || !mapping.read_write {
            return Some(covered);
        }
        covered = mapping.end;
    }
    (covered < end).then_some(covered)
}

/// [`first_unmapped`] for this process; `None` also where its mappings cannot be read (not
/// Linux, or no `/proc`), which leaves the range unchecked.
pub(crate) fn first_unmapped_here(addr: u64, len: u64) -> Option<u64> {
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => first_unmapped(&maps, addr, len),
        Err(error) => {
            tracing::debug!(%error, "cannot read /proc/self/maps; host ranges are not checked");
            None
        }
    }
}

/// [`first_unmapped`] for this process, where not being able to read its mappings is an
/// error rather than a range left unchecked.
pub(crate) fn first_unmapped_strictly(addr: u64, len: u64) -> Result<Option<u64>, std::io::Error> {
    std::fs::read_to_string("/proc/self/maps").map(|maps| first_unmapped(&maps, addr, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
00651000-00652000 rw-p 00051000 08:02 173521      /usr/bin/python3
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000200000 rw-s 00000000 00:05 1234   /dev/shm/ring
7f0000300000-7f0000400000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0      [stack]
7ffe00000000-7ffe00200000 rw-s 00000000 00:05 99     /dev/nvidia-uvm
";

    #[test]
    fn ranges_inside_writable_mappings_pass_and_gaps_or_read_only_bytes_are_named() {
        // Inside one mapping, and across two that touch.
        assert_eq!(first_unmapped(MAPS, 0x7f00_0000_1000, 0x1000), None);
        assert_eq!(first_unmapped(MAPS, 0x7f00_000f_f000, 0x2000), None);
        // Running into the gap after them.
        assert_eq!(
            first_unmapped(MAPS, 0x7f00_001f_f000, 0x2000),
            Some(0x7f00_0020_0000)
        );
        // Nothing mapped there at all.
        assert_eq!(first_unmapped(MAPS, 0x1000, 16), Some(0x1000));
        assert_eq!(
            first_unmapped(MAPS, 0x7fff_0000_0000, 16),
            Some(0x7fff_0000_0000)
        );
        // Code is mapped but not writable.
        assert_eq!(first_unmapped(MAPS, 0x40_1000, 16), Some(0x40_1000));
        // The GPU driver's device mappings are not host memory.
        assert_eq!(
            first_unmapped(MAPS, 0x7ffe_0000_1000, 16),
            Some(0x7ffe_0000_1000)
        );
        assert_eq!(first_unmapped("", 0x1000, 1), Some(0x1000));
    }

    #[test]
    fn this_process_has_its_own_heap_mapped_and_not_page_zero() {
        let buffer = vec![7u8; 1 << 20];
        let addr = buffer.as_ptr() as u64;
        assert_eq!(first_unmapped_here(addr, buffer.len() as u64), None);
        assert_eq!(first_unmapped_here(0x1000, 4096), Some(0x1000));
    }
}
