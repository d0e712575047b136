//! The device list and what each device and port reports, read from raw verbs attributes.

use std::sync::Arc;

use ::sideway::ibverbs::device::{DeviceInfo as _, DeviceList, GetDeviceListErrorKind};
use ::sideway::ibverbs::device_context::DeviceContext;

use super::failure::{self, errno};
use super::raw;
use crate::device::{DeviceInfo, Gid, GidEntry, GidType, LinkLayer, PortInfo};
use crate::error::VerbsError;

/// GID indices a QP's `sgid_index` (a `u8`) can name; larger tables are read up to here.
const GID_INDICES: i32 = u8::MAX as i32 + 1;

/// The devices rdma-core lists.
///
/// # Errors
/// [`VerbsError::Unsupported`] (what = "RDMA") when rdma-core is missing, the kernel has no
/// RDMA support, or the list is empty: [`failure::unavailable`] says which and what to do.
/// [`VerbsError::Failed`] for other errors of `ibv_get_device_list`.
pub(super) fn list() -> Result<DeviceList, VerbsError> {
    let devices = DeviceList::new().map_err(|error| match &error.0 {
        GetDeviceListErrorKind::Ibverbs(io) if io.kind() == std::io::ErrorKind::Unsupported => {
            failure::unavailable(Some(io))
        }
        _ => failure::failed("ibv_get_device_list", &error),
    })?;
    if devices.is_empty() {
        return Err(failure::unavailable(None));
    }
    Ok(devices)
}

/// Opens the device named `name` (`ibv_open_device`).
///
/// # Errors
/// As [`list`]; [`VerbsError::NoSuchDevice`]; [`VerbsError::Failed`] when it cannot be opened
/// (the message says when `/dev/infiniband` is not accessible).
pub(super) fn open(name: &str) -> Result<Arc<DeviceContext>, VerbsError> {
    let devices = list()?;
    let device = devices
        .iter()
        .find(|device| device.name() == name)
        .ok_or_else(|| VerbsError::NoSuchDevice {
            name: name.to_owned(),
        })?;
    open_device(name, device.open())
}

fn open_device(
    name: &str,
    opened: Result<Arc<DeviceContext>, ::sideway::ibverbs::device::OpenDeviceError>,
) -> Result<Arc<DeviceContext>, VerbsError> {
    opened.map_err(|error| {
        let ::sideway::ibverbs::device::OpenDeviceErrorKind::Ibverbs(io) = &error.0 else {
            return failure::failed("ibv_open_device", &error);
        };
        match io.kind() {
            std::io::ErrorKind::PermissionDenied => VerbsError::Failed {
                call: "ibv_open_device",
                message: format!(
                    "cannot open {name}: {io}; this user needs read and write access to \
                     /dev/infiniband/uverbs* (the rdma group, or in a container \
                     --device /dev/infiniband)"
                ),
            },
            _ => failure::os("ibv_open_device", name, io),
        }
    })
}

/// Every listed device with its ports and GID tables.
///
/// A port whose state, link layer or active MTU is a value verbs does not define is left out
/// (logged as a warning): nothing could be connected through it safely, and the other ports
/// and devices stay usable.
///
/// # Errors
/// As [`list`]; [`VerbsError::Failed`] when a device cannot be opened or queried.
pub(super) fn describe_all() -> Result<Vec<DeviceInfo>, VerbsError> {
    let devices = list()?;
    let mut infos = Vec::with_capacity(devices.len());
    for device in devices.iter() {
        let name = device.name();
        let context = open_device(&name, device.open())?;
        infos.push(describe(&name, &context)?);
    }
    Ok(infos)
}

fn describe(name: &str, context: &DeviceContext) -> Result<DeviceInfo, VerbsError> {
    let attr = context.query_device().map_err(|error| {
        let ::sideway::ibverbs::device_context::QueryDeviceErrorKind::Ibverbs(io) = &error.0 else {
            return failure::failed("ibv_query_device_ex", &error);
        };
        failure::os("ibv_query_device_ex", name, io)
    })?;
    let mut ports = Vec::new();
    for port_num in 1..=attr.phys_port_cnt() {
        match describe_port(name, context, port_num) {
            Ok(port) => ports.push(port),
            Err(error) => tracing::warn!("ferry-rdma: {name} port {port_num} left out: {error}"),
        }
    }
    Ok(DeviceInfo {
        name: name.to_owned(),
        ports,
        // Negative limits would be a driver bug; they read as "none".
        max_sge: u32::try_from(attr.max_sge()).unwrap_or(0),
        max_qp_wr: u32::try_from(attr.max_qp_wr()).unwrap_or(0),
        max_rd_atomic: u8::try_from(attr.max_qp_rd_atom().min(attr.max_qp_init_rd_atom()))
            .unwrap_or(0),
    })
}

