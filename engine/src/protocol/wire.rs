//! Encoding of protocol messages.
//!
//! A transport frame carries one or more messages, each prefixed by its `u32` length. All
//! integers and floats are little endian. Decoding validates every length against the message
//! size and the table's value length, so a malformed message is an error value, never a panic.
//!
//! | type | layout after the type byte |
//! | --- | --- |
//! | ACCESS | kind u8, flags u8, pad u8, table u16, origin u16, op u64, part u32, count u32, [index u32]×count if INDEXED, keys: first u64 if RUN (keys first..first+count), the hash u64 of a kept list if KEYS_CACHED, else u64×count (kept by the receiver if KEYS_REMEMBER), \[values\]×count if push/set/push-pull |
//! | RESPONSE | kind u8, flags u8, pad u8, table u16, responder u16, op u64, part u32, count u32, [index u32]×count if INDEXED, \[values\]×count if pull/push-pull |
//! | LOCALIZE | flags u8 (GRANTED: asked for by the intent service on a home's grant), pad u16, table u16, pad u16, count u32, pad u32, (key u64, resv u32, region u32, addr u64)×count |
//! | RELOCATE | pad, new_owner u16, table u16, pad u16, count u32, pad u32, (key u64, resv u32, region u32, addr u64)×count |
//! | FAILURE | code u8, flags u8, pad u8, table u16, node u16, op u64, part u32, count u32, key u64 (the first failed key), index u32×count |
//! | LOCALIZE_FAILED | code u8, pad u16, table u16, node u16, count u32, pad u32, resv u32×count |
//! | BARRIER, BARRIER_RELEASE | kind u8, pad u16, generation u32 |
//! | BARRIER_FAILED | kind u8, pad u16, generation u32, lost node u16 |
//! | REPLICA_DELTA | flags u8 (CUT: the shipment's last message, cut an image; FULL: of every replicated slot), table u16, round u32, count u32, (key u64, values)×count |
//! | LEAVING | count u16, (node u16, reason length u16, reason UTF-8)×count — alone in its frame, handled by the runtime, not the protocol |
//! | CLOCK | pad×3, smallest completed clock of the sender's workers u64 |
//! | INTENT, INTENT_GO | level u8 (INTENT: 0 none, 1 soon, 2 now; INTENT_GO: 0 move, 1 replicate), pad u16, table u16, pad u16, count u32, key u64×count |
//! | REPLICA_ACK | flags u8 (CUT: an image was cut), table u16, round u32, keys u32, changed u32, region u32, pad u32, addr u64, position u32×changed |
//! | REPLICA_SYNC | pad u8, table u16, id u32, count u32, offset u32, delta-present bits (⌈count/8⌉ bytes, item i in bit i % 8 of byte i / 8, unused bits 0), (key u64, values if present)×count |
//! | REPLICA_SYNC_ACK | pad u8, table u16, id u32, count u32, held u32, region u32, pad u32, addr u64, index u32×held, hint u16×(count − held) |
//! | PEER_LOST | pad u8, lost node u16, reason length u16, reason UTF-8 (at most 512 bytes) |

use std::borrow::Cow;

use crate::codec::ValueCodec;
use crate::error::{Error, Result};
use crate::store::RemoteAddr;

/// Message type bytes.
pub mod msg {
    /// A pull, push or set of keys, from a requester (or forwarded by a home node).
    pub const ACCESS: u8 = 1;
    /// Values or acknowledgements for (part of) an access.
    pub const RESPONSE: u8 = 2;
    /// A requester asks a home node to move keys to it.
    pub const LOCALIZE: u8 = 3;
    /// A home node tells an old owner to hand keys over.
    pub const RELOCATE: u8 = 4;
    /// Items of an access that cannot be served.
    pub const FAILURE: u8 = 5;
    /// Relocations that cannot happen.
    pub const LOCALIZE_FAILED: u8 = 6;
    /// A node enters a barrier (sent to the coordinator: rank 0, or its successor).
    pub const BARRIER: u8 = 7;
    /// The coordinator releases a barrier.
    pub const BARRIER_RELEASE: u8 = 8;
    /// Rank 0 declares a barrier failed because a node was lost before it completed.
    pub const BARRIER_FAILED: u8 = 9;
    /// Replica node to home node: pushes its replicas took since the last round.
    pub const REPLICA_DELTA: u8 = 10;
    /// Home node to replica node: the deltas are applied; where the replicated slots lie.
    pub const REPLICA_ACK: u8 = 11;
    /// A node leaves after losing peers; names them and why (sent alone in a frame, read by the
    /// runtime around the protocol).
    pub const LEAVING: u8 = 12;
    /// A node's smallest completed worker clock (bounded delay).
    pub const CLOCK: u8 = 13;
    /// Node to home node: its workers' intent on keys begins (or ended).
    pub const INTENT: u8 = 14;
    /// Home node to node: it is the only one with intent on keys; move them (AdaPM 4.1).
    pub const INTENT_GO: u8 = 15;
    /// Node to a key's owner: deltas of its run-time replicas; cut their images (AdaPM B.1).
    pub const REPLICA_SYNC: u8 = 16;
    /// Owner to replica node: which deltas were applied, where their keys' images lie.
    pub const REPLICA_SYNC_ACK: u8 = 17;
    /// A node learnt that a peer is lost, and tells every other live node before anything it
    /// sends them later (so that none serves its later requests through the lost node).
    pub const PEER_LOST: u8 = 18;
    /// Owner to its backup: images of the slots that changed since the last round (see
    /// `protocol::backup`).
    pub const BACKUP: u8 = 19;
    /// Backup to owner: every image of a round is kept.
    pub const BACKUP_ACK: u8 = 20;
    /// A node asks rank 0 to let it leave (see `protocol::leave`).
    pub const LEAVE_ASK: u8 = 21;
    /// Rank 0 to every live node: a node's departure begins (in rank 0's order).
    pub const LEAVE_BEGIN: u8 = 22;
    /// Node to leaving node: it sends it no more requests, and sent this behind the last.
    pub const LEAVE_READY: u8 = 23;
    /// Leaving node to every live node: its keys are handed over; it is gone.
    pub const LEFT: u8 = 24;
    /// Node to a new coordinator (its predecessor was lost): the last barrier generation of a
    /// kind it was released from, which therefore completed (see `protocol::barrier`).
    pub const BARRIER_PASSED: u8 = 25;
    /// Node to a new coordinator: the departures it knows were begun, in order, and whether it
    /// asked to leave itself (see `protocol::leave`).
    pub const LEAVE_KNOWN: u8 = 26;
    /// Joining node to the coordinator: it asks to take its rank back (see `protocol::join`).
    pub const JOIN_ASK: u8 = 27;
    /// Coordinator to a joining node: the nodes gone from the cluster.
    pub const JOIN_WELCOME: u8 = 28;
    /// Node to the node that serves a joining node's keys: it sends that node no more
    /// requests, and sent this behind the last.
    pub const JOIN_READY: u8 = 29;
    /// The node that served a joining node's keys to the joining node: their slot images.
    pub const JOIN_IMAGES: u8 = 30;
    /// Joining node to the coordinator: it holds every image handed to it.
    pub const JOIN_HANDED: u8 = 31;
    /// Coordinator to every live node (relayed by each): the joining node is a member again,
    /// from the barrier generations given.
    pub const JOINED: u8 = 32;
    /// Node to a joined node: it counts it as a member (its requests will be answered).
    pub const JOIN_ACK: u8 = 33;
    /// Coordinator to every live node: the joining node was lost before it joined; its join
    /// ends (where it had been handed its keys, they fail over).
    pub const JOIN_ABANDONED: u8 = 34;
    /// Joined node to a node that handed it keys: they are on its own backups now, so the
    /// giver's rounds held back since the hand-over may complete.
    pub const JOIN_SETTLED: u8 = 35;
    /// Survivor to survivor, after a loss with relocation and backups: every one-sided write
    /// the sender posted is ahead of this on the link (see `protocol::census`).
    pub const CENSUS_FLUSH: u8 = 36;
    /// Survivor to a home: what it holds, awaits and hands over of the home's keys.
    pub const CENSUS: u8 = 37;
    /// Home to every survivor: it settled its keys after the loss.
    pub const CENSUS_DONE: u8 = 38;
    /// A leaving node, in a cluster that relocates keys, to the home of keys it holds: take
    /// them back (items as in LOCALIZE, reservations unused; see `protocol::leave`).
    pub const GIVE_BACK: u8 = 39;
    /// A node to the home of ids of a dynamic table: their slot keys, please (see
    /// `protocol::assign`).
    pub const ASSIGN: u8 = 40;
    /// Home to asker: the slot keys of the ids it asked for.
    pub const ASSIGNED: u8 = 41;
    /// Home of ids of a dynamic table to every node: these ids may be evicted (see
    /// `protocol::evict`).
    pub const EVICT: u8 = 42;
    /// Node to home: of the ids offered, these are kept.
    pub const EVICTED: u8 = 43;
}

