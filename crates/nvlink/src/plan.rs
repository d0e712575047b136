//! Which copy path each copy of a transfer takes, and the entry list the copy kernel reads.
//! Pure functions of the copies, so the choice is tested without a GPU.

/// How the nvlink transport moves a transfer's copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyPath {
    /// Measured choice ([`engines_from`]): copies from 2 MiB on the copy engines, handed over
    /// with `cuMemcpyBatchAsync` (from 16 MiB, one `cuMemcpyAsync` each, on drivers without
    /// it); everything smaller in one gather/scatter kernel launch per GPU.
    #[default]
    Auto,
    /// Every copy on the copy engines, one `cuMemcpyAsync` each.
    CopyEngine,
    /// Every copy on the copy engines, handed over with one `cuMemcpyBatchAsync` per stream
    /// (drivers from CUDA 13.0; older ones get one call per copy).
    Batched,
    /// Every copy the kernel can reach in the kernel; the rest on the copy engines.
    Kernel,
}

impl std::str::FromStr for CopyPath {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "auto" => Ok(CopyPath::Auto),
            "copy-engine" | "ce" => Ok(CopyPath::CopyEngine),
            "batched" => Ok(CopyPath::Batched),
            "kernel" => Ok(CopyPath::Kernel),
            other => Err(format!(
                "unknown copy path {other:?}; use auto, kernel, copy-engine or batched"
            )),
        }
    }
}

impl std::fmt::Display for CopyPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyPath::Auto => "auto",
            CopyPath::CopyEngine => "copy-engine",
            CopyPath::Batched => "batched",
            CopyPath::Kernel => "kernel",
        })
    }
}

/// Under [`CopyPath::Auto`] with batched copies, copies at least this long go to the copy
/// engines. Measured on two H200s (NV18), scattered blocks, 256 MiB a point, as a fraction of
/// the same-run `peer_copy` (kernel / batched): 0.880 / 0.882 at 1 MiB, 0.867 / 0.927 at
/// 4 MiB, 0.876 / 0.939 at 16 MiB; below 1 MiB the kernel wins by far (0.874 / 0.745 at
/// 256 KiB). `docs/copy-paths.md` has the whole sweep.
pub const BATCHED_FROM: u64 = 2 << 20;

/// Under [`CopyPath::Auto`] without batched copies, copies at least this long go to the copy
/// engines, one `cuMemcpyAsync` each: measured 0.887 at 16 MiB against the kernel's 0.876,
/// 0.769 against 0.867 at 4 MiB.
pub const ENGINE_FROM: u64 = 16 << 20;

/// Under [`CopyPath::Auto`], a transfer that is one copy of at most this many bytes goes to
/// the copy engines as one `cuMemcpyAsync`: the kernel earns its launch over many copies, and
/// for one short copy it only adds its argument buffer. Measured on one H200, a 4 KiB write
/// with its notification: see `docs/copy-paths.md`.
pub(crate) const SINGLE_TO_ENGINES_UP_TO: u64 = 64 << 10;

/// The longest single copy whose notification the GPU publishes in the same launch, with
/// one block of the kernel (`ferry_copy_publish`) instead of a copy and a stream write: one
/// driver call fewer on a short write's way, where each costs microseconds.
pub(crate) const PUBLISHING_COPY_MAX: u64 = 64 << 10;

/// Where the copy engines take over from the kernel under [`CopyPath::Auto`].
pub fn engines_from(batched: bool) -> u64 {
    match batched {
        true => BATCHED_FROM,
        false => ENGINE_FROM,
    }
}

/// Bytes of one kernel entry: source, destination and length as little-endian u64.
pub(crate) const ENTRY_BYTES: usize = 24;

/// One copy between two addresses of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: u64,
    /// Whether the local GPU's kernels can load and store both ends.
    pub(crate) kernel_reaches: bool,
}

/// Indices of the copies each path takes.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) kernel: Vec<usize>,
    pub(crate) copy_engine: Vec<usize>,
}

/// Whether `path` gives a copy of `len` bytes to the kernel (where the kernel reaches it);
/// `batched` tells whether the driver has batched copies.
pub(crate) fn takes_kernel(path: CopyPath, len: u64, batched: bool) -> bool {
    match path {
        CopyPath::Auto => len < engines_from(batched),
        CopyPath::CopyEngine | CopyPath::Batched => false,
        CopyPath::Kernel => true,
    }
}

