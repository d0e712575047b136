//! Topology over fake sysfs trees, laid out as the kernel lays out the real one: PCI devices
//! under `sys/devices`, RDMA devices reached through `sys/class/infiniband/<name>` and their
//! `device` link, GPUs through `sys/bus/pci/devices/<bdf>`. The probe's tests build on the
//! same trees.

use super::{NicChoice, PathClass, Topology};
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

/// A PCIe switch below root port 0000:00:01.0 of the NUMA-0 root complex.
const SWITCH: &str = "pci0000:00/0000:00:01.0/0000:01:00.0";
/// The GPU on the switch's first downstream port.
pub(crate) const GPU: &str = "0000:18:00.0";

/// A fake sysfs tree in a temporary directory, removed on drop.
pub(crate) struct Sysfs {
    dir: tempfile::TempDir,
}

impl Sysfs {
    fn new() -> Sysfs {
        Sysfs {
            dir: tempfile::tempdir().expect("a temporary directory"),
        }
    }

    pub(crate) fn root(&self) -> &Path {
        self.dir.path()
    }

    /// PCI device `path` (below `sys/devices`) on NUMA node `numa` (-1: unknown).
    fn device(&self, path: &str, numa: i32) -> PathBuf {
        let dir = self.root().join("sys/devices").join(path);
        fs::create_dir_all(&dir).expect("the PCI device directory");
        fs::write(dir.join("numa_node"), format!("{numa}\n")).expect("numa_node");
        dir
    }

    /// RDMA device `name` on PCI device `path`, with one port in `state` (`4: ACTIVE`).
    fn nic(&self, name: &str, path: &str, numa: i32, state: &str) {
        let device = self.device(path, numa);
        let dir = device.join("infiniband").join(name);
        fs::create_dir_all(dir.join("ports/1")).expect("the ports directory");
        fs::write(dir.join("ports/1/state"), format!("{state}\n")).expect("the port state");
        symlink(&device, dir.join("device")).expect("the device link");
        let class = self.root().join("sys/class/infiniband");
        fs::create_dir_all(&class).expect("the infiniband class directory");
        symlink(&dir, class.join(name)).expect("the class link");
    }

    /// The GPU at `bdf` on PCI device `path`.
    fn gpu(&self, bdf: &str, path: &str, numa: i32) {
        let device = self.device(path, numa);
        let bus = self.root().join("sys/bus/pci/devices");
        fs::create_dir_all(&bus).expect("the PCI bus directory");
        symlink(device, bus.join(bdf)).expect("the bus link");
    }

    fn read(&self, devices: &[&str]) -> Topology {
        let devices: Vec<String> = devices.iter().map(|name| name.to_string()).collect();
        Topology::read(self.root(), &devices)
    }
}

/// The GPU and mlx5_0 on one switch; mlx5_1 on another root port of the same root complex.
pub(crate) fn switch_and_root_port() -> Sysfs {
    let sysfs = Sysfs::new();
    sysfs.gpu(GPU, &format!("{SWITCH}/0000:02:00.0/{GPU}"), 0);
    sysfs.nic(
        "mlx5_0",
        &format!("{SWITCH}/0000:02:04.0/0000:05:00.0"),
        0,
        "4: ACTIVE",
    );
    sysfs.nic(
        "mlx5_1",
        "pci0000:00/0000:00:02.0/0000:06:00.0",
        0,
        "4: ACTIVE",
    );
    sysfs
}

/// Three GPUs and two NICs, each on its own root port of one root complex: all equally near.
fn root_ports() -> Sysfs {
    let sysfs = Sysfs::new();
    for (port, bdf) in [
        (1, "0000:10:00.0"),
        (2, "0000:20:00.0"),
        (3, "0000:30:00.0"),
    ] {
        sysfs.gpu(bdf, &format!("pci0000:00/0000:00:0{port}.0/{bdf}"), 0);
    }
    sysfs.nic(
        "mlx5_0",
        "pci0000:00/0000:00:04.0/0000:40:00.0",
        0,
        "4: ACTIVE",
    );
    sysfs.nic(
        "mlx5_1",
        "pci0000:00/0000:00:05.0/0000:50:00.0",
        0,
        "4: ACTIVE",
    );
    sysfs
}

fn names(choices: &[NicChoice]) -> Vec<&str> {
    choices.iter().map(|choice| choice.name.as_str()).collect()
}

