//! The model driven as pairs of connected hosts.

use super::*;
use crate::qp::{AddressVector, GlobalRoute, InitAttr, QpEndpoint, RtrAttr, RtsAttr};
use crate::work::{RemoteSegment, SendOpcode, Sge, WcOpcode, WcStatus};

type Result<T = ()> = std::result::Result<T, VerbsError>;

const CAPS: QpCaps = QpCaps {
    max_send_wr: 16,
    max_recv_wr: 16,
    max_send_sge: 4,
    max_recv_sge: 4,
};
const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ);
const LEN: u64 = 64 * 1024;

/// One side: a host's verbs, a QP and one registered buffer.
struct Side {
    verbs: ModelVerbs,
    context: ModelContext,
    pd: ModelPd,
    cq: ModelCq,
    qp: ModelQp,
    buffer: u64,
    keys: MrKeys,
    psn: Psn,
}

impl Side {
    fn new(fabric: &Fabric, config: HostConfig, psn: u32) -> Result<Side> {
        let verbs = fabric.add_host(config);
        let context = verbs.open("mlx5_0")?;
        let pd = verbs.alloc_pd(&context)?;
        let cq = verbs.create_cq(&context, 64)?;
        let qp = verbs.create_qp(&pd, &cq, &cq, CAPS)?;
        let buffer = verbs.alloc(LEN)?;
        let mr = verbs.reg_mr(&pd, buffer, LEN, ALL)?;
        let keys = verbs.mr_keys(&mr);
        Ok(Side {
            verbs,
            context,
            pd,
            cq,
            qp,
            buffer,
            keys,
            psn: Psn::new(psn)?,
        })
    }

    fn endpoint(&self) -> Result<(QpEndpoint, u8)> {
        let devices = self.verbs.devices()?;
        let port = &devices[0].ports[0];
        let index = port.preferred_gid_index();
        let gid = port.gid(index).map(|entry| entry.gid).unwrap_or_default();
        Ok((
            QpEndpoint {
                qpn: self.verbs.qp_num(&self.qp),
                psn: self.psn,
                lid: port.lid,
                gid,
            },
            index,
        ))
    }

    fn init(&self, access: AccessFlags) -> Result {
        let attr = InitAttr {
            port: 1,
            pkey_index: 0,
            access,
        };
        self.verbs.modify_qp(&self.qp, &QpTransition::Init(attr))
    }

    /// RTR with the peer's endpoint, then RTS with this side's PSN.
    fn connect_to(&self, peer: &QpEndpoint, rnr_retry: u8) -> Result {
        let (_, sgid_index) = self.endpoint()?;
        let global = (peer.gid != Gid::default()).then_some(GlobalRoute {
            dest_gid: peer.gid,
            sgid_index,
            hop_limit: 64,
            traffic_class: 0,
        });
        let rtr = RtrAttr {
            path_mtu: Mtu::Mtu1024,
            dest_qpn: peer.qpn,
            rq_psn: peer.psn,
            address: AddressVector {
                dest_lid: peer.lid,
                global,
            },
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
        };
        self.verbs
            .modify_qp(&self.qp, &QpTransition::ReadyToReceive(rtr))?;
        let rts = RtsAttr {
            sq_psn: self.psn,
            timeout: 14,
            retry_count: 7,
            rnr_retry,
            max_rd_atomic: 16,
        };
        self.verbs
            .modify_qp(&self.qp, &QpTransition::ReadyToSend(rts))
    }

    fn poll(&self) -> Result<Vec<WorkCompletion>> {
        let mut out = Vec::new();
        self.verbs.poll_cq(&self.cq, 64, &mut out)?;
        Ok(out)
    }

    fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.buffer + offset,
            len,
            lkey: self.keys.lkey,
        }
    }

    fn remote(&self, offset: u64) -> RemoteSegment {
        RemoteSegment {
            addr: self.buffer + offset,
            rkey: self.keys.rkey,
        }
    }

    fn fill(&self, offset: u64, len: usize, seed: u8) -> Result<Vec<u8>> {
        let bytes: Vec<u8> = (0..len)
            .map(|index| (index as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        self.verbs.write_memory(self.buffer + offset, &bytes)?;
        Ok(bytes)
    }
}

struct Pair {
    fabric: Fabric,
    a: Side,
    b: Side,
}

fn pair_with(config_a: HostConfig, config_b: HostConfig, rnr_retry: u8) -> Result<Pair> {
    let fabric = Fabric::new();
    let a = Side::new(&fabric, config_a, 0x1234)?;
    let b = Side::new(&fabric, config_b, 0xabcdef)?;
    a.init(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
    b.init(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
    // The exchange over the control connection.
    let (endpoint_a, _) = a.endpoint()?;
    let (endpoint_b, _) = b.endpoint()?;
    a.connect_to(&endpoint_b, rnr_retry)?;
    b.connect_to(&endpoint_a, rnr_retry)?;
    Ok(Pair { fabric, a, b })
}

fn pair() -> Result<Pair> {
    pair_with(
        HostConfig::roce("prefill", [10, 0, 0, 1]),
        HostConfig::roce("decode", [10, 0, 0, 2]),
        7,
    )
}

fn write(wr_id: u64, sg_list: Vec<Sge>, remote: RemoteSegment) -> SendRequest {
    SendRequest {
        wr_id,
        opcode: SendOpcode::RdmaWrite,
        sg_list,
        remote,
        signaled: true,
    }
}

fn read(wr_id: u64, sg_list: Vec<Sge>, remote: RemoteSegment) -> SendRequest {
    SendRequest {
        wr_id,
        opcode: SendOpcode::RdmaRead,
        sg_list,
        remote,
        signaled: true,
    }
}

fn statuses(completions: &[WorkCompletion]) -> Vec<(u64, WcStatus)> {
    completions
        .iter()
        .map(|completion| (completion.wr_id, completion.status))
        .collect()
}

#[test]
fn connection_walks_reset_init_rtr_rts() -> Result {
    let fabric = Fabric::new();
    let a = Side::new(&fabric, HostConfig::roce("a", [10, 0, 0, 1]), 1)?;
    let b = Side::new(&fabric, HostConfig::roce("b", [10, 0, 0, 2]), 2)?;
    assert_eq!(a.verbs.qp_state(&a.qp)?, QpState::Reset);
    let (endpoint_b, _) = b.endpoint()?;
    // RTR straight from RESET is refused.
    assert!(matches!(
        a.connect_to(&endpoint_b, 7),
        Err(VerbsError::InvalidTransition {
            from: QpState::Reset,
            ..
        })
    ));
    a.init(AccessFlags::REMOTE_WRITE)?;
    assert_eq!(a.verbs.qp_state(&a.qp)?, QpState::Init);
    b.init(AccessFlags::REMOTE_WRITE)?;
    let (endpoint_a, gid_index) = a.endpoint()?;
    assert_eq!(gid_index, 3, "the IPv4-mapped RoCE v2 entry");
    assert_eq!(endpoint_a.gid, Gid::from_ipv4([10, 0, 0, 1]));
    a.connect_to(&endpoint_b, 7)?;
    b.connect_to(&endpoint_a, 7)?;
    assert_eq!(a.verbs.qp_state(&a.qp)?, QpState::ReadyToSend);
    assert_eq!(b.verbs.qp_state(&b.qp)?, QpState::ReadyToSend);
    // RTS -> RTR is not a transition.
    let rtr = QpTransition::ReadyToReceive(RtrAttr {
        path_mtu: Mtu::Mtu1024,
        dest_qpn: endpoint_b.qpn,
        rq_psn: endpoint_b.psn,
        address: AddressVector {
            dest_lid: 0,
            global: None,
        },
        max_dest_rd_atomic: 1,
        min_rnr_timer: 1,
    });
    assert!(matches!(
        a.verbs.modify_qp(&a.qp, &rtr),
        Err(VerbsError::InvalidTransition { .. })
    ));
    Ok(())
}

#[test]
fn roce_rtr_without_global_route_is_refused() -> Result {
    let fabric = Fabric::new();
    let a = Side::new(&fabric, HostConfig::roce("a", [10, 0, 0, 1]), 1)?;
    a.init(AccessFlags::REMOTE_WRITE)?;
    let peer = QpEndpoint {
        qpn: 0x100,
        psn: Psn::new(5)?,
        lid: 0,
        gid: Gid::default(),
    };
    let refused = a.connect_to(&peer, 7);
    assert!(
        matches!(
            refused,
            Err(VerbsError::InvalidAttribute {
                attribute: "address.global",
                ..
            })
        ),
        "{refused:?}"
    );
    Ok(())
}

#[test]
fn infiniband_pair_connects_by_lid() -> Result {
    let pair = pair_with(
        HostConfig::infiniband("a", 7),
        HostConfig::infiniband("b", 9),
        7,
    )?;
    let bytes = pair.a.fill(0, 5000, 3)?;
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[write(1, vec![pair.a.sge(0, 5000)], pair.b.remote(100))],
    )?;
    assert_eq!(statuses(&pair.a.poll()?), vec![(1, WcStatus::Success)]);
    assert_eq!(pair.b.verbs.read_memory(pair.b.buffer + 100, 5000)?, bytes);
    Ok(())
}

#[test]
fn write_moves_bytes_to_the_peer() -> Result {
    let pair = pair()?;
    let bytes = pair.a.fill(10, 3000, 1)?;
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[write(7, vec![pair.a.sge(10, 3000)], pair.b.remote(500))],
    )?;
    let completions = pair.a.poll()?;
    assert_eq!(statuses(&completions), vec![(7, WcStatus::Success)]);
    assert_eq!(completions[0].opcode, WcOpcode::RdmaWrite);
    assert_eq!(pair.b.verbs.read_memory(pair.b.buffer + 500, 3000)?, bytes);
    // Bytes around the destination are untouched.
    assert_eq!(pair.b.verbs.read_memory(pair.b.buffer + 499, 1)?, vec![0]);
    assert_eq!(pair.b.verbs.read_memory(pair.b.buffer + 3500, 1)?, vec![0]);
    assert!(
        pair.b.poll()?.is_empty(),
        "a WRITE completes nothing at the responder"
    );
    Ok(())
}

#[test]
fn read_brings_the_peers_bytes() -> Result {
    let pair = pair()?;
    let bytes = pair.b.fill(4096, 8192, 9)?;
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[read(3, vec![pair.a.sge(0, 8192)], pair.b.remote(4096))],
    )?;
    let completions = pair.a.poll()?;
    assert_eq!(statuses(&completions), vec![(3, WcStatus::Success)]);
    assert_eq!(
        (completions[0].opcode, completions[0].byte_len),
        (WcOpcode::RdmaRead, 8192)
    );
    assert_eq!(pair.a.verbs.read_memory(pair.a.buffer, 8192)?, bytes);
    Ok(())
}