/// Splits `copies` between the kernel and the copy engines as `path` says; `batched` tells
/// whether the driver has batched copies.
pub(crate) fn route(copies: &[Copy], path: CopyPath, batched: bool) -> Route {
    let mut route = Route::default();
    for (index, copy) in copies.iter().enumerate() {
        if copy.kernel_reaches && takes_kernel(path, copy.len, batched) {
            route.kernel.push(index);
        } else {
            route.copy_engine.push(index);
        }
    }
    route
}

/// The shortest piece the kernel cuts a long copy into: a warp copies 2 KiB per round, and
/// below two rounds finding its next piece (reading block ids over the bus) outweighs copying.
pub(crate) const MIN_PIECE: u64 = 4096;

/// The length of the pieces that the kernel's warps take of copies of `bytes` in all: `most`
/// (the configured chunk) where that makes at least `items` pieces, else shorter, a multiple
/// of [`MIN_PIECE`] and not below it, so that a few long blocks (one layer's KV, say) spread
/// over the whole grid instead of keeping a few multiprocessors busy for longer.
fn piece_bytes(bytes: u64, items: u64, most: u64) -> u64 {
    let most = most.max(1);
    let even = bytes
        .div_ceil(items.max(1))
        .checked_next_multiple_of(MIN_PIECE)
        .unwrap_or(most);
    even.clamp(MIN_PIECE.min(most), most)
}

/// How the kernel cuts long copies into pieces for its warps ([`piece_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pieces {
    /// The longest piece: the configured chunk.
    pub(crate) most: u64,
    /// Pieces a launch needs to get the largest grid.
    pub(crate) full_grid: u64,
}

impl Pieces {
    /// The piece length for copies of `bytes` in all.
    pub(crate) fn len_for(self, bytes: u64) -> u64 {
        piece_bytes(bytes, self.full_grid, self.most)
    }
}

/// The kernel's entries for the copies at `indices`: (src, dst, len), none longer than
/// `chunk` (at least 1).
pub(crate) fn kernel_entries(copies: &[Copy], indices: &[usize], chunk: u64) -> Vec<[u64; 3]> {
    let chunk = chunk.max(1);
    let mut entries = Vec::with_capacity(indices.len());
    for &index in indices {
        let copy = copies[index];
        let mut done = 0;
        while done < copy.len {
            let len = (copy.len - done).min(chunk);
            entries.push([copy.src + done, copy.dst + done, len]);
            done += len;
        }
    }
    entries
}

/// One launch of one GPU's copies, on one of its streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Launch {
    /// The copy kernel over these entries (src, dst, len), on stream 0.
    Kernel(Vec<[u64; 3]>),
    /// One batched copy call on `stream` for these copies.
    Batch { stream: usize, copies: Vec<Copy> },
    /// One copy on `stream`.
    Single { stream: usize, copy: Copy },
}

impl Launch {
    /// The stream (of its GPU) the launch queues on.
    pub(crate) fn stream(&self) -> usize {
        match self {
            Launch::Kernel(_) => 0,
            Launch::Batch { stream, .. } | Launch::Single { stream, .. } => *stream,
        }
    }
}

/// The launches that queue `copies` on `streams` streams (at least one) of one GPU, split as
/// `path` says (`batched` tells whether the driver has batched copies): the kernel's share in
/// one launch on stream 0 with its copies cut as `pieces` says; the copy engines' share over
/// the other streams (all of them when the kernel has none), as one batched call per stream
/// or else one copy per stream in turn.
pub(crate) fn launches(
    copies: &[Copy],
    path: CopyPath,
    batched: bool,
    streams: usize,
    pieces: Pieces,
) -> Vec<Launch> {
    let streams = streams.max(1);
    if let ([only], CopyPath::Auto) = (copies, path) {
        if only.len <= SINGLE_TO_ENGINES_UP_TO {
            return vec![Launch::Single {
                stream: 0,
                copy: *only,
            }];
        }
    }
    let route = route(copies, path, batched);
    let mut launches = Vec::new();
    if !route.kernel.is_empty() {
        let bytes = route.kernel.iter().fold(0u64, |bytes, &index| {
            bytes.saturating_add(copies[index].len)
        });
        let chunk = pieces.len_for(bytes);
        launches.push(Launch::Kernel(kernel_entries(copies, &route.kernel, chunk)));
    }
    let first = usize::from(streams > 1 && !route.kernel.is_empty());
    let engine_streams = streams - first;
    let batch_calls = matches!(path, CopyPath::Batched | CopyPath::Auto) && batched;
    if batch_calls && !route.copy_engine.is_empty() {
        let share = route.copy_engine.len().div_ceil(engine_streams);
        for (turn, indices) in route.copy_engine.chunks(share).enumerate() {
            launches.push(Launch::Batch {
                stream: first + turn,
                copies: indices.iter().map(|&index| copies[index]).collect(),
            });
        }
    } else {
        for (turn, &index) in route.copy_engine.iter().enumerate() {
            launches.push(Launch::Single {
                stream: first + turn % engine_streams,
                copy: copies[index],
            });
        }
    }
    launches
}

