//! What `ferry probe` reports, as text any front end prints: the machine (CUDA driver, GPUs,
//! peer access, FABRIC support, transports, RDMA devices) and, for a running engine, which
//! path each of its buffers gets from here and why. The `ferry` CLI and the Python module's
//! `python -m ferry_kv probe` print the same. The facts behind the report come from
//! [`fabric`] (may a GPU allocate memory with FABRIC handles) and [`rdma`] (this host's RDMA
//! devices, or why it has none).

use crate::cuda::{DeviceInfo, Driver};
use crate::transport::Reach;
use crate::{Engine, Location, Region, Result};
use std::fmt::Write;

pub use ferry_nvlink::{probe_fabric as fabric, FabricSupport};
/// The state of a port of a device [`rdma`] lists; only an active port carries traffic.
pub use ferry_rdma::PortState as RdmaPortState;
pub use ferry_rdma::{probe as rdma, RdmaProbe};

/// The machine's CUDA driver, GPUs, peer access, FABRIC support, transports and RDMA devices
/// (or why there are none), one fact a line.
///
/// # Errors
/// [`crate::Error::Cuda`] when the driver is loaded but cannot list its GPUs.
pub fn machine() -> Result<String> {
    let mut out = String::new();
    let driver = Driver::get();
    let _ = writeln!(out, "cuda: {}", driver.status());
    let gpus = driver.devices()?;
    for gpu in &gpus {
        let _ = writeln!(
            out,
            "gpu {}: {} {} pci {}",
            gpu.ordinal, gpu.name, gpu.uuid, gpu.pci_bus_id
        );
    }
    if gpus.len() > 1 {
        let _ = writeln!(out, "peer access (row reads/writes column):");
        for from in &gpus {
            let row: Vec<String> = gpus
                .iter()
                .map(|to| match from.ordinal == to.ordinal {
                    true => "  -".to_owned(),
                    false => match driver.can_access_peer(from.ordinal, to.ordinal) {
                        Ok(true) => "yes".to_owned(),
                        Ok(false) => " no".to_owned(),
                        Err(error) => format!("error: {error}"),
                    },
                })
                .collect();
            let _ = writeln!(out, "  gpu {}: {}", from.ordinal, row.join(" "));
        }
    }
    let fabrics: Vec<(u32, FabricSupport)> = gpus
        .iter()
        .map(|gpu| (gpu.ordinal, fabric(gpu.ordinal)))
        .collect();
    for (ordinal, support) in &fabrics {
        let _ = match support {
            FabricSupport::Permitted => {
                writeln!(out, "fabric handles on gpu {ordinal}: permitted")
            }
            FabricSupport::Refused(error) => {
                writeln!(out, "fabric handles on gpu {ordinal}: refused ({error})")
            }
        };
    }
    let _ = writeln!(out, "transports:");
    let _ = writeln!(
        out,
        "  tcp: available (any host; GPU memory staged through pinned host buffers)"
    );
    let _ = match gpus.is_empty() {
        true => writeln!(out, "  nvlink: unavailable ({})", driver.status()),
        false => writeln!(
            out,
            "  nvlink: available (cudaMalloc and POSIX-fd VMM memory of processes on this host)"
        ),
    };
    let permitted = fabrics
        .iter()
        .any(|(_, support)| *support == FabricSupport::Permitted);
    let _ = match (gpus.is_empty(), permitted) {
        (true, _) => writeln!(out, "  mnnvl: unavailable ({})", driver.status()),
        (false, false) => writeln!(
            out,
            "  mnnvl: unavailable (no GPU here permits FABRIC-handle allocations)"
        ),
        (false, true) => writeln!(out, "  mnnvl: available (VMM memory with FABRIC handles, any node of the NVLink domain; not yet run on GB200 hardware)"),
    };
    let _ = write!(out, "{}", rdma());
    Ok(out)
}