/// Flag: the message lists item indices (a subset of a part, or items of several parts).
pub const FLAG_INDEXED: u8 = 1;
/// Flag: an access forwarded by the key's home node to its owner.
pub const FLAG_FORWARDED: u8 = 2;
/// Flag: an access sent straight to a cached owner.
pub const FLAG_DIRECT: u8 = 4;
/// Flag: an access a stale cache sent to a non-owner, which passed it to the home node.
pub const FLAG_STALE: u8 = 8;
/// Flag: the keys are a run `first..first + count`, sent as `first` alone.
pub const FLAG_RUN: u8 = 16;
/// Flag: the receiver keeps this ACCESS's key list for later references by hash (key caching).
pub const FLAG_KEYS_REMEMBER: u8 = 32;
/// Flag: the keys are a list the receiver kept, sent as its hash (`u64`) alone.
pub const FLAG_KEYS_CACHED: u8 = 64;

/// LOCALIZE flag: the intent service asks for the keys because their home granted them to
/// this node; the home declines a key it has since granted to another node.
pub const MOVE_GRANTED: u8 = 1;

/// Kinds of key access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AccessKind {
    /// Read values.
    Pull = 1,
    /// Add updates.
    Push = 2,
    /// Overwrite values.
    Set = 3,
    /// Apply updates and return the updated values (one round trip).
    PushPull = 4,
}

impl AccessKind {
    fn from_u8(b: u8) -> Option<AccessKind> {
        match b {
            1 => Some(AccessKind::Pull),
            2 => Some(AccessKind::Push),
            3 => Some(AccessKind::Set),
            4 => Some(AccessKind::PushPull),
            _ => None,
        }
    }

    /// Whether requests carry values (push, set and push-pull).
    pub fn carries_values(self) -> bool {
        !matches!(self, AccessKind::Pull)
    }

    /// Whether answers carry values (pull and push-pull).
    #[inline]
    pub fn returns_values(self) -> bool {
        matches!(self, AccessKind::Pull | AccessKind::PushPull)
    }

    /// Whether the access changes the value through the table's updater (push and push-pull).
    #[inline]
    pub fn updates(self) -> bool {
        matches!(self, AccessKind::Push | AccessKind::PushPull)
    }
}

/// Why items failed, as carried by FAILURE and LOCALIZE_FAILED.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FailureCode {
    /// The node holding the key (in `node`) is lost.
    PeerLost = 1,
    /// The key's value was lost with its owner.
    KeyLost = 2,
    /// The protocol state does not allow the request (a bug or a misbehaving peer).
    Protocol = 3,
    /// The key is stuck in a relocation that failed or timed out.
    Unavailable = 4,
    /// LOCALIZE_FAILED: the home declined a granted relocation (`MOVE_GRANTED`): it has since
    /// granted the key to another node.
    Declined = 5,
    /// LOCALIZE_FAILED, from a key's home after a census (`protocol::census`): no live node
    /// will hand the key over for this reservation (its request was lost with a node); the
    /// requester stops waiting, and what queued for the key goes through the home.
    Superseded = 6,
}

impl FailureCode {
    fn from_u8(b: u8) -> FailureCode {
        match b {
            1 => FailureCode::PeerLost,
            2 => FailureCode::KeyLost,
            4 => FailureCode::Unavailable,
            5 => FailureCode::Declined,
            6 => FailureCode::Superseded,
            _ => FailureCode::Protocol,
        }
    }
}

/// Bytes per LOCALIZE / RELOCATE item.
pub const MOVE_ITEM: usize = 24;
/// Header bytes of ACCESS, RESPONSE and FAILURE.
pub const ACCESS_HEADER: usize = 24;
/// Header bytes of LOCALIZE, RELOCATE and LOCALIZE_FAILED.
pub const MOVE_HEADER: usize = 16;

fn bad(what: impl Into<String>) -> Error {
    Error::Protocol(what.into())
}

#[inline]
pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline]
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

#[inline]
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let b = &b[at..at + 8];
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

/// Iterates the length-prefixed messages of a frame.
pub struct Messages<'a> {
    rest: &'a [u8],
    consumed: usize,
}

impl<'a> Messages<'a> {
    /// The messages of `frame`.
    pub fn new(frame: &'a [u8]) -> Messages<'a> {
        Messages { rest: frame, consumed: 0 }
    }

    /// Bytes of the frame consumed so far: the offset of the next message's length prefix.
    pub fn offset(&self) -> usize {
        self.consumed
    }
}

/// The operation a RESPONSE or FAILURE body answers (its origin routes it by this id).
pub fn op_of(body: &[u8]) -> Option<u64> {
    (body.len() >= ACCESS_HEADER).then(|| u64_at(body, 8))
}

impl<'a> Iterator for Messages<'a> {
    type Item = Result<&'a [u8]>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        if self.rest.len() < 4 {
            self.rest = &[];
            return Some(Err(bad("truncated message length")));
        }
        let len = u32_at(self.rest, 0) as usize;
        if len == 0 || len > self.rest.len() - 4 {
            self.rest = &[];
            return Some(Err(bad(format!("message length {len} does not fit the frame"))));
        }
        let body = &self.rest[4..4 + len];
        self.rest = &self.rest[4 + len..];
        self.consumed += 4 + len;
        Some(Ok(body))
    }
}

/// A decoded ACCESS message.
#[derive(Debug, Clone)]
pub struct Access<'a> {
    /// What to do.
    pub kind: AccessKind,
    /// FLAG_* bits.
    pub flags: u8,
    /// Table id.
    pub table: u16,
    /// The node whose operation this is (responses go there).
    pub origin: u16,
    /// The operation id at the origin.
    pub op: u64,
    /// The part of the operation.
    pub part: u32,
    /// Number of items.
    pub count: usize,
    indices: &'a [u8],
    keys: Cow<'a, [u8]>,
    /// For a run: the first key.
    first: u64,
    values: Cow<'a, [u8]>,
    value_bytes: usize,
}

