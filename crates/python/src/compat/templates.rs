//! The block copies of a peer's last paged submit, their pools already found in the local
//! regions and the peer's buffers, kept for the next submit that names the same pools: every
//! request of a model names the same pool per layer and K/V, and finding a request's 160 pools
//! again cost as much as planning its 40,960 block ids.

use super::paged::PagedCopy;
use ferry::BlockCopy;
use parking_lot::Mutex;
use std::sync::Arc;

/// The copies built for one submit (each beside the paged copy it was built from, without
/// ids), and the registrations' generation they were found in.
struct Kept {
    generation: u64,
    copies: Vec<(PagedCopy, BlockCopy)>,
}

/// One peer's kept copies, shared by every clone of its open peer.
#[derive(Clone, Default)]
pub(crate) struct Templates(Arc<Mutex<Option<Kept>>>);

impl Templates {
    /// `copies` as block copies with their own ids, when the last ones kept name the same pools
    /// in the same order and no registration changed since (`generation`); `None` otherwise.
    pub(crate) fn reuse(&self, generation: u64, copies: &[PagedCopy]) -> Option<Vec<BlockCopy>> {
        let kept = self.0.lock();
        let kept = kept.as_ref()?;
        let same = kept.generation == generation
            && kept.copies.len() == copies.len()
            && kept
                .copies
                .iter()
                .zip(copies)
                .all(|((kept, _), paged)| kept.same_pools(paged));
        same.then(|| {
            kept.copies
                .iter()
                .zip(copies)
                .map(|((_, template), paged)| {
                    template
                        .clone()
                        .with_ids(Arc::clone(&paged.local_ids), Arc::clone(&paged.remote_ids))
                })
                .collect()
        })
    }

    /// Keeps `built`, the block copies of `copies` found in registrations of `generation`
    /// (without their ids, which the next request replaces).
    pub(crate) fn keep(&self, generation: u64, copies: &[PagedCopy], built: &[BlockCopy]) {
        let kept = copies.iter().zip(built).map(|(paged, copy)| {
            (
                paged.without_ids(),
                copy.clone().with_ids(Vec::new(), Vec::new()),
            )
        });
        *self.0.lock() = Some(Kept {
            generation,
            copies: kept.collect(),
        });
    }

    /// Forgets the kept copies (and the regions they hold).
    pub(crate) fn clear(&self) {
        self.0.lock().take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::BlockLayout;

    fn paged(pools: Vec<(u64, u64)>, ids: &[u32]) -> PagedCopy {
        let layout = BlockLayout::packed(1 << 20, 4096);
        PagedCopy {
            len: 4096,
            local: layout,
            remote: layout,
            local_ids: ids.into(),
            remote_ids: ids.iter().map(|id| id + 1).collect(),
            pools,
        }
    }

    fn built(copy: &PagedCopy) -> BlockCopy {
        BlockCopy::new(
            copy.len,
            copy.local,
            copy.remote,
            Arc::clone(&copy.local_ids),
            Arc::clone(&copy.remote_ids),
        )
    }

    #[test]
    fn the_same_pools_are_reused_with_each_requests_own_ids() {
        let templates = Templates::default();
        let first = paged(vec![(0x1000, 0x9000)], &[1, 2]);
        assert!(templates.reuse(7, std::slice::from_ref(&first)).is_none());
        templates.keep(7, std::slice::from_ref(&first), &[built(&first)]);
        let next = paged(vec![(0x1000, 0x9000)], &[5, 6, 7]);
        let reused = templates
            .reuse(7, std::slice::from_ref(&next))
            .expect("the same pools in the same generation");
        assert_eq!(reused.len(), 1);
        let shown = format!("{:?}", reused[0]);
        assert!(shown.contains("local_ids: [5, 6, 7]"), "{shown}");
        assert!(shown.contains("remote_ids: [6, 7, 8]"), "{shown}");
    }

    #[test]
    fn other_pools_another_generation_or_a_cleared_peer_build_afresh() {
        let templates = Templates::default();
        let first = paged(vec![(0x1000, 0x9000), (0x2000, 0xa000)], &[1]);
        templates.keep(3, std::slice::from_ref(&first), &[built(&first)]);
        let moved = paged(vec![(0x1000, 0x9000), (0x2000, 0xb000)], &[1]);
        assert!(templates.reuse(3, &[moved]).is_none());
        let fewer = paged(vec![(0x1000, 0x9000)], &[1]);
        assert!(templates.reuse(3, &[fewer]).is_none());
        assert!(templates.reuse(4, std::slice::from_ref(&first)).is_none());
        assert!(templates
            .reuse(3, &[first.clone(), first.clone()])
            .is_none());
        assert!(templates.reuse(3, std::slice::from_ref(&first)).is_some());
        templates.clear();
        assert!(templates.reuse(3, &[first]).is_none());
    }
}
