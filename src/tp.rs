//! Tensor-parallel KV caches: which KV heads each prefill rank sends to each decode rank when
//! the two sides split the heads differently (prefill TP=4, decode TP=2, for example), and the
//! paged block copy that sends them.
//!
//! Each rank's block holds its heads back to back (`[heads][tokens][dim]`), so the heads two
//! ranks share are one byte sub-range of each side's block.

use crate::{BlockCopy, BlockLayout};
use std::sync::Arc;

/// How the KV heads are split on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSplit {
    /// KV heads of the model (8 for Llama-3-70B).
    pub heads: u32,
    /// Bytes of one head in one block (tokens per block x head dim x element size).
    pub head_bytes: u64,
    /// Tensor-parallel ranks on the prefill side.
    pub prefill_tp: u32,
    /// Tensor-parallel ranks on the decode side.
    pub decode_tp: u32,
}

/// The side of a disaggregated pair a tensor-parallel degree belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpSide {
    /// The ranks that compute the KV cache and send it.
    Prefill,
    /// The ranks that receive the KV cache.
    Decode,
}

impl std::fmt::Display for TpSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TpSide::Prefill => "prefill",
            TpSide::Decode => "decode",
        })
    }
}

/// Why a [`HeadSplit`] cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeadSplitError {
    /// A side's rank count is 0 or does not divide the heads.
    #[error("{heads} KV heads cannot be split evenly over {side} TP={tp}; use a TP degree that divides the number of KV heads")]
    Uneven {
        /// KV heads of the model.
        heads: u32,
        /// The side whose ranks do not divide them.
        side: TpSide,
        /// That side's rank count.
        tp: u32,
    },
    /// `head_bytes` is 0.
    #[error("a head needs at least one byte per block; set head_bytes to tokens per block x head dim x element size")]
    EmptyHead,
}

impl From<HeadSplitError> for crate::Error {
    /// A head split is the caller's configuration: [`crate::Error::ApiMisuse`] with its message.
    fn from(error: HeadSplitError) -> Self {
        crate::Error::ApiMisuse(error.to_string())
    }
}

/// The heads one prefill rank sends to one decode rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSlice {
    /// The sending rank.
    pub prefill_rank: u32,
    /// The receiving rank.
    pub decode_rank: u32,
    /// The first head, counted over the whole model.
    pub first_head: u32,
    /// Number of heads.
    pub heads: u32,
}

impl HeadSplit {
    /// Checks that both sides divide the heads evenly.
    ///
    /// # Errors
    /// [`HeadSplitError::Uneven`] naming the side whose rank count does not divide the heads,
    /// [`HeadSplitError::EmptyHead`] for `head_bytes == 0`.
    pub fn validate(&self) -> Result<(), HeadSplitError> {
        for (side, tp) in [
            (TpSide::Prefill, self.prefill_tp),
            (TpSide::Decode, self.decode_tp),
        ] {
            if tp == 0 || self.heads % tp != 0 {
                return Err(HeadSplitError::Uneven {
                    heads: self.heads,
                    side,
                    tp,
                });
            }
        }
        if self.head_bytes == 0 {
            return Err(HeadSplitError::EmptyHead);
        }
        Ok(())
    }

    /// Heads each rank of a side with `tp` ranks holds.
    fn per_rank(&self, tp: u32) -> u32 {
        self.heads / tp.max(1)
    }

    /// Bytes of one block on a prefill rank.
    pub fn prefill_block_bytes(&self) -> u64 {
        u64::from(self.per_rank(self.prefill_tp)) * self.head_bytes
    }

    /// Bytes of one block on a decode rank.
    pub fn decode_block_bytes(&self) -> u64 {
        u64::from(self.per_rank(self.decode_tp)) * self.head_bytes
    }

    /// Every (prefill rank, decode rank) pair that shares heads, with the heads it shares.
    pub fn slices(&self) -> Vec<HeadSlice> {
        let (from, to) = (
            self.per_rank(self.prefill_tp),
            self.per_rank(self.decode_tp),
        );
        let mut slices = Vec::new();
        for prefill_rank in 0..self.prefill_tp {
            let (start, end) = (prefill_rank * from, (prefill_rank + 1) * from);
            for decode_rank in 0..self.decode_tp {
                let first = start.max(decode_rank * to);
                let last = end.min((decode_rank + 1) * to);
                if first < last {
                    slices.push(HeadSlice {
                        prefill_rank,
                        decode_rank,
                        first_head: first,
                        heads: last - first,
                    });
                }
            }
        }
        slices
    }

