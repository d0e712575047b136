//! NIXL descriptor lists: rows of `(addr, len, devID)`, or NIXL's strided form `(addr, len,
//! devID, stride, count)` where one row stands for `count` descriptors `stride` bytes apart.
//! Descriptor `i` of a list is found by its row and its place in the row, in row order.

use super::errors::NixlError;

/// One row: `count` descriptors of `len` bytes at `addr`, `addr + stride`, ...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Row {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) device: u64,
    pub(crate) stride: u64,
    pub(crate) count: u64,
}

impl Row {
    /// The address of descriptor `k` of the row.
    fn addr_of(&self, k: u64) -> u64 {
        self.addr + k * self.stride
    }

    /// From the row's first byte to the end of its last descriptor.
    pub(crate) fn extent(&self) -> u64 {
        (self.count - 1) * self.stride + self.len
    }
}

/// A descriptor: its row and its place in the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    pub(crate) row: usize,
    pub(crate) k: u64,
}

/// A prepared list: its rows and, per row, the index of its first descriptor.
#[derive(Debug)]
pub(crate) struct DescList {
    rows: Vec<Row>,
    starts: Vec<u64>,
    total: u64,
    /// Whether it was given in the strided form (each row a pool of blocks).
    pub(crate) strided: bool,
}

/// Most descriptors one list may hold; NIXL indexes them with 32 bits.
const MAX_DESCRIPTORS: u64 = u32::MAX as u64;

impl DescList {
    /// Decodes `width` (3 or 5) native-endian `u64` columns per row from `bytes`.
    pub(crate) fn decode(bytes: &[u8], width: usize) -> Result<DescList, NixlError> {
        if width != 3 && width != 5 {
            return Err(NixlError::InvalidParam(format!(
                "a descriptor list has 3 columns (addr, len, devID) or 5 (addr, len, devID, stride, count), not {width}"
            )));
        }
        let row_bytes = width * 8;
        if bytes.len() % row_bytes != 0 {
            return Err(NixlError::InvalidParam(format!(
                "{} bytes are not whole rows of {width} 64-bit columns",
                bytes.len()
            )));
        }
        let mut rows = Vec::with_capacity(bytes.len() / row_bytes);
        let mut starts = Vec::with_capacity(rows.capacity());
        let mut total: u64 = 0;
        for (index, chunk) in bytes.chunks_exact(row_bytes).enumerate() {
            let column = |c: usize| {
                let mut word = [0u8; 8];
                word.copy_from_slice(&chunk[c * 8..c * 8 + 8]);
                u64::from_ne_bytes(word)
            };
            let (stride, count) = if width == 5 {
                (column(3), column(4))
            } else {
                (column(1), 1)
            };
            let row = Row {
                addr: column(0),
                len: column(1),
                device: column(2),
                stride,
                count,
            };
            check_row(index, &row)?;
            starts.push(total);
            total += row.count;
            if total > MAX_DESCRIPTORS {
                return Err(NixlError::InvalidParam(format!(
                    "the list holds more than {MAX_DESCRIPTORS} descriptors; split it"
                )));
            }
            rows.push(row);
        }
        Ok(DescList {
            rows,
            starts,
            total,
            strided: width == 5,
        })
    }

    /// The rows, in order.
    pub(crate) fn rows(&self) -> &[Row] {
        &self.rows
    }

    /// How many descriptors the list holds.
    pub(crate) fn len(&self) -> u64 {
        self.total
    }

    /// Where descriptor `index` is, or `None` past the end. `hint` is the row of the last
    /// look-up: callers walk a row's descriptors in order.
    pub(crate) fn place(&self, index: u64, hint: usize) -> Option<Place> {
        if index >= self.total {
            return None;
        }
        let in_row = |row: usize| {
            let start = self.starts[row];
            (index >= start && index - start < self.rows[row].count).then(|| Place {
                row,
                k: index - start,
            })
        };
        if let Some(place) = self.rows.get(hint).and_then(|_| in_row(hint)) {
            return Some(place);
        }
        let row = self.starts.partition_point(|&start| start <= index) - 1;
        in_row(row)
    }

    /// Descriptor `place`: address and length.
    pub(crate) fn descriptor(&self, place: Place) -> (u64, u64) {
        let row = &self.rows[place.row];
        (row.addr_of(place.k), row.len)
    }
}

fn check_row(index: usize, row: &Row) -> Result<(), NixlError> {
    let invalid = |what: String| {
        Err(NixlError::InvalidParam(format!(
            "descriptor row {index}: {what}"
        )))
    };
    if row.len == 0 {
        return invalid("its length is 0; every descriptor covers at least one byte".into());
    }
    if row.count == 0 {
        return invalid("its count is 0; a strided row stands for at least one descriptor".into());
    }
    if row.count > 1 && row.stride < row.len {
        return invalid(format!(
            "its stride {} is shorter than its length {}: descriptors of one row must not overlap",
            row.stride, row.len
        ));
    }
    let end = row
        .stride
        .checked_mul(row.count - 1)
        .and_then(|span| span.checked_add(row.len))
        .and_then(|span| span.checked_add(row.addr));
    if end.is_none() {
        return invalid(format!(
            "address {:#x} plus {} descriptors of stride {} runs past the end of the address space",
            row.addr, row.count, row.stride
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(rows: &[[u64; 5]]) -> Vec<u8> {
        rows.iter()
            .flat_map(|row| row.iter().flat_map(|value| value.to_ne_bytes()))
            .collect()
    }

    #[test]
    fn strided_rows_expand_in_row_order() {
        let list = DescList::decode(
            &bytes(&[[0x1000, 64, 0, 128, 3], [0x9000, 64, 0, 64, 2]]),
            5,
        )
        .expect("valid");
        assert_eq!(list.len(), 5);
        let place = list.place(4, 0).expect("inside");
        assert_eq!(place, Place { row: 1, k: 1 });
        assert_eq!(list.descriptor(place), (0x9040, 64));
        assert_eq!(
            list.descriptor(list.place(2, 1).expect("inside")),
            (0x1100, 64)
        );
        assert_eq!(list.place(5, 1), None);
        assert_eq!(list.rows()[0].extent(), 320);
    }

    #[test]
    fn three_columns_are_one_descriptor_a_row() {
        let raw: Vec<u8> = [0x10u64, 8, 1, 0x40, 16, 1]
            .iter()
            .flat_map(|value| value.to_ne_bytes())
            .collect();
        let list = DescList::decode(&raw, 3).expect("valid");
        assert!(!list.strided);
        assert_eq!(
            list.descriptor(list.place(1, 0).expect("inside")),
            (0x40, 16)
        );
    }

    #[test]
    fn bad_rows_are_refused_with_their_index() {
        for (rows, needle) in [
            (vec![[0x1000, 0, 0, 0, 1]], "length is 0"),
            (vec![[0x1000, 64, 0, 64, 0]], "count is 0"),
            (vec![[0x1000, 64, 0, 32, 2]], "must not overlap"),
            (vec![[u64::MAX - 10, 64, 0, 64, 1]], "address space"),
        ] {
            let error = DescList::decode(&bytes(&rows), 5).expect_err("invalid");
            assert!(error.to_string().contains(needle), "{error}");
        }
        assert!(DescList::decode(&[0; 17], 3).is_err());
        assert!(DescList::decode(&[], 4).is_err());
    }
}