fn describe_port(
    name: &str,
    context: &DeviceContext,
    port_num: u8,
) -> Result<PortInfo, VerbsError> {
    let port = context.query_port(port_num).map_err(|error| {
        let ::sideway::ibverbs::device_context::QueryPortErrorKind::Ibverbs(io) = &error.source
        else {
            return failure::failed("ibv_query_port", &error);
        };
        failure::os("ibv_query_port", name, io)
    })?;
    let attr = &port.attr;
    let unknown = |what: &str, value: u32| VerbsError::Failed {
        call: "ibv_query_port",
        message: format!(
            "{name} port {port_num} reports {what} {value}, a value verbs does not define; \
             a newer ferry may know it"
        ),
    };
    let state = raw::port_state(attr.state).ok_or_else(|| unknown("state", attr.state))?;
    let link_layer = raw::link_layer(attr.link_layer)
        .ok_or_else(|| unknown("link layer", attr.link_layer.into()))?;
    let active_mtu =
        raw::mtu(attr.active_mtu).ok_or_else(|| unknown("active MTU", attr.active_mtu))?;
    Ok(PortInfo {
        port_num,
        state,
        link_layer,
        active_mtu,
        lid: attr.lid,
        line_rate_mbps: raw::line_rate_mbps(
            attr.active_speed,
            attr.active_speed_ex,
            attr.active_width,
        ),
        max_msg_size: attr.max_msg_sz,
        gids: gid_table(name, context, port_num, link_layer, attr.gid_tbl_len),
    })
}

/// The populated entries of a port's GID table. Entries that cannot be read are skipped, as
/// rdma-core's tools do: unpopulated RoCE entries fail with `EINVAL` on some kernels, and in
/// containers an entry of another network namespace cannot be read.
fn gid_table(
    name: &str,
    context: &DeviceContext,
    port_num: u8,
    link_layer: LinkLayer,
    table_len: i32,
) -> Vec<GidEntry> {
    let mut entries = Vec::new();
    for index in 0..table_len.clamp(0, GID_INDICES) {
        // `index` is in 0..=255, so both conversions are exact.
        let (Ok(index_u32), Ok(index_u8)) = (u32::try_from(index), u8::try_from(index)) else {
            continue;
        };
        let Ok(gid) = context.query_gid(port_num, index_u32) else {
            continue;
        };
        if gid.raw == [0; 16] {
            continue;
        }
        let Some(kind) = entry_type(name, context, port_num, link_layer, index_u32) else {
            tracing::debug!(
                "ferry-rdma: {name} port {port_num} GID {index}: type unknown, left out"
            );
            continue;
        };
        entries.push(GidEntry {
            index: index_u8,
            gid: Gid(gid.raw),
            kind,
        });
    }
    entries
}

/// The type of a GID entry: on InfiniBand always [`GidType::Ib`]; on Ethernet what
/// `ibv_query_gid_type` says, or the sysfs file it reads when the installed rdma-core lacks the
/// call (it is one of libibverbs' private symbols).
fn entry_type(
    name: &str,
    context: &DeviceContext,
    port_num: u8,
    link_layer: LinkLayer,
    index: u32,
) -> Option<GidType> {
    if link_layer == LinkLayer::InfiniBand {
        return Some(GidType::Ib);
    }
    match context.query_gid_type(port_num, index) {
        Ok(raw_type) => raw::gid_type(raw_type, link_layer),
        Err(error) => {
            let ::sideway::ibverbs::device_context::QueryGidErrorKind::Ibverbs(io) = &error.source
            else {
                return None;
            };
            if io.raw_os_error() != Some(errno::EOPNOTSUPP) {
                return None;
            }
            let path =
                format!("/sys/class/infiniband/{name}/ports/{port_num}/gid_attrs/types/{index}");
            let text = std::fs::read_to_string(path).ok()?;
            raw::gid_type_from_sysfs(&text, link_layer)
        }
    }
}