    /// The block layouts of `slice` over pools of `pool_blocks` blocks: the prefill rank's
    /// side first, the decode rank's second; each names the byte sub-range of its rank's block
    /// that the slice's heads occupy.
    pub fn layouts(&self, slice: &HeadSlice, pool_blocks: u64) -> (BlockLayout, BlockLayout) {
        let (from, to) = (
            self.per_rank(self.prefill_tp),
            self.per_rank(self.decode_tp),
        );
        let prefill = BlockLayout {
            pool_bytes: pool_blocks * self.prefill_block_bytes(),
            block_stride: self.prefill_block_bytes(),
            offset: u64::from(slice.first_head - slice.prefill_rank * from) * self.head_bytes,
        };
        let decode = BlockLayout {
            pool_bytes: pool_blocks * self.decode_block_bytes(),
            block_stride: self.decode_block_bytes(),
            offset: u64::from(slice.first_head - slice.decode_rank * to) * self.head_bytes,
        };
        (prefill, decode)
    }

    /// Bytes of `slice` in one block.
    pub fn slice_bytes(&self, slice: &HeadSlice) -> u64 {
        u64::from(slice.heads) * self.head_bytes
    }

    /// The block copy for `slice` over pools of `pool_blocks` blocks on both sides, moving
    /// block `local_ids[i]` of the prefill rank to block `remote_ids[i]` of the decode rank;
    /// add the pools (one per layer and K/V) with [`BlockCopy::pool`] or [`BlockCopy::pool_at`].
    pub fn block_copy(
        &self,
        slice: &HeadSlice,
        pool_blocks: u64,
        local_ids: Arc<[u32]>,
        remote_ids: Arc<[u32]>,
    ) -> BlockCopy {
        let (local, remote) = self.layouts(slice, pool_blocks);
        BlockCopy::new(
            self.slice_bytes(slice),
            local,
            remote,
            local_ids,
            remote_ids,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(prefill_tp: u32, decode_tp: u32) -> HeadSplit {
        HeadSplit {
            heads: 8,
            head_bytes: 4096,
            prefill_tp,
            decode_tp,
        }
    }

    #[test]
    fn every_head_goes_from_its_prefill_rank_to_its_decode_rank_exactly_once() {
        for (p, d) in [
            (1, 1),
            (2, 1),
            (1, 2),
            (4, 2),
            (2, 4),
            (4, 4),
            (8, 2),
            (2, 8),
        ] {
            let split = split(p, d);
            split.validate().unwrap();
            let mut seen = [0u32; 8];
            for slice in split.slices() {
                for head in slice.first_head..slice.first_head + slice.heads {
                    seen[head as usize] += 1;
                    assert_eq!(head / (8 / p), slice.prefill_rank, "{p}->{d} head {head}");
                    assert_eq!(head / (8 / d), slice.decode_rank, "{p}->{d} head {head}");
                }
            }
            assert_eq!(seen, [1; 8], "{p}->{d}");
        }
    }

    #[test]
    fn tp4_to_tp2_places_each_half_of_a_decode_block() {
        let split = split(4, 2);
        assert_eq!(split.prefill_block_bytes(), 2 * 4096);
        assert_eq!(split.decode_block_bytes(), 4 * 4096);
        let slices = split.slices();
        assert_eq!(slices.len(), 4);
        // Prefill rank 1 holds heads 2-3: the second half of decode rank 0's block.
        assert_eq!(
            slices[1],
            HeadSlice {
                prefill_rank: 1,
                decode_rank: 0,
                first_head: 2,
                heads: 2
            }
        );
    }

    #[test]
    fn tp2_to_tp4_sends_each_half_of_a_prefill_block_to_its_own_decode_rank() {
        let split = split(2, 4);
        let slices = split.slices();
        // Prefill rank 0 holds heads 0-3: heads 0-1 to decode rank 0, heads 2-3 to rank 1.
        let (first, second) = (slices[0], slices[1]);
        assert_eq!((first.decode_rank, second.decode_rank), (0, 1));
        let (prefill, decode) = split.layouts(&second, 16);
        assert_eq!(prefill.block_stride, 4 * 4096);
        assert_eq!(prefill.offset, 2 * 4096);
        assert_eq!(prefill.pool_bytes, 16 * 4 * 4096);
        assert_eq!(decode.block_stride, 2 * 4096);
        assert_eq!(decode.offset, 0);
        assert_eq!(split.slice_bytes(&second), 2 * 4096);
    }

    #[test]
    fn uneven_splits_are_refused_naming_the_side() {
        assert_eq!(
            split(3, 2).validate(),
            Err(HeadSplitError::Uneven {
                heads: 8,
                side: TpSide::Prefill,
                tp: 3
            })
        );
        let error = split(2, 0).validate().unwrap_err();
        assert_eq!(
            error.to_string(),
            "8 KV heads cannot be split evenly over decode TP=0; use a TP degree that divides the number of KV heads"
        );
        let ferry_error: crate::Error = error.into();
        assert!(
            matches!(&ferry_error, crate::Error::ApiMisuse(text) if text.contains("decode TP=0")),
            "{ferry_error:?}"
        );
    }
}