impl<'a> Access<'a> {
    /// Decodes an ACCESS body; `value_len` gives each table's value length. A message that
    /// refers to a cached key list fails (see [`Access::decode_cached`]).
    #[cfg(any(test, feature = "sim"))]
    pub fn decode(b: &'a [u8], value_len: impl Fn(u16) -> Option<usize>) -> Result<Access<'a>> {
        Access::decode_cached(b, value_len, |_| None)
    }

    /// [`Access::decode`], with `cached(hash)` giving the key list a FLAG_KEYS_CACHED message
    /// refers to.
    pub fn decode_cached(b: &'a [u8], value_len: impl Fn(u16) -> Option<usize>, cached: impl FnOnce(u64) -> Option<Vec<u8>>) -> Result<Access<'a>> {
        if b.len() < ACCESS_HEADER {
            return Err(bad("short ACCESS"));
        }
        let kind = AccessKind::from_u8(b[1]).ok_or_else(|| bad(format!("unknown access kind {}", b[1])))?;
        let flags = b[2];
        let table = u16_at(b, 4);
        let vlen = value_len(table).ok_or_else(|| bad(format!("ACCESS for unknown table {table}")))?;
        let count = u32_at(b, 20) as usize;
        let indexed = flags & FLAG_INDEXED != 0;
        let run = flags & FLAG_RUN != 0;
        let value_bytes = vlen * 4;
        let codec = ValueCodec::from_u8(b[3]).ok_or_else(|| bad(format!("unknown value codec {}", b[3])))?;
        let idx_bytes = if indexed { count.checked_mul(4) } else { Some(0) };
        let by_hash = flags & FLAG_KEYS_CACHED != 0;
        if by_hash && run {
            return Err(bad("ACCESS with a run of keys and a cached key list"));
        }
        let key_bytes = if run || by_hash { Some(8) } else { count.checked_mul(8) };
        let val_total = if kind.carries_values() { count.checked_mul(vlen).and_then(|n| codec.encoded_len(n)) } else { Some(0) };
        let need = (|| ACCESS_HEADER.checked_add(idx_bytes?)?.checked_add(key_bytes?)?.checked_add(val_total?))();
        if need != Some(b.len()) {
            return Err(bad(format!("ACCESS of {count} items has {} bytes", b.len())));
        }
        let keys_at = ACCESS_HEADER + idx_bytes.unwrap_or(0);
        let values_at = keys_at + key_bytes.unwrap_or(0);
        let first = if run { u64_at(b, keys_at) } else { 0 };
        if run && first.checked_add(count as u64).is_none() {
            return Err(bad(format!("ACCESS run of {count} keys from {first} overflows")));
        }
        Ok(Access {
            kind,
            flags,
            table,
            origin: u16_at(b, 6),
            op: u64_at(b, 8),
            part: u32_at(b, 16),
            count,
            indices: &b[ACCESS_HEADER..keys_at],
            keys: if by_hash {
                let hash = u64_at(b, keys_at);
                let list = cached(hash).ok_or_else(|| bad(format!("ACCESS refers to key list {hash:#x}, which this node does not keep")))?;
                if list.len() != count * 8 {
                    return Err(bad(format!("ACCESS of {count} items refers to a kept list of {} keys", list.len() / 8)));
                }
                Cow::Owned(list)
            } else {
                Cow::Borrowed(&b[keys_at..values_at])
            },
            first,
            values: decode_values(codec, &b[values_at..], count * vlen)?,
            value_bytes,
        })
    }

    /// Whether the keys are a run.
    pub fn is_run(&self) -> bool {
        self.flags & FLAG_RUN != 0
    }

    /// For a run, its first key.
    pub fn first_key(&self) -> Option<u64> {
        self.is_run().then_some(self.first)
    }

    /// All value bytes (little-endian `f32`, decompressed), item after item (push and set).
    pub fn values(&self) -> &[u8] {
        &self.values
    }

    /// Whether item indices are listed.
    pub fn indexed(&self) -> bool {
        self.flags & FLAG_INDEXED != 0
    }

    /// The listed keys as bytes (empty for a run), for keeping them (key caching).
    pub fn key_bytes(&self) -> &[u8] {
        &self.keys
    }

    /// The index (within its part) of item `i`.
    #[inline]
    pub fn index(&self, i: usize) -> u32 {
        if self.indexed() { u32_at(self.indices, i * 4) } else { i as u32 }
    }

    /// The key of item `i`.
    #[inline]
    pub fn key(&self, i: usize) -> u64 {
        if self.is_run() { self.first + i as u64 } else { u64_at(&self.keys, i * 8) }
    }

    /// The value bytes of item `i` (empty for pulls, which carry none).
    #[inline]
    pub fn value(&self, i: usize) -> &[u8] {
        if self.kind.carries_values() { &self.values[i * self.value_bytes..(i + 1) * self.value_bytes] } else { &[] }
    }
}

/// A message's values as little-endian `f32`: borrowed when uncompressed, decoded otherwise.
fn decode_values(codec: ValueCodec, bytes: &[u8], elements: usize) -> Result<Cow<'_, [u8]>> {
    Ok(match codec {
        ValueCodec::F32 => Cow::Borrowed(bytes),
        codec => Cow::Owned(codec.decode(bytes, elements)?),
    })
}

/// The fixed fields of an ACCESS message.
#[derive(Debug, Clone, Copy)]
pub struct AccessHeader {
    /// What to do.
    pub kind: AccessKind,
    /// FLAG_* bits; with `FLAG_INDEXED` the item indices are written.
    pub flags: u8,
    /// Table id.
    pub table: u16,
    /// The node whose operation this is.
    pub origin: u16,
    /// Operation id at the origin.
    pub op: u64,
    /// Part of the operation.
    pub part: u32,
    /// How the values are encoded (the table's codec; ignored for pulls).
    pub codec: ValueCodec,
}

/// Encodes an ACCESS of `count` items into `out` (length prefix included), calling `index`,
/// `key` and `value` (which appends item `i`'s value bytes; push and set only) per item. With
/// `FLAG_RUN` in the header, only `key(0)` is written: the caller promises that the keys are
/// `key(0)..key(0) + count`. Writes straight into the frame: no per-item allocation.
pub fn encode_access(
    out: &mut Vec<u8>,
    h: AccessHeader,
    count: usize,
    index: impl Fn(usize) -> u32,
    key: impl Fn(usize) -> u64,
    mut value: impl FnMut(usize, &mut Vec<u8>),
) {
    let start = begin(out, msg::ACCESS);
    // Keys go out listed (or as a run): nothing to keep, nothing kept.
    let h = AccessHeader { flags: h.flags & !(FLAG_KEYS_CACHED | FLAG_KEYS_REMEMBER), ..h };
    access_header(out, h, count);
    if h.flags & FLAG_INDEXED != 0 {
        for i in 0..count {
            out.extend_from_slice(&index(i).to_le_bytes());
        }
    }
    if h.flags & FLAG_RUN != 0 {
        out.extend_from_slice(&key(0).to_le_bytes());
    } else {
        for i in 0..count {
            out.extend_from_slice(&key(i).to_le_bytes());
        }
    }
    if h.kind.carries_values() {
        let values_at = out.len();
        for i in 0..count {
            value(i, out);
        }
        h.codec.compress_tail(out, values_at);
    }
    finish(out, start);
}

/// The keys of an ACCESS encoded as a block.
#[derive(Debug, Clone, Copy)]
pub enum BlockKeys<'a> {
    /// `first..first + count`.
    Run {
        /// First key.
        first: u64,
        /// Number of keys.
        count: usize,
    },
    /// Any keys.
    List(&'a [u64]),
    /// A list the receiver keeps, by its hash (key caching).
    Cached {
        /// The list's hash.
        hash: u64,
        /// Number of keys.
        count: usize,
    },
}

impl BlockKeys<'_> {
    /// Number of keys.
    pub fn len(&self) -> usize {
        match self {
            BlockKeys::Run { count, .. } | BlockKeys::Cached { count, .. } => *count,
            BlockKeys::List(k) => k.len(),
        }
    }
}

/// Encodes a non-indexed ACCESS whose keys are a run or a list and whose values (push and set)
/// lie back to back in `values` (`keys × value bytes`): block copies instead of per-item work.
pub fn encode_access_block(out: &mut Vec<u8>, mut h: AccessHeader, keys: BlockKeys<'_>, values: &[u8]) {
    debug_assert_eq!(h.flags & FLAG_INDEXED, 0);
    let count = keys.len();
    let start = begin(out, msg::ACCESS);
    h.flags &= !(FLAG_RUN | FLAG_KEYS_CACHED);
    match keys {
        BlockKeys::Run { .. } => h.flags = (h.flags | FLAG_RUN) & !FLAG_KEYS_REMEMBER,
        BlockKeys::Cached { .. } => h.flags = (h.flags | FLAG_KEYS_CACHED) & !FLAG_KEYS_REMEMBER,
        BlockKeys::List(_) => {}
    }
    access_header(out, h, count);
    match keys {
        BlockKeys::Run { first, .. } => out.extend_from_slice(&first.to_le_bytes()),
        BlockKeys::List(keys) => out.extend_from_slice(crate::util::u64_bytes(keys)),
        BlockKeys::Cached { hash, .. } => out.extend_from_slice(&hash.to_le_bytes()),
    }
    if h.kind.carries_values() {
        let values_at = out.len();
        out.extend_from_slice(values);
        h.codec.compress_tail(out, values_at);
    }
    finish(out, start);
}

fn access_header(out: &mut Vec<u8>, h: AccessHeader, count: usize) {
    let codec = if h.kind.carries_values() { h.codec as u8 } else { 0 };
    out.extend_from_slice(&[h.kind as u8, h.flags, codec]);
    out.extend_from_slice(&h.table.to_le_bytes());
    out.extend_from_slice(&h.origin.to_le_bytes());
    out.extend_from_slice(&h.op.to_le_bytes());
    out.extend_from_slice(&h.part.to_le_bytes());
    out.extend_from_slice(&(count as u32).to_le_bytes());
}

/// A decoded RESPONSE message.
#[derive(Debug, Clone)]
pub struct Response<'a> {
    /// The access kind answered.
    pub kind: AccessKind,
    /// FLAG_* bits.
    pub flags: u8,
    /// Table id.
    pub table: u16,
    /// The node that served the items (the owner).
    pub responder: u16,
    /// Operation id at the origin.
    pub op: u64,
    /// Part of the operation.
    pub part: u32,
    /// Number of items answered.
    pub count: usize,
    indices: &'a [u8],
    values: Cow<'a, [u8]>,
    value_bytes: usize,
}