#[test]
fn sg_lists_gather_writes_and_scatter_reads() -> Result {
    let pair = pair()?;
    let first = pair.a.fill(0, 100, 1)?;
    let second = pair.a.fill(1000, 50, 2)?;
    let third = pair.a.fill(5000, 7, 3)?;
    let sg_list = vec![
        pair.a.sge(0, 100),
        pair.a.sge(1000, 50),
        pair.a.sge(5000, 7),
    ];
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[write(1, sg_list, pair.b.remote(200))])?;
    let expected: Vec<u8> = [first, second, third].concat();
    assert_eq!(
        pair.b.verbs.read_memory(pair.b.buffer + 200, 157)?,
        expected
    );
    // Read it back scattered over two other ranges.
    let sg_list = vec![pair.a.sge(20_000, 57), pair.a.sge(30_000, 100)];
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[read(2, sg_list, pair.b.remote(200))])?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(
        pair.a.verbs.read_memory(pair.a.buffer + 20_000, 57)?,
        expected[..57]
    );
    assert_eq!(
        pair.a.verbs.read_memory(pair.a.buffer + 30_000, 100)?,
        expected[57..]
    );
    Ok(())
}

#[test]
fn write_with_imm_delivers_the_immediate_after_the_data() -> Result {
    let pair = pair()?;
    pair.b.verbs.post_recv(
        &pair.b.qp,
        &[RecvRequest {
            wr_id: 77,
            sg_list: vec![],
        }],
    )?;
    let bytes = pair.a.fill(0, 4096, 5)?;
    let request = SendRequest {
        wr_id: 1,
        opcode: SendOpcode::RdmaWriteWithImm { imm: 42 },
        sg_list: vec![pair.a.sge(0, 4096)],
        remote: pair.b.remote(0),
        signaled: true,
    };
    pair.a.verbs.post_send(&pair.a.qp, &[request])?;
    assert_eq!(statuses(&pair.a.poll()?), vec![(1, WcStatus::Success)]);
    let received = pair.b.poll()?;
    assert_eq!(received.len(), 1);
    assert_eq!(
        (received[0].wr_id, received[0].status, received[0].opcode),
        (77, WcStatus::Success, WcOpcode::RecvRdmaWithImm)
    );
    assert_eq!((received[0].imm, received[0].byte_len), (Some(42), 4096));
    assert_eq!(pair.b.verbs.read_memory(pair.b.buffer, 4096)?, bytes);
    Ok(())
}

