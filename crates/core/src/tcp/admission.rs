//! Which accepted connections the listener keeps: a sans-IO ledger of strangers (connections
//! that have not authenticated, or, without a secret, not said hello) and peers (those that
//! have).
//!
//! Strangers get a budget of their own, smaller than the peers' and split per source address:
//! a stranger over its source's share, or over the whole budget, evicts the oldest stranger
//! (of its source first) instead of being refused, so a flood of silent or slow connections
//! only ever evicts itself and never keeps a real peer from reaching its handshake. Peers are
//! counted apart and never evicted; a stranger that authenticates when the peers' cap is full
//! is refused then.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

/// How many connections of each kind the listener keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AdmissionLimits {
    /// Connections that have authenticated (or said hello, without a secret).
    pub(crate) peers: usize,
    /// Connections that have not, all sources together.
    pub(crate) strangers: usize,
    /// Connections that have not, from one source address.
    pub(crate) strangers_per_source: usize,
}

/// A connection's place in the ledger, from [`Admission::arrive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket(u64);

/// Why a stranger could not become a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The peers' cap is reached.
    PeersFull,
    /// The ticket is no stranger's: it was evicted, or promoted already.
    NotWaiting,
}

/// A stranger: its ticket, its source and what closes its connection.
#[derive(Debug)]
struct Stranger<C> {
    ticket: Ticket,
    source: IpAddr,
    closer: C,
}

/// The ledger; `C` is what closes a stranger's connection, handed back when it is evicted.
#[derive(Debug)]
pub(crate) struct Admission<C> {
    limits: AdmissionLimits,
    next: u64,
    /// Strangers, oldest first.
    strangers: VecDeque<Stranger<C>>,
    per_source: HashMap<IpAddr, usize>,
    peers: usize,
}

impl<C> Admission<C> {
    /// An empty ledger; every limit is at least 1.
    pub(crate) fn new(limits: AdmissionLimits) -> Admission<C> {
        Admission {
            limits: AdmissionLimits {
                peers: limits.peers.max(1),
                strangers: limits.strangers.max(1),
                strangers_per_source: limits.strangers_per_source.max(1),
            },
            next: 0,
            strangers: VecDeque::new(),
            per_source: HashMap::new(),
            peers: 0,
        }
    }

    /// Records a connection from `source`, closed by `closer`, as a stranger; returns its
    /// ticket and the stranger it evicts to make room, if any, with its closer (which the
    /// caller uses).
    pub(crate) fn arrive(&mut self, source: IpAddr, closer: C) -> (Ticket, Option<(Ticket, C)>) {
        let from_source = self.per_source.get(&source).copied().unwrap_or(0);
        let evicted = if from_source >= self.limits.strangers_per_source {
            self.strangers
                .iter()
                .find(|stranger| stranger.source == source)
                .map(|stranger| stranger.ticket)
        } else if self.strangers.len() >= self.limits.strangers {
            self.strangers.front().map(|stranger| stranger.ticket)
        } else {
            None
        };
        let evicted = evicted.and_then(|ticket| Some((ticket, self.forget(ticket)?)));
        let ticket = Ticket(self.next);
        self.next += 1;
        self.strangers.push_back(Stranger {
            ticket,
            source,
            closer,
        });
        *self.per_source.entry(source).or_insert(0) += 1;
        (ticket, evicted)
    }

    /// Makes the stranger `ticket` a peer.
    pub(crate) fn promote(&mut self, ticket: Ticket) -> Result<(), Refused> {
        if self.forget(ticket).is_none() {
            return Err(Refused::NotWaiting);
        }
        if self.peers >= self.limits.peers {
            return Err(Refused::PeersFull);
        }
        self.peers += 1;
        Ok(())
    }

    /// A stranger's connection ended (it failed its handshake, timed out, or was evicted and
    /// has now closed); nothing happens for a ticket already gone.
    pub(crate) fn stranger_left(&mut self, ticket: Ticket) {
        self.forget(ticket);
    }

    /// A peer's connection ended.
    pub(crate) fn peer_left(&mut self) {
        self.peers = self.peers.saturating_sub(1);
    }