#[test]
fn a_nic_under_the_gpus_switch_wins() {
    let sysfs = switch_and_root_port();
    // Listed first, so the order given would pick it if distance did not.
    let mut topology = sysfs.read(&["mlx5_1", "mlx5_0"]);
    let ranked = topology.rank_gpu(GPU);
    assert_eq!(names(&ranked), ["mlx5_0", "mlx5_1"]);
    assert_eq!(ranked[0].class, Some(PathClass::Pix));
    assert_eq!(ranked[0].distance, Some(4));
    assert_eq!(ranked[1].class, Some(PathClass::Phb));
    assert_eq!(ranked[1].distance, Some(6));
    // A second GPU on the switch gets the near NIC too: distance outranks sharing.
    let second = "0000:19:00.0";
    sysfs.gpu(second, &format!("{SWITCH}/0000:02:08.0/{second}"), 0);
    assert_eq!(topology.nics_for_gpu(GPU), ["mlx5_0", "mlx5_1"]);
    assert_eq!(topology.nics_for_gpu(second), ["mlx5_0", "mlx5_1"]);
}

#[test]
fn equally_near_nics_are_shared_round_robin() {
    let sysfs = root_ports();
    let mut topology = sysfs.read(&["mlx5_0", "mlx5_1"]);
    assert_eq!(topology.nics_for_gpu("0000:10:00.0")[0], "mlx5_0");
    assert_eq!(topology.nics_for_gpu("0000:20:00.0")[0], "mlx5_1");
    assert_eq!(topology.nics_for_gpu("0000:30:00.0")[0], "mlx5_0");
    // Asking again does not count a GPU twice.
    assert_eq!(topology.nics_for_gpu("0000:10:00.0")[0], "mlx5_0");
    assert_eq!(topology.nics_for_gpu("0000:20:00.0")[0], "mlx5_1");
    let ranked = topology.rank_gpu("0000:10:00.0");
    assert!(ranked
        .iter()
        .all(|choice| choice.distance == Some(4) && choice.class == Some(PathClass::Phb)));
}

#[test]
fn the_gpus_numa_node_breaks_a_tie_in_distance() {
    let sysfs = Sysfs::new();
    sysfs.gpu(GPU, &format!("pci0000:40/0000:40:01.0/{GPU}"), 1);
    sysfs.nic(
        "mlx5_0",
        "pci0000:00/0000:00:01.0/0000:05:00.0",
        0,
        "4: ACTIVE",
    );
    sysfs.nic(
        "mlx5_1",
        "pci0000:80/0000:80:01.0/0000:85:00.0",
        1,
        "4: ACTIVE",
    );
    let ranked = sysfs.read(&["mlx5_0", "mlx5_1"]).rank_gpu(GPU);
    assert_eq!(names(&ranked), ["mlx5_1", "mlx5_0"]);
    assert_eq!(ranked[0].class, Some(PathClass::Node));
    assert_eq!(ranked[1].class, Some(PathClass::Sys));
    assert_eq!(ranked[0].distance, ranked[1].distance);
}

#[test]
fn an_override_restricts_the_candidates_and_orders_ties() {
    let sysfs = switch_and_root_port();
    let only_far = sysfs
        .read(&["mlx5_0", "mlx5_1"])
        .restrict(&["mlx5_1".to_owned()]);
    assert_eq!(names(&only_far.rank_gpu(GPU)), ["mlx5_1"]);

    let unknown = sysfs
        .read(&["mlx5_0", "mlx5_1"])
        .restrict(&["mlx5_9".to_owned(), "mlx5_0".to_owned()]);
    assert_eq!(names(&unknown.rank_gpu(GPU)), ["mlx5_0"]);
    let shown = unknown.to_string();
    assert!(
        shown.contains("devices restricted to mlx5_9, mlx5_0; not RDMA devices here: mlx5_9"),
        "{shown}"
    );

    let sysfs = root_ports();
    let mut reversed = sysfs
        .read(&["mlx5_0", "mlx5_1"])
        .restrict(&["mlx5_1".to_owned(), "mlx5_0".to_owned()]);
    assert_eq!(reversed.nics_for_gpu("0000:10:00.0"), ["mlx5_1", "mlx5_0"]);
    assert_eq!(reversed.nics_for_gpu("0000:20:00.0"), ["mlx5_0", "mlx5_1"]);

    let everything = sysfs.read(&["mlx5_0", "mlx5_1"]).restrict(&[]);
    assert_eq!(everything.rank_gpu("0000:10:00.0").len(), 2);
}