#[test]
fn write_with_imm_waits_for_a_receive_when_rnr_retry_is_infinite() -> Result {
    let pair = pair()?;
    let request = SendRequest {
        wr_id: 1,
        opcode: SendOpcode::RdmaWriteWithImm { imm: 9 },
        sg_list: vec![pair.a.sge(0, 8)],
        remote: pair.b.remote(0),
        signaled: true,
    };
    pair.a.verbs.post_send(&pair.a.qp, &[request])?;
    assert!(
        pair.a.poll()?.is_empty(),
        "RNR with rnr_retry 7 keeps retrying"
    );
    pair.b.verbs.post_recv(
        &pair.b.qp,
        &[RecvRequest {
            wr_id: 5,
            sg_list: vec![],
        }],
    )?;
    assert_eq!(statuses(&pair.a.poll()?), vec![(1, WcStatus::Success)]);
    assert_eq!(pair.b.poll()?[0].imm, Some(9));
    Ok(())
}

#[test]
fn posting_before_rts_is_refused() -> Result {
    let fabric = Fabric::new();
    let a = Side::new(&fabric, HostConfig::roce("a", [10, 0, 0, 1]), 1)?;
    let b = Side::new(&fabric, HostConfig::roce("b", [10, 0, 0, 2]), 2)?;
    let request = write(1, vec![a.sge(0, 8)], b.remote(0));
    let refused = a.verbs.post_send(&a.qp, std::slice::from_ref(&request));
    assert!(
        matches!(
            refused,
            Err(VerbsError::QpNotReady {
                state: QpState::Reset,
                ..
            })
        ),
        "{refused:?}"
    );
    assert!(matches!(
        a.verbs.post_recv(
            &a.qp,
            &[RecvRequest {
                wr_id: 1,
                sg_list: vec![]
            }]
        ),
        Err(VerbsError::QpNotReady { .. })
    ));
    a.init(AccessFlags::REMOTE_WRITE)?;
    a.verbs.post_recv(
        &a.qp,
        &[RecvRequest {
            wr_id: 1,
            sg_list: vec![],
        }],
    )?;
    assert!(matches!(
        a.verbs.post_send(&a.qp, std::slice::from_ref(&request)),
        Err(VerbsError::QpNotReady {
            state: QpState::Init,
            ..
        })
    ));
    let (endpoint_b, _) = b.endpoint()?;
    let (_, sgid_index) = a.endpoint()?;
    let rtr = RtrAttr {
        path_mtu: Mtu::Mtu1024,
        dest_qpn: endpoint_b.qpn,
        rq_psn: endpoint_b.psn,
        address: AddressVector {
            dest_lid: 0,
            global: Some(GlobalRoute {
                dest_gid: endpoint_b.gid,
                sgid_index,
                hop_limit: 64,
                traffic_class: 0,
            }),
        },
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
    };
    a.verbs
        .modify_qp(&a.qp, &QpTransition::ReadyToReceive(rtr))?;
    assert!(matches!(
        a.verbs.post_send(&a.qp, &[request]),
        Err(VerbsError::QpNotReady {
            state: QpState::ReadyToReceive,
            ..
        })
    ));
    assert!(a.poll()?.is_empty(), "refused requests complete nothing");
    Ok(())
}

