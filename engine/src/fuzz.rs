//! Structured fuzzing of the protocol's decoders and handlers.
//!
//! Uniformly random bytes almost never carry a valid length prefix, so they never reach the
//! message decoders. This fuzzer builds *valid* frames of every message type — ACCESS (runs and
//! lists, indexed or not, every kind), RESPONSE and FAILURE for operations that exist, LOCALIZE,
//! RELOCATE, LOCALIZE_FAILED, BARRIER, BARRIER_RELEASE, the replication and intent messages,
//! PEER_LOST, failover's: BACKUP, BACKUP_ACK, BARRIER_PASSED and the membership changes
//! (leaves and joins), and a dynamic table's ASSIGN, ASSIGNED, EVICT and EVICTED — and then mutates most of them: a
//! header field (count, table, kind or code, flags, operation, part, origin, node), a length
//! prefix, the body's length, an index or key, the type byte, or random bits. Each frame is fed
//! to a live node (a [`Core`] of a three-node cluster with keys at home, keys elsewhere, keys
//! arriving; every third node a classic one with a backup per key, which takes failover's
//! messages) exactly as the runtime feeds peers' frames, and whatever it delivers to workers
//! goes through a [`Requester`] with pending operations. A case passes when nothing panics; a
//! rejection must be an error value.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::codec::ValueCodec;
use crate::config::{HugePages, TableSpec};
use crate::protocol::backup::wire as backup_wire;
use crate::protocol::census::{self, wire as census_wire};
use crate::protocol::leave::wire as leave_wire;
use crate::protocol::wire::{self, AccessHeader, AccessKind, BlockKeys, FailureCode, MoveItem, msg};
use crate::protocol::{Core, Delivery, Issued, OpId, Progress, PullTarget, Requester, Settings};
use crate::store::{LocalRegistrar, RemoteAddr, Store};

/// What a fuzzing run saw.
#[derive(Debug, Default, Clone)]
pub struct FuzzReport {
    /// Frames fed to the node.
    pub cases: u64,
    /// Frames the node handled without an error.
    pub accepted: u64,
    /// Frames it rejected with an error (the runtime would close the connection).
    pub rejected: u64,
    /// Frames that were left unmutated.
    pub unmutated: u64,
    /// Per message type name: (accepted, rejected) of frames built around that type.
    pub per_type: BTreeMap<&'static str, (u64, u64)>,
    /// Deliveries fed to the requester, and how many it reported as a peer's fault.
    pub deliveries: u64,
    /// Deliveries the requester rejected as a peer's fault.
    pub faults: u64,
    /// Cases that panicked (must be zero), with the first panic's message.
    pub panics: u64,
    /// The first panic, if any.
    pub first_panic: Option<String>,
}

const TYPES: [&str; 32] = [
    "access",
    "response",
    "failure",
    "localize",
    "relocate",
    "localize-failed",
    "barrier",
    "barrier-release",
    "barrier-failed",
    "replica-delta",
    "replica-ack",
    "intent",
    "intent-go",
    "replica-sync",
    "replica-sync-ack",
    "peer-lost",
    "backup",
    "backup-ack",
    "barrier-passed",
    "membership",
    "leave-known",
    "join-welcome",
    "join-handed",
    "joined",
    "census-flush",
    "census",
    "census-done",
    "give-back",
    "assign",
    "assigned",
    "evict",
    "evicted",
];
/// The first of [`TYPES`] that only a node with a dynamic table takes (every target has one).
const DYNAMIC_TYPES: usize = 28;
/// The first of [`TYPES`] that only a node with backups takes.
const FAILOVER_TYPES: usize = 16;
/// Membership changes laid out as one node each (`leave_wire::encode`).
const MEMBERSHIP: [u8; 9] =
    [msg::LEAVE_ASK, msg::LEAVE_BEGIN, msg::LEAVE_READY, msg::LEFT, msg::JOIN_ASK, msg::JOIN_READY, msg::JOIN_ACK, msg::JOIN_ABANDONED, msg::JOIN_SETTLED];