impl<'a> Response<'a> {
    /// Decodes a RESPONSE body.
    pub fn decode(b: &'a [u8], value_len: impl Fn(u16) -> Option<usize>) -> Result<Response<'a>> {
        if b.len() < ACCESS_HEADER {
            return Err(bad("short RESPONSE"));
        }
        let kind = AccessKind::from_u8(b[1]).ok_or_else(|| bad(format!("unknown access kind {}", b[1])))?;
        let flags = b[2];
        let table = u16_at(b, 4);
        let vlen = value_len(table).ok_or_else(|| bad(format!("RESPONSE for unknown table {table}")))?;
        let count = u32_at(b, 20) as usize;
        let idx_bytes = if flags & FLAG_INDEXED != 0 { count * 4 } else { 0 };
        let value_bytes = vlen * 4;
        let codec = ValueCodec::from_u8(b[3]).ok_or_else(|| bad(format!("unknown value codec {}", b[3])))?;
        let val_total = if kind.returns_values() { count.checked_mul(vlen).and_then(|n| codec.encoded_len(n)) } else { Some(0) };
        let need = val_total.and_then(|v| (ACCESS_HEADER + idx_bytes).checked_add(v));
        if need != Some(b.len()) {
            return Err(bad(format!("RESPONSE of {count} items has {} bytes", b.len())));
        }
        Ok(Response {
            kind,
            flags,
            table,
            responder: u16_at(b, 6),
            op: u64_at(b, 8),
            part: u32_at(b, 16),
            count,
            indices: &b[ACCESS_HEADER..ACCESS_HEADER + idx_bytes],
            values: decode_values(codec, &b[ACCESS_HEADER + idx_bytes..], if kind.returns_values() { count * vlen } else { 0 })?,
            value_bytes,
        })
    }

    /// The index (within its part) of item `i`.
    #[inline]
    pub fn index(&self, i: usize) -> u32 {
        if self.flags & FLAG_INDEXED != 0 { u32_at(self.indices, i * 4) } else { i as u32 }
    }

    /// Whether item indices are listed.
    pub fn indexed(&self) -> bool {
        self.flags & FLAG_INDEXED != 0
    }

    /// All value bytes (little-endian `f32`, decompressed), item after item (pulls).
    pub fn values(&self) -> &[u8] {
        &self.values
    }

    /// The value bytes of item `i` (empty unless this answers a pull).
    #[inline]
    pub fn value(&self, i: usize) -> &[u8] {
        if self.kind.returns_values() { &self.values[i * self.value_bytes..(i + 1) * self.value_bytes] } else { &[] }
    }
}

/// Writes a RESPONSE header whose items and values (little-endian `f32`) the caller appends
/// next; returns the message start for [`finish_response`], which compresses the values with
/// `codec`. `indexed` responses list their indices first.
#[allow(clippy::too_many_arguments)]
pub fn begin_response(out: &mut Vec<u8>, kind: AccessKind, flags: u8, table: u16, responder: u16, op: u64, part: u32, codec: ValueCodec) -> usize {
    let start = begin(out, msg::RESPONSE);
    let codec = if kind.returns_values() { codec as u8 } else { 0 };
    out.extend_from_slice(&[kind as u8, flags, codec]);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&responder.to_le_bytes());
    out.extend_from_slice(&op.to_le_bytes());
    out.extend_from_slice(&part.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    start
}

/// Sets the item count and length of a response started with [`begin_response`], compressing
/// its values with the codec named there.
pub fn finish_response(out: &mut Vec<u8>, start: usize, count: usize) {
    let at = start + 4 + 20;
    out[at..at + 4].copy_from_slice(&(count as u32).to_le_bytes());
    let (flags, codec) = (out[start + 6], out[start + 7]);
    if let Some(codec) = ValueCodec::from_u8(codec).filter(|c| *c != ValueCodec::F32) {
        let values_at = start + 4 + ACCESS_HEADER + if flags & FLAG_INDEXED != 0 { count * 4 } else { 0 };
        codec.compress_tail(out, values_at);
    }
    finish(out, start);
}

/// One LOCALIZE / RELOCATE item: the key, the requester's reservation and its slot address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveItem {
    /// The key.
    pub key: u64,
    /// Reservation id at the requester (the immediate of the relocation write).
    pub resv: u32,
    /// The reserved slot at the requester.
    pub to: RemoteAddr,
}

/// A decoded LOCALIZE or RELOCATE.
#[derive(Debug, Clone, Copy)]
pub struct Move<'a> {
    /// LOCALIZE: its flags (`MOVE_GRANTED`).
    pub flags: u8,
    /// Table id.
    pub table: u16,
    /// RELOCATE: the new owner.
    pub new_owner: u16,
    /// Number of items.
    pub count: usize,
    items: &'a [u8],
}

impl<'a> Move<'a> {
    /// Decodes a LOCALIZE or RELOCATE body.
    pub fn decode(b: &'a [u8], tables: usize) -> Result<Move<'a>> {
        if b.len() < MOVE_HEADER {
            return Err(bad("short LOCALIZE/RELOCATE"));
        }
        let table = u16_at(b, 4);
        if table as usize >= tables {
            return Err(bad(format!("LOCALIZE/RELOCATE for unknown table {table}")));
        }
        let count = u32_at(b, 8) as usize;
        if count.checked_mul(MOVE_ITEM).and_then(|n| n.checked_add(MOVE_HEADER)) != Some(b.len()) {
            return Err(bad(format!("LOCALIZE/RELOCATE of {count} items has {} bytes", b.len())));
        }
        Ok(Move { flags: b[1], table, new_owner: u16_at(b, 2), count, items: &b[MOVE_HEADER..] })
    }

    /// Item `i`.
    pub fn item(&self, i: usize) -> MoveItem {
        let at = i * MOVE_ITEM;
        MoveItem {
            key: u64_at(self.items, at),
            resv: u32_at(self.items, at + 8),
            to: RemoteAddr { region: u32_at(self.items, at + 12), addr: u64_at(self.items, at + 16) },
        }
    }
}

/// Encodes a LOCALIZE (`new_owner` unused, 0) or RELOCATE (`flags` 0).
pub fn encode_move(out: &mut Vec<u8>, ty: u8, flags: u8, table: u16, new_owner: u16, items: &[MoveItem]) {
    let start = begin(out, ty);
    out.push(flags);
    out.extend_from_slice(&new_owner.to_le_bytes());
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(items.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for it in items {
        out.extend_from_slice(&it.key.to_le_bytes());
        out.extend_from_slice(&it.resv.to_le_bytes());
        out.extend_from_slice(&it.to.region.to_le_bytes());
        out.extend_from_slice(&it.to.addr.to_le_bytes());
    }
    finish(out, start);
}

/// A decoded FAILURE.
#[derive(Debug, Clone, Copy)]
pub struct Failure<'a> {
    /// Why.
    pub code: FailureCode,
    /// Table id.
    pub table: u16,
    /// The lost node, for `PeerLost`.
    pub node: u16,
    /// Operation id at the origin.
    pub op: u64,
    /// Part of the operation.
    pub part: u32,
    /// Number of failed items.
    pub count: usize,
    /// The first failed key (for the error message).
    pub key: u64,
    indices: &'a [u8],
}

/// Header bytes of FAILURE: the ACCESS header and the first failed key.
pub const FAILURE_HEADER: usize = ACCESS_HEADER + 8;

impl<'a> Failure<'a> {
    /// Decodes a FAILURE body.
    pub fn decode(b: &'a [u8]) -> Result<Failure<'a>> {
        if b.len() < FAILURE_HEADER {
            return Err(bad("short FAILURE"));
        }
        let count = u32_at(b, 20) as usize;
        if count.checked_mul(4).and_then(|n| n.checked_add(FAILURE_HEADER)) != Some(b.len()) {
            return Err(bad(format!("FAILURE of {count} items has {} bytes", b.len())));
        }
        Ok(Failure {
            code: FailureCode::from_u8(b[1]),
            table: u16_at(b, 4),
            node: u16_at(b, 6),
            op: u64_at(b, 8),
            part: u32_at(b, 16),
            count,
            key: u64_at(b, ACCESS_HEADER),
            indices: &b[FAILURE_HEADER..],
        })
    }

    /// The index (within its part) of failed item `i`.
    pub fn index(&self, i: usize) -> u32 {
        u32_at(self.indices, i * 4)
    }
}

/// Encodes a FAILURE for the given item indices of (op, part); `key` is the first failed key.
#[allow(clippy::too_many_arguments)]
pub fn encode_failure(out: &mut Vec<u8>, code: FailureCode, table: u16, node: u16, op: u64, part: u32, key: u64, indices: &[u32]) {
    let start = begin(out, msg::FAILURE);
    out.extend_from_slice(&[code as u8, FLAG_INDEXED, 0]);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&node.to_le_bytes());
    out.extend_from_slice(&op.to_le_bytes());
    out.extend_from_slice(&part.to_le_bytes());
    out.extend_from_slice(&(indices.len() as u32).to_le_bytes());
    out.extend_from_slice(&key.to_le_bytes());
    for i in indices {
        out.extend_from_slice(&i.to_le_bytes());
    }
    finish(out, start);
}

/// A decoded LOCALIZE_FAILED.
#[derive(Debug, Clone, Copy)]
pub struct LocalizeFailed<'a> {
    /// Why.
    pub code: FailureCode,
    /// The lost node, for `PeerLost`.
    pub node: u16,
    /// Number of reservations.
    pub count: usize,
    resvs: &'a [u8],
}

