//! A peer's descriptor checked against what its export really maps here. Every offset, length
//! and piece list in it is peer input: each address a copy will touch is computed with checked
//! arithmetic and must lie inside the mapping whose size the driver reported, before the GPU
//! gets any work. A violation names the field.

use crate::export::GpuExport;
use ferry_core::{InstanceId, ProtocolViolation};

/// The most allocations one export may list: enough for a 1 TiB range of PyTorch's 20 MiB
/// expandable segments, and a bound on what a peer can make this process allocate.
pub(crate) const MAX_PIECES: usize = 1 << 16;

fn violation(field: &'static str, problem: String) -> ProtocolViolation {
    ProtocolViolation::Descriptor { field, problem }
}

/// Checks the allocation sizes of a VMM export against the `handles` that came with them: at
/// least one, at most [`MAX_PIECES`], as many as the handles, none empty, and a total that
/// fits this machine's address space. Returns the sizes as `usize`.
pub(crate) fn vmm_pieces(pieces: &[u64], handles: usize) -> Result<Vec<usize>, ProtocolViolation> {
    let field = "export.pieces";
    if pieces.is_empty() {
        return Err(violation(
            field,
            "is empty: the export names no allocation".into(),
        ));
    }
    if pieces.len() > MAX_PIECES {
        return Err(violation(
            field,
            format!(
                "lists {} allocations, more than the {MAX_PIECES} one export may have",
                pieces.len()
            ),
        ));
    }
    if pieces.len() != handles {
        return Err(violation(
            field,
            format!(
                "lists {} allocation sizes for {handles} allocation handles",
                pieces.len()
            ),
        ));
    }
    let mut sizes = Vec::with_capacity(pieces.len());
    let mut total = 0usize;
    for (index, &piece) in pieces.iter().enumerate() {
        let size = usize::try_from(piece)
            .ok()
            .filter(|&size| size > 0)
            .ok_or_else(|| {
                violation(field, format!("gives allocation {index} the size {piece}"))
            })?;
        total = total.checked_add(size).ok_or_else(|| {
            violation(
                field,
                format!("sizes add up past this machine's address space at allocation {index}"),
            )
        })?;
        sizes.push(size);
    }
    Ok(sizes)
}

/// A peer's buffer placed in what its export mapped here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MappedBuffer {
    /// The buffer's first byte in the peer's address space.
    addr: u64,
    /// Bytes of the buffer, all of them mapped.
    len: u64,
    /// Where the buffer's first byte is mapped in this process.
    here: u64,
}

impl MappedBuffer {
    /// Places the peer's buffer `addr..+len` at `offset` (its export's) into `mapped` bytes
    /// mapped at `base` (what the driver reports). The whole buffer must lie inside.
    pub(crate) fn place(
        base: u64,
        mapped: u64,
        offset: u64,
        addr: u64,
        len: u64,
    ) -> Result<MappedBuffer, ProtocolViolation> {
        let buffer = MappedBuffer::in_place(addr, len)?;
        if offset >= mapped {
            return Err(violation(
                "export.offset",
                format!("{offset} lies past the {mapped} bytes the peer's allocation really maps"),
            ));
        }
        if offset.checked_add(len).is_none_or(|end| end > mapped) {
            return Err(violation(
                "len",
                format!(
                    "of the buffer at {addr:#x} is {len} bytes, but only {} of the {mapped} bytes its allocation really maps follow its offset {offset}",
                    mapped - offset
                ),
            ));
        }
        let here = base.checked_add(offset).ok_or_else(|| {
            violation(
                "export.offset",
                format!("{offset} added to the mapping at {base:#x} wraps"),
            )
        })?;
        Ok(MappedBuffer { here, ..buffer })
    }

