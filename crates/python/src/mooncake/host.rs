//! What `initialize` is given: the host this engine is reached at, and where descriptors live.

use std::sync::Arc;

/// The host part of Mooncake's `local_hostname`, which may carry a port (ignored: the engine
/// picks its own, as `get_rpc_port` reports) and may be an IPv6 address, bracketed or not.
pub(crate) fn host_of(local_hostname: &str) -> Result<String, String> {
    let text = local_hostname.trim();
    let host = if let Some(rest) = text.strip_prefix('[') {
        match rest.split_once(']') {
            Some((host, tail)) if tail.is_empty() || tail.starts_with(':') => host,
            _ => return Err(format!("`{local_hostname}` opens a bracket it does not close; write an IPv6 host as [addr] or [addr]:port")),
        }
    } else if text.matches(':').count() > 1 {
        text
    } else {
        text.split_once(':').map_or(text, |(host, _)| host)
    };
    if host.is_empty() {
        return Err(format!(
            "`{local_hostname}` names no host; pass the host name or IP address peers reach this process at"
        ));
    }
    Ok(host.to_owned())
}

/// The address to listen on for `host`: IPv6 hosts are bracketed, port 0 lets the system pick.
pub(crate) fn listen_address(host: &str) -> String {
    if host.contains(':') {
        format!("[{host}]:0")
    } else {
        format!("{host}:0")
    }
}

/// The metadata store for Mooncake's `metadata_server` string: `P2PHANDSHAKE` (peers find each
/// other by `host:port`) or a URL ferry's stores take (`redis://`, `memory`).
pub(crate) fn store_for(
    metadata_server: &str,
) -> Result<Arc<dyn ferry::metadata::MetadataStore>, String> {
    let text = metadata_server.trim();
    if text.eq_ignore_ascii_case("P2PHANDSHAKE") {
        return Ok(Arc::new(ferry::metadata::PeerToPeer::default()));
    }
    ferry::metadata::from_url(text).map_err(|error| {
        format!("metadata_server `{metadata_server}`: {error}; this module takes P2PHANDSHAKE or redis://host:port (etcd is not built into it)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_dropped_and_ipv6_hosts_kept_whole() {
        assert_eq!(host_of("10.0.0.2").as_deref(), Ok("10.0.0.2"));
        assert_eq!(host_of("10.0.0.2:17000").as_deref(), Ok("10.0.0.2"));
        assert_eq!(host_of("node-3").as_deref(), Ok("node-3"));
        assert_eq!(host_of("fe80::1").as_deref(), Ok("fe80::1"));
        assert_eq!(host_of("[fe80::1]:17000").as_deref(), Ok("fe80::1"));
        assert_eq!(host_of("[::1]").as_deref(), Ok("::1"));
        assert!(host_of("").is_err());
        assert!(host_of(":17000").is_err());
        assert!(host_of("[::1").is_err());
        assert_eq!(listen_address("::1"), "[::1]:0");
        assert_eq!(listen_address("127.0.0.1"), "127.0.0.1:0");
    }
}