impl<'a> LocalizeFailed<'a> {
    /// Decodes a LOCALIZE_FAILED body.
    pub fn decode(b: &'a [u8]) -> Result<LocalizeFailed<'a>> {
        if b.len() < MOVE_HEADER {
            return Err(bad("short LOCALIZE_FAILED"));
        }
        let count = u32_at(b, 8) as usize;
        if count.checked_mul(4).and_then(|n| n.checked_add(MOVE_HEADER)) != Some(b.len()) {
            return Err(bad(format!("LOCALIZE_FAILED of {count} items has {} bytes", b.len())));
        }
        Ok(LocalizeFailed { code: FailureCode::from_u8(b[1]), node: u16_at(b, 6), count, resvs: &b[MOVE_HEADER..] })
    }

    /// Reservation `i`.
    pub fn resv(&self, i: usize) -> u32 {
        u32_at(self.resvs, i * 4)
    }
}

/// Encodes a LOCALIZE_FAILED for reservations of the receiving requester.
pub fn encode_localize_failed(out: &mut Vec<u8>, code: FailureCode, table: u16, node: u16, resvs: &[u32]) {
    let start = begin(out, msg::LOCALIZE_FAILED);
    out.extend_from_slice(&[code as u8, 0, 0]);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&node.to_le_bytes());
    out.extend_from_slice(&(resvs.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for r in resvs {
        out.extend_from_slice(&r.to_le_bytes());
    }
    finish(out, start);
}

/// Encodes BARRIER or BARRIER_RELEASE.
pub fn encode_barrier(out: &mut Vec<u8>, ty: u8, kind: u8, generation: u32) {
    let start = begin(out, ty);
    out.extend_from_slice(&[kind, 0, 0]);
    out.extend_from_slice(&generation.to_le_bytes());
    finish(out, start);
}

/// Bytes of a CLOCK message with its length prefix.
pub const CLOCK_BYTES: usize = 16;

/// Encodes CLOCK: the sender's workers have all completed `min` clocks.
pub fn encode_clock(out: &mut Vec<u8>, min: u64) {
    let start = begin(out, msg::CLOCK);
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&min.to_le_bytes());
    finish(out, start);
}

/// Decodes CLOCK: the sender's smallest completed count.
pub fn decode_clock(b: &[u8]) -> Result<u64> {
    if b.len() != 12 {
        return Err(bad("CLOCK of wrong size"));
    }
    Ok(u64::from_le_bytes(b[4..12].try_into().map_err(|_| bad("CLOCK of wrong size"))?))
}

/// Bytes of an INTENT or INTENT_GO before its keys (type byte included).
pub const INTENT_HEADER: usize = 12;

/// Encodes INTENT (`ty` = [`msg::INTENT`], with the sender's level of need) or INTENT_GO
/// (with the grant: 0 move, 1 replicate) for `keys` of `table`.
pub fn encode_intent(out: &mut Vec<u8>, ty: u8, level: u8, table: u16, keys: &[u64]) {
    let start = begin(out, ty);
    out.extend_from_slice(&[level, 0, 0]);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        out.extend_from_slice(&k.to_le_bytes());
    }
    finish(out, start);
}

/// Decodes INTENT or INTENT_GO: (level, table, keys).
pub fn decode_intent(b: &[u8]) -> Result<(super::IntentLevel, u16, impl ExactSizeIterator<Item = u64> + '_)> {
    if b.len() < INTENT_HEADER {
        return Err(bad("short INTENT"));
    }
    let count = u32_at(b, 8) as usize;
    if count.checked_mul(8).and_then(|n| n.checked_add(INTENT_HEADER)) != Some(b.len()) {
        return Err(bad(format!("INTENT of {count} keys has {} bytes", b.len())));
    }
    let level = super::IntentLevel::from_u8(b[1]).ok_or_else(|| bad(format!("INTENT with level {}", b[1])))?;
    Ok((level, u16_at(b, 4), b[INTENT_HEADER..].chunks_exact(8).map(|c| u64_at(c, 0))))
}

/// Decodes BARRIER or BARRIER_RELEASE: (kind, generation).
pub fn decode_barrier(b: &[u8]) -> Result<(u8, u32)> {
    if b.len() != 8 {
        return Err(bad("BARRIER of wrong size"));
    }
    Ok((b[1], u32_at(b, 4)))
}

/// Encodes BARRIER_FAILED: generation `generation` of barrier `kind` cannot complete because
/// node `lost` is gone.
pub fn encode_barrier_failed(out: &mut Vec<u8>, kind: u8, generation: u32, lost: u16) {
    let start = begin(out, msg::BARRIER_FAILED);
    out.extend_from_slice(&[kind, 0, 0]);
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&lost.to_le_bytes());
    finish(out, start);
}

/// Decodes BARRIER_FAILED: (kind, generation, lost node).
pub fn decode_barrier_failed(b: &[u8]) -> Result<(u8, u32, u16)> {
    if b.len() != 10 {
        return Err(bad("BARRIER_FAILED of wrong size"));
    }
    Ok((b[1], u32_at(b, 4), u16::from_le_bytes([b[8], b[9]])))
}

/// Header bytes of REPLICA_DELTA and REPLICA_ACK (type byte included).
pub const REPLICA_HEADER: usize = 12;
/// Bytes of REPLICA_ACK before its positions.
pub const REPLICA_ACK_HEADER: usize = REPLICA_HEADER + 4 + 16;
/// REPLICA_DELTA flag: the sender's replicas may be stale whether or not the home's slots changed
/// (its first round, or a refresh that failed): the image must hold every replicated slot.
pub const REPLICA_FULL: u8 = 1;
/// REPLICA_DELTA flag: the last message of a round's shipment, after which the home cuts the
/// sender's image; REPLICA_ACK flag: this acknowledgement carries the image.
pub const REPLICA_CUT: u8 = 2;

/// Starts a REPLICA_DELTA of `table` for round `round`; append `(key, values)` items with
/// [`push_replica_delta_key`] and close it with [`finish_replica_delta`].
pub fn begin_replica_delta(out: &mut Vec<u8>, table: u16, round: u32, flags: u8) -> usize {
    let start = begin(out, msg::REPLICA_DELTA);
    out.push(flags);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&round.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    start
}

/// Appends an item's key to a REPLICA_DELTA (its values follow, appended by the caller).
pub fn push_replica_delta_key(out: &mut Vec<u8>, key: u64) {
    out.extend_from_slice(&key.to_le_bytes());
}

/// Sets the flags of a REPLICA_DELTA begun at `start`.
pub fn set_replica_delta_flags(out: &mut [u8], start: usize, flags: u8) {
    out[start + 5] = flags;
}

/// Closes a REPLICA_DELTA of `count` items begun at `start`.
pub fn finish_replica_delta(out: &mut [u8], start: usize, count: u32) {
    out[start + 4 + 8..start + 4 + 12].copy_from_slice(&count.to_le_bytes());
    finish(out, start);
}

/// A decoded REPLICA_DELTA.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaDelta<'a> {
    /// REPLICA_FULL and REPLICA_CUT bits.
    pub flags: u8,
    /// Table id.
    pub table: u16,
    /// The sender's round.
    pub round: u32,
    /// Items.
    pub count: usize,
    items: &'a [u8],
    item_bytes: usize,
}

impl<'a> ReplicaDelta<'a> {
    /// Decodes a REPLICA_DELTA body; `value_len` gives each table's value length.
    pub fn decode(b: &'a [u8], value_len: impl Fn(u16) -> Option<usize>) -> Result<ReplicaDelta<'a>> {
        if b.len() < REPLICA_HEADER {
            return Err(bad("short REPLICA_DELTA"));
        }
        let table = u16_at(b, 2);
        let vl = value_len(table).ok_or_else(|| bad(format!("REPLICA_DELTA for unknown table {table}")))?;
        if b[1] & !(REPLICA_FULL | REPLICA_CUT) != 0 {
            return Err(bad(format!("REPLICA_DELTA with unknown flags {:#x}", b[1])));
        }
        let count = u32_at(b, 8) as usize;
        let item_bytes = 8 + vl * 4;
        if count.checked_mul(item_bytes) != Some(b.len() - REPLICA_HEADER) {
            return Err(bad(format!("REPLICA_DELTA of {count} items has {} bytes", b.len())));
        }
        Ok(ReplicaDelta { flags: b[1], table, round: u32_at(b, 4), count, items: &b[REPLICA_HEADER..], item_bytes })
    }

    /// Item `i`: its key and its values as little-endian bytes.
    pub fn item(&self, i: usize) -> (u64, &'a [u8]) {
        let at = i * self.item_bytes;
        (u64_at(self.items, at), &self.items[at + 8..at + self.item_bytes])
    }
}

/// Where a home node cut a peer's image, and which replicated slots it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaImage {
    /// Where the image starts.
    pub remote: RemoteAddr,
    /// Per slot image, in order: the key's position among the home's replicated keys (in key
    /// order). Strictly increasing.
    pub positions: Vec<u32>,
}