    /// The peer's buffer `addr..+len` at its own addresses: both engines live in this
    /// process, so nothing is mapped.
    pub(crate) fn in_place(addr: u64, len: u64) -> Result<MappedBuffer, ProtocolViolation> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(violation(
                "len",
                format!("of the buffer at {addr:#x} is {len}, which is empty or runs past the end of the address space"),
            ));
        }
        Ok(MappedBuffer {
            addr,
            len,
            here: addr,
        })
    }

    /// Where the peer's `addr..+len` is mapped here; the range must lie inside the buffer.
    pub(crate) fn translate(&self, addr: u64, len: u64) -> Result<u64, ProtocolViolation> {
        let start = addr.checked_sub(self.addr);
        match start.and_then(|start| Some((start, start.checked_add(len)?))) {
            Some((start, end)) if end <= self.len => Ok(self.here + start),
            _ => Err(violation(
                "addr",
                format!(
                    "and len name the buffer {:#x}..+{}, which does not hold the range {addr:#x}..+{len} a copy asked for",
                    self.addr, self.len
                ),
            )),
        }
    }
}

/// From a pool's base to the end of the last byte a paged copy touches in it: the highest
/// block id times the stride, plus the offset inside a block and the bytes per block. `None`
/// when that does not fit in 64 bits.
pub(crate) fn block_extent(highest: u32, stride: u64, offset: u64, len: u64) -> Option<u64> {
    u64::from(highest)
        .checked_mul(stride)?
        .checked_add(offset)?
        .checked_add(len)
}

/// Checks that an fd-passing export names the fd socket of the engine it came from, by its
/// abstract name and by its socket file (where it has one): a peer must not point this engine
/// at another engine's memory.
pub(crate) fn export_owner(export: &GpuExport, owner: InstanceId) -> Result<(), ProtocolViolation> {
    match export {
        GpuExport::VmmFd { socket, .. } if *socket != crate::fd_socket_name(owner) => {
            Err(ProtocolViolation::Descriptor {
                field: "export.socket",
                problem: format!(
                    "names the fd socket {socket:?}, which is not that of the peer's engine {owner}"
                ),
            })
        }
        GpuExport::VmmFd {
            socket_path: Some(path),
            ..
        } => socket_path(path, owner, "export.socket_path"),
        _ => Ok(()),
    }
}

