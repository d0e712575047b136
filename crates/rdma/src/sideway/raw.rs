//! Raw verbs values to ferry's types, and ferry's types to sideway's.
//!
//! sideway's own conversions (`From<u32> for WorkCompletionStatus`, `Mtu`, `PortState`,
//! `LinkLayer`, `GidType`, ...) panic on a value they do not know, and a newer kernel,
//! provider or rdma-core may report one. This layer reads the raw fields instead and maps
//! them here: every function answers `None` for a value it does not know, and its caller turns
//! that into an error (a port it cannot describe, a QP state it cannot name) or, for work
//! completions, into [`WcStatus::GeneralError`].

use ::sideway::ibverbs::device_context::Mtu as SidewayMtu;
use ::sideway::ibverbs::AccessFlags as SidewayAccess;
use rdma_mummy_sys::{
    ibv_mtu, ibv_port_state, ibv_qp_state, ibv_wc_opcode, ibv_wc_status,
    IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2, IBV_LINK_LAYER_ETHERNET,
    IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_UNSPECIFIED,
};

use crate::device::{GidType, LinkLayer, Mtu, PortState};
use crate::memory::AccessFlags;
use crate::qp::QpState;
use crate::work::{WcOpcode, WcStatus, WorkCompletion};

/// `ibv_wc_status` to [`WcStatus`]. `None` for the statuses ferry has no name for: the
/// reliable-datagram and tag-matching ones (an RC QP does not produce them), the response
/// timeout, and values verbs does not define.
pub(super) fn wc_status(raw: u32) -> Option<WcStatus> {
    Some(match raw {
        ibv_wc_status::IBV_WC_SUCCESS => WcStatus::Success,
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => WcStatus::LocalLengthError,
        ibv_wc_status::IBV_WC_LOC_QP_OP_ERR => WcStatus::LocalQpOperationError,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtectionError,
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::WrFlushError,
        ibv_wc_status::IBV_WC_MW_BIND_ERR => WcStatus::MemoryWindowBindError,
        ibv_wc_status::IBV_WC_BAD_RESP_ERR => WcStatus::BadResponseError,
        ibv_wc_status::IBV_WC_LOC_ACCESS_ERR => WcStatus::LocalAccessError,
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => WcStatus::RemoteInvalidRequestError,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccessError,
        ibv_wc_status::IBV_WC_REM_OP_ERR => WcStatus::RemoteOperationError,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExceeded,
        ibv_wc_status::IBV_WC_REM_ABORT_ERR => WcStatus::RemoteAbortError,
        ibv_wc_status::IBV_WC_FATAL_ERR => WcStatus::FatalError,
        ibv_wc_status::IBV_WC_GENERAL_ERR => WcStatus::GeneralError,
        _ => return None,
    })
}

/// `ibv_wc_opcode` to [`WcOpcode`]. `None` for the operations ferry never posts (SEND,
/// atomics, memory windows, ...) and values verbs does not define.
pub(super) fn wc_opcode(raw: u32) -> Option<WcOpcode> {
    Some(match raw {
        ibv_wc_opcode::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
        ibv_wc_opcode::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
        ibv_wc_opcode::IBV_WC_RECV => WcOpcode::Recv,
        ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => return None,
    })
}

/// The raw fields of one polled `ibv_wc`, as sideway's accessors return them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RawCompletion {
    pub(super) wr_id: u64,
    pub(super) status: u32,
    pub(super) opcode: u32,
    pub(super) byte_len: u32,
    /// `imm_data` as verbs stores it: in network byte order.
    pub(super) imm_data: u32,
}