/// Writes `entries` in the kernel's layout into the front of `out`, which must hold
/// `entries.len() * ENTRY_BYTES` bytes.
pub(crate) fn write_entries(entries: &[[u64; 3]], out: &mut [u8]) {
    for (entry, slot) in entries.iter().zip(out.chunks_exact_mut(ENTRY_BYTES)) {
        for (value, field) in entry.iter().zip(slot.chunks_exact_mut(8)) {
            field.copy_from_slice(&value.to_le_bytes());
        }
    }
}

/// The copy a notification can ride on in one `ferry_copy_publish` launch: `launch` is one
/// copy of at most [`PUBLISHING_COPY_MAX`] bytes that the kernels reach (for the kernel, one
/// entry or the pieces [`launches`] cut one copy into), and `path` lets the kernel take it
/// (`auto` or `kernel`).
pub(crate) fn publishing_copy(launch: &Launch, path: CopyPath) -> Option<Copy> {
    let copy = match launch {
        Launch::Single { copy, .. } => *copy,
        Launch::Kernel(entries) => one_copy(entries)?,
        Launch::Batch { .. } => return None,
    };
    let kernel_may = matches!(path, CopyPath::Auto | CopyPath::Kernel);
    (kernel_may && copy.kernel_reaches && copy.len <= PUBLISHING_COPY_MAX).then_some(copy)
}

/// The copy whose consecutive pieces `entries` are, if they are one copy's.
fn one_copy(entries: &[[u64; 3]]) -> Option<Copy> {
    let [src, dst, _] = *entries.first()?;
    let mut len: u64 = 0;
    for &[piece_src, piece_dst, piece_len] in entries {
        let follows =
            src.checked_add(len) == Some(piece_src) && dst.checked_add(len) == Some(piece_dst);
        if !follows {
            return None;
        }
        len = len.checked_add(piece_len)?;
    }
    Some(Copy {
        dst,
        src,
        len,
        kernel_reaches: true,
    })
}

/// Blocks of a paged copy at least this long whose ends may disagree modulo 16 take the
/// `_shifted` build of the kernel (eight vectors in flight, four when shifting, one block per
/// multiprocessor); shorter ones take the plain build, which shifts one vector deep with two
/// blocks per multiprocessor and so twice the warps for many short blocks. Measured on one
/// H200, 65,536 blocks a round: 1000-byte blocks moved at 0.23-0.30 of the device copy with
/// the plain build and 0.20-0.21 with the `_shifted` one; 2004-byte blocks alike with both;
/// from 4097 bytes up the `_shifted` build was faster (`docs/copy-paths.md`).
pub(crate) const DEEP_SHIFT_FROM: u64 = 2048;

/// Whether some entry's source and destination disagree modulo 16, so the list goes to the
/// `_shifted` kernel.
pub(crate) fn any_shifted(entries: &[[u64; 3]]) -> bool {
    entries.iter().any(|&[src, dst, _]| (src ^ dst) % 16 != 0)
}

/// Where the paged kernel's arrays sit in its argument buffer: source and destination pool
/// bases (u64 each), then source and destination block ids (u32 each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PagedArgs {
    pub(crate) src_bases: u64,
    pub(crate) dst_bases: u64,
    pub(crate) src_ids: u64,
    pub(crate) dst_ids: u64,
    end: u64,
}

impl PagedArgs {
    pub(crate) fn new(pools: usize, ids: usize) -> PagedArgs {
        let (pools, ids) = (pools as u64, ids as u64);
        PagedArgs {
            src_bases: 0,
            dst_bases: 8 * pools,
            src_ids: 16 * pools,
            dst_ids: 16 * pools + 4 * ids,
            end: 16 * pools + 8 * ids,
        }
    }