/// Checks a peer's socket path (its descriptor's field `field`): an absolute path with no
/// `..` part, short enough for a socket, whose file is `ferry-<owner>.sock`, the peer engine's
/// own. Which directory it lies in is the peer's word (each pod may mount the shared volume
/// elsewhere, though it must be the same path for peers to reach it); that the socket there
/// is really bound under this path, not reached through a link, is checked as it is
/// connected to.
pub(crate) fn socket_path(
    path: &str,
    owner: InstanceId,
    field: &'static str,
) -> Result<(), ProtocolViolation> {
    let problem = |problem: String| Err(violation(field, problem));
    let file = crate::fd_passing::socket_file_name(owner);
    let as_path = std::path::Path::new(path);
    if !as_path.is_absolute() {
        return problem(format!("{path:?} is not an absolute path"));
    }
    if as_path
        .components()
        .any(|component| component == std::path::Component::ParentDir)
    {
        return problem(format!("{path:?} climbs out of its directory with `..`"));
    }
    if path.len() > crate::fd_passing::MAX_SOCKET_PATH || path.contains('\0') {
        return problem(format!(
            "{path:?} is no socket path: longer than {} bytes or holding a NUL",
            crate::fd_passing::MAX_SOCKET_PATH
        ));
    }
    let named = path
        .strip_suffix(file.as_str())
        .is_some_and(|dir| dir.ends_with('/'));
    if !named {
        return problem(format!(
            "{path:?} names a socket file other than {file:?}, that of the peer's engine {owner}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(outcome: Result<impl std::fmt::Debug, ProtocolViolation>) -> &'static str {
        match outcome {
            Err(ProtocolViolation::Descriptor { field, .. }) => field,
            other => panic!("expected a descriptor violation, got {other:?}"),
        }
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_buffer_inside_its_mapping_translates_every_range_it_holds() {
        let buffer = MappedBuffer::place(0x7000_0000, 4 * MIB, MIB, 0x10_0000, 2 * MIB).unwrap();
        assert_eq!(buffer.translate(0x10_0000, 1), Ok(0x7000_0000 + MIB));
        assert_eq!(
            buffer.translate(0x10_0000 + 2 * MIB - 8, 8),
            Ok(0x7000_0000 + 3 * MIB - 8)
        );
        let whole = MappedBuffer::place(0x7000_0000, 4 * MIB, 0, 0x10_0000, 4 * MIB).unwrap();
        assert_eq!(whole.translate(0x10_0000, 4 * MIB), Ok(0x7000_0000));
    }

    #[test]
    fn an_offset_or_length_past_the_mapping_is_refused_naming_the_field() {
        assert_eq!(
            field(MappedBuffer::place(
                0x7000_0000,
                4 * MIB,
                4 * MIB,
                0x1000,
                1
            )),
            "export.offset"
        );
        assert_eq!(
            field(MappedBuffer::place(
                0x7000_0000,
                4 * MIB,
                1 << 40,
                0x1000,
                1
            )),
            "export.offset"
        );
        assert_eq!(
            field(MappedBuffer::place(
                0x7000_0000,
                4 * MIB,
                MIB,
                0x1000,
                3 * MIB + 1
            )),
            "len"
        );
        assert_eq!(
            field(MappedBuffer::place(
                0x7000_0000,
                4 * MIB,
                0,
                0x1000,
                4 * MIB + 1
            )),
            "len"
        );
    }

    #[test]
    fn sums_that_overflow_are_refused_not_wrapped() {
        assert_eq!(
            field(MappedBuffer::place(0x1000, 4 * MIB, 1, 0x1000, u64::MAX)),
            "len"
        );
        assert_eq!(
            field(MappedBuffer::place(0x1000, 4 * MIB, 0, u64::MAX - 10, 100)),
            "len"
        );
        assert_eq!(
            field(MappedBuffer::place(u64::MAX - 10, u64::MAX, 100, 0x1000, 1)),
            "export.offset"
        );
        let buffer = MappedBuffer::place(0x7000_0000, 4 * MIB, 0, 0x10_0000, 4 * MIB).unwrap();
        assert_eq!(field(buffer.translate(0x10_0000 + 8, u64::MAX)), "addr");
        assert_eq!(field(buffer.translate(u64::MAX, 2)), "addr");
        assert_eq!(block_extent(u32::MAX, u64::MAX / 2, 0, 1), None);
        assert_eq!(block_extent(1, u64::MAX, 1, 0), None);
    }

    #[test]
    fn ranges_outside_the_buffer_are_refused_on_both_ends() {
        let buffer = MappedBuffer::place(0x7000_0000, 4 * MIB, 0, 0x10_0000, MIB).unwrap();
        assert_eq!(field(buffer.translate(0x10_0000 - 1, 2)), "addr");
        assert_eq!(field(buffer.translate(0x10_0000 + MIB - 1, 2)), "addr");
        assert_eq!(field(buffer.translate(0x10_0000 + MIB, 1)), "addr");
        assert_eq!(
            buffer.translate(0x10_0000 + MIB - 1, 1),
            Ok(0x7000_0000 + MIB - 1)
        );
    }

    #[test]
    fn empty_buffers_are_refused() {
        assert_eq!(field(MappedBuffer::in_place(0x1000, 0)), "len");
        assert_eq!(field(MappedBuffer::place(0x1000, MIB, 0, 0x1000, 0)), "len");
        assert_eq!(
            MappedBuffer::in_place(0x1000, 8)
                .unwrap()
                .translate(0x1004, 4),
            Ok(0x1004)
        );
    }

    #[test]
    fn piece_lists_must_be_real_match_their_handles_and_fit() {
        assert_eq!(
            vmm_pieces(&[2 * MIB, 2 * MIB], 2),
            Ok(vec![2 << 20, 2 << 20])
        );
        assert_eq!(field(vmm_pieces(&[], 0)), "export.pieces");
        assert_eq!(field(vmm_pieces(&[2 * MIB, 0], 2)), "export.pieces");
        assert_eq!(field(vmm_pieces(&[2 * MIB, 2 * MIB], 3)), "export.pieces");
        assert_eq!(
            field(vmm_pieces(&[2 * MIB, 2 * MIB, 2 * MIB], 2)),
            "export.pieces"
        );
        assert_eq!(field(vmm_pieces(&[u64::MAX, 2], 2)), "export.pieces");
        assert_eq!(
            field(vmm_pieces(&vec![MIB; MAX_PIECES + 1], MAX_PIECES + 1)),
            "export.pieces"
        );
        match vmm_pieces(&[2 * MIB, 0], 2) {
            Err(ProtocolViolation::Descriptor { problem, .. }) => {
                assert!(problem.contains("allocation 1 the size 0"), "{problem}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_highest_block_id_bounds_what_a_paged_copy_touches() {
        const BLOCK: u64 = 32 << 10;
        let pool = 128 * BLOCK;
        assert_eq!(block_extent(127, BLOCK, 0, BLOCK), Some(pool));
        assert_eq!(block_extent(127, BLOCK, BLOCK / 2, BLOCK / 2), Some(pool));
        // A pool mapped with exactly its 128 blocks holds id 127 and refuses id 128.
        let buffer = MappedBuffer::place(0x7000_0000, pool, 0, 0x10_0000, pool).unwrap();
        let reach = |highest| block_extent(highest, BLOCK, 0, BLOCK).unwrap();
        assert_eq!(buffer.translate(0x10_0000, reach(127)), Ok(0x7000_0000));
        assert_eq!(field(buffer.translate(0x10_0000, reach(128))), "addr");
    }

    #[test]
    fn an_fd_export_must_name_its_own_engines_socket() {
        let owner = InstanceId::from_u128(7);
        let export = |socket: String| GpuExport::VmmFd {
            socket,
            socket_path: None,
            region: 0x1000,
            offset: 0,
            pieces: vec![4096],
        };
        assert!(export_owner(&export(crate::fd_socket_name(owner)), owner).is_ok());
        let other = crate::fd_socket_name(InstanceId::from_u128(8));
        assert_eq!(field(export_owner(&export(other), owner)), "export.socket");
    }

    #[test]
    fn an_fd_exports_socket_path_must_be_its_own_engines_file_in_a_plain_absolute_path() {
        let owner = InstanceId::from_u128(7);
        let own = crate::fd_passing::socket_file_name(owner);
        let third = crate::fd_passing::socket_file_name(InstanceId::from_u128(8));
        let export = |path: String| GpuExport::VmmFd {
            socket: crate::fd_socket_name(owner),
            socket_path: Some(path),
            region: 0x1000,
            offset: 0,
            pieces: vec![4096],
        };
        for good in [
            format!("/run/ferry/{own}"),
            format!("/{own}"),
            format!("/a/./b/{own}"),
        ] {
            assert!(export_owner(&export(good.clone()), owner).is_ok(), "{good}");
        }
        let refused = [
            // Another engine's socket, in the same directory or as a prefix of the name.
            (format!("/run/ferry/{third}"), "other than"),
            (format!("/run/ferry/x{own}"), "other than"),
            (format!("/run/ferry/{own}/"), "other than"),
            (format!("/run/ferry/{own}.old"), "other than"),
            ("/run/ferry/".to_owned(), "other than"),
            // Out of the directory, or not a path to a directory at all.
            (format!("/run/ferry/../other/{own}"), "climbs out"),
            (format!("run/ferry/{own}"), "not an absolute path"),
            (own.clone(), "not an absolute path"),
            (String::new(), "not an absolute path"),
            (format!("/{}/{own}", "d".repeat(70)), "longer than"),
            (format!("/run/\0/{own}"), "NUL"),
        ];
        for (path, expected) in refused {
            match export_owner(&export(path.clone()), owner) {
                Err(ProtocolViolation::Descriptor { field, problem }) => {
                    assert_eq!(field, "export.socket_path", "{path}");
                    assert!(problem.contains(expected), "{path}: {problem}");
                }
                other => panic!("{path}: expected a refusal, got {other:?}"),
            }
        }
    }
}
