//! A peer's buffers mapped here: each export opened once (its IPC handle confirmed with its
//! engine first), each descriptor remembered with its mapping, and the bounds every copy is
//! checked against.

use super::*;

/// A peer buffer descriptor planned before (kept, so that no other descriptor takes its
/// address) and the mapping it lies in.
pub(super) type Known = (Arc<BufferDescriptor>, Arc<Opened>);

/// The peer mappings a transfer's copies go through, by identity, held until the copies are
/// done, so that closing the link meanwhile unmaps nothing the GPU still uses. A map rather
/// than a list: a request over a pool per layer holds hundreds, each looked up per pool.
pub(super) type Held = FxHashMap<usize, Arc<Opened>>;

impl NvlinkLink {
    /// Maps the exports of every distinct buffer of `remotes` not mapped yet into GPU
    /// `ordinal`, so that planning finds them all ([`Self::mapped`]).
    pub(super) async fn map_all<'a>(
        &self,
        remotes: impl Iterator<Item = &'a Arc<BufferDescriptor>>,
        ordinal: u32,
    ) -> Result<()> {
        if self.local_peer.is_some() {
            return Ok(());
        }
        let mut missing: Vec<&Arc<BufferDescriptor>> = Vec::new();
        {
            let known = self.known.lock();
            // Consecutive ops mostly name one buffer: a repeat of the one looked at last
            // skips the map, which a list of thousands of flat copies would otherwise hash
            // once each.
            let mut previous: Option<&Arc<BufferDescriptor>> = None;
            for remote in remotes {
                if previous.is_some_and(|previous| Arc::ptr_eq(previous, remote)) {
                    continue;
                }
                previous = Some(remote);
                if !known.contains_key(&descriptor_key(remote)) {
                    missing.push(remote);
                }
            }
        }
        for remote in missing {
            let Some(export) = remote.export(self.transport) else {
                return Err(self.refused("its buffer carries no export"));
            };
            let mapped = self.mappings.lock().get(export).cloned();
            let opened = match mapped {
                Some(opened) => opened,
                None => {
                    let decoded = GpuExport::of(remote, self.transport)
                        .map_err(|violation| self.fail(violation))?
                        .ok_or_else(|| self.refused("its buffer carries no export"))?;
                    bounds::export_owner(&decoded, self.instance)
                        .map_err(|violation| self.fail(violation))?;
                    let owner = Owner {
                        socket: &self.socket,
                        region: remote.addr,
                        silent: &self.owner_silent,
                    };
                    let opened = PeerMapping::open(
                        Context::get(ordinal)?,
                        &decoded,
                        owner,
                        self.secret.as_ref(),
                    )
                    .await
                    .map_err(|error| match error {
                        OpenError::Peer(violation) => self.fail(violation),
                        OpenError::Local(reason) => self.refused(&reason.to_string()),
                    })?;
                    let opened = Arc::new(opened);
                    self.mappings
                        .lock()
                        .insert(export.clone(), Arc::clone(&opened));
                    opened
                }
            };
            let mut known = self.known.lock();
            // Descriptors of views the peer has since replaced would otherwise pile up.
            if known.len() >= KNOWN_MOST {
                known.clear();
            }
            known.insert(descriptor_key(remote), (Arc::clone(remote), opened));
        }
        Ok(())
    }

    /// Where `remote` is mapped in this process ([`Self::map_all`] mapped it); the mapping is
    /// added to `held`. The buffer must lie inside what the driver really mapped.
    pub(super) fn mapped(
        &self,
        remote: &BufferDescriptor,
        held: &mut Held,
    ) -> Result<MappedBuffer> {
        if let Some(instance) = self.local_peer {
            if !ferry_core::local_engine_registered(instance, remote.addr, remote.len) {
                return Err(self.fail(ProtocolViolation::Descriptor {
                    field: "addr",
                    problem: format!(
                        "names {} bytes at {:#x}, which the engine of this process does not have registered",
                        remote.len, remote.addr
                    ),
                }));
            }
            return MappedBuffer::in_place(remote.addr, remote.len)
                .map_err(|violation| self.fail(violation));
        }
        let known = self
            .known
            .lock()
            .get(&descriptor_key(remote))
            .map(|(_, opened)| Arc::clone(opened));
        let opened = known.or_else(|| {
            remote
                .export(self.transport)
                .and_then(|export| self.mappings.lock().get(export).cloned())
        });
        let Some(opened) = opened else {
            // Mapped before planning began, so only a close since can have dropped it.
            self.still_alive()?;
            return Err(self.refused("a buffer's mapping went away while the transfer was planned"));
        };
        let buffer = MappedBuffer::place(
            opened.mapping.base(),
            opened.len,
            opened.offset,
            remote.addr,
            remote.len,
        )
        .map_err(|violation| self.fail(violation))?;
        held.entry(Arc::as_ptr(&opened) as usize).or_insert(opened);
        Ok(buffer)
    }
}

/// Most descriptors [`NvlinkLink::known`] keeps before it starts over.
pub(super) const KNOWN_MOST: usize = 1 << 16;

/// A peer buffer descriptor's identity while [`NvlinkLink::known`] holds it: its address.
pub(super) fn descriptor_key(remote: &BufferDescriptor) -> usize {
    remote as *const BufferDescriptor as usize
}