/// Encodes REPLICA_ACK: round `round` of `table` is applied; of the home's `keys` replicated
/// keys, those in `image` (when one was cut) changed and can be read there.
pub fn encode_replica_ack(out: &mut Vec<u8>, table: u16, round: u32, keys: u32, image: Option<&ReplicaImage>) {
    let start = begin(out, msg::REPLICA_ACK);
    let empty = ReplicaImage { remote: RemoteAddr { region: 0, addr: 0 }, positions: Vec::new() };
    out.push(if image.is_some() { REPLICA_CUT } else { 0 });
    let image = image.unwrap_or(&empty);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&round.to_le_bytes());
    out.extend_from_slice(&keys.to_le_bytes());
    out.extend_from_slice(&(image.positions.len() as u32).to_le_bytes());
    out.extend_from_slice(&image.remote.region.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&image.remote.addr.to_le_bytes());
    for p in &image.positions {
        out.extend_from_slice(&p.to_le_bytes());
    }
    finish(out, start);
}

/// A decoded REPLICA_ACK: (table, round, keys, image when one was cut). Positions must be
/// strictly increasing and below `keys`.
pub fn decode_replica_ack(b: &[u8]) -> Result<(u16, u32, u32, Option<ReplicaImage>)> {
    if b.len() < REPLICA_ACK_HEADER {
        return Err(bad("short REPLICA_ACK"));
    }
    let (table, round, keys, changed) = (u16_at(b, 2), u32_at(b, 4), u32_at(b, 8), u32_at(b, 12) as usize);
    if changed.checked_mul(4) != Some(b.len() - REPLICA_ACK_HEADER) {
        return Err(bad(format!("REPLICA_ACK of {changed} positions has {} bytes", b.len())));
    }
    let remote = RemoteAddr { region: u32_at(b, 16), addr: u64_at(b, 24) };
    let positions: Vec<u32> = (0..changed).map(|i| u32_at(b, REPLICA_ACK_HEADER + 4 * i)).collect();
    if positions.windows(2).any(|w| w[0] >= w[1]) || positions.last().is_some_and(|&p| p >= keys) {
        return Err(bad("REPLICA_ACK positions are not increasing below its key count"));
    }
    match b[1] {
        REPLICA_CUT => Ok((table, round, keys, Some(ReplicaImage { remote, positions }))),
        0 if positions.is_empty() => Ok((table, round, keys, None)),
        other => Err(bad(format!("REPLICA_ACK with flags {other:#x} and {} positions", positions.len()))),
    }
}

/// Header bytes of REPLICA_SYNC (type byte included).
pub const REPLICA_SYNC_HEADER: usize = 16;
/// Bytes of REPLICA_SYNC_ACK before its indices.
pub const REPLICA_SYNC_ACK_HEADER: usize = 32;

/// Starts a REPLICA_SYNC of `table` with id `id` and `count` items whose images go to slot
/// image `offset` on; append exactly `count` items with [`push_replica_sync_item`] and close it
/// with [`finish_replica_sync`].
pub fn begin_replica_sync(out: &mut Vec<u8>, table: u16, id: u32, offset: u32, count: u32) -> usize {
    let start = begin(out, msg::REPLICA_SYNC);
    out.push(0);
    out.extend_from_slice(&table.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    out.resize(out.len() + (count as usize).div_ceil(8), 0);
    start
}

/// Appends item `index` of the REPLICA_SYNC begun at `start`: `key` and its `delta`. A delta of
/// zeros is left out (only its key travels): most replicas took no push since the last round,
/// and the owner need only cut their images.
pub fn push_replica_sync_item(out: &mut Vec<u8>, start: usize, index: usize, key: u64, delta: &[f32]) {
    out.extend_from_slice(&key.to_le_bytes());
    if delta.iter().all(|&d| d == 0.0) {
        return;
    }
    out[start + 4 + REPLICA_SYNC_HEADER + index / 8] |= 1 << (index % 8);
    for d in delta {
        out.extend_from_slice(&d.to_le_bytes());
    }
}

/// Closes a REPLICA_SYNC begun at `start`.
pub fn finish_replica_sync(out: &mut [u8], start: usize) {
    finish(out, start);
}

/// A decoded REPLICA_SYNC.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaSync<'a> {
    /// Table id.
    pub table: u16,
    /// The sender's id for this message (echoed by the acknowledgement).
    pub id: u32,
    /// Where in the sender's image buffer the held keys' images go (in slot images).
    pub offset: u32,
    /// Items.
    pub count: usize,
    present: &'a [u8],
    items: &'a [u8],
    value_bytes: usize,
}