    /// Bytes of the whole buffer.
    pub(crate) fn bytes(&self) -> usize {
        self.end as usize
    }

    /// Writes the four arrays into `out`, which holds at least [`PagedArgs::bytes`] bytes.
    pub(crate) fn write(
        &self,
        out: &mut [u8],
        src_bases: &[u64],
        dst_bases: &[u64],
        src_ids: &[u32],
        dst_ids: &[u32],
    ) {
        fn put<const N: usize, T: std::marker::Copy>(
            out: &mut [u8],
            at: u64,
            values: &[T],
            bytes: fn(T) -> [u8; N],
        ) {
            for (slot, &value) in out[at as usize..].chunks_exact_mut(N).zip(values) {
                slot.copy_from_slice(&bytes(value));
            }
        }
        put(out, self.src_bases, src_bases, u64::to_le_bytes);
        put(out, self.dst_bases, dst_bases, u64::to_le_bytes);
        put(out, self.src_ids, src_ids, u32::to_le_bytes);
        put(out, self.dst_ids, dst_ids, u32::to_le_bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of up to 1 MiB, whatever the grid.
    const WHOLE: Pieces = Pieces {
        most: 1 << 20,
        full_grid: 1,
    };

    fn copy(len: u64, kernel_reaches: bool) -> Copy {
        Copy {
            dst: 0x10_0000,
            src: 0x20_0000,
            len,
            kernel_reaches,
        }
    }

    #[test]
    fn auto_sends_small_copies_to_the_kernel_and_large_ones_to_the_copy_engines() {
        let copies = [
            copy(4096, true),
            copy(ENGINE_FROM, true),
            copy(32 << 10, false),
            copy(1 << 20, true),
        ];
        assert_eq!(
            route(&copies, CopyPath::Auto, false),
            Route {
                kernel: vec![0, 3],
                copy_engine: vec![1, 2],
            }
        );
        assert_eq!(
            route(&copies, CopyPath::CopyEngine, true).kernel,
            Vec::<usize>::new()
        );
        assert_eq!(
            route(&copies, CopyPath::Kernel, true),
            Route {
                kernel: vec![0, 1, 3],
                copy_engine: vec![2],
            }
        );
    }

    #[test]
    fn with_batched_copies_the_engines_take_over_from_two_mib() {
        let copies = [copy(BATCHED_FROM - 1, true), copy(BATCHED_FROM, true)];
        assert_eq!(
            route(&copies, CopyPath::Auto, true),
            Route {
                kernel: vec![0],
                copy_engine: vec![1],
            }
        );
        assert_eq!(route(&copies, CopyPath::Auto, false).kernel, vec![0, 1]);
    }

    #[test]
    fn a_transfer_too_short_for_the_grid_in_whole_chunks_takes_shorter_pieces() {
        // One layer of Llama-70B's KV: 512 blocks of 32 KiB, a grid that wants 8,448 items.
        assert_eq!(piece_bytes(512 * (32 << 10), 8448, 64 << 10), MIN_PIECE);
        // Enough bytes for the grid in whole chunks: the configured chunk.
        assert_eq!(piece_bytes(1 << 30, 8448, 64 << 10), 64 << 10);
        // In between: an even share, rounded up to a whole number of minimal pieces.
        assert_eq!(piece_bytes(8448 * 20_000, 8448, 64 << 10), 20_480);
        // A configured chunk below the minimum is kept; so is any piece of an empty list.
        assert_eq!(piece_bytes(1 << 20, 8448, 1024), 1024);
        assert_eq!(piece_bytes(0, 8448, 64 << 10), MIN_PIECE);
        assert_eq!(piece_bytes(u64::MAX, 1, 64 << 10), 64 << 10);
    }

    #[test]
    fn a_lone_long_kernel_copy_is_spread_over_the_grid() {
        let pieces = Pieces {
            most: 64 << 10,
            full_grid: 8448,
        };
        let planned = launches(&[copy(16 << 20, true)], CopyPath::Kernel, true, 4, pieces);
        let [Launch::Kernel(entries)] = &planned[..] else {
            panic!("expected one kernel launch, got {planned:?}");
        };
        assert_eq!(entries.len(), (16 << 20) / MIN_PIECE as usize);
        assert!(entries.iter().all(|entry| entry[2] == MIN_PIECE));
    }

    #[test]
    fn long_copies_are_cut_into_chunks_that_cover_them_exactly() {
        const KERNEL_CHUNK: u64 = 64 << 10;
        let copies = [copy(KERNEL_CHUNK * 2 + 3, true), copy(5, true)];
        let entries = kernel_entries(&copies, &[0, 1], KERNEL_CHUNK);
        assert_eq!(
            entries,
            vec![
                [0x20_0000, 0x10_0000, KERNEL_CHUNK],
                [
                    0x20_0000 + KERNEL_CHUNK,
                    0x10_0000 + KERNEL_CHUNK,
                    KERNEL_CHUNK
                ],
                [
                    0x20_0000 + 2 * KERNEL_CHUNK,
                    0x10_0000 + 2 * KERNEL_CHUNK,
                    3
                ],
                [0x20_0000, 0x10_0000, 5],
            ]
        );
    }

    #[test]
    fn entries_are_written_little_endian_in_kernel_order() {
        let mut out = vec![0u8; 2 * ENTRY_BYTES];
        write_entries(&[[1, 2, 3], [0x0102, 5, 6]], &mut out);
        assert_eq!(&out[0..8], &1u64.to_le_bytes());
        assert_eq!(&out[8..16], &2u64.to_le_bytes());
        assert_eq!(&out[16..24], &3u64.to_le_bytes());
        assert_eq!(&out[24..32], &0x0102u64.to_le_bytes());
        assert_eq!(&out[40..48], &6u64.to_le_bytes());
    }

    #[test]
    fn lists_with_an_entry_whose_ends_disagree_modulo_16_go_to_the_shifting_kernel() {
        assert!(!any_shifted(&[[0x1000, 0x2000, 4097], [0x1008, 0x3008, 3]]));
        assert!(any_shifted(&[[0x1000, 0x2000, 16], [0x1001, 0x3000, 16]]));
        assert!(any_shifted(&[[0x1004, 0x2008, 16]]));
        assert!(!any_shifted(&[]));
    }

    #[test]
    fn paged_arguments_sit_back_to_back_in_kernel_order() {
        let layout = PagedArgs::new(2, 3);
        assert_eq!(layout.bytes(), 2 * 16 + 3 * 8);
        let mut out = vec![0u8; layout.bytes()];
        layout.write(&mut out, &[10, 11], &[20, 21], &[1, 2, 3], &[4, 5, 6]);
        assert_eq!(&out[0..8], &10u64.to_le_bytes());
        assert_eq!(&out[8..16], &11u64.to_le_bytes());
        assert_eq!(&out[16..24], &20u64.to_le_bytes());
        assert_eq!(&out[32..36], &1u32.to_le_bytes());
        assert_eq!(&out[40..44], &3u32.to_le_bytes());
        assert_eq!(&out[44..48], &4u32.to_le_bytes());
        assert_eq!(&out[52..56], &6u32.to_le_bytes());
    }

    #[test]
    fn the_kernel_takes_stream_zero_and_the_copy_engines_share_the_others() {
        let copies = [
            copy(4096, true),
            copy(ENGINE_FROM, true),
            copy(ENGINE_FROM + 1, false),
            copy(8192, true),
            copy(ENGINE_FROM * 2, true),
        ];
        let planned = launches(&copies, CopyPath::Auto, false, 3, WHOLE);
        assert_eq!(
            planned,
            vec![
                Launch::Kernel(vec![
                    [0x20_0000, 0x10_0000, 4096],
                    [0x20_0000, 0x10_0000, 8192]
                ]),
                Launch::Single {
                    stream: 1,
                    copy: copies[1]
                },
                Launch::Single {
                    stream: 2,
                    copy: copies[2]
                },
                Launch::Single {
                    stream: 1,
                    copy: copies[4]
                },
            ]
        );
        assert_eq!(
            planned.iter().map(Launch::stream).collect::<Vec<_>>(),
            [0, 1, 2, 1]
        );
    }

    #[test]
    fn batched_copies_go_out_as_one_even_call_per_stream() {
        let copies: Vec<Copy> = (0..5).map(|_| copy(BATCHED_FROM, true)).collect();
        let planned = launches(&copies, CopyPath::Batched, true, 2, WHOLE);
        assert_eq!(
            planned,
            vec![
                Launch::Batch {
                    stream: 0,
                    copies: copies[..3].to_vec()
                },
                Launch::Batch {
                    stream: 1,
                    copies: copies[3..].to_vec()
                },
            ]
        );
        // Without the driver's batched copies the same path falls back to one call each, and
        // one stream takes everything, the kernel's launch included.
        let planned = launches(&copies, CopyPath::Batched, false, 1, WHOLE);
        assert_eq!(planned.len(), 5);
        assert!(planned.iter().all(|launch| launch.stream() == 0));
        let mixed = [copy(4096, true), copy(ENGINE_FROM, true)];
        let planned = launches(&mixed, CopyPath::Auto, false, 1, WHOLE);
        assert_eq!(
            planned.iter().map(Launch::stream).collect::<Vec<_>>(),
            [0, 0]
        );
        assert!(launches(&[], CopyPath::Auto, true, 4, WHOLE).is_empty());
    }

    #[test]
    fn one_short_copy_alone_takes_one_copy_engine_call_under_auto_only() {
        for batched in [false, true] {
            let short = copy(SINGLE_TO_ENGINES_UP_TO, true);
            assert_eq!(
                launches(&[short], CopyPath::Auto, batched, 4, WHOLE),
                [Launch::Single {
                    stream: 0,
                    copy: short
                }]
            );
            let longer = copy(SINGLE_TO_ENGINES_UP_TO + 1, true);
            assert!(matches!(
                launches(&[longer], CopyPath::Auto, batched, 4, WHOLE)[..],
                [Launch::Kernel(_)]
            ));
            assert!(matches!(
                launches(&[short], CopyPath::Kernel, batched, 4, WHOLE)[..],
                [Launch::Kernel(_)]
            ));
            assert!(matches!(
                launches(&[short, short], CopyPath::Auto, batched, 4, WHOLE)[..],
                [Launch::Kernel(_)]
            ));
        }
    }

    #[test]
    fn a_notification_rides_on_one_short_copy_the_kernel_may_take_and_on_nothing_else() {
        let short = copy(PUBLISHING_COPY_MAX, true);
        let single = Launch::Single {
            stream: 0,
            copy: short,
        };
        assert_eq!(publishing_copy(&single, CopyPath::Auto), Some(short));
        assert_eq!(publishing_copy(&single, CopyPath::Kernel), Some(short));
        assert_eq!(publishing_copy(&single, CopyPath::CopyEngine), None);
        assert_eq!(publishing_copy(&single, CopyPath::Batched), None);
        let entry = Launch::Kernel(vec![[short.src, short.dst, short.len]]);
        assert_eq!(publishing_copy(&entry, CopyPath::Kernel), Some(short));
        let unreachable = Launch::Single {
            stream: 0,
            copy: copy(4096, false),
        };
        assert_eq!(publishing_copy(&unreachable, CopyPath::Auto), None);
        let longer = Launch::Single {
            stream: 0,
            copy: copy(PUBLISHING_COPY_MAX + 1, true),
        };
        assert_eq!(publishing_copy(&longer, CopyPath::Auto), None);
        let two = Launch::Kernel(vec![[short.src, short.dst, 8], [short.src, short.dst, 8]]);
        assert_eq!(publishing_copy(&two, CopyPath::Auto), None);
        // The pieces a grid-filling cut makes of one short copy are still that one copy.
        let cut = Pieces {
            most: 64 << 10,
            full_grid: 8448,
        };
        let pieces = &launches(&[short], CopyPath::Kernel, true, 4, cut)[0];
        assert!(matches!(pieces, Launch::Kernel(entries) if entries.len() == 16));
        assert_eq!(publishing_copy(pieces, CopyPath::Kernel), Some(short));
        let gap = Launch::Kernel(vec![
            [short.src, short.dst, 8],
            [short.src + 16, short.dst + 16, 8],
        ]);
        assert_eq!(publishing_copy(&gap, CopyPath::Kernel), None);
    }

    #[test]
    fn copy_paths_parse_and_print() {
        for path in [
            CopyPath::Auto,
            CopyPath::CopyEngine,
            CopyPath::Batched,
            CopyPath::Kernel,
        ] {
            assert_eq!(path.to_string().parse::<CopyPath>(), Ok(path));
        }
        assert!("dma".parse::<CopyPath>().is_err());
    }
}
