//! A remote engine opened by name: its descriptor and the links to it.

use crate::descriptor::{BufferDescriptor, SegmentDescriptor};
use crate::error::{Error, Result};
use crate::memory::RegionEntry;
use crate::metadata::MetadataStore;
use crate::transport::{Link, Transport};
use parking_lot::{Mutex, MutexGuard, RwLock};
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::Arc;
use std::task::Poll;

/// What a peer needs of its engine: the transports (in the engine's order), the control one
/// and the metadata store its descriptor comes from.
#[derive(Clone, Copy)]
pub(crate) struct PeerContext<'a> {
    pub(crate) control: &'a dyn Transport,
    pub(crate) transports: &'a [Arc<dyn Transport>],
    pub(crate) metadata: &'a dyn MetadataStore,
}

/// A remote engine this engine can move data to and from. Cheap to clone.
#[derive(Clone)]
pub struct Peer {
    pub(crate) inner: Arc<PeerInner>,
}

pub(crate) struct PeerInner {
    name: Arc<str>,
    view: RwLock<Arc<PeerView>>,
    /// The control transport's link, which carries notifications; reopened when it has failed.
    control: Mutex<Arc<dyn Link>>,
    links: Mutex<HashMap<&'static str, Arc<dyn Link>>>,
    /// Which link notifications to the peer take.
    messages: Mutex<MessagePath>,
    /// Taken, first come first served, to find the link a notification goes over: a link
    /// still opening then holds back the notifications sent after the one that opens it.
    message_turn: tokio::sync::Mutex<()>,
}

/// Which link carries the notifications to one peer: chosen at the first notification, given
/// up for the control link when that link answers `Unavailable` (before it sent anything, and
/// once nothing it sent can still arrive), and chosen again for a peer that restarted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MessagePath {
    /// Chosen at the first notification.
    Unchosen,
    /// The link of the engine's transport of this index and name, which carries
    /// notifications itself.
    Through(usize, &'static str),
    /// The link of the control transport of this name.
    Control(&'static str),
}

/// Pairs of a local region and a remote buffer one view remembers the transport of, at most.
const MAX_ROUTES: usize = 4096;

/// A descriptor with its buffers sorted by address, for quick lookups.
pub(crate) struct PeerView {
    pub(crate) descriptor: SegmentDescriptor,
    /// The descriptor's buffers by address, shared with the ops that name them by index.
    sorted: Arc<[Arc<BufferDescriptor>]>,
    /// `(addr, len)` of each buffer of `sorted`, in its order: searched without visiting every
    /// descriptor on the way, as each pool of a paged copy is looked up.
    bounds: Box<[(u64, u64)]>,
    /// The transport chosen for each pair of a local region (its registration's sequence)
    /// and a remote buffer (where this view holds it) so far ([`PeerView::route`]).
    routes: Mutex<FxHashMap<(u64, usize), usize>>,
}

/// [`PeerView`]'s route cache, held locked between look-ups.
pub(crate) struct Routes<'a> {
    known: MutexGuard<'a, FxHashMap<(u64, usize), usize>>,
}

impl Routes<'_> {
    /// As [`PeerView::route`].
    pub(crate) fn route(
        &mut self,
        local: &RegionEntry,
        remote: &Arc<BufferDescriptor>,
        choose: impl FnOnce() -> Result<usize>,
    ) -> Result<usize> {
        // Every remote buffer of a batch is one of this view's, so its place is its identity.
        let key = (local.sequence, Arc::as_ptr(remote) as usize);
        if let Some(&transport) = self.known.get(&key) {
            return Ok(transport);
        }
        // The transports are asked unlocked, so batches to this peer on other threads do not
        // wait on them.
        let transport = MutexGuard::unlocked(&mut self.known, choose)?;
        // Regions registered and dropped per request would grow the map for as long as the
        // view lasts: past a bound it starts over, and the transports are asked again.
        if self.known.len() >= MAX_ROUTES {
            self.known.clear();
        }
        self.known.insert(key, transport);
        Ok(transport)
    }
}