#[test]
fn too_many_sges_and_full_queues_are_refused_whole() -> Result {
    let pair = pair()?;
    let sg_list = (0..5).map(|index| pair.a.sge(index * 10, 10)).collect();
    let lists = [
        write(1, vec![pair.a.sge(0, 1)], pair.b.remote(0)),
        write(2, sg_list, pair.b.remote(0)),
    ];
    let refused = pair.a.verbs.post_send(&pair.a.qp, &lists);
    assert!(
        matches!(
            refused,
            Err(VerbsError::TooManySge {
                index: 1,
                count: 5,
                max: 4,
                ..
            })
        ),
        "{refused:?}"
    );
    assert!(pair.a.poll()?.is_empty(), "nothing of the list was posted");
    // Unsignaled requests hold their slots until a later signaled completion is polled.
    let mut unsignaled = write(0, vec![pair.a.sge(0, 8)], pair.b.remote(0));
    unsignaled.signaled = false;
    pair.a
        .verbs
        .post_send(&pair.a.qp, &vec![unsignaled.clone(); 15])?;
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[write(99, vec![pair.a.sge(0, 8)], pair.b.remote(0))],
    )?;
    let full = pair
        .a
        .verbs
        .post_send(&pair.a.qp, std::slice::from_ref(&unsignaled));
    assert!(
        matches!(
            full,
            Err(VerbsError::QueueFull {
                outstanding: 16,
                capacity: 16,
                ..
            })
        ),
        "{full:?}"
    );
    assert_eq!(statuses(&pair.a.poll()?), vec![(99, WcStatus::Success)]);
    pair.a.verbs.post_send(&pair.a.qp, &vec![unsignaled; 16])?;
    Ok(())
}

#[test]
fn message_longer_than_the_port_allows_is_a_local_length_error() -> Result {
    let mut config = HostConfig::roce("a", [10, 0, 0, 1]);
    config.devices[0].ports[0].max_msg_size = 1024;
    let pair = pair_with(config, HostConfig::roce("b", [10, 0, 0, 2]), 7)?;
    let requests = [
        write(
            1,
            vec![pair.a.sge(0, 1000), pair.a.sge(2000, 100)],
            pair.b.remote(0),
        ),
        write(2, vec![pair.a.sge(0, 8)], pair.b.remote(0)),
    ];
    pair.a.verbs.post_send(&pair.a.qp, &requests)?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::LocalLengthError), (2, WcStatus::WrFlushError)]
    );
    assert_eq!(pair.a.verbs.qp_state(&pair.a.qp)?, QpState::Error);
    Ok(())
}

#[test]
fn bad_local_ranges_are_local_protection_errors() -> Result {
    let unknown_lkey = |side: &Side| Sge {
        addr: side.buffer,
        len: 8,
        lkey: 0xdead_0011,
    };
    let rkey_as_lkey = |side: &Side| Sge {
        addr: side.buffer,
        len: 8,
        lkey: side.keys.rkey,
    };
    let past_end = |side: &Side| Sge {
        addr: side.buffer + LEN - 4,
        len: 8,
        lkey: side.keys.lkey,
    };
    let cases: [fn(&Side) -> Sge; 3] = [unknown_lkey, rkey_as_lkey, past_end];
    for (index, case) in cases.into_iter().enumerate() {
        let pair = pair()?;
        let sge = case(&pair.a);
        pair.a.verbs.post_send(
            &pair.a.qp,
            &[write(index as u64, vec![sge], pair.b.remote(0))],
        )?;
        assert_eq!(
            statuses(&pair.a.poll()?),
            vec![(index as u64, WcStatus::LocalProtectionError)],
            "case {index}"
        );
    }
    Ok(())
}

#[test]
fn read_into_a_region_without_local_write_is_a_local_protection_error() -> Result {
    let pair = pair()?;
    let target = pair.a.verbs.alloc(4096)?;
    let read_only = pair
        .a
        .verbs
        .reg_mr(&pair.a.pd, target, 4096, AccessFlags::NONE)?;
    let sge = Sge {
        addr: target,
        len: 64,
        lkey: pair.a.verbs.mr_keys(&read_only).lkey,
    };
    // As a WRITE's source it is fine.
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[write(1, vec![sge], pair.b.remote(0))])?;
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[read(2, vec![sge], pair.b.remote(0))])?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::Success), (2, WcStatus::LocalProtectionError)]
    );
    Ok(())
}

