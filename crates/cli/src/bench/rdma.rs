//! The check `ferry bench --rdma` makes before it starts anything: this build has the RDMA
//! transport and rdma-core lists a device here. A machine without RDMA gets one clear message
//! instead of a run whose transfers would fall back to TCP.

use ferry::probe::RdmaPortState;

/// `ferry bench --rdma` cannot run with this build or on this host.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NoRdma {
    /// The binary was built without the `rdma` feature.
    #[error("this ferry was built without RDMA: rebuild with `--features rdma`")]
    NotBuilt,
    /// rdma-core, its kernel support or a device is missing: what `ferry probe` says.
    #[error(
        "ferry bench --rdma needs RDMA, which is unavailable here: {0}; run it on a host where \
         `ferry probe` lists an RDMA device, or leave out --rdma"
    )]
    Unavailable(String),
}

/// The line rate of this host's fastest active RDMA port, GB/s, when a port reports it.
pub(crate) fn line_rate_gbps() -> Option<f64> {
    let devices = ferry::probe::rdma().devices.ok()?;
    devices
        .iter()
        .flat_map(|device| &device.ports)
        .filter(|port| matches!(port.state, RdmaPortState::Active))
        .filter_map(|port| port.line_rate_mbps)
        .max()
        .map(|mbps| mbps as f64 / 8_000.0)
}

/// Succeeds when this build has RDMA and rdma-core lists at least one device.
pub(crate) fn check() -> Result<(), NoRdma> {
    if !cfg!(feature = "rdma") {
        return Err(NoRdma::NotBuilt);
    }
    refusal(&ferry::probe::rdma().devices).map_or(Ok(()), Err)
}

/// Why the probe's device list rules RDMA out: its reason, or an empty list.
fn refusal<Device, Why: std::fmt::Display>(devices: &Result<Vec<Device>, Why>) -> Option<NoRdma> {
    match devices {
        Ok(devices) if !devices.is_empty() => None,
        Ok(_) => Some(NoRdma::Unavailable("rdma-core lists no device".to_owned())),
        Err(reason) => Some(NoRdma::Unavailable(reason.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::{check, refusal, NoRdma};

    #[test]
    fn the_probes_reason_is_the_refusal() {
        let refused = refusal::<(), _>(&Err("rdma-core's libibverbs is not installed"))
            .expect("no devices")
            .to_string();
        assert!(
            refused.starts_with(
                "ferry bench --rdma needs RDMA, which is unavailable here: rdma-core's \
                 libibverbs is not installed; "
            ),
            "{refused}"
        );
        let empty = refusal::<(), &str>(&Ok(Vec::new()))
            .expect("an empty list")
            .to_string();
        assert!(empty.contains("rdma-core lists no device"), "{empty}");
        assert!(refusal::<(), &str>(&Ok(vec![()])).is_none());
    }

    #[test]
    fn a_build_without_the_feature_says_how_to_get_it() {
        if cfg!(feature = "rdma") {
            assert!(!matches!(check(), Err(NoRdma::NotBuilt)));
        } else {
            assert_eq!(
                check().expect_err("no RDMA in this build").to_string(),
                "this ferry was built without RDMA: rebuild with `--features rdma`"
            );
        }
    }
}
