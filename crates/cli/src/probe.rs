//! `ferry probe`: what this machine offers, and with `--peer` which path a running engine's
//! buffers get from here and why.

use ferry::cuda::{DeviceInfo, Driver};
use ferry::transport::{probe_fabric, rdma_probe, FabricSupport, Reach};
use ferry::{Location, Region};

/// Prints the machine's CUDA driver, GPUs, peer access, FABRIC support, transports and RDMA
/// devices (or why there are none); with `peer`, the route from here to each of that engine's
/// buffers.
pub(crate) fn run(
    peer: Option<&str>,
    metadata: &str,
    secret: &crate::secret_file::SecretFile,
) -> Result<(), Box<dyn std::error::Error>> {
    let driver = Driver::get();
    println!("cuda: {}", driver.status());
    let gpus = driver.devices()?;
    for gpu in &gpus {
        println!(
            "gpu {}: {} {} pci {}",
            gpu.ordinal, gpu.name, gpu.uuid, gpu.pci_bus_id
        );
    }
    if gpus.len() > 1 {
        println!("peer access (row reads/writes column):");
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
            println!("  gpu {}: {}", from.ordinal, row.join(" "));
        }
    }
    let fabric: Vec<(u32, FabricSupport)> = gpus
        .iter()
        .map(|gpu| (gpu.ordinal, probe_fabric(gpu.ordinal)))
        .collect();
    for (ordinal, support) in &fabric {
        match support {
            FabricSupport::Permitted => println!("fabric handles on gpu {ordinal}: permitted"),
            FabricSupport::Refused(error) => {
                println!("fabric handles on gpu {ordinal}: refused ({error})")
            }
        }
    }
    println!("transports:");
    println!("  tcp: available (any host; GPU memory staged through pinned host buffers)");
    match gpus.is_empty() {
        true => println!("  nvlink: unavailable ({})", driver.status()),
        false => {
            println!("  nvlink: available (cudaMalloc and POSIX-fd VMM memory of processes on this host)")
        }
    }
    let permitted = fabric
        .iter()
        .any(|(_, support)| *support == FabricSupport::Permitted);
    match (gpus.is_empty(), permitted) {
        (true, _) => println!("  mnnvl: unavailable ({})", driver.status()),
        (false, false) => println!("  mnnvl: unavailable (no GPU here permits FABRIC-handle allocations)"),
        (false, true) => println!("  mnnvl: available (VMM memory with FABRIC handles, any node of the NVLink domain; not yet run on GB200 hardware)"),
    }
    print!("{}", rdma_probe());
    match peer {
        Some(name) => routes(name, metadata, secret, &gpus),
        None => Ok(()),
    }
}

/// Connects to `name` and prints, for host memory and each GPU here, the transport every one
/// of its buffers gets and what each transport answered. Writes nothing into the peer.
fn routes(
    name: &str,
    metadata: &str,
    secret: &crate::secret_file::SecretFile,
    gpus: &[DeviceInfo],
) -> Result<(), Box<dyn std::error::Error>> {
    let engine = secret
        .apply(ferry::Engine::builder())?
        .metadata(ferry::metadata::from_url(metadata)?)
        .build_blocking()?;
    let peer = engine.connect_blocking(name)?;
    let descriptor = peer.descriptor();
    let mine = engine.descriptor();
    println!(
        "peer {name}: engine {} (pid {} on host {}, boot {}); {}",
        descriptor.instance,
        descriptor.pid,
        descriptor.host.hostname,
        descriptor.host.boot_id,
        match (
            descriptor.host.same_boot(&mine.host),
            descriptor.process == mine.process
        ) {
            (_, true) => "this process",
            (true, false) => "another process on this host",
            (false, false) => "another host",
        }
    );
    if descriptor.buffers.is_empty() {
        println!("  the peer has no registered buffers yet");
        return Ok(());
    }
    let mut locals: Vec<(String, Region)> = vec![("host memory".into(), engine.allocate(4096)?)];
    for gpu in gpus {
        match engine.allocate_device(gpu.ordinal, 4096) {
            Ok(region) => locals.push((format!("gpu {}", gpu.ordinal), region)),
            Err(error) => println!(
                "  gpu {}: cannot allocate a probe buffer ({error})",
                gpu.ordinal
            ),
        }
    }
    for (what, local) in &locals {
        println!("  from {what}:");
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
            println!(
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
    Ok(())
}