/// Connects `engine` to the engine named `name` and reports, for host memory and each GPU
/// here, the transport every one of its buffers gets and what each transport answered.
/// Writes nothing into the peer; allocates a 4 KiB probe buffer in host memory and on each
/// GPU of `engine`'s process for as long as it runs.
///
/// # Errors
/// Connecting to the peer, or allocating host probe memory, failed.
pub fn routes(engine: &Engine, name: &str) -> Result<String> {
    let mut out = String::new();
    let gpus: Vec<DeviceInfo> = Driver::get().devices().unwrap_or_default();
    let peer = engine.connect_blocking(name)?;
    let descriptor = peer.descriptor();
    let mine = engine.descriptor();
    let same_host = descriptor.host.same_boot(&mine.host);
    let same_process = descriptor.process == mine.process;
    let _ = writeln!(
        out,
        "peer {name}: engine {} (pid {} on host {}, boot {}); {}",
        descriptor.instance,
        descriptor.pid,
        descriptor.host.hostname,
        descriptor.host.boot_id,
        match (same_host, same_process) {
            (_, true) => "this process",
            (true, false) => "another process on this host",
            (false, false) => "another host",
        }
    );
    if let Some(note) = pid_clash(descriptor.pid, mine.pid, same_host && !same_process) {
        let _ = writeln!(out, "  note: {note}");
    }
    if descriptor.buffers.is_empty() {
        let _ = writeln!(out, "  the peer has no registered buffers yet");
        return Ok(out);
    }
    let mut locals: Vec<(String, Region)> = vec![("host memory".into(), engine.allocate(4096)?)];
    for gpu in &gpus {
        match engine.allocate_device(gpu.ordinal, 4096) {
            Ok(region) => locals.push((format!("gpu {}", gpu.ordinal), region)),
            Err(error) => {
                let _ = writeln!(
                    out,
                    "  gpu {}: cannot allocate a probe buffer ({error})",
                    gpu.ordinal
                );
            }
        }
    }
    for (what, local) in &locals {
        let _ = writeln!(out, "  from {what}:");
        for route in engine.routes(local, &peer) {
            let remote = &route.remote;
            let place = match remote.location {
                Location::Device { ordinal, .. } => format!("the peer's gpu {ordinal}"),
                location => location.to_string(),
            };
            let declined: Vec<String> = route
                .answers
                .iter()
                .filter_map(|(transport, reach)| match reach {
                    Reach::No { reason } => Some(format!("{transport}: {reason}")),
                    Reach::Yes { .. } => None,
                })
                .collect();
            let _ = writeln!(
                out,
                "    buffer {:#x} ({} bytes, {place}): {}{}",
                remote.addr,
                remote.len,
                route.chosen.unwrap_or("no transport"),
                match declined.is_empty() {
                    true => String::new(),
                    false => format!(" [{}]", declined.join("; ")),
                }
            );
        }
    }
    Ok(out)
}

/// What `ferry probe --peer` says of a peer process on this host whose PID, as its own PID
/// namespace numbers it, equals this process's, or is 1 (the first process of a PID namespace
/// other than the host's, as a container's main process is): CUDA refused IPC handles between
/// processes of equal PIDs in two PID namespaces on the GPU machine (measured with H100s and
/// driver 580, not documented), so their `cudaMalloc` buffers are likely to take TCP, or the
/// owner's staging buffers where staging is on. `None` for any other peer.
fn pid_clash(peer_pid: u32, own_pid: u32, other_process_here: bool) -> Option<String> {
    use ferry_nvlink::PID_CLASH_REMEDIES as REMEDIES;
    if !other_process_here {
        return None;
    }
    if peer_pid == own_pid {
        return Some(format!(
            "the peer's process has this probe's PID ({own_pid}), in another PID namespace; \
             CUDA has refused IPC handles between processes of equal PIDs, so an engine with \
             this PID here (where this probe runs) is likely to move `cudaMalloc` buffers \
             (PyTorch's default allocator) with it through staging buffers the owner hands \
             over by file descriptor (one more copy, on the owner's GPU), or over TCP where \
             staging is off or the fd socket out of reach; to map them directly: \
             {REMEDIES}"
        ));
    }
    (peer_pid == 1).then(|| {
        format!(
            "the peer's process is PID 1 of its own PID namespace (a container's first \
             process); an engine here that is PID 1 of a different PID namespace (another \
             pod's main process, say) is likely to move `cudaMalloc` buffers with it through \
             staging buffers (one more copy), or over TCP where staging is off or the fd \
             socket out of reach, since CUDA has refused IPC handles between processes of \
             equal PIDs; to map them directly: {REMEDIES}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::pid_clash;

    #[test]
    fn another_process_here_with_this_pid_or_pid_1_gets_the_pid_clash_note() {
        let equal = pid_clash(1, 1, true).expect("a note for two PID-1 processes");
        assert!(equal.contains("this probe's PID (1)"), "{equal}");
        assert!(
            equal.contains("hostPID") && equal.contains("expandable_segments"),
            "{equal}"
        );
        let first = pid_clash(1, 57, true).expect("a note for a peer that is PID 1");
        assert!(
            first.contains("is PID 1 of its own PID namespace"),
            "{first}"
        );
        assert!(first.contains("hostPID"), "{first}");
        assert_eq!(
            pid_clash(9, 2, true),
            None,
            "different PIDs, none of them 1"
        );
        assert_eq!(
            pid_clash(7, 7, false),
            None,
            "this process, or another host"
        );
        assert_eq!(
            pid_clash(1, 1, false),
            None,
            "this process, or another host"
        );
    }
}