impl<'a> ReplicaSync<'a> {
    /// Decodes a REPLICA_SYNC body; `value_len` gives each table's value length.
    pub fn decode(b: &'a [u8], value_len: impl Fn(u16) -> Option<usize>) -> Result<ReplicaSync<'a>> {
        if b.len() < REPLICA_SYNC_HEADER {
            return Err(bad("short REPLICA_SYNC"));
        }
        let table = u16_at(b, 2);
        let vl = value_len(table).ok_or_else(|| bad(format!("REPLICA_SYNC for unknown table {table}")))?;
        let count = u32_at(b, 8) as usize;
        let items_at = REPLICA_SYNC_HEADER + count.div_ceil(8);
        if b.len() < items_at {
            return Err(bad(format!("REPLICA_SYNC of {count} items has {} bytes", b.len())));
        }
        let present = &b[REPLICA_SYNC_HEADER..items_at];
        if !count.is_multiple_of(8) && present[count / 8] >> (count % 8) != 0 {
            return Err(bad("REPLICA_SYNC marks deltas beyond its items"));
        }
        let deltas = present.iter().map(|m| m.count_ones() as usize).sum::<usize>();
        let value_bytes = vl * 4;
        let expected = deltas.checked_mul(value_bytes).and_then(|d| d.checked_add(count.checked_mul(8)?)).and_then(|i| i.checked_add(items_at));
        if expected != Some(b.len()) {
            return Err(bad(format!("REPLICA_SYNC of {count} items, {deltas} with deltas, has {} bytes", b.len())));
        }
        Ok(ReplicaSync { table, id: u32_at(b, 4), offset: u32_at(b, 12), count, present, items: &b[items_at..], value_bytes })
    }

    /// The items in order: each key and its delta as little-endian bytes (`None`: zeros).
    pub fn items(&self) -> impl Iterator<Item = (u64, Option<&'a [u8]>)> + use<'a> {
        let (present, items, value_bytes) = (self.present, self.items, self.value_bytes);
        let mut at = 0;
        (0..self.count).map(move |i| {
            let key = u64_at(items, at);
            at += 8;
            if present[i / 8] & (1 << (i % 8)) == 0 {
                return (key, None);
            }
            let delta = &items[at..at + value_bytes];
            at += value_bytes;
            (key, Some(delta))
        })
    }
}

/// A REPLICA_SYNC's acknowledgement: which of its items the receiver held (their deltas applied,
/// their images at `remote`, in order) and, for each other item in order, the node to send it
/// to next time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSyncAck {
    /// Table id.
    pub table: u16,
    /// The REPLICA_SYNC's id.
    pub id: u32,
    /// Its item count.
    pub count: u32,
    /// Where the held items' images start.
    pub remote: RemoteAddr,
    /// Indices of the held items, strictly increasing, below `count`.
    pub held: Vec<u32>,
    /// Per item not held, in order: where its key is to be found (the owner, as far as the
    /// receiver knows, or the key's home), or `LOST_OWNER` from the home of a key whose value
    /// was lost with its owner.
    pub hints: Vec<u16>,
}

/// Encodes REPLICA_SYNC_ACK.
pub fn encode_replica_sync_ack(out: &mut Vec<u8>, ack: &ReplicaSyncAck) {
    let start = begin(out, msg::REPLICA_SYNC_ACK);
    out.push(0);
    out.extend_from_slice(&ack.table.to_le_bytes());
    out.extend_from_slice(&ack.id.to_le_bytes());
    out.extend_from_slice(&ack.count.to_le_bytes());
    out.extend_from_slice(&(ack.held.len() as u32).to_le_bytes());
    out.extend_from_slice(&ack.remote.region.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&ack.remote.addr.to_le_bytes());
    for i in &ack.held {
        out.extend_from_slice(&i.to_le_bytes());
    }
    for h in &ack.hints {
        out.extend_from_slice(&h.to_le_bytes());
    }
    finish(out, start);
}

/// Decodes REPLICA_SYNC_ACK; indices must increase below the item count, and there must be one
/// hint per item not held.
pub fn decode_replica_sync_ack(b: &[u8]) -> Result<ReplicaSyncAck> {
    if b.len() < REPLICA_SYNC_ACK_HEADER {
        return Err(bad("short REPLICA_SYNC_ACK"));
    }
    let (table, id, count, held) = (u16_at(b, 2), u32_at(b, 4), u32_at(b, 8), u32_at(b, 12));
    let others = count.checked_sub(held).ok_or_else(|| bad(format!("REPLICA_SYNC_ACK holds {held} of {count} items")))? as usize;
    if (held as usize) * 4 + others * 2 != b.len() - REPLICA_SYNC_ACK_HEADER {
        return Err(bad(format!("REPLICA_SYNC_ACK of {count} items has {} bytes", b.len())));
    }
    let held: Vec<u32> = (0..held as usize).map(|i| u32_at(b, REPLICA_SYNC_ACK_HEADER + 4 * i)).collect();
    if held.windows(2).any(|w| w[0] >= w[1]) || held.last().is_some_and(|&i| i >= count) {
        return Err(bad("REPLICA_SYNC_ACK indices are not increasing below its item count"));
    }
    let hints_at = REPLICA_SYNC_ACK_HEADER + 4 * held.len();
    let hints = (0..others).map(|i| u16_at(b, hints_at + 2 * i)).collect();
    Ok(ReplicaSyncAck { table, id, count, remote: RemoteAddr { region: u32_at(b, 16), addr: u64_at(b, 24) }, held, hints })
}

/// Longest reason LEAVING carries per node (longer ones are cut at a character boundary).
pub const LEAVING_REASON_MAX: usize = 512;

/// Encodes LEAVING: this node leaves after losing `lost` (node, why).
pub fn encode_leaving(out: &mut Vec<u8>, lost: &[(u16, String)]) {
    let start = begin(out, msg::LEAVING);
    let count = lost.len().min(u16::MAX as usize);
    out.extend_from_slice(&(count as u16).to_le_bytes());
    for (node, reason) in &lost[..count] {
        let reason = &reason[..reason.floor_char_boundary(LEAVING_REASON_MAX)];
        out.extend_from_slice(&node.to_le_bytes());
        out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
        out.extend_from_slice(reason.as_bytes());
    }
    finish(out, start);
}

/// The lost nodes a frame's LEAVING names, if the frame is one (`None` for any other frame).
pub fn leaving_of(frame: &[u8]) -> Option<Result<Vec<(u16, String)>>> {
    let mut messages = Messages::new(frame);
    let body = match messages.next()? {
        Ok(body) => body,
        Err(e) => return Some(Err(e)),
    };
    if body.first() != Some(&msg::LEAVING) {
        return None;
    }
    if messages.next().is_some() {
        return Some(Err(bad("LEAVING shares its frame with other messages")));
    }
    Some(decode_leaving(body))
}

fn decode_leaving(b: &[u8]) -> Result<Vec<(u16, String)>> {
    if b.len() < 3 {
        return Err(bad("LEAVING too short"));
    }
    let count = u16_at(b, 1) as usize;
    let mut at = 3;
    let mut lost = Vec::with_capacity(count.min(64));
    for _ in 0..count {
        if b.len() < at + 4 {
            return Err(bad("LEAVING cut short"));
        }
        let (node, len) = (u16_at(b, at), u16_at(b, at + 2) as usize);
        at += 4;
        let reason = b.get(at..at + len).ok_or_else(|| bad("LEAVING reason cut short"))?;
        lost.push((node, String::from_utf8_lossy(reason).into_owned()));
        at += len;
    }
    if at != b.len() {
        return Err(bad("LEAVING with trailing bytes"));
    }
    Ok(lost)
}

/// Encodes PEER_LOST: node `lost`, of incarnation `incarnation` (see
/// `Directory::incarnation`), is gone, and why (cut to [`LEAVING_REASON_MAX`] bytes at a
/// character boundary). Returns the message's length.
pub fn encode_peer_lost(out: &mut Vec<u8>, lost: u16, incarnation: u8, reason: &str) -> usize {
    let reason = &reason[..reason.floor_char_boundary(LEAVING_REASON_MAX)];
    let start = begin(out, msg::PEER_LOST);
    out.push(incarnation);
    out.extend_from_slice(&lost.to_le_bytes());
    out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    out.extend_from_slice(reason.as_bytes());
    finish(out, start);
    out.len() - start
}

/// Decodes PEER_LOST: (lost node, its incarnation, reason).
pub fn decode_peer_lost(b: &[u8]) -> Result<(u16, u8, String)> {
    if b.len() < 6 {
        return Err(bad("PEER_LOST too short"));
    }
    let len = u16_at(b, 4) as usize;
    if b.len() != 6 + len || len > LEAVING_REASON_MAX {
        return Err(bad("PEER_LOST of wrong size"));
    }
    Ok((u16_at(b, 2), b[1], String::from_utf8_lossy(&b[6..]).into_owned()))
}

pub(crate) fn begin(out: &mut Vec<u8>, ty: u8) -> usize {
    let start = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, ty]);
    start
}