/// A polled completion as ferry reports it, for the QP numbered `qp_num`.
///
/// - An unknown status becomes [`WcStatus::GeneralError`] (logged with its value).
/// - Verbs leaves the opcode undefined when the status is an error; an opcode this layer does
///   not know then reads [`WcOpcode::RdmaWrite`], which [`WorkCompletion::opcode`]'s contract
///   ("only meaningful on success") allows. A *successful* completion of an operation ferry
///   never posts (a SEND, an atomic) becomes [`WcStatus::GeneralError`]: something other than
///   this layer posted to the QP.
/// - The immediate value is reported for successful receives of a WRITE_WITH_IMM, converted
///   from network byte order, so a peer's `imm` arrives as the same `u32` it sent (also from
///   C peers, which pass `htonl(value)` as verbs expects).
pub(super) fn completion(raw: RawCompletion, qp_num: u32) -> WorkCompletion {
    let mut status = wc_status(raw.status).unwrap_or_else(|| {
        tracing::warn!(
            status = raw.status,
            wr_id = raw.wr_id,
            "ferry-rdma: a work completion has a status this build has no name for; reported as IBV_WC_GENERAL_ERR"
        );
        WcStatus::GeneralError
    });
    let opcode = match wc_opcode(raw.opcode) {
        Some(opcode) => opcode,
        None => {
            if status.is_success() {
                tracing::warn!(
                    opcode = raw.opcode,
                    wr_id = raw.wr_id,
                    "ferry-rdma: a successful completion of an operation ferry never posts; reported as IBV_WC_GENERAL_ERR"
                );
                status = WcStatus::GeneralError;
            }
            WcOpcode::RdmaWrite
        }
    };
    let imm = (status.is_success() && opcode == WcOpcode::RecvRdmaWithImm)
        .then(|| u32::from_be(raw.imm_data));
    WorkCompletion {
        wr_id: raw.wr_id,
        status,
        opcode,
        byte_len: raw.byte_len,
        imm,
        qp_num,
    }
}