#[test]
fn remote_checks_fail_with_remote_access_error_and_flush_the_rest() -> Result {
    let in_bounds = |pair: &Pair| pair.b.remote(0);
    let past_end = |pair: &Pair| pair.b.remote(LEN - 4);
    let unknown_rkey = |pair: &Pair| RemoteSegment {
        addr: pair.b.buffer,
        rkey: 0x7777_0022,
    };
    let lkey_as_rkey = |pair: &Pair| RemoteSegment {
        addr: pair.b.buffer,
        rkey: pair.b.keys.lkey,
    };
    type Case = (&'static str, fn(&Pair) -> RemoteSegment, SendOpcode);
    let cases: [Case; 4] = [
        ("past the region's end", past_end, SendOpcode::RdmaWrite),
        ("unknown rkey", unknown_rkey, SendOpcode::RdmaRead),
        ("an lkey as rkey", lkey_as_rkey, SendOpcode::RdmaWrite),
        ("in bounds (control)", in_bounds, SendOpcode::RdmaWrite),
    ];
    for (name, remote, opcode) in cases {
        let pair = pair()?;
        let first = SendRequest {
            wr_id: 1,
            opcode,
            sg_list: vec![pair.a.sge(0, 16)],
            remote: remote(&pair),
            signaled: true,
        };
        let second = write(2, vec![pair.a.sge(0, 16)], pair.b.remote(0));
        pair.a.verbs.post_send(&pair.a.qp, &[first, second])?;
        let expected = if name.starts_with("in bounds") {
            vec![(1, WcStatus::Success), (2, WcStatus::Success)]
        } else {
            vec![
                (1, WcStatus::RemoteAccessError),
                (2, WcStatus::WrFlushError),
            ]
        };
        assert_eq!(statuses(&pair.a.poll()?), expected, "{name}");
    }
    Ok(())
}

#[test]
fn rkey_of_another_protection_domain_is_a_remote_access_error() -> Result {
    let pair = pair()?;
    let other_pd = pair.b.verbs.alloc_pd(&pair.b.context)?;
    let buffer = pair.b.verbs.alloc(4096)?;
    let other = pair.b.verbs.reg_mr(&other_pd, buffer, 4096, ALL)?;
    let remote = RemoteSegment {
        addr: buffer,
        rkey: pair.b.verbs.mr_keys(&other).rkey,
    };
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[write(1, vec![pair.a.sge(0, 8)], remote)])?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::RemoteAccessError)]
    );
    assert_eq!(
        pair.b.verbs.read_memory(buffer, 8)?,
        vec![0; 8],
        "nothing was written"
    );
    Ok(())
}

#[test]
fn missing_remote_access_flags_are_remote_access_errors() -> Result {
    // The region allows reads only: a WRITE is refused, a READ works.
    let pair = pair()?;
    let buffer = pair.b.verbs.alloc(4096)?;
    let readable = pair
        .b
        .verbs
        .reg_mr(&pair.b.pd, buffer, 4096, AccessFlags::REMOTE_READ)?;
    let remote = RemoteSegment {
        addr: buffer,
        rkey: pair.b.verbs.mr_keys(&readable).rkey,
    };
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[read(1, vec![pair.a.sge(0, 8)], remote)])?;
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[write(2, vec![pair.a.sge(0, 8)], remote)])?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::Success), (2, WcStatus::RemoteAccessError)]
    );

    // The responder QP allows writes only: a READ is refused even on a readable region.
    let fabric = Fabric::new();
    let a = Side::new(&fabric, HostConfig::roce("a", [10, 0, 0, 1]), 1)?;
    let b = Side::new(&fabric, HostConfig::roce("b", [10, 0, 0, 2]), 2)?;
    a.init(AccessFlags::REMOTE_WRITE)?;
    b.init(AccessFlags::REMOTE_WRITE)?;
    a.connect_to(&b.endpoint()?.0, 7)?;
    b.connect_to(&a.endpoint()?.0, 7)?;
    a.verbs
        .post_send(&a.qp, &[read(3, vec![a.sge(0, 8)], b.remote(0))])?;
    assert_eq!(statuses(&a.poll()?), vec![(3, WcStatus::RemoteAccessError)]);

    // REMOTE_WRITE without LOCAL_WRITE cannot even be registered.
    let refused = pair
        .b
        .verbs
        .reg_mr(&pair.b.pd, buffer, 4096, AccessFlags::REMOTE_WRITE);
    assert!(
        matches!(refused, Err(VerbsError::InvalidAccess { .. })),
        "{refused:?}"
    );
    Ok(())
}

