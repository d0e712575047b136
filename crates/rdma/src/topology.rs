//! Which RDMA NIC serves which GPU, from the PCI topology in sysfs.
//!
//! GPUDirect RDMA moves bytes between a NIC and GPU memory over PCIe. A NIC under the GPU's
//! own PCIe switch reaches it without crossing the CPU; one in another root complex, or on
//! the other socket, shares the CPU's links with everything else. So, as NCCL
//! (`ncclIbGetPciPath`) and Mooncake (`topology.cpp`) do, [`Topology`] measures the distance
//! between the two devices' sysfs paths (path components after their longest common prefix,
//! both sides summed) and ranks the NICs for each GPU:
//!
//! 1. candidates are the NICs with an active port, restricted by an explicit device list
//!    when there is one ([`Topology::restrict`]); NICs whose port state cannot be read come
//!    after the active ones, NICs whose ports are all down are left out;
//! 2. the smallest distance first; a NIC whose distance is unknown (a sysfs entry is missing)
//!    comes after every NIC whose distance is known;
//! 3. between equally near NICs, the one serving the fewest GPUs so far, so that GPUs spread
//!    over them round-robin;
//! 4. then a NIC on the GPU's NUMA node; then the order the devices were given in.
//!
//! Host memory uses the NICs on its NUMA node when that is known ([`Topology::nics_for_host`]).

mod pci;
mod sysfs;
#[cfg(test)]
pub(crate) mod tests;

pub use pci::PathClass;
use std::fmt;
use std::path::{Path, PathBuf};
use sysfs::{GpuInfo, NicInfo, PortState, SysfsProblem};

/// One NIC as a candidate for one GPU: how far it is, or why that is unknown.
///
/// `distance` and `class` are both known, or both unknown with `unknown` saying why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicChoice {
    /// The RDMA device name (`mlx5_0`).
    pub name: String,
    /// PCI path components between the GPU and the NIC, both sides summed.
    pub distance: Option<u32>,
    /// The kind of PCIe path between them.
    pub class: Option<PathClass>,
    /// Why the distance is unknown (which sysfs entry is missing).
    pub unknown: Option<String>,
}

impl fmt::Display for NicChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.class, self.distance, &self.unknown) {
            (Some(class), Some(distance), _) => {
                write!(f, "{} ({class}, distance {distance})", self.name)
            }
            (_, _, Some(why)) => write!(f, "{} (distance unknown: {why})", self.name),
            _ => write!(f, "{} (distance unknown)", self.name),
        }
    }
}

/// The RDMA devices of this host with their PCI places, and the NIC each GPU asked about was
/// given. Built by [`Topology::read`]; its [`Display`](fmt::Display) is what `ferry probe`
/// prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Where sysfs is read from: `/`, or a fake tree in tests.
    root: PathBuf,
    /// The candidates, in the order given (the override's order once restricted).
    nics: Vec<NicInfo>,
    /// The override list, when one restricted the candidates.
    restricted_to: Option<Vec<String>>,
    /// Each GPU asked about (as sysfs names it), with its first choice, in the order asked.
    assigned: Vec<(String, Option<NicChoice>)>,
}

impl Topology {
    /// Reads the RDMA devices `devices` (verbs names, `mlx5_0`) from sysfs under `root` (`/`
    /// except in tests): each one's PCI device, NUMA node and port states.
    ///
    /// Never fails: a device whose sysfs entries are missing is kept, with an unknown
    /// distance to every GPU and the reason, which [`NicChoice::unknown`] and the
    /// [`Display`](fmt::Display) output give.
    pub fn read(root: &Path, devices: &[String]) -> Topology {
        Topology {
            root: root.to_owned(),
            nics: devices.iter().map(|name| sysfs::nic(root, name)).collect(),
            restricted_to: None,
            assigned: Vec::new(),
        }
    }

    /// Restricts the candidates to `names`, in that order, which then breaks the last ties
    /// (an explicit device list, like Mooncake's `device_name`). Names that are not among
    /// the devices read are ignored, and the [`Display`](fmt::Display) output lists them. An
    /// empty list restricts nothing.
    pub fn restrict(mut self, names: &[String]) -> Topology {
        if names.is_empty() {
            return self;
        }
        let mut kept = Vec::with_capacity(names.len());
        for name in names {
            if let Some(index) = self.nics.iter().position(|nic| &nic.name == name) {
                kept.push(self.nics.swap_remove(index));
            }
        }
        self.nics = kept;
        self.restricted_to = Some(names.to_vec());
        self
    }

    /// The NICs for the GPU at PCI address `pci_bus_id` (`0000:18:00.0`, as CUDA or
    /// nvidia-smi print it), best first (see the module docs for the order), given the GPUs
    /// assigned so far by [`Topology::nics_for_gpu`]. Assigns nothing. NICs whose ports are
    /// all down are left out; empty when no NIC is left.
    pub fn rank_gpu(&self, pci_bus_id: &str) -> Vec<NicChoice> {
        let (key, gpu) = self.gpu(pci_bus_id);
        let mut ranked: Vec<_> = self
            .nics
            .iter()
            .enumerate()
            .filter(|(_, nic)| !matches!(nic.port, PortState::Down(_)))
            .map(|(position, nic)| {
                let choice = choose(nic, &gpu);
                let rank = (
                    choice.distance.is_none(),
                    matches!(nic.port, PortState::Unknown(_)),
                    choice.distance,
                    self.serving(&nic.name, &key),
                    numa_rank(gpu.numa, nic.numa),
                    position,
                );
                (rank, choice)
            })
            .collect();
        ranked.sort_by_key(|(rank, _)| *rank);
        ranked.into_iter().map(|(_, choice)| choice).collect()
    }

