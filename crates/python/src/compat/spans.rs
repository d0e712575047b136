//! Spans of registered memory by address, and which of them holds a range: how the
//! address-based APIs find the peer's buffer behind a pool they were given.

/// A registered range on either side: start address and length.
pub(crate) type Span = (u64, u64);

/// The index of the span of `spans` (sorted by start) that holds `[addr, addr + len)`.
pub(crate) fn holding(spans: &[Span], addr: u64, len: u64) -> Option<usize> {
    let end = addr.checked_add(len)?;
    let index = spans
        .partition_point(|&(start, _)| start <= addr)
        .checked_sub(1)?;
    let (start, span_len) = spans[index];
    (end <= start.saturating_add(span_len)).then_some(index)
}

/// A range no registration holds, on this side or the peer's.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outside {
    /// The local range is not inside memory registered here.
    Local(String),
    /// The peer's range is not inside memory the peer registered (as far as this engine knows).
    Peer(String),
}

impl std::fmt::Display for Outside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outside::Local(message) | Outside::Peer(message) => f.write_str(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_span_holding_a_range_is_found_and_ranges_across_ends_are_not() {
        let spans = [(0x1000, 0x1000), (0x4000, 0x100)];
        assert_eq!(holding(&spans, 0x1000, 0x1000), Some(0));
        assert_eq!(holding(&spans, 0x4010, 0x10), Some(1));
        assert_eq!(holding(&spans, 0x1800, 0x900), None, "past the first span");
        assert_eq!(holding(&spans, 0xfff, 1), None, "before every span");
        assert_eq!(holding(&spans, u64::MAX, 2), None, "wraps");
        assert_eq!(holding(&[], 0, 1), None);
    }
}