    /// Strangers now kept.
    #[cfg(test)]
    pub(crate) fn strangers(&self) -> usize {
        self.strangers.len()
    }

    /// Peers now kept.
    #[cfg(test)]
    pub(crate) fn peers(&self) -> usize {
        self.peers
    }

    /// Removes the stranger `ticket`, if it is one; returns its closer.
    fn forget(&mut self, ticket: Ticket) -> Option<C> {
        let at = self
            .strangers
            .iter()
            .position(|stranger| stranger.ticket == ticket)?;
        let stranger = self.strangers.remove(at)?;
        if let Some(count) = self.per_source.get_mut(&stranger.source) {
            *count -= 1;
            if *count == 0 {
                self.per_source.remove(&stranger.source);
            }
        }
        Some(stranger.closer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    fn ledger(peers: usize, strangers: usize, per_source: usize) -> Admission<()> {
        Admission::new(AdmissionLimits {
            peers,
            strangers,
            strangers_per_source: per_source,
        })
    }

    /// [`Admission::arrive`] with nothing to close, the evicted stranger by its ticket.
    fn arrive(admission: &mut Admission<()>, source: IpAddr) -> (Ticket, Option<Ticket>) {
        let (ticket, evicted) = admission.arrive(source, ());
        (ticket, evicted.map(|(evicted, ())| evicted))
    }

    #[test]
    fn a_flood_from_one_source_evicts_only_itself() {
        let mut admission = ledger(4, 8, 3);
        let (real, _) = arrive(&mut admission, ip(1));
        let mut flood = Vec::new();
        for _ in 0..300 {
            let (ticket, evicted) = arrive(&mut admission, ip(2));
            if let Some(evicted) = evicted {
                assert!(
                    flood.contains(&evicted),
                    "the flood evicted a stranger not its own"
                );
            }
            flood.push(ticket);
            assert!(admission.strangers() <= 4);
        }
        assert_eq!(admission.promote(real), Ok(()));
        assert_eq!(admission.peers(), 1);
        // The oldest of the flood are gone, the last three wait.
        assert_eq!(admission.promote(flood[0]), Err(Refused::NotWaiting));
        assert_eq!(admission.promote(flood[299]), Ok(()));
    }

    #[test]
    fn a_flood_from_many_sources_evicts_the_oldest_stranger_and_never_a_peer() {
        let mut admission = ledger(2, 4, 4);
        let (first, _) = arrive(&mut admission, ip(1));
        assert_eq!(admission.promote(first), Ok(()));
        let mut last = None;
        for source in 0..100u8 {
            let (ticket, evicted) = arrive(&mut admission, ip(source));
            if source >= 4 {
                assert!(evicted.is_some(), "a full budget evicts");
            }
            last = Some(ticket);
        }
        assert_eq!(admission.strangers(), 4);
        assert_eq!(admission.peers(), 1, "peers are never evicted");
        // A newcomer evicts the oldest stranger and can then promote itself.
        let (newcomer, evicted) = arrive(&mut admission, ip(200));
        assert!(evicted.is_some());
        assert_eq!(admission.promote(newcomer), Ok(()));
        assert_eq!(
            admission.promote(last.expect("strangers arrived")),
            Err(Refused::PeersFull)
        );
        assert_eq!(admission.peers(), 2);
    }

    #[test]
    fn leaving_frees_room_and_unknown_tickets_change_nothing() {
        let mut admission = ledger(1, 2, 2);
        let (a, _) = arrive(&mut admission, ip(1));
        let (b, _) = arrive(&mut admission, ip(1));
        admission.stranger_left(a);
        admission.stranger_left(a);
        assert_eq!(admission.strangers(), 1);
        let (_, evicted) = arrive(&mut admission, ip(1));
        assert_eq!(evicted, None, "a stranger that left makes room");
        assert_eq!(admission.promote(b), Ok(()));
        admission.peer_left();
        admission.peer_left();
        assert_eq!(admission.peers(), 0);
        let (c, _) = arrive(&mut admission, ip(3));
        assert_eq!(admission.promote(c), Ok(()));
    }
}
