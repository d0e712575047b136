//! Which transport moves the bytes between a local region and a peer's buffer, and why: the
//! same choice a batch makes, laid open for tools such as `ferry probe --peer`.

use crate::descriptor::BufferDescriptor;
use crate::engine::Engine;
use crate::memory::Region;
use crate::peer::Peer;
use crate::transport::Reach;

/// How bytes between one local region and one of a peer's buffers move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The peer's buffer, as its descriptor lists it.
    pub remote: BufferDescriptor,
    /// The transport a batch would use: the cheapest that can; `None` when none can.
    pub chosen: Option<&'static str>,
    /// What every transport of the engine answered, in the engine's order.
    pub answers: Vec<(&'static str, Reach)>,
}

impl Engine {
    /// The route a batch between `local` and each of `peer`'s buffers (as last fetched) would
    /// take, with every transport's answer. Asking may make a transport try the peer's memory
    /// once (nvlink maps one buffer of each kind of export), exactly as the first batch would.
    pub fn routes(&self, local: &Region, peer: &Peer) -> Vec<Route> {
        let info = local.info();
        let view = peer.view();
        view.descriptor
            .buffers
            .iter()
            .map(|remote| {
                let answers: Vec<(&'static str, Reach)> = self
                    .transports()
                    .iter()
                    .map(|transport| {
                        (
                            transport.name(),
                            transport.reach(&info, &view.descriptor, remote),
                        )
                    })
                    .collect();
                let chosen = answers
                    .iter()
                    .filter_map(|(name, reach)| match reach {
                        Reach::Yes { cost } => Some((*cost, *name)),
                        Reach::No { .. } => None,
                    })
                    .min_by_key(|(cost, _)| *cost)
                    .map(|(_, name)| name);
                Route {
                    remote: remote.clone(),
                    chosen,
                    answers,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn host_memory_routes_over_tcp_and_says_why_others_decline() {
        let decode = crate::EngineBuilder::new(crate::TcpOnly)
            .build_blocking()
            .unwrap();
        let _pool = decode.allocate(4096).unwrap();
        let prefill = crate::EngineBuilder::new(crate::TcpOnly)
            .build_blocking()
            .unwrap();
        let local = prefill.allocate(4096).unwrap();
        let peer = prefill.connect_blocking(decode.name()).unwrap();
        let routes = prefill.routes(&local, &peer);
        assert_eq!(routes.len(), 1);
        assert_eq!(routes[0].chosen, Some(crate::TCP));
        assert_eq!(routes[0].remote, peer.buffers()[0]);
        assert!(routes[0]
            .answers
            .iter()
            .any(|(name, reach)| *name == crate::TCP && matches!(reach, crate::Reach::Yes { .. })));
    }
}