/// Replicated keys of table 0: 40..48 are homed at the node under test (rank 1 of 3, range
/// partitioning), 0..8 at node 0 and 70..80 at node 2.
const REPLICATED: [std::ops::Range<u64>; 3] = [0..8, 40..48, 70..80];
const NODES: usize = 3;
const RANK: usize = 1;
const KEYS: [u64; 2] = [96, 40];
const VALUE_LEN: [usize; 2] = [3, 1];
/// Slot keys per node of table 2, a dynamic table.
const DYNAMIC_CAPACITY: u64 = 16;

/// The node under test, its requester, and operations of the requester still pending.
struct Target {
    /// Whether it keeps backups (and takes failover's messages).
    backups: bool,
    core: Core,
    requester: Requester,
    ops: Vec<(OpId, u16, AccessKind, usize)>,
    tx: crate::protocol::Transmit,
}

/// The node under test for `seed`: every third one keeps one backup per key (backups need
/// tables without replicated keys) and takes failover's messages — half of those a fresh node
/// of a classic parameter server that asked to join, a quarter a member of one, a quarter a
/// member of a cluster that relocates keys (and takes the census's messages); the others move
/// keys and replicate some.
fn target(seed: u64) -> Target {
    let backups = seed % 3 == 2;
    let joining = backups && seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 63 == 0;
    let relocation = !backups || (!joining && seed % 2 == 1);
    let a = TableSpec::new("a", KEYS[0], VALUE_LEN[0]);
    // The dynamic table evicts on every other target (EVICT and EVICTED are refused on the
    // others).
    let mut c =
        TableSpec::dynamic("c", 2, DYNAMIC_CAPACITY).evicting(if seed % 4 < 2 { crate::dynamic::Eviction::Lfu } else { crate::dynamic::Eviction::Never });
    c.keys = DYNAMIC_CAPACITY * NODES as u64;
    let specs = vec![if backups { a } else { a.replicating(REPLICATED) }, TableSpec::new("b", KEYS[1], VALUE_LEN[1]), c];
    let store = Arc::new(Store::new(RANK, NODES, &specs, 16, HugePages::Off, Arc::new(LocalRegistrar::default())).expect("a small store"));
    let settings = Settings {
        relocation,
        backups: backups as usize,
        location_caches: seed.is_multiple_of(2),
        max_message_bytes: 64 << 10,
        part_bytes: 256,
        small_operation_rows: crate::protocol::SMALL_OPERATION_ROWS,
        op_timeout_ns: u64::MAX / 4,
        loss_grace_ns: 1_000,
        shards: 4,
        // (A node sharing clocks cannot join.)
        share_clocks: !backups,
        first_clock: 0,
    };
    let core = Core::new(RANK, NODES, &specs, store, settings);
    let mut requester = core.requester(0, 1);
    let mut tx = core.transmit();
    let mut ops = Vec::new();
    // Operations on keys homed elsewhere (pending: nobody answers them), and keys arriving here.
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for i in 0..6u64 {
        let table = (i % 2) as u16;
        let keys: Vec<u64> = (0..rng.gen_range(1..40)).map(|_| rng.gen_range(0..KEYS[table as usize])).collect();
        let kind = [AccessKind::Pull, AccessKind::Push, AccessKind::Set][i as usize % 3];
        let vl = VALUE_LEN[table as usize];
        let input = if kind.carries_values() { vec![1.0; keys.len() * vl] } else { Vec::new() };
        let target = if kind == AccessKind::Pull { PullTarget::Owned(vec![0.0; keys.len() * vl]) } else { PullTarget::None };
        let mut step = core.step(&mut tx, 1);
        if let Ok(Issued::Pending { op, .. }) = step.issue_access(&mut requester, kind, table, &keys, &input, target, None) {
            ops.push((op, table, kind, keys.len()));
        }
        drain(&mut step);
    }
    let mut step = core.step(&mut tx, 1);
    if joining {
        let _ = step.ask_to_join(0);
    }
    let arriving: Vec<u64> = (0..10).map(|k| k * 9 % KEYS[0]).collect();
    if let Ok(Issued::Pending { op, .. }) = step.issue_localize(&mut requester, 0, &arriving, true, None) {
        ops.push((op, 0, AccessKind::Pull, 0));
    }
    drain(&mut step);
    drop(step);
    while tx.poll_delivery().is_some() {}
    Target { backups, core, requester, ops, tx }
}