/// `ibv_mtu` to [`Mtu`]; `None` for 0 and values verbs does not define.
pub(super) fn mtu(raw: u32) -> Option<Mtu> {
    Some(match raw {
        ibv_mtu::IBV_MTU_256 => Mtu::Mtu256,
        ibv_mtu::IBV_MTU_512 => Mtu::Mtu512,
        ibv_mtu::IBV_MTU_1024 => Mtu::Mtu1024,
        ibv_mtu::IBV_MTU_2048 => Mtu::Mtu2048,
        ibv_mtu::IBV_MTU_4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

/// [`Mtu`] to sideway's, for a QP's path MTU (variant to variant: no conversion that panics).
pub(super) fn sideway_mtu(mtu: Mtu) -> SidewayMtu {
    match mtu {
        Mtu::Mtu256 => SidewayMtu::Mtu256,
        Mtu::Mtu512 => SidewayMtu::Mtu512,
        Mtu::Mtu1024 => SidewayMtu::Mtu1024,
        Mtu::Mtu2048 => SidewayMtu::Mtu2048,
        Mtu::Mtu4096 => SidewayMtu::Mtu4096,
    }
}

/// `ibv_port_state` to [`PortState`]; `None` for `IBV_PORT_NOP` (reserved, never reported by
/// a working device) and values verbs does not define.
pub(super) fn port_state(raw: u32) -> Option<PortState> {
    Some(match raw {
        ibv_port_state::IBV_PORT_DOWN => PortState::Down,
        ibv_port_state::IBV_PORT_INIT => PortState::Init,
        ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
        ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
        ibv_port_state::IBV_PORT_ACTIVE_DEFER => PortState::ActiveDefer,
        _ => return None,
    })
}

/// A port's `link_layer` byte to [`LinkLayer`]. `IBV_LINK_LAYER_UNSPECIFIED` is InfiniBand, as
/// `ibv_devinfo` reads it: kernels before link layers were reported leave it 0 on IB ports.
pub(super) fn link_layer(raw: u8) -> Option<LinkLayer> {
    match raw {
        IBV_LINK_LAYER_UNSPECIFIED | IBV_LINK_LAYER_INFINIBAND => Some(LinkLayer::InfiniBand),
        IBV_LINK_LAYER_ETHERNET => Some(LinkLayer::Ethernet),
        _ => None,
    }
}

/// The GID type `ibv_query_gid_type` reports (the sysfs numbering: 0 is "IB/RoCE v1", 1 is
/// "RoCE v2") on a port of `link_layer`; `None` for other values and for RoCE v2 on an
/// InfiniBand port.
pub(super) fn gid_type(raw: u32, link_layer: LinkLayer) -> Option<GidType> {
    match (raw, link_layer) {
        (IBV_GID_TYPE_SYSFS_IB_ROCE_V1, LinkLayer::InfiniBand) => Some(GidType::Ib),
        (IBV_GID_TYPE_SYSFS_IB_ROCE_V1, LinkLayer::Ethernet) => Some(GidType::RoceV1),
        (IBV_GID_TYPE_SYSFS_ROCE_V2, LinkLayer::Ethernet) => Some(GidType::RoceV2),
        _ => None,
    }
}

/// The text of `/sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<index>` (what
/// `ibv_query_gid_type` reads), for when that call is missing from the installed rdma-core.
pub(super) fn gid_type_from_sysfs(text: &str, link_layer: LinkLayer) -> Option<GidType> {
    match text.trim() {
        "IB/RoCE v1" => gid_type(IBV_GID_TYPE_SYSFS_IB_ROCE_V1, link_layer),
        "RoCE v2" => gid_type(IBV_GID_TYPE_SYSFS_ROCE_V2, link_layer),
        _ => None,
    }
}

/// `ibv_qp_state` to [`QpState`]; `None` for the states ferry never moves a QP to (SQD, SQE)
/// and for `IBV_QPS_UNKNOWN` and values verbs does not define.
pub(super) fn qp_state(raw: u32) -> Option<QpState> {
    Some(match raw {
        ibv_qp_state::IBV_QPS_RESET => QpState::Reset,
        ibv_qp_state::IBV_QPS_INIT => QpState::Init,
        ibv_qp_state::IBV_QPS_RTR => QpState::ReadyToReceive,
        ibv_qp_state::IBV_QPS_RTS => QpState::ReadyToSend,
        ibv_qp_state::IBV_QPS_ERR => QpState::Error,
        _ => return None,
    })
}

/// [`AccessFlags`] to sideway's, flag by flag (ferry has only the three RC transfers need).
pub(super) fn sideway_access(access: AccessFlags) -> SidewayAccess {
    let mut flags = SidewayAccess::none();
    if access.contains(AccessFlags::LOCAL_WRITE) {
        flags |= SidewayAccess::LocalWrite;
    }
    if access.contains(AccessFlags::REMOTE_WRITE) {
        flags |= SidewayAccess::RemoteWrite;
    }
    if access.contains(AccessFlags::REMOTE_READ) {
        flags |= SidewayAccess::RemoteRead;
    }
    if access.contains(AccessFlags::RELAXED_ORDERING) {
        flags |= SidewayAccess::RelaxedOrdering;
    }
    flags
}

/// A port's data rate in Mb/s from its raw `active_speed` (or `active_speed_ex`, which newer
/// rdma-core fills for speeds past NDR and which then wins) and `active_width` codes; `None`
/// for a code verbs does not define.
pub(super) fn line_rate_mbps(speed: u8, speed_ex: u32, width: u8) -> Option<u64> {
    let code = if speed_ex != 0 {
        speed_ex
    } else {
        u32::from(speed)
    };
    let per_lane: u64 = match code {
        1 => 2_500,      // SDR
        2 => 5_000,      // DDR
        4 | 8 => 10_000, // QDR, FDR10
        16 => 14_000,    // FDR
        32 => 25_000,    // EDR
        64 => 50_000,    // HDR
        128 => 100_000,  // NDR
        256 => 200_000,  // XDR
        _ => return None,
    };
    let lanes: u64 = match width {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => return None,
    };
    Some(per_lane * lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The expected values are the verbs ABI numbers written out (from <infiniband/verbs.h>),
    // so these tests also pin the constants the mapping uses.

    #[test]
    fn every_wc_status_maps_and_unknown_ones_have_no_name() {
        let expected = [
            (0, Some(WcStatus::Success)),
            (1, Some(WcStatus::LocalLengthError)),
            (2, Some(WcStatus::LocalQpOperationError)),
            (3, None), // IBV_WC_LOC_EEC_OP_ERR: reliable datagram
            (4, Some(WcStatus::LocalProtectionError)),
            (5, Some(WcStatus::WrFlushError)),
            (6, Some(WcStatus::MemoryWindowBindError)),
            (7, Some(WcStatus::BadResponseError)),
            (8, Some(WcStatus::LocalAccessError)),
            (9, Some(WcStatus::RemoteInvalidRequestError)),
            (10, Some(WcStatus::RemoteAccessError)),
            (11, Some(WcStatus::RemoteOperationError)),
            (12, Some(WcStatus::RetryExceeded)),
            (13, Some(WcStatus::RnrRetryExceeded)),
            (14, None), // IBV_WC_LOC_RDD_VIOL_ERR
            (15, None), // IBV_WC_REM_INV_RD_REQ_ERR
            (16, Some(WcStatus::RemoteAbortError)),
            (17, None), // IBV_WC_INV_EECN_ERR
            (18, None), // IBV_WC_INV_EEC_STATE_ERR
            (19, Some(WcStatus::FatalError)),
            (20, None), // IBV_WC_RESP_TIMEOUT_ERR
            (21, Some(WcStatus::GeneralError)),
            (22, None), // IBV_WC_TM_ERR
            (23, None), // IBV_WC_TM_RNDV_INCOMPLETE
            (24, None),
            (999, None),
            (u32::MAX, None),
        ];
        for (raw, status) in expected {
            assert_eq!(wc_status(raw), status, "status {raw}");
            if let Some(status) = status {
                // The name ferry prints is the one verbs gives the same number.
                assert!(status.name().starts_with("IBV_WC_"), "{status:?}");
            }
        }
    }

    #[test]
    fn wc_opcodes_ferry_posts_map_and_others_have_no_name() {
        let known = [
            (1, WcOpcode::RdmaWrite),
            (2, WcOpcode::RdmaRead),
            (128, WcOpcode::Recv),
            (129, WcOpcode::RecvRdmaWithImm),
        ];
        for (raw, opcode) in known {
            assert_eq!(wc_opcode(raw), Some(opcode), "opcode {raw}");
        }
        // SEND, CMP_SWAP, FETCH_ADD, BIND_MW, LOCAL_INV, TSO, FLUSH, ATOMIC_WRITE, the
        // tag-matching and driver opcodes, and values verbs does not define.
        for raw in [
            0, 3, 4, 5, 6, 7, 8, 9, 10, 127, 130, 131, 132, 133, 134, 135, 999,
        ] {
            assert_eq!(wc_opcode(raw), None, "opcode {raw}");
        }
    }

    fn raw(status: u32, opcode: u32) -> RawCompletion {
        RawCompletion {
            wr_id: 7,
            status,
            opcode,
            byte_len: 4096,
            imm_data: 0x1234_5678u32.to_be(),
        }
    }

    #[test]
    fn a_write_with_imm_receive_reports_the_value_the_peer_sent() {
        let completion = completion(raw(0, 129), 42);
        assert_eq!(
            completion,
            WorkCompletion {
                wr_id: 7,
                status: WcStatus::Success,
                opcode: WcOpcode::RecvRdmaWithImm,
                byte_len: 4096,
                imm: Some(0x1234_5678),
                qp_num: 42,
            }
        );
    }

    #[test]
    fn only_successful_imm_receives_carry_an_immediate() {
        assert_eq!(completion(raw(0, 1), 1).imm, None);
        assert_eq!(completion(raw(0, 128), 1).imm, None);
        assert_eq!(completion(raw(5, 129), 1).imm, None);
    }

    #[test]
    fn an_unknown_status_is_a_general_error() {
        let completion = completion(raw(200, 1), 3);
        assert_eq!(completion.status, WcStatus::GeneralError);
        assert_eq!(completion.wr_id, 7);
    }

    #[test]
    fn an_error_with_an_undefined_opcode_keeps_its_status() {
        let completion = completion(raw(5, 0xdead), 3);
        assert_eq!(completion.status, WcStatus::WrFlushError);
    }

    #[test]
    fn a_successful_send_completion_is_a_general_error() {
        // ferry never posts SEND (opcode 0): a success for one is not something it asked for.
        assert_eq!(completion(raw(0, 0), 3).status, WcStatus::GeneralError);
    }

    #[test]
    fn every_mtu_maps_and_others_have_no_name() {
        let expected = [
            (0, None),
            (1, Some(Mtu::Mtu256)),
            (2, Some(Mtu::Mtu512)),
            (3, Some(Mtu::Mtu1024)),
            (4, Some(Mtu::Mtu2048)),
            (5, Some(Mtu::Mtu4096)),
            (6, None),
            (4096, None),
            (u32::MAX, None),
        ];
        for (raw, expected) in expected {
            assert_eq!(mtu(raw), expected, "mtu {raw}");
            if let Some(value) = expected {
                assert_eq!(sideway_mtu(value) as u32, raw, "{value:?} back to verbs");
            }
        }
    }

    #[test]
    fn every_port_state_maps_and_nop_and_unknown_ones_have_no_name() {
        let expected = [
            (0, None), // IBV_PORT_NOP
            (1, Some(PortState::Down)),
            (2, Some(PortState::Init)),
            (3, Some(PortState::Armed)),
            (4, Some(PortState::Active)),
            (5, Some(PortState::ActiveDefer)),
            (6, None),
            (u32::MAX, None),
        ];
        for (raw, expected) in expected {
            assert_eq!(port_state(raw), expected, "port state {raw}");
        }
    }

    #[test]
    fn every_link_layer_maps_and_unknown_ones_have_no_name() {
        assert_eq!(link_layer(0), Some(LinkLayer::InfiniBand));
        assert_eq!(link_layer(1), Some(LinkLayer::InfiniBand));
        assert_eq!(link_layer(2), Some(LinkLayer::Ethernet));
        for raw in 3..=u8::MAX {
            assert_eq!(link_layer(raw), None, "link layer {raw}");
        }
    }

    #[test]
    fn gid_types_follow_the_link_layer() {
        assert_eq!(gid_type(0, LinkLayer::InfiniBand), Some(GidType::Ib));
        assert_eq!(gid_type(0, LinkLayer::Ethernet), Some(GidType::RoceV1));
        assert_eq!(gid_type(1, LinkLayer::Ethernet), Some(GidType::RoceV2));
        assert_eq!(gid_type(1, LinkLayer::InfiniBand), None);
        assert_eq!(gid_type(2, LinkLayer::Ethernet), None);
        assert_eq!(gid_type(u32::MAX, LinkLayer::InfiniBand), None);
    }

    #[test]
    fn sysfs_gid_types_read_as_the_call_would() {
        assert_eq!(
            gid_type_from_sysfs("RoCE v2\n", LinkLayer::Ethernet),
            Some(GidType::RoceV2)
        );
        assert_eq!(
            gid_type_from_sysfs("IB/RoCE v1\n", LinkLayer::Ethernet),
            Some(GidType::RoceV1)
        );
        assert_eq!(
            gid_type_from_sysfs("IB/RoCE v1", LinkLayer::InfiniBand),
            Some(GidType::Ib)
        );
        assert_eq!(gid_type_from_sysfs("", LinkLayer::Ethernet), None);
        assert_eq!(gid_type_from_sysfs("RoCE v3", LinkLayer::Ethernet), None);
    }

    #[test]
    fn every_qp_state_maps_and_the_ones_ferry_never_uses_have_no_name() {
        let expected = [
            (0, Some(QpState::Reset)),
            (1, Some(QpState::Init)),
            (2, Some(QpState::ReadyToReceive)),
            (3, Some(QpState::ReadyToSend)),
            (4, None), // IBV_QPS_SQD
            (5, None), // IBV_QPS_SQE
            (6, Some(QpState::Error)),
            (7, None), // IBV_QPS_UNKNOWN
            (8, None),
            (u32::MAX, None),
        ];
        for (raw, expected) in expected {
            assert_eq!(qp_state(raw), expected, "qp state {raw}");
        }
    }

    #[test]
    fn access_flags_keep_their_bits() {
        for access in [
            AccessFlags::NONE,
            AccessFlags::LOCAL_WRITE,
            AccessFlags::REMOTE_READ,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::RELAXED_ORDERING,
        ] {
            assert_eq!(
                sideway_access(access).bits() as u32,
                access.bits(),
                "{access:?}"
            );
        }
    }

    #[test]
    fn line_rates_multiply_lanes_by_the_lane_rate_and_unknown_codes_are_none() {
        assert_eq!(line_rate_mbps(128, 0, 2), Some(400_000), "NDR 4x");
        assert_eq!(line_rate_mbps(64, 0, 2), Some(200_000), "HDR 4x");
        assert_eq!(line_rate_mbps(32, 0, 1), Some(25_000), "EDR 1x");
        assert_eq!(
            line_rate_mbps(0, 256, 16),
            Some(400_000),
            "XDR 2x through speed_ex"
        );
        assert_eq!(line_rate_mbps(3, 0, 2), None, "unknown speed");
        assert_eq!(line_rate_mbps(128, 0, 3), None, "unknown width");
    }
}