#[test]
fn deregistered_region_is_a_remote_access_error() -> Result {
    let pair = pair()?;
    let buffer = pair.b.verbs.alloc(4096)?;
    let region = pair.b.verbs.reg_mr(&pair.b.pd, buffer, 4096, ALL)?;
    let remote = RemoteSegment {
        addr: buffer,
        rkey: pair.b.verbs.mr_keys(&region).rkey,
    };
    pair.b.verbs.dereg_mr(region)?;
    pair.a
        .verbs
        .post_send(&pair.a.qp, &[write(1, vec![pair.a.sge(0, 8)], remote)])?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::RemoteAccessError)]
    );
    Ok(())
}

#[test]
fn write_with_imm_without_a_receive_is_rnr_retry_exceeded() -> Result {
    let pair = pair_with(
        HostConfig::roce("a", [10, 0, 0, 1]),
        HostConfig::roce("b", [10, 0, 0, 2]),
        3,
    )?;
    let request = SendRequest {
        wr_id: 1,
        opcode: SendOpcode::RdmaWriteWithImm { imm: 1 },
        sg_list: vec![pair.a.sge(0, 8)],
        remote: pair.b.remote(0),
        signaled: true,
    };
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[request, write(2, vec![pair.a.sge(0, 8)], pair.b.remote(0))],
    )?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::RnrRetryExceeded), (2, WcStatus::WrFlushError)]
    );
    Ok(())
}

#[test]
fn malformed_receive_is_a_remote_operation_error() -> Result {
    let pair = pair()?;
    let bad = Sge {
        addr: pair.b.buffer,
        len: 8,
        lkey: 0x4242_0011,
    };
    pair.b.verbs.post_recv(
        &pair.b.qp,
        &[
            RecvRequest {
                wr_id: 10,
                sg_list: vec![bad],
            },
            RecvRequest {
                wr_id: 11,
                sg_list: vec![],
            },
        ],
    )?;
    let request = SendRequest {
        wr_id: 1,
        opcode: SendOpcode::RdmaWriteWithImm { imm: 1 },
        sg_list: vec![pair.a.sge(0, 8)],
        remote: pair.b.remote(0),
        signaled: true,
    };
    pair.a.verbs.post_send(&pair.a.qp, &[request])?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::RemoteOperationError)]
    );
    assert_eq!(
        statuses(&pair.b.poll()?),
        vec![
            (10, WcStatus::LocalQpOperationError),
            (11, WcStatus::WrFlushError)
        ]
    );
    assert_eq!(pair.b.verbs.qp_state(&pair.b.qp)?, QpState::Error);
    Ok(())
}

#[test]
fn dead_peer_is_retry_exceeded_and_flushes_the_rest() -> Result {
    let pair = pair()?;
    pair.fabric.set_auto_progress(false);
    let requests: Vec<_> = (1..=3)
        .map(|wr_id| write(wr_id, vec![pair.a.sge(0, 8)], pair.b.remote(0)))
        .collect();
    pair.a.verbs.post_send(&pair.a.qp, &requests)?;
    assert!(pair.a.poll()?.is_empty(), "held in the send queue");
    pair.b.verbs.die();
    assert_eq!(pair.fabric.progress(), 3);
    let expected = vec![
        (1, WcStatus::RetryExceeded),
        (2, WcStatus::WrFlushError),
        (3, WcStatus::WrFlushError),
    ];
    assert_eq!(statuses(&pair.a.poll()?), expected);
    assert_eq!(pair.a.verbs.qp_state(&pair.a.qp)?, QpState::Error);
    // The dead host's own calls fail; the survivor's later posts are flushed, not refused.
    assert!(matches!(
        pair.b.verbs.devices(),
        Err(VerbsError::DeviceGone { .. })
    ));
    pair.fabric.set_auto_progress(true);
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[write(4, vec![pair.a.sge(0, 8)], pair.b.remote(0))],
    )?;
    assert_eq!(statuses(&pair.a.poll()?), vec![(4, WcStatus::WrFlushError)]);
    Ok(())
}

#[test]
fn link_down_is_retry_exceeded() -> Result {
    let pair = pair()?;
    pair.b.verbs.set_port_state("mlx5_0", 1, PortState::Down)?;
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[read(1, vec![pair.a.sge(0, 8)], pair.b.remote(0))],
    )?;
    assert_eq!(
        statuses(&pair.a.poll()?),
        vec![(1, WcStatus::RetryExceeded)]
    );
    Ok(())
}