impl PeerView {
    /// The view of `descriptor`.
    pub(crate) fn new(descriptor: SegmentDescriptor) -> Self {
        let mut sorted: Vec<Arc<BufferDescriptor>> =
            descriptor.buffers.iter().cloned().map(Arc::new).collect();
        sorted.sort_by_key(|buffer| buffer.addr);
        let bounds = sorted
            .iter()
            .map(|buffer| (buffer.addr, buffer.len))
            .collect();
        PeerView {
            descriptor,
            sorted: sorted.into(),
            bounds,
            routes: Mutex::default(),
        }
    }

    /// The buffer holding all of `addr..addr+len`.
    pub(crate) fn covering(&self, addr: u64, len: u64) -> Option<&Arc<BufferDescriptor>> {
        self.covering_index(addr, len)
            .map(|index| &self.sorted[index])
    }

    /// The index in [`PeerView::buffers`] of the buffer holding all of `addr..addr+len`.
    pub(crate) fn covering_index(&self, addr: u64, len: u64) -> Option<usize> {
        let end = addr.checked_add(len)?;
        let index = self.bounds.partition_point(|&(start, _)| start <= addr);
        let index = index.checked_sub(1)?;
        let &(start, len) = self.bounds.get(index)?;
        (end <= start.saturating_add(len)).then_some(index)
    }

    /// The transport (by index) that moves bytes between the local region `local` and
    /// `remote`, from `choose` the first time the pair is asked about. Transports answer
    /// differently only once they have read a new descriptor of the peer, which comes with a
    /// new view, so the answer holds for this view's life; refusals are not kept.
    pub(crate) fn route(
        &self,
        local: &RegionEntry,
        remote: &Arc<BufferDescriptor>,
        choose: impl FnOnce() -> Result<usize>,
    ) -> Result<usize> {
        self.routes().route(local, remote, choose)
    }

    /// The route cache of [`PeerView::route`], locked once for many look-ups: a paged copy
    /// asks about each of its pools, hundreds for a pool per layer.
    pub(crate) fn routes(&self) -> Routes<'_> {
        Routes {
            known: self.routes.lock(),
        }
    }

    /// The descriptor's buffers, sorted by address.
    pub(crate) fn buffers(&self) -> &Arc<[Arc<BufferDescriptor>]> {
        &self.sorted
    }
}