#[test]
fn a_missing_device_dir_gives_an_unknown_distance_sorted_last() {
    let sysfs = switch_and_root_port();
    // A device with a class entry and a port but no PCI device, and one with nothing at all.
    let rxe = sysfs.root().join("sys/class/infiniband/rxe0/ports/1");
    fs::create_dir_all(&rxe).expect("the rxe0 ports directory");
    fs::write(rxe.join("state"), "4: ACTIVE\n").expect("the rxe0 port state");
    let topology = sysfs.read(&["mlx5_9", "rxe0", "mlx5_1", "mlx5_0"]);

    let ranked = topology.rank_gpu(GPU);
    assert_eq!(names(&ranked), ["mlx5_0", "mlx5_1", "rxe0", "mlx5_9"]);
    for choice in &ranked[2..] {
        assert_eq!((choice.distance, choice.class), (None, None));
        let why = choice.unknown.as_deref().unwrap_or_default();
        assert!(
            why.contains(&format!(
                "infiniband/{}/device cannot be resolved",
                choice.name
            )),
            "{why}"
        );
    }
    let shown = topology.to_string();
    assert!(shown.contains("rxe0: PCI unknown ("), "{shown}");
    assert!(shown.contains("mlx5_9: PCI unknown ("), "{shown}");
    assert!(shown.contains("port state unknown ("), "{shown}");

    // A GPU sysfs does not list, and text that is no bus id: every distance unknown, no panic.
    let missing = topology.rank_gpu("0000:99:00.0");
    assert_eq!(missing.len(), 4);
    let why = missing[0].unknown.as_deref().unwrap_or_default();
    assert!(
        why.starts_with("GPU: ") && why.contains("0000:99:00.0"),
        "{why}"
    );
    let garbage = topology.rank_gpu("GPU-0123");
    let why = garbage[0].unknown.as_deref().unwrap_or_default();
    assert!(why.contains("not a PCI bus id"), "{why}");
}

#[test]
fn nics_whose_ports_are_down_are_not_candidates() {
    let sysfs = Sysfs::new();
    sysfs.gpu(GPU, &format!("{SWITCH}/0000:02:00.0/{GPU}"), 0);
    sysfs.nic(
        "mlx5_0",
        &format!("{SWITCH}/0000:02:04.0/0000:05:00.0"),
        0,
        "1: DOWN",
    );
    sysfs.nic(
        "mlx5_1",
        "pci0000:00/0000:00:02.0/0000:06:00.0",
        0,
        "4: ACTIVE",
    );
    let mut topology = sysfs.read(&["mlx5_0", "mlx5_1"]);
    assert_eq!(topology.nics_for_gpu(GPU), ["mlx5_1"]);
    assert_eq!(topology.nics_for_host(Some(0)), ["mlx5_1"]);
    let shown = topology.to_string();
    assert!(
        shown.contains("mlx5_0: PCI 0000:05:00.0, NUMA node 0, port down (port 1 DOWN), not used"),
        "{shown}"
    );
}

#[test]
fn host_memory_uses_the_nics_of_its_numa_node() {
    let sysfs = Sysfs::new();
    sysfs.nic(
        "mlx5_0",
        "pci0000:00/0000:00:01.0/0000:05:00.0",
        0,
        "4: ACTIVE",
    );
    sysfs.nic(
        "mlx5_1",
        "pci0000:80/0000:80:01.0/0000:85:00.0",
        1,
        "4: ACTIVE",
    );
    sysfs.nic(
        "mlx5_2",
        "pci0000:80/0000:80:02.0/0000:86:00.0",
        1,
        "4: ACTIVE",
    );
    let topology = sysfs.read(&["mlx5_0", "mlx5_1", "mlx5_2"]);
    assert_eq!(topology.nics_for_host(Some(1)), ["mlx5_1", "mlx5_2"]);
    assert_eq!(topology.nics_for_host(Some(0)), ["mlx5_0"]);
    // A node without NICs, or an unknown node: all of them.
    assert_eq!(topology.nics_for_host(Some(3)).len(), 3);
    assert_eq!(topology.nics_for_host(None).len(), 3);
}

#[test]
fn display_names_each_gpus_nic_path_class_and_distance() {
    let sysfs = switch_and_root_port();
    let mut topology = sysfs.read(&["mlx5_0", "mlx5_1"]);
    // As nvidia-smi prints it: eight-digit domain, upper case.
    topology.nics_for_gpu("00000000:18:00.0");
    topology.nics_for_gpu("0000:AA:00.0");
    let shown = topology.to_string();
    assert!(
        shown.contains("mlx5_0: PCI 0000:05:00.0, NUMA node 0, port active\n"),
        "{shown}"
    );
    assert!(
        shown.contains("GPU 0000:18:00.0 -> mlx5_0 (PIX, distance 4)\n"),
        "{shown}"
    );
    assert!(
        shown.contains("GPU 0000:aa:00.0 -> mlx5_1 (distance unknown: GPU: "),
        "{shown}"
    );
}