    /// The names of [`Topology::rank_gpu`]'s NICs for the GPU at `pci_bus_id`, best first,
    /// and records the first as that GPU's NIC, so that the next GPU for which it ties with
    /// another NIC gets the other one. Asking again for the same GPU replaces its record
    /// rather than counting it twice.
    pub fn nics_for_gpu(&mut self, pci_bus_id: &str) -> Vec<String> {
        self.assign_gpu(pci_bus_id)
            .into_iter()
            .map(|choice| choice.name)
            .collect()
    }

    /// [`Topology::rank_gpu`], recording the first choice as this GPU's NIC as
    /// [`Topology::nics_for_gpu`] does.
    pub fn assign_gpu(&mut self, pci_bus_id: &str) -> Vec<NicChoice> {
        let ranked = self.rank_gpu(pci_bus_id);
        let (key, _) = self.gpu(pci_bus_id);
        let first = ranked.first().cloned();
        match self.assigned.iter_mut().find(|(gpu, _)| *gpu == key) {
            Some(record) => record.1 = first,
            None => self.assigned.push((key, first)),
        }
        ranked
    }

    /// The NICs for host memory on NUMA node `numa_node`: those on that node when it is
    /// known and has any, else all; active ports first, then in the order given. NICs whose
    /// ports are all down are left out.
    pub fn nics_for_host(&self, numa_node: Option<u32>) -> Vec<String> {
        let mut usable: Vec<&NicInfo> = self
            .nics
            .iter()
            .filter(|nic| !matches!(nic.port, PortState::Down(_)))
            .collect();
        // Stable: the order given stays within each port state.
        usable.sort_by_key(|nic| matches!(nic.port, PortState::Unknown(_)));
        let local = |nic: &&NicInfo| numa_node.is_some() && nic.numa == numa_node;
        if usable.iter().any(local) {
            usable.retain(local);
        }
        usable.into_iter().map(|nic| nic.name.clone()).collect()
    }

    /// The GPU at `pci_bus_id` as sysfs names it, and what sysfs says about it.
    fn gpu(&self, pci_bus_id: &str) -> (String, GpuInfo) {
        match sysfs::bus_id(pci_bus_id) {
            Some(bdf) => {
                let info = sysfs::gpu(&self.root, &bdf);
                (bdf, info)
            }
            None => (
                pci_bus_id.trim().to_owned(),
                GpuInfo {
                    path: Err(SysfsProblem::NotABusId {
                        text: pci_bus_id.to_owned(),
                    }),
                    numa: None,
                },
            ),
        }
    }

    /// How many GPUs other than `gpu` have `nic` as their first choice.
    fn serving(&self, nic: &str, gpu: &str) -> usize {
        self.assigned
            .iter()
            .filter(|(other, choice)| {
                other != gpu && choice.as_ref().is_some_and(|choice| choice.name == nic)
            })
            .count()
    }
}

/// How `nic` stands for `gpu`: distance and kind of path, or which path is unknown.
fn choose(nic: &NicInfo, gpu: &GpuInfo) -> NicChoice {
    let unknown = |why: String| NicChoice {
        name: nic.name.clone(),
        distance: None,
        class: None,
        unknown: Some(why),
    };
    match (&gpu.path, &nic.path) {
        (Err(why), _) => unknown(format!("GPU: {why}")),
        (_, Err(why)) => unknown(why.to_string()),
        (Ok(gpu_path), Ok(nic_path)) => {
            let same_numa = gpu.numa.zip(nic.numa).map(|(gpu, nic)| gpu == nic);
            let (distance, class) = pci::between(gpu_path, nic_path, same_numa);
            NicChoice {
                name: nic.name.clone(),
                distance: Some(distance),
                class: Some(class),
                unknown: None,
            }
        }
    }
}

/// 0 for a NIC on the GPU's NUMA node, 1 when either node is unknown, 2 for another node.
fn numa_rank(gpu: Option<u32>, nic: Option<u32>) -> u8 {
    match gpu.zip(nic) {
        Some((gpu, nic)) if gpu == nic => 0,
        None => 1,
        Some(_) => 2,
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.nics.is_empty() {
            writeln!(f, "no RDMA devices to use")?;
        }
        for nic in &self.nics {
            let pci = match &nic.path {
                Ok(path) => path.file_name().map_or_else(
                    || path.display().to_string(),
                    |name| name.to_string_lossy().into_owned(),
                ),
                Err(why) => format!("unknown ({why})"),
            };
            let numa = nic
                .numa
                .map_or_else(|| "unknown".to_owned(), |node| node.to_string());
            let port = match &nic.port {
                PortState::Active => "active".to_owned(),
                PortState::Down(states) => format!("down ({states}), not used"),
                PortState::Unknown(why) => format!("state unknown ({why})"),
            };
            writeln!(f, "{}: PCI {pci}, NUMA node {numa}, port {port}", nic.name)?;
        }
        if let Some(names) = &self.restricted_to {
            let missing: Vec<&str> = names
                .iter()
                .filter(|name| !self.nics.iter().any(|nic| &nic.name == *name))
                .map(String::as_str)
                .collect();
            write!(f, "devices restricted to {}", names.join(", "))?;
            match missing.is_empty() {
                true => writeln!(f)?,
                false => writeln!(f, "; not RDMA devices here: {}", missing.join(", "))?,
            }
        }
        for (gpu, choice) in &self.assigned {
            match choice {
                Some(choice) => writeln!(f, "GPU {gpu} -> {choice}")?,
                None => writeln!(f, "GPU {gpu} -> none (no RDMA device with a usable port)")?,
            }
        }
        Ok(())
    }
}