pub(crate) fn finish(out: &mut [u8], start: usize) {
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    #[test]
    fn peer_lost_round_trips_and_rejects_garbage() {
        let mut frame = Vec::new();
        let len = encode_peer_lost(&mut frame, 3, 2, "crashed");
        assert_eq!(len, frame.len());
        let body = Messages::new(&frame).next().unwrap().unwrap();
        assert_eq!(decode_peer_lost(body).unwrap(), (3, 2, "crashed".to_string()));
        let mut long = Vec::new();
        encode_peer_lost(&mut long, 1, 0, &"é".repeat(400));
        let body = Messages::new(&long).next().unwrap().unwrap();
        let (_, _, reason) = decode_peer_lost(body).unwrap();
        assert!(reason.len() <= LEAVING_REASON_MAX && reason.starts_with('é'), "cut at a character boundary");
        let body = Messages::new(&frame).next().unwrap().unwrap().to_vec();
        for cut in 0..body.len() {
            assert!(decode_peer_lost(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = body.clone();
        longer.push(b'x');
        assert!(decode_peer_lost(&longer).is_err(), "trailing bytes");
    }

    #[test]
    fn leaving_round_trips_and_rejects_garbage() {
        let lost = vec![(2u16, "node 2 sent nothing for 1500 ms".to_string()), (3, "é".repeat(400))];
        let mut frame = Vec::new();
        encode_leaving(&mut frame, &lost);
        let decoded = leaving_of(&frame).expect("a LEAVING frame").unwrap();
        assert_eq!(decoded[0], lost[0]);
        assert!(decoded[1].1.len() <= LEAVING_REASON_MAX && decoded[1].1.starts_with('é'), "cut at a character boundary");
        let mut other = Vec::new();
        encode_barrier(&mut other, msg::BARRIER, 0, 1);
        assert!(leaving_of(&other).is_none(), "another message is not LEAVING");
        let mut two = frame.clone();
        two.extend_from_slice(&other);
        assert!(leaving_of(&two).unwrap().is_err(), "LEAVING comes alone");
        for cut in 5..frame.len() {
            let mut short = frame[..cut].to_vec();
            let len = (cut - 4) as u32;
            short[..4].copy_from_slice(&len.to_le_bytes());
            assert!(leaving_of(&short).unwrap().is_err(), "cut at {cut}");
        }
    }

    use super::*;

    fn vl(t: u16) -> Option<usize> {
        (t < 2).then_some(3)
    }

    #[test]
    fn replica_messages_round_trip() {
        let mut out = Vec::new();
        let start = begin_replica_delta(&mut out, 1, 7, REPLICA_FULL | REPLICA_CUT);
        for (key, v) in [(5u64, 1.0f32), (9, 2.0)] {
            push_replica_delta_key(&mut out, key);
            for _ in 0..3 {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        finish_replica_delta(&mut out, start, 2);
        let image = ReplicaImage { remote: RemoteAddr { region: 3, addr: 64 }, positions: vec![0, 2, 5] };
        encode_replica_ack(&mut out, 1, 7, 6, Some(&image));
        encode_replica_ack(&mut out, 1, 7, 6, None);
        let bodies: Vec<_> = Messages::new(&out).collect::<Result<_>>().unwrap();
        let d = ReplicaDelta::decode(bodies[0], vl).unwrap();
        assert_eq!((d.flags, d.table, d.round, d.count), (REPLICA_FULL | REPLICA_CUT, 1, 7, 2));
        assert_eq!(d.item(1), (9, &[2.0f32.to_le_bytes(); 3].concat()[..]));
        assert!(ReplicaDelta::decode(&bodies[0][..bodies[0].len() - 1], vl).is_err());
        assert!(ReplicaDelta::decode(bodies[0], |_| None).is_err());
        assert_eq!(decode_replica_ack(bodies[1]).unwrap(), (1, 7, 6, Some(image.clone())));
        assert_eq!(decode_replica_ack(bodies[2]).unwrap(), (1, 7, 6, None));
        let mut beyond = Vec::new();
        encode_replica_ack(&mut beyond, 1, 7, 5, Some(&image));
        assert!(decode_replica_ack(&beyond[4..]).is_err(), "positions must lie below the key count");
        let mut unordered = Vec::new();
        encode_replica_ack(&mut unordered, 1, 7, 6, Some(&ReplicaImage { positions: vec![2, 2], ..image }));
        assert!(decode_replica_ack(&unordered[4..]).is_err(), "positions must increase");
    }

    #[test]
    fn replica_sync_messages_round_trip() {
        let mut out = Vec::new();
        // Nine items, so the delta-present bits take two bytes; items 0, 1, 4 and 8 carry zeros
        // (item 1 a negative zero among them).
        let items: Vec<(u64, f32)> = (0..9).map(|i| (5 + 2 * i as u64, if i % 4 == 0 || i == 1 { 0.0 } else { i as f32 })).collect();
        let start = begin_replica_sync(&mut out, 1, 42, 100, items.len() as u32);
        for (i, &(key, v)) in items.iter().enumerate() {
            push_replica_sync_item(&mut out, start, i, key, &[v, if i == 1 { -0.0 } else { v }, v]);
        }
        finish_replica_sync(&mut out, start);
        // Only the five deltas that are not zeros travel.
        assert_eq!(out.len() - start, 4 + REPLICA_SYNC_HEADER + 2 + 9 * 8 + 5 * 12);
        let ack = ReplicaSyncAck { table: 1, id: 42, count: 3, remote: RemoteAddr { region: 3, addr: 64 }, held: vec![0, 2], hints: vec![4] };
        encode_replica_sync_ack(&mut out, &ack);
        let bodies: Vec<_> = Messages::new(&out).collect::<Result<_>>().unwrap();
        let sync = ReplicaSync::decode(bodies[0], vl).unwrap();
        assert_eq!((sync.table, sync.id, sync.offset, sync.count), (1, 42, 100, 9));
        let decoded: Vec<(u64, Option<Vec<u8>>)> = sync.items().map(|(k, d)| (k, d.map(<[u8]>::to_vec))).collect();
        let expected: Vec<(u64, Option<Vec<u8>>)> = items.iter().map(|&(k, v)| (k, (v != 0.0).then(|| [v.to_le_bytes(); 3].concat()))).collect();
        assert_eq!(decoded, expected);
        assert!(ReplicaSync::decode(&bodies[0][..bodies[0].len() - 1], vl).is_err());
        assert!(ReplicaSync::decode(bodies[0], |_| None).is_err());
        // A delta marked present that is not there, and a mark beyond the items.
        let mut marked = bodies[0].to_vec();
        marked[REPLICA_SYNC_HEADER] |= 1 << 1;
        assert!(ReplicaSync::decode(&marked, vl).is_err());
        let mut beyond = bodies[0].to_vec();
        beyond[REPLICA_SYNC_HEADER + 1] |= 1 << 1;
        assert!(ReplicaSync::decode(&beyond, vl).is_err());
        // A count the body cannot hold.
        let mut huge = bodies[0].to_vec();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(ReplicaSync::decode(&huge, vl).is_err());
        assert_eq!(decode_replica_sync_ack(bodies[1]).unwrap(), ack);
        for bad_ack in [
            ReplicaSyncAck { held: vec![2, 0], ..ack.clone() },
            ReplicaSyncAck { held: vec![0, 3], ..ack.clone() },
            ReplicaSyncAck { hints: vec![], ..ack.clone() },
            ReplicaSyncAck { count: 1, ..ack.clone() },
        ] {
            let mut o = Vec::new();
            encode_replica_sync_ack(&mut o, &bad_ack);
            assert!(decode_replica_sync_ack(&o[4..]).is_err(), "{bad_ack:?} must be refused");
        }
        assert!(decode_replica_sync_ack(&bodies[1][..bodies[1].len() - 2]).is_err());
    }

    #[test]
    fn access_round_trip() {
        let v1: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        let v2: Vec<u8> = [4.0f32, 5.0, 6.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        let mut out = Vec::new();
        let items: [(u32, u64, &[u8]); 2] = [(5, 10, &v1), (9, 20, &v2)];
        let h = AccessHeader { kind: AccessKind::Push, flags: FLAG_INDEXED | FLAG_FORWARDED, table: 1, origin: 7, op: 99, part: 3, codec: ValueCodec::F32 };
        encode_access(&mut out, h, 2, |i| items[i].0, |i| items[i].1, |i, o| o.extend_from_slice(items[i].2));
        let bodies: Vec<_> = Messages::new(&out).collect::<Result<_>>().unwrap();
        assert_eq!(bodies.len(), 1);
        assert_eq!(bodies[0][0], msg::ACCESS);
        let a = Access::decode(bodies[0], vl).unwrap();
        assert_eq!((a.kind, a.table, a.origin, a.op, a.part, a.count), (AccessKind::Push, 1, 7, 99, 3, 2));
        assert_eq!((a.index(0), a.key(0), a.index(1), a.key(1)), (5, 10, 9, 20));
        assert_eq!(a.value(1), &v2[..]);
    }

    #[test]
    fn response_and_moves_round_trip() {
        let mut out = Vec::new();
        let start = begin_response(&mut out, AccessKind::Pull, 0, 0, 2, 5, 1, ValueCodec::F32);
        out.extend_from_slice(&[0u8; 24]);
        finish_response(&mut out, start, 2);
        let items = [MoveItem { key: 3, resv: 4, to: RemoteAddr { region: 5, addr: 6 } }];
        encode_move(&mut out, msg::RELOCATE, 0, 1, 9, &items);
        encode_failure(&mut out, FailureCode::KeyLost, 1, 3, 8, 2, 77, &[4, 5]);
        encode_localize_failed(&mut out, FailureCode::PeerLost, 0, 2, &[11]);
        encode_barrier(&mut out, msg::BARRIER, 1, 77);
        encode_move(&mut out, msg::LOCALIZE, MOVE_GRANTED, 1, 0, &items);
        encode_localize_failed(&mut out, FailureCode::Declined, 1, 0, &[12]);
        let bodies: Vec<_> = Messages::new(&out).collect::<Result<_>>().unwrap();
        let r = Response::decode(bodies[0], vl).unwrap();
        assert_eq!((r.count, r.responder, r.op, r.part, r.index(1)), (2, 2, 5, 1, 1));
        let m = Move::decode(bodies[1], 2).unwrap();
        assert_eq!((m.table, m.new_owner, m.count, m.item(0)), (1, 9, 1, items[0]));
        let f = Failure::decode(bodies[2]).unwrap();
        assert_eq!((f.code, f.node, f.op, f.part, f.count, f.key, f.index(1)), (FailureCode::KeyLost, 3, 8, 2, 2, 77, 5));
        let lf = LocalizeFailed::decode(bodies[3]).unwrap();
        assert_eq!((lf.code, lf.node, lf.count, lf.resv(0)), (FailureCode::PeerLost, 2, 1, 11));
        assert_eq!(decode_barrier(bodies[4]).unwrap(), (1, 77));
        assert_eq!(m.flags, 0);
        let granted = Move::decode(bodies[5], 2).unwrap();
        assert_eq!((granted.flags, granted.table, granted.item(0)), (MOVE_GRANTED, 1, items[0]));
        let declined = LocalizeFailed::decode(bodies[6]).unwrap();
        assert_eq!((declined.code, declined.resv(0)), (FailureCode::Declined, 12));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            for body in Messages::new(&bytes).flatten() {
                let _ = Access::decode(body, vl);
                let _ = Response::decode(body, vl);
                let _ = Move::decode(body, 2);
                let _ = Failure::decode(body);
                let _ = LocalizeFailed::decode(body);
                let _ = decode_barrier(body);
            }
        }

        #[test]
        fn truncated_access_is_rejected(cut in 1usize..60) {
            let v: Vec<u8> = vec![0; 12];
            let mut out = Vec::new();
            let h = AccessHeader { kind: AccessKind::Set, flags: 0, table: 0, origin: 1, op: 2, part: 3, codec: ValueCodec::F32 };
            encode_access(&mut out, h, 2, |i| i as u32, |i| i as u64 + 1, |_, o| o.extend_from_slice(&v));
            let body = &out[4..];
            let cut = cut.min(body.len() - 1);
            prop_assert!(Access::decode(&body[..body.len() - cut], vl).is_err());
        }
    }
}