impl Peer {
    /// A peer reached first through `control`, the link of the engine's control transport
    /// named `transport`.
    pub(crate) fn new(
        descriptor: SegmentDescriptor,
        transport: &'static str,
        control: Arc<dyn Link>,
    ) -> Peer {
        let mut links: HashMap<&'static str, Arc<dyn Link>> = HashMap::new();
        links.insert(transport, Arc::clone(&control));
        Peer {
            inner: Arc::new(PeerInner {
                name: Arc::from(descriptor.name.as_str()),
                view: RwLock::new(Arc::new(PeerView::new(descriptor))),
                control: Mutex::new(control),
                links: Mutex::new(links),
                messages: Mutex::new(MessagePath::Unchosen),
                message_turn: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// The peer's name: the engine name it was connected with.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The peer's segment name, shared: a label that costs no copy.
    pub(crate) fn shared_name(&self) -> Arc<str> {
        Arc::clone(&self.inner.name)
    }

    /// The peer's descriptor as last fetched.
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.view().descriptor.clone()
    }

    /// The peer's registered buffers as last fetched, in the order it registered them.
    pub fn buffers(&self) -> Vec<BufferDescriptor> {
        self.view().descriptor.buffers.clone()
    }

    /// The peer's buffer its owner named `name` ([`crate::Region::set_name`]), as last
    /// fetched; `None` when it has none of that name (reconnect to see newer names).
    pub fn buffer(&self, name: &str) -> Option<BufferDescriptor> {
        self.view()
            .descriptor
            .buffers
            .iter()
            .find(|buffer| buffer.name.as_deref() == Some(name))
            .cloned()
    }

    /// The peer's buffer holding the byte at `addr` (an address in the peer's process), as
    /// last fetched: for callers that were given addresses rather than buffer names.
    pub fn buffer_at(&self, addr: u64) -> Option<BufferDescriptor> {
        self.view()
            .covering(addr, 1)
            .map(|buffer| (**buffer).clone())
    }

    /// False once the control connection to the peer has failed. The next notification or
    /// [`crate::Engine::connect`] opens a new one.
    pub fn is_alive(&self) -> bool {
        self.inner.control.lock().is_alive()
    }

    /// The link notifications go over. When the old one failed (the peer restarted, a
    /// connection broke), the descriptor is fetched afresh and a new link opened.
    pub(crate) async fn control(&self, engine: PeerContext<'_>) -> Result<Arc<dyn Link>> {
        let current = Arc::clone(&self.inner.control.lock());
        if current.is_alive() {
            return Ok(current);
        }
        let before = self.view().descriptor.instance;
        let view = self.refresh(engine).await?;
        let transport = engine.control;
        let fresh = transport.open(&view.descriptor).await?;
        *self.inner.control.lock() = Arc::clone(&fresh);
        let mut links = self.inner.links.lock();
        if view.descriptor.instance != before {
            // A new engine answers at the name (the peer restarted): every other link still
            // leads to the old one, and its notifications may take another path.
            links.clear();
            *self.inner.messages.lock() = MessagePath::Unchosen;
        }
        links.insert(transport.name(), Arc::clone(&fresh));
        Ok(fresh)
    }

    /// Hands `payload` to the peer's inbox: through the link of the first transport that
    /// carries notifications to this peer ([`Transport::carries_notifications`]), or over the
    /// control link, also from the first time that link could not.
    ///
    /// # Cancel safety
    /// As [`Link::notify`].
    pub(crate) async fn notify(&self, engine: PeerContext<'_>, payload: &[u8]) -> Result<()> {
        // Notifications keep their order because each takes its turn here and its link's
        // `notify` is first polled (which queues it there) before the next one's turn comes.
        let turn = self.inner.message_turn.lock().await;
        let (link, control) = self.message_link(engine).await?;
        if let Some((transport, link)) = link {
            let mut sending = link.notify(payload);
            match futures::poll!(sending.as_mut()) {
                Poll::Ready(Err(error @ Error::Unavailable { .. })) => {
                    self.notify_over_control(engine, transport, &error);
                }
                Poll::Ready(outcome) => return outcome,
                Poll::Pending => {
                    drop(turn);
                    return sending.await;
                }
            }
        }
        let mut sending = control.notify(payload);
        let first = futures::poll!(sending.as_mut());
        drop(turn);
        match first {
            Poll::Ready(outcome) => outcome,
            Poll::Pending => sending.await,
        }
    }

    /// Sends this peer's notifications over the control link from now on, since `transport`'s
    /// link could not carry them (`error` says why).
    fn notify_over_control(&self, engine: PeerContext<'_>, transport: &str, error: &Error) {
        tracing::info!(peer = %self.name(), transport, %error, "notifications to this peer go over the control connection");
        *self.inner.messages.lock() = MessagePath::Control(engine.control.name());
    }

    /// The link of the transport that carries notifications to this peer (with its name),
    /// if one does, and the control link.
    async fn message_link(
        &self,
        engine: PeerContext<'_>,
    ) -> Result<(Option<(&'static str, Arc<dyn Link>)>, Arc<dyn Link>)> {
        // The control link notices a peer that restarted, and then brings its new descriptor.
        let control = self.control(engine).await?;
        let MessagePath::Through(index, name) = self.message_path(engine) else {
            return Ok((None, control));
        };
        match self.link(engine.transports[index].as_ref()).await {
            Ok(link) => Ok((Some((name, link)), control)),
            Err(error) => {
                self.notify_over_control(engine, name, &error);
                Ok((None, control))
            }
        }
    }

    /// Which link carries notifications to this peer, chosen now if no notification chose it
    /// yet.
    fn message_path(&self, engine: PeerContext<'_>) -> MessagePath {
        let mut path = self.inner.messages.lock();
        if *path == MessagePath::Unchosen {
            let descriptor = &self.view().descriptor;
            *path = engine
                .transports
                .iter()
                .position(|transport| transport.carries_notifications(descriptor))
                .map_or(MessagePath::Control(engine.control.name()), |index| {
                    MessagePath::Through(index, engine.transports[index].name())
                });
        }
        *path
    }

    /// The index of the engine's transport whose link carries notifications to this peer
    /// itself; `None` when they go over the control link.
    pub(crate) fn message_transport(&self, engine: PeerContext<'_>) -> Option<usize> {
        match self.message_path(engine) {
            MessagePath::Through(index, _) => Some(index),
            MessagePath::Unchosen | MessagePath::Control(_) => None,
        }
    }

    /// The transport whose link carries notifications to this peer: one that has a path of
    /// its own (`nvlink`'s shared memory between processes of one host), or the control
    /// transport (`tcp`). `None` until the first notification to the peer chose it.
    pub fn notifications_through(&self) -> Option<&'static str> {
        match *self.inner.messages.lock() {
            MessagePath::Unchosen => None,
            MessagePath::Through(_, name) | MessagePath::Control(name) => Some(name),
        }
    }

    pub(crate) fn view(&self) -> Arc<PeerView> {
        Arc::clone(&self.inner.view.read())
    }

    pub(crate) fn update(&self, descriptor: SegmentDescriptor) -> Arc<PeerView> {
        let view = Arc::new(PeerView::new(descriptor));
        *self.inner.view.write() = Arc::clone(&view);
        view
    }

    /// Fetches the descriptor again, for addresses the cached one does not cover, and lets
    /// every transport read it.
    pub(crate) async fn refresh(&self, engine: PeerContext<'_>) -> Result<Arc<PeerView>> {
        let descriptor = engine.metadata.fetch(&self.inner.name).await?;
        for transport in engine.transports {
            transport.import(&descriptor).await;
        }
        Ok(self.update(descriptor))
    }

    /// The open link through `transport`, opening it on first use.
    pub(crate) async fn link(&self, transport: &dyn Transport) -> Result<Arc<dyn Link>> {
        let cached = self.inner.links.lock().get(transport.name()).cloned();
        if let Some(link) = cached.filter(|link| link.is_alive()) {
            return Ok(link);
        }
        let link = transport.open(&self.view().descriptor).await?;
        self.inner
            .links
            .lock()
            .insert(transport.name(), Arc::clone(&link));
        Ok(link)
    }

    /// Whether both handles are the same opened peer.
    pub(crate) fn same(&self, other: &Peer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Closes every link, failing whatever is still in flight on them.
    pub(crate) fn close(&self) {
        for link in self.inner.links.lock().values() {
            link.close();
        }
    }
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("name", &self.inner.name)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::PeerView;
    use crate::descriptor::{
        BufferDescriptor, HostIdentity, SegmentDescriptor, DESCRIPTOR_VERSION,
    };
    use crate::memory::Location;

    #[test]
    fn coverage_is_exact_at_both_ends() {
        let buffer = |addr| BufferDescriptor {
            addr,
            len: 0x1000,
            location: Location::Host { pinned: false },
            name: None,
            exports: Vec::new(),
        };
        let view = PeerView::new(SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: "127.0.0.1:7000".into(),
            host: HostIdentity::current(),
            generation: 1,
            instance: crate::InstanceId::from_u128(7),
            process: crate::InstanceId::from_u128(7),
            pid: 7,
            endpoints: Vec::new(),
            gpus: Vec::new(),
            buffers: vec![buffer(0x5000), buffer(0x1000)],
            signature: None,
        });
        assert!(view.covering(0x1000, 0x1000).is_some());
        assert!(view.covering(0x1fff, 1).is_some());
        assert!(view.covering(0x1fff, 2).is_none());
        assert!(view.covering(0xfff, 1).is_none());
        assert!(view.covering(u64::MAX, 2).is_none());
    }
}