#[test]
fn mismatched_psn_is_retry_exceeded() -> Result {
    let fabric = Fabric::new();
    let a = Side::new(&fabric, HostConfig::roce("a", [10, 0, 0, 1]), 100)?;
    let b = Side::new(&fabric, HostConfig::roce("b", [10, 0, 0, 2]), 200)?;
    a.init(AccessFlags::REMOTE_WRITE)?;
    b.init(AccessFlags::REMOTE_WRITE)?;
    let (mut endpoint_a, _) = a.endpoint()?;
    endpoint_a.psn = Psn::new(101)?; // b expects a PSN a does not send
    a.connect_to(&b.endpoint()?.0, 7)?;
    b.connect_to(&endpoint_a, 7)?;
    a.verbs
        .post_send(&a.qp, &[write(1, vec![a.sge(0, 8)], b.remote(0))])?;
    assert_eq!(statuses(&a.poll()?), vec![(1, WcStatus::RetryExceeded)]);
    Ok(())
}

#[test]
fn moving_to_error_flushes_outstanding_work() -> Result {
    let pair = pair()?;
    pair.fabric.set_auto_progress(false);
    pair.a.verbs.post_recv(
        &pair.a.qp,
        &[RecvRequest {
            wr_id: 20,
            sg_list: vec![],
        }],
    )?;
    pair.a.verbs.post_send(
        &pair.a.qp,
        &[
            write(1, vec![pair.a.sge(0, 8)], pair.b.remote(0)),
            read(2, vec![pair.a.sge(0, 8)], pair.b.remote(0)),
        ],
    )?;
    pair.a.verbs.modify_qp(&pair.a.qp, &QpTransition::Error)?;
    pair.fabric.progress();
    let completions = pair.a.poll()?;
    assert_eq!(
        statuses(&completions),
        vec![
            (1, WcStatus::WrFlushError),
            (2, WcStatus::WrFlushError),
            (20, WcStatus::WrFlushError)
        ]
    );
    assert_eq!(completions[2].opcode, WcOpcode::Recv);
    assert_eq!(
        pair.b.verbs.read_memory(pair.b.buffer, 8)?,
        vec![0; 8],
        "flushed work moved nothing"
    );
    Ok(())
}

#[test]
fn overrun_completion_queue_reports_lost_completions() -> Result {
    let fabric = Fabric::new();
    let verbs = fabric.add_host(HostConfig::roce("a", [10, 0, 0, 1]));
    let context = verbs.open("mlx5_0")?;
    let pd = verbs.alloc_pd(&context)?;
    let cq = verbs.create_cq(&context, 1)?;
    let qp = verbs.create_qp(&pd, &cq, &cq, CAPS)?;
    verbs.modify_qp(
        &qp,
        &QpTransition::Init(InitAttr {
            port: 1,
            pkey_index: 0,
            access: AccessFlags::NONE,
        }),
    )?;
    verbs.post_recv(
        &qp,
        &[
            RecvRequest {
                wr_id: 1,
                sg_list: vec![],
            },
            RecvRequest {
                wr_id: 2,
                sg_list: vec![],
            },
        ],
    )?;
    verbs.modify_qp(&qp, &QpTransition::Error)?;
    let mut out = Vec::new();
    assert!(matches!(
        verbs.poll_cq(&cq, 8, &mut out),
        Err(VerbsError::CqOverrun { capacity: 1 })
    ));
    Ok(())
}

#[test]
fn registration_refuses_unmapped_memory_and_unknown_devices() -> Result {
    let fabric = Fabric::new();
    let verbs = fabric.add_host(HostConfig::roce("a", [10, 0, 0, 1]));
    assert!(matches!(
        verbs.open("mlx5_9"),
        Err(VerbsError::NoSuchDevice { .. })
    ));
    let context = verbs.open("mlx5_0")?;
    let pd = verbs.alloc_pd(&context)?;
    let buffer = verbs.alloc(4096)?;
    assert!(matches!(
        verbs.reg_mr(&pd, buffer + 4000, 200, ALL),
        Err(VerbsError::BadAddress { .. })
    ));
    assert!(matches!(
        verbs.reg_mr(&pd, 0x1000, 8, ALL),
        Err(VerbsError::BadAddress { .. })
    ));
    let other = fabric.add_host(HostConfig::roce("b", [10, 0, 0, 2]));
    assert!(matches!(
        other.reg_mr(&pd, buffer, 8, ALL),
        Err(VerbsError::ForeignHandle { .. })
    ));
    Ok(())
}