/// Discards a step's frames and completes its writes at once.
fn drain(step: &mut crate::protocol::Step<'_, '_>) {
    loop {
        while step.transmit().poll_transmit().is_some() {}
        while let Some(w) = step.transmit().poll_write() {
            let _ = step.handle_write_done(w.wr_id, Ok(()));
        }
        // As a driver does: what LEFT adds is handed over too.
        if !step.handed_over() {
            break;
        }
    }
}

fn values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-4..5) as f32).collect()
}

fn value_bytes(rng: &mut ChaCha8Rng, n: usize) -> Vec<u8> {
    values(rng, n).iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A key below `keys` that `accept` takes, drawn up to 20 times (the last one drawn if none
/// was taken).
fn key_where(rng: &mut ChaCha8Rng, keys: u64, mut accept: impl FnMut(&mut ChaCha8Rng, u64) -> bool) -> u64 {
    let mut key = rng.gen_range(0..keys);
    for _ in 0..20 {
        if accept(rng, key) {
            break;
        }
        key = rng.gen_range(0..keys);
    }
    key
}

/// A valid message of type `ty` (an index into [`TYPES`]).
fn message(rng: &mut ChaCha8Rng, ty: usize, t: &Target) -> Vec<u8> {
    let mut out = Vec::new();
    // Intents and localizes (granted ones included) name the dynamic table's slot keys one time
    // in three: a home that evicts claims their slots (held, offered in a round, or free).
    let table = if matches!(ty, 3 | 11 | 12) && rng.gen_bool(1.0 / 3.0) { 2 } else { rng.gen_range(0..2u16) };
    let keys = KEYS.get(table as usize).copied().unwrap_or(DYNAMIC_CAPACITY * NODES as u64);
    let vl = VALUE_LEN.get(table as usize).copied().unwrap_or(2);
    let peer = if rng.gen_bool(0.5) { 0 } else { 2 };
    // Any codec: a receiver decodes what the header names, whatever its table's own codec.
    let codec = [ValueCodec::F32, ValueCodec::Bf16, ValueCodec::F16, ValueCodec::Int8][rng.gen_range(0..4)];
    match ty {
        0 => {
            let kind = [AccessKind::Pull, AccessKind::Push, AccessKind::Set, AccessKind::PushPull][rng.gen_range(0..4)];
            let count = rng.gen_range(0..20usize);
            let origin = rng.gen_range(0..NODES as u16);
            let flags = [0, wire::FLAG_FORWARDED, wire::FLAG_DIRECT, wire::FLAG_STALE][rng.gen_range(0..4)];
            let h = AccessHeader { kind, flags, table, origin, op: rng.gen_range(1..1000), part: rng.gen_range(0..4), codec };
            let values = if kind.carries_values() { value_bytes(rng, count * vl) } else { Vec::new() };
            match rng.gen_range(0..3) {
                0 if count > 0 && (count as u64) < keys => {
                    let first = rng.gen_range(0..keys - count as u64);
                    wire::encode_access_block(&mut out, h, BlockKeys::Run { first, count }, &values);
                }
                1 => {
                    let ks: Vec<u64> = (0..count).map(|_| rng.gen_range(0..keys)).collect();
                    wire::encode_access_block(&mut out, h, BlockKeys::List(&ks), &values);
                }
                _ => {
                    let ks: Vec<u64> = (0..count).map(|_| rng.gen_range(0..keys)).collect();
                    let h = AccessHeader { flags: h.flags | wire::FLAG_INDEXED, ..h };
                    let vb = vl * 4;
                    wire::encode_access(&mut out, h, count, |i| i as u32 * 2, |i| ks[i], |i, o| o.extend_from_slice(&values[i * vb..(i + 1) * vb]));
                }
            }
        }
        1 | 2 => {
            let (op, table, kind, rows) = t.ops.get(rng.gen_range(0..t.ops.len().max(1))).copied().unwrap_or((7, table, AccessKind::Pull, 1));
            let vl = VALUE_LEN[table as usize];
            let count = rng.gen_range(0..=rows.min(12));
            if ty == 1 {
                let indexed = rng.gen_bool(0.5);
                let start = wire::begin_response(&mut out, kind, if indexed { wire::FLAG_INDEXED } else { 0 }, table, peer, op, rng.gen_range(0..3), codec);
                if indexed {
                    for i in 0..count {
                        out.extend_from_slice(&(i as u32).to_le_bytes());
                    }
                }
                if kind.returns_values() {
                    out.extend(value_bytes(rng, count * vl));
                }
                wire::finish_response(&mut out, start, count);
            } else {
                let code = [FailureCode::PeerLost, FailureCode::KeyLost, FailureCode::Protocol, FailureCode::Unavailable][rng.gen_range(0..4)];
                let indices: Vec<u32> = (0..count as u32).collect();
                wire::encode_failure(&mut out, code, table, peer, op, rng.gen_range(0..3), rng.gen_range(0..keys), &indices);
            }
        }
        3 | 4 => {
            let items: Vec<MoveItem> = (0..rng.gen_range(0..8))
                .map(|_| MoveItem {
                    key: rng.gen_range(0..keys),
                    resv: rng.gen_range(1..1 << 28),
                    to: RemoteAddr { region: rng.gen_range(0..3), addr: rng.gen_range(0..4096) },
                })
                .collect();
            let (ty, owner) = if ty == 3 { (msg::LOCALIZE, 0) } else { (msg::RELOCATE, [0u16, 2][rng.gen_range(0..2)]) };
            let flags = if ty == msg::LOCALIZE { rng.gen_range(0..2) * wire::MOVE_GRANTED } else { 0 };
            wire::encode_move(&mut out, ty, flags, table, owner, &items);
        }
        5 => {
            let resvs: Vec<u32> = (0..rng.gen_range(0..6)).map(|_| rng.gen_range(0..1 << 30)).collect();
            let code = [FailureCode::PeerLost, FailureCode::Declined][rng.gen_range(0..2)];
            wire::encode_localize_failed(&mut out, code, table, peer, &resvs);
        }
        6 | 7 => wire::encode_barrier(&mut out, if ty == 6 { msg::BARRIER } else { msg::BARRIER_RELEASE }, rng.gen_range(0..2), rng.gen_range(1..4)),
        8 => wire::encode_barrier_failed(&mut out, rng.gen_range(0..2), rng.gen_range(1..4), rng.gen_range(0..NODES as u16)),
        9 => {
            // Mostly keys this node is home to (accepted), sometimes any key of the table.
            let start = wire::begin_replica_delta(&mut out, table, rng.gen_range(0..4), rng.gen_range(0..4));
            let count = rng.gen_range(0..6u32);
            for _ in 0..count {
                let key = if table == 0 && rng.gen_bool(0.8) { rng.gen_range(REPLICATED[1].clone()) } else { rng.gen_range(0..keys) };
                wire::push_replica_delta_key(&mut out, key);
                out.extend(value_bytes(rng, vl));
            }
            wire::finish_replica_delta(&mut out, start, count);
        }
        11 | 12 => {
            // INTENT: mostly keys homed at the node under test (accepted), sometimes any key;
            // INTENT_GO: any key of the table.
            let dir = t.core.directory();
            let here = ty == 11 && rng.gen_bool(0.8);
            let ks: Vec<u64> = (0..rng.gen_range(0..6)).map(|_| key_where(rng, keys, |_, k| !here || dir.home(table, k) == RANK as u16)).collect();
            let ty_byte = if ty == 11 { msg::INTENT } else { msg::INTENT_GO };
            wire::encode_intent(&mut out, ty_byte, rng.gen_range(0..3), table, &ks);
        }
        13 => {
            // Table 1 keeps run-time replicas (accepted), table 0 does not (refused); keys held
            // here or not, sometimes beyond the table.
            let count = rng.gen_range(0..12u32);
            let start = wire::begin_replica_sync(&mut out, table, rng.r#gen(), rng.gen_range(0..8), count);
            for i in 0..count as usize {
                let key = if rng.gen_bool(0.9) { rng.gen_range(0..keys) } else { keys + rng.gen_range(0..4) };
                // Some deltas are zeros, which travel as their key only.
                let delta = if rng.gen_bool(0.5) { vec![0.0; vl] } else { values(rng, vl) };
                wire::push_replica_sync_item(&mut out, start, i, key, &delta);
            }
            wire::finish_replica_sync(&mut out, start);
        }
        14 => {
            let count = rng.gen_range(0..6u32);
            let held: Vec<u32> = (0..count).filter(|_| rng.gen_bool(0.5)).collect();
            // Now and then the home's "lost with its owner" (u16::MAX).
            let hints = (0..count as usize - held.len()).map(|_| if rng.gen_bool(0.2) { u16::MAX } else { rng.gen_range(0..NODES as u16 + 1) }).collect();
            let ack = wire::ReplicaSyncAck {
                table: rng.gen_range(0..3),
                id: rng.r#gen(),
                count,
                remote: RemoteAddr { region: rng.gen_range(0..3), addr: rng.gen_range(0..4096) },
                held,
                hints,
            };
            wire::encode_replica_sync_ack(&mut out, &ack);
        }
        15 => {
            // Mostly a node the receiver ignores (itself, the sender) or none at all; now and
            // then a real peer, which the node then treats as lost for the rest of its run.
            let lost = match rng.gen_range(0..50) {
                0 => [0u16, 2][rng.gen_range(0..2)],
                1..=20 => RANK as u16,
                21..=30 => peer,
                _ => rng.gen_range(NODES as u16..u16::MAX),
            };
            wire::encode_peer_lost(&mut out, lost, 0, "fuzzed");
        }
        16 => {
            // Images of keys the sender serves (node 0's or node 2's home keys) or any, the
            // round's last message or not; BACKUP and JOIN_IMAGES are laid out alike.
            let ty = if rng.gen_bool(0.8) { msg::BACKUP } else { msg::JOIN_IMAGES };
            let mut writer = backup_wire::ImageWriter::begin(&mut out, ty, table, rng.gen_range(0..5));
            let count = rng.gen_range(0..6u32);
            let dir = t.core.directory();
            // Now and then consecutive keys, which go as one run.
            let mut last: Option<u64> = None;
            for _ in 0..count {
                let key = key_where(rng, keys, |rng, k| rng.gen_bool(0.2) || dir.home(table, k) == peer);
                let key = match last {
                    Some(k) if k + 1 < keys && rng.gen_bool(0.5) => k + 1,
                    _ => key,
                };
                last = Some(key);
                writer.key(&mut out, key);
                // Value and updater state (none: the tables add).
                out.extend(value_bytes(rng, vl));
            }
            writer.finish(&mut out, rng.gen_bool(0.7));
        }
        17 => {
            backup_wire::encode_ack(&mut out, rng.gen_range(0..5));
        }
        18 => wire::encode_barrier(&mut out, msg::BARRIER_PASSED, rng.gen_range(0..2), rng.gen_range(0..4)),
        19 => {
            // A departure or join of a node of the cluster (mostly the sender or node 2), or of
            // one beyond it; LEAVE_BEGIN's entry is a join now and then.
            let ty = MEMBERSHIP[rng.gen_range(0..MEMBERSHIP.len())];
            let node = match rng.gen_range(0..10) {
                0 => rng.gen_range(NODES as u16..u16::MAX),
                1 => RANK as u16,
                2..=5 => peer,
                _ => 2,
            };
            let node = if ty == msg::LEAVE_BEGIN && rng.gen_bool(0.3) { node | 0x8000 } else { node };
            if ty == msg::LEFT {
                leave_wire::encode_left(&mut out, node, rng.gen_range(0..2));
            } else {
                leave_wire::encode(&mut out, ty, node);
            }
        }
        20 => {
            let queue: Vec<u16> = (0..rng.gen_range(0..4)).map(|_| if rng.gen_bool(0.3) { 0x8000 | 2 } else { rng.gen_range(0..NODES as u16 + 1) }).collect();
            leave_wire::encode_known(&mut out, &queue, rng.gen_bool(0.3));
        }
        21 => {
            let gone: Vec<u16> = (0..rng.gen_range(0..3)).map(|_| rng.gen_range(0..NODES as u16 + 1)).collect();
            let incarnations: Vec<u8> = (0..NODES).map(|_| rng.gen_range(0..3)).collect();
            leave_wire::encode_welcome(&mut out, &gone, &incarnations);
        }
        22 => {
            let joined = rng.gen_bool(0.3).then(|| [rng.gen_range(0..4), rng.gen_range(0..4)]);
            leave_wire::encode_handed(&mut out, [peer, 2][rng.gen_range(0..2)], joined);
        }
        23 => {
            leave_wire::encode_joined(&mut out, [peer, 2, RANK as u16][rng.gen_range(0..3)], [rng.gen_range(0..4), rng.gen_range(0..4)]);
        }
        24 | 26 => {
            // Mostly of the census under way (one loss known, once a PEER_LOST came).
            let ty = if ty == 24 { msg::CENSUS_FLUSH } else { msg::CENSUS_DONE };
            census_wire::encode_short(&mut out, ty, [1, 1, 1, 0, 2][rng.gen_range(0..5)]);
        }
        25 => {
            let dir = t.core.directory();
            let claims: Vec<(u64, census::Claim)> = (0..rng.gen_range(0..12))
                .map(|_| {
                    let key = key_where(rng, keys, |rng, k| rng.gen_bool(0.2) || dir.home(table, k) == RANK as u16);
                    let claim = match rng.gen_range(0..4) {
                        0 => census::Claim::Held,
                        1 => census::Claim::Arriving(rng.gen_range(0..64), RemoteAddr { region: rng.gen_range(0..3), addr: rng.gen_range(0..4096) }),
                        2 => census::Claim::Handing(rng.gen_range(0..NODES as u16 + 1)),
                        _ => census::Claim::Then(rng.gen_range(0..NODES as u16 + 1)),
                    };
                    (key, claim)
                })
                .collect();
            census_wire::encode_census(&mut out, table, [1, 1, 1, 0, 2][rng.gen_range(0..5)], rng.gen_bool(0.5), &claims);
        }
        27 => {
            // Keys mostly homed here (a leaving peer gives them back), some beyond the table.
            let dir = t.core.directory();
            let items: Vec<MoveItem> = (0..rng.gen_range(0..8))
                .map(|_| {
                    let key = if rng.gen_bool(0.05) {
                        keys + rng.gen_range(0..4)
                    } else {
                        key_where(rng, keys, |rng, k| rng.gen_bool(0.2) || dir.home(table, k) == RANK as u16)
                    };
                    MoveItem { key, resv: rng.gen_range(0..4), to: RemoteAddr { region: rng.gen_range(0..3), addr: rng.gen_range(0..4096) } }
                })
                .collect();
            wire::encode_move(&mut out, msg::GIVE_BACK, 0, table, peer, &items);
        }
        28 | 29 => {
            // Mostly table 2 (dynamic); ids of every home, a few whose home is not this node;
            // in answers, slot keys of the table, refusals, and a few beyond it.
            let table = if rng.gen_bool(0.9) { 2 } else { rng.gen_range(0..3u16) };
            let count = rng.gen_range(0..12);
            let values: Vec<u64> = if ty == 28 {
                (0..count).map(|_| if rng.gen_bool(0.3) { rng.gen_range(0..64) } else { rng.r#gen() }).collect()
            } else {
                let slot_keys = DYNAMIC_CAPACITY * NODES as u64;
                (0..count)
                    .map(|_| match rng.gen_range(0..11) {
                        10 => crate::protocol::assign::NOT_ADMITTED,
                        0 => crate::protocol::assign::FULL,
                        1 => crate::protocol::assign::NOT_HOME,
                        2 => slot_keys + rng.gen_range(0..4),
                        _ => rng.gen_range(0..slot_keys),
                    })
                    .collect()
            };
            let ty = if ty == 28 { msg::ASSIGN } else { msg::ASSIGNED };
            // Flags: an intent (read, write, set), or one that is none.
            let flags = if ty == msg::ASSIGN { [0u8, 1, 2, 3, 7][rng.gen_range(0..5)] } else { 0 };
            crate::protocol::assign::encode(&mut out, ty, flags, table, rng.gen_range(0..4), values.into_iter());
        }
        30 | 31 => {
            // EVICT: ids with slot keys of the sender's range, or of another's; EVICTED: ids
            // kept with their uses, for a round that may be open.
            let table = if rng.gen_bool(0.9) { 2 } else { rng.gen_range(0..3u16) };
            let count = rng.gen_range(0..8);
            let values: Vec<u64> = if ty == 30 {
                let odd = rng.gen_bool(0.1).then_some(7);
                (0..count)
                    .flat_map(|_| {
                        let owner = if rng.gen_bool(0.8) { peer as u64 } else { rng.gen_range(0..NODES as u64 + 1) };
                        [rng.gen_range(0..64), owner * DYNAMIC_CAPACITY + rng.gen_range(0..DYNAMIC_CAPACITY)]
                    })
                    .chain(odd)
                    .collect()
            } else {
                (0..count).flat_map(|_| [rng.gen_range(0..64), if rng.gen_bool(0.1) { u64::MAX } else { rng.gen_range(0..20) }]).collect()
            };
            let ty = if ty == 30 { msg::EVICT } else { msg::EVICTED };
            crate::protocol::assign::encode(&mut out, ty, 0, table, rng.gen_range(0..4), values.into_iter());
        }
        _ => {
            // The key count the sender holds (node 0: 8 keys, node 2: 10), or not; positions of
            // changed slots among them.
            let keys = if rng.gen_bool(0.8) { [8u32, 10][(peer / 2) as usize] } else { rng.gen_range(0..12) };
            let positions: Vec<u32> = (0..keys).filter(|_| rng.gen_bool(0.5)).collect();
            let image = wire::ReplicaImage { remote: RemoteAddr { region: rng.gen_range(0..3), addr: rng.gen_range(0..4096) }, positions };
            wire::encode_replica_ack(&mut out, table, rng.gen_range(0..4), keys, rng.gen_bool(0.8).then_some(&image));
        }
    }
    out
}

/// Mutates one message (its 4-byte length prefix first) in place; returns whether it did.
fn mutate(rng: &mut ChaCha8Rng, m: &mut Vec<u8>) -> bool {
    if m.len() < 5 || rng.gen_bool(0.5) {
        return false;
    }
    let body = 4;
    match rng.gen_range(0..9) {
        // A header field: kind/code (1), flags (2), table (4), origin/node (6), op (8), part
        // (16), count (20).
        0 => {
            let at = body + [1usize, 2, 4, 6, 8, 16, 20][rng.gen_range(0..7)];
            if at < m.len() {
                m[at] = if rng.gen_bool(0.5) { rng.r#gen() } else { m[at].wrapping_add(1) };
            }
        }
        1 => {
            // The count: off by one, or huge.
            let at = body + 20;
            if at + 4 <= m.len() {
                let c = u32::from_le_bytes(m[at..at + 4].try_into().expect("4 bytes"));
                let c = match rng.gen_range(0..3) {
                    0 => c.wrapping_add(1),
                    1 => c.wrapping_sub(1),
                    _ => u32::MAX - rng.gen_range(0..4),
                };
                m[at..at + 4].copy_from_slice(&c.to_le_bytes());
            }
        }
        2 => {
            // The length prefix.
            let len = u32::from_le_bytes(m[..4].try_into().expect("4 bytes"));
            let len = match rng.gen_range(0..3) {
                0 => len.wrapping_add(rng.gen_range(1..8)),
                1 => len.saturating_sub(rng.gen_range(1..8)),
                _ => rng.r#gen(),
            };
            m[..4].copy_from_slice(&len.to_le_bytes());
        }
        3 => {
            // The body shorter (prefix adjusted, so the frame still parses).
            let cut = rng.gen_range(1..=(m.len() - 5).max(1)).min(m.len() - 5);
            m.truncate(m.len() - cut);
            let len = (m.len() - 4) as u32;
            m[..4].copy_from_slice(&len.to_le_bytes());
        }
        4 => {
            // The body longer.
            for _ in 0..rng.gen_range(1..12) {
                m.push(rng.r#gen());
            }
            let len = (m.len() - 4) as u32;
            m[..4].copy_from_slice(&len.to_le_bytes());
        }
        5 => {
            // The type byte.
            m[body] = rng.gen_range(0..40);
        }
        6 => {
            // A key, an index or a value: a random 8-byte word somewhere after the header.
            if m.len() > body + 32 {
                let at = rng.gen_range(body + 24..m.len() - 7);
                let word: u64 = if rng.gen_bool(0.5) { rng.gen_range(0..200) } else { rng.r#gen() };
                m[at..at + 8].copy_from_slice(&word.to_le_bytes());
            }
        }
        7 => {
            // The table id out of range.
            if m.len() > body + 6 {
                m[body + 4..body + 6].copy_from_slice(&rng.gen_range(2u16..u16::MAX).to_le_bytes());
            }
        }
        _ => {
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(body..m.len());
                m[at] ^= 1 << rng.gen_range(0..8);
            }
        }
    }
    true
}

/// Feeds `cases` fuzzed frames (seeded by `seed`) to fresh nodes and reports what happened.
pub fn run(cases: u64, seed: u64) -> FuzzReport {
    let mut report = FuzzReport::default();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut t = target(seed);
    for case in 0..cases {
        if case % 500 == 499 {
            t = target(seed.wrapping_add(case));
        }
        // Failover's messages go mostly to a node with backups (the others refuse them all).
        let ty = match (t.backups, rng.gen_range(0..10)) {
            (true, 0..5) | (false, 0) => rng.gen_range(FAILOVER_TYPES..DYNAMIC_TYPES),
            (_, 9) => rng.gen_range(DYNAMIC_TYPES..TYPES.len()),
            _ => rng.gen_range(0..FAILOVER_TYPES),
        };
        let mut frame = Vec::new();
        let mut mutated = false;
        let messages = if rng.gen_bool(0.7) { 1 } else { rng.gen_range(2..=3) };
        for i in 0..messages {
            let this = if i == 0 { ty } else { rng.gen_range(0..TYPES.len()) };
            let mut m = message(&mut rng, this, &t);
            mutated |= mutate(&mut rng, &mut m);
            frame.extend(m);
        }
        if !mutated {
            report.unmutated += 1;
        }
        let from = match rng.gen_range(0..40) {
            0 => RANK as u16,
            1 => 7,
            n => [0, 2][n % 2],
        };
        let frame = Bytes::from(frame);
        let outcome = catch_unwind(AssertUnwindSafe(|| feed(&mut t, from, &frame)));
        report.cases += 1;
        match outcome {
            Ok((ok, deliveries, faults)) => {
                let entry = report.per_type.entry(TYPES[ty]).or_default();
                if ok {
                    report.accepted += 1;
                    entry.0 += 1;
                } else {
                    report.rejected += 1;
                    entry.1 += 1;
                }
                report.deliveries += deliveries;
                report.faults += faults;
            }
            Err(panic) => {
                report.panics += 1;
                if report.first_panic.is_none() {
                    let text = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                    report.first_panic = Some(format!("case {case} (seed {seed}, frame {:02x?}): {text}", &frame[..frame.len().min(96)]));
                }
                t = target(seed.wrapping_add(case).wrapping_add(1));
            }
        }
    }
    report
}

/// Feeds one frame from `from` the way the runtime does; then every delivery to the worker.
/// Returns whether the node accepted the frame, and the deliveries and faults seen.
fn feed(t: &mut Target, from: u16, frame: &Bytes) -> (bool, u64, u64) {
    let (mut at, mut item) = (0, 0);
    let ok = loop {
        let mut step = t.core.step(&mut t.tx, 1_000);
        let progress = step.handle_frame(from, frame, at, item);
        drain(&mut step);
        drop(step);
        match progress {
            Ok(Progress::Done) => break true,
            Ok(Progress::Yield { at: a, item: i }) => (at, item) = (a, i),
            Err(_) => break false,
        }
    };
    let (mut deliveries, mut faults) = (0, 0);
    while let Some((_, d)) = t.tx.poll_delivery() {
        deliveries += 1;
        if matches!(d, Delivery::Messages { .. } | Delivery::Local(_)) && t.requester.handle(d, t.core.directory(), None).is_some() {
            faults += 1;
        }
    }
    (ok, deliveries, faults)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_thousand_structured_cases_never_panic_and_mostly_reach_the_decoders() {
        let report = run(10_000, 42);
        eprintln!("{report:?}");
        assert_eq!(report.panics, 0, "{:?}", report.first_panic);
        assert_eq!(report.cases, 10_000);
        // Most frames are well-formed enough to be handled; every type is both accepted and
        // rejected sometimes, so the decoders see valid input and its mutations.
        assert!(report.accepted > report.cases / 3, "{report:?}");
        for ty in TYPES {
            let (accepted, rejected) = report.per_type.get(ty).copied().unwrap_or_default();
            assert!(accepted > 0 && rejected > 0, "{ty}: {accepted} accepted, {rejected} rejected");
        }
        assert!(report.deliveries > 100 && report.faults > 0, "{report:?}");
    }
}
