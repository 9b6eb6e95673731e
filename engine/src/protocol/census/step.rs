//! The census's steps: its beginning at a loss, the flush, the census itself, the homes'
//! settling of their keys and the end (see the module documentation). Every one holds every
//! shard.

use std::sync::atomic::Ordering;

use super::wire::{self as census_wire, CensusMessage};
use super::{Claim, chain, root};
use crate::error::{Error, Result};
use crate::protocol::shard::Queued;
use crate::protocol::wire::{FailureCode, Move, MoveItem, msg};
use crate::protocol::{LOST_OWNER, Progress, Step};
use crate::stats::MessageKind;
use crate::store::RemoteAddr;
use crate::util::FastMap;

impl Step<'_, '_> {
    /// `peer` is lost (every shard held, `peer` marked lost), in a cluster that relocates keys
    /// and keeps backups: a census begins, or begins again. Keys this node was handing to a
    /// lost node are served here again, and hand-overs queued behind arrivals to a lost node
    /// are dropped (the key stays where it lands).
    pub(crate) fn begin_census(&mut self, peer: u16) {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let epoch = dir.losses() as u32;
        core.census().lock().begin(epoch, dir.nodes());
        dir.set_recovering(true);
        for s in 0..dir.shards() {
            for transit in self.shard(s).transits.values_mut() {
                transit.queue.retain(|q| !matches!(q, Queued::Relocate { new_owner, .. } if dir.is_lost(*new_owner)));
            }
        }
        let back = core.backups().lock().take_back(|n| dir.is_lost(n));
        let taken_back = back.len();
        let mut arrived = Vec::new();
        for (mut slot, table, key) in back {
            // (Its head carries the hand-over's stamp: the versions are made whole again.)
            store.take_incoming_stamp(&mut slot);
            // This node may have asked for the key back meanwhile (its home then sent the
            // request to the lost node): the key lands in the slot reserved for it.
            let shard = self.shard_of(table, key);
            let resv = shard.reservations.iter().find(|&(_, &k)| k == (table, key)).map(|(&resv, _)| resv);
            match resv.filter(|_| shard.transits.get(&(table, key)).is_some_and(|t| t.slot.is_some())) {
                Some(resv) => {
                    let mut image = Vec::new();
                    store.reserved(&mut slot).append_all_le_bytes(&mut image);
                    store.free(slot);
                    self.land_image_here(table, key, resv, &image, &mut arrived);
                }
                None => store.lock(table, key).publish(slot),
            }
            core.note_written(table, key);
        }
        self.deliver_arrived(arrived);
        if taken_back > 0 {
            let counters = core.backup_counters();
            counters.want(counters.round_after_now());
        }
        tracing::info!(node = dir.rank(), peer, epoch, taken_back, "a census of the keys begins after a loss");
        self.advance_census();
    }

    /// Takes the census as far as it can go now (every shard held): flushes once this node's
    /// writes completed, reports once every survivor flushed, settles this node's keys once
    /// every survivor reported, and ends once every survivor settled its own.
    pub(crate) fn advance_census(&mut self) {
        let core = self.core;
        let dir = core.directory();
        let rank = dir.rank();
        let live = |n: u16| !dir.is_lost(n);
        let mut census = core.census().lock();
        if census.wants_flush() && core.writes_out().load(Ordering::Acquire) == 0 {
            census.note_flushed();
            let epoch = census.epoch();
            drop(census);
            self.send_to_live(&[], MessageKind::Membership, |out| census_wire::encode_short(out, msg::CENSUS_FLUSH, epoch));
            census = core.census().lock();
        }
        if census.census_due(rank, live) {
            census.note_reported();
            drop(census);
            self.send_census();
            census = core.census().lock();
        }
        if census.resolve_due(live) {
            let claims = census.take_claims();
            let epoch = census.epoch();
            drop(census);
            self.settle_keys(claims);
            self.send_to_live(&[], MessageKind::Membership, |out| census_wire::encode_short(out, msg::CENSUS_DONE, epoch));
            // Items for the keys just settled go where the census put them.
            let held = core.census().lock().take_held_accesses();
            for message in held {
                self.route_access_here(&message[4..], "an item held during the census");
            }
            census = core.census().lock();
            census.note_done(rank);
        }
        if census.over(live) {
            let held = census.end();
            drop(census);
            self.end_census(held);
        }
    }

    /// Tells every live home what this node holds, awaits and hands over of its keys (its own
    /// claims go straight into its census; what it holds of its own keys it looks up itself).
    fn send_census(&mut self) {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let rank = dir.rank();
        let mut claims: Vec<Vec<(u16, u64, Claim)>> = vec![Vec::new(); dir.nodes()];
        for table in 0..dir.tables().len() as u16 {
            let t = store.table(table);
            for key in 0..dir.tables()[table as usize].keys {
                if t.slot_of(key).is_some() {
                    let home = dir.home(table, key);
                    if home != rank {
                        claims[home as usize].push((table, key, Claim::Held));
                    }
                }
            }
        }
        for (table, key, claim) in self.claims_but_held() {
            claims[dir.home(table, key) as usize].push((table, key, claim));
        }
        let epoch = core.census().lock().epoch();
        let per_message = ((core.settings().max_message_bytes - census_wire::HEADER - 16) / census_wire::CLAIM).max(1);
        for (node, mut list) in claims.into_iter().enumerate() {
            let node = node as u16;
            if node == rank {
                // (What this node claims of its own keys it looks up when it settles them.)
                core.census().lock().note_report(rank);
                continue;
            }
            if dir.is_lost(node) {
                continue;
            }
            list.sort_by_key(|&(table, key, _)| (table, key));
            for group in list.chunk_by(|a, b| a.0 == b.0) {
                for chunk in group.chunks(per_message) {
                    let items: Vec<(u64, Claim)> = chunk.iter().map(|&(_, key, claim)| (key, claim)).collect();
                    let bytes = census_wire::encode_census(self.tx.buf(node), chunk[0].0, epoch, false, &items);
                    self.tx.sent(node, MessageKind::Membership, bytes);
                }
            }
            let bytes = census_wire::encode_census(self.tx.buf(node), 0, epoch, true, &[]);
            self.tx.sent(node, MessageKind::Membership, bytes);
        }
    }

    /// What this node claims of keys, but that it holds them: the keys it awaits (and hands
    /// over once they arrived), and those it holds out of service to hand over.
    fn claims_but_held(&self) -> Vec<(u16, u64, Claim)> {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let mut claims = Vec::new();
        for s in 0..dir.shards() {
            let shard = self.shard_ref(s);
            for (&resv, &(table, key)) in &shard.reservations {
                let Some(transit) = shard.transits.get(&(table, key)) else { continue };
                let Some(slot) = transit.slot.as_ref() else { continue };
                claims.push((table, key, Claim::Arriving(resv, store.table(table).remote_addr(slot.index()))));
                for queued in &transit.queue {
                    if let Queued::Relocate { new_owner, .. } = queued {
                        claims.push((table, key, Claim::Then(*new_owner)));
                    }
                }
            }
        }
        claims.extend(core.backups().lock().leaving().map(|(table, key, to)| (table, key, Claim::Handing(to))));
        // A RELOCATE held here since the census began hands its keys over once it is over: at
        // once if held here, once arrived if on its way.
        for (_, table, key, to) in self.held_moves_of(msg::RELOCATE) {
            if dir.is_lost(to) {
                continue;
            }
            if store.table(table).slot_of(key).is_some() {
                claims.push((table, key, Claim::Handing(to)));
            } else if self.shard_ref(dir.shard_of(table, key)).transits.contains_key(&(table, key)) {
                claims.push((table, key, Claim::Then(to)));
            }
        }
        claims
    }

    /// Settles every key this node is home for after the census (see the module
    /// documentation, 4): records where each is, and for a key no live node holds or hands
    /// over, adopts the image kept here — or, when nodes await it, writes the image into the
    /// slot the first of them reserved, so that the hand-overs queued behind it go on.
    fn settle_keys(&mut self, mut claims: FastMap<(u16, u64), Vec<(u16, Claim)>>) {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let rank = dir.rank();
        let homes = dir.served_homes();
        let (mut adopted, mut written, mut lost) = (0usize, 0usize, 0usize);
        let mut arrived = Vec::new();
        // Held requests met otherwise: their nodes hold the key, or will once the hand-overs
        // under way end (node, table, key).
        let mut met: Vec<(u16, u16, u64)> = Vec::new();
        // This node's own arrivals off their chains: what queued for them goes through the
        // home — often this node — so only once every owner is recorded.
        let mut own_superseded: Vec<(u16, u32)> = Vec::new();
        // This node's own claims, as they are now (its own requests made since it reported
        // are held here, and nothing else moved meanwhile).
        for (table, key, claim) in self.claims_but_held() {
            if dir.home(table, key) == rank {
                claims.entry((table, key)).or_default().push((rank, claim));
            }
        }
        // LOCALIZE held here since the census began: their requesters' arrivals are expected
        // (the moves go once the census is over).
        let expected: std::collections::HashSet<(u16, u16, u64)> =
            self.held_moves_of(msg::LOCALIZE).into_iter().map(|(from, table, key, _)| (from, table, key)).collect();
        for table in 0..dir.tables().len() as u16 {
            let meta = &dir.tables()[table as usize];
            for &home in &homes {
                for (index, key) in meta.partitioner.home_keys(home as usize).enumerate() {
                    let mut claimed = claims.remove(&(table, key)).unwrap_or_default();
                    if store.table(table).slot_of(key).is_some() {
                        claimed.push((rank, Claim::Held));
                    }
                    let settled = root(&claimed).and_then(|root| root.map(|r| chain(&claimed, r)).transpose());
                    // A node whose LOCALIZE is held here awaits the key because of it: the
                    // move goes once the census is over, from wherever the key is then.
                    // (This node's own request held here cannot go to itself: the key lands
                    // here from the image.)
                    let head = first_arrival(&claimed, |node| expected.contains(&(node, table, key))).or_else(|| first_arrival(&claimed, |node| node != rank));
                    let rooted = settled.as_ref().is_ok_and(|s| s.is_some());
                    let chained: Vec<u16> = match &settled {
                        Ok(Some(nodes)) => nodes.clone(),
                        _ => head.and_then(|(n, _, _)| chain(&claimed, n).ok()).unwrap_or_default(),
                    };
                    for &(node, claim) in &claimed {
                        // (The root's own new arrival, if it asked for the key back, is the
                        // chain's end, not its start.)
                        let on_chain = chained.iter().skip(usize::from(rooted)).any(|&n| n == node);
                        if let Claim::Arriving(resv, _) = claim
                            && !on_chain
                            && !expected.contains(&(node, table, key))
                        {
                            if node == rank {
                                own_superseded.push((table, resv));
                            } else {
                                self.send_refusal(node, FailureCode::Superseded, table, &[resv]);
                            }
                        }
                    }
                    let root_holds = claimed.iter().any(|&(n, c)| c == Claim::Held && chained.first() == Some(&n));
                    let skip = usize::from(rooted && !root_holds);
                    for &node in chained.iter().skip(skip) {
                        if expected.contains(&(node, table, key)) {
                            met.push((node, table, key));
                        }
                    }
                    let owner = match settled {
                        Ok(Some(nodes)) => *nodes.last().unwrap_or(&LOST_OWNER),
                        Ok(None) => {
                            let image = core.backups().lock().images().get(table, home, index).map(<[u8]>::to_vec);
                            match (head, image) {
                                (None, Some(image)) => match store.adopt(table, key, &image) {
                                    Ok(true) => {
                                        core.note_written(table, key);
                                        adopted += 1;
                                        rank
                                    }
                                    Ok(false) => LOST_OWNER,
                                    Err(e) => {
                                        tracing::error!(node = rank, table, key, "could not take over a key after a loss: {e}");
                                        LOST_OWNER
                                    }
                                },
                                (None, None) => LOST_OWNER,
                                (Some((node, resv, at)), Some(image)) => {
                                    written += 1;
                                    if node == rank {
                                        met.push((rank, table, key));
                                    }
                                    self.write_image(node, table, key, resv, at, &image, &mut arrived);
                                    chained.last().copied().unwrap_or(node)
                                }
                                (Some((node, resv, _)), None) => {
                                    let error = Error::KeyLost { table: dir.table_name(table), key };
                                    self.send_localize_failed(node, &error, table, &[resv]);
                                    LOST_OWNER
                                }
                            }
                        }
                        Err(e) => {
                            tracing::error!(node = rank, table, key, "the census cannot place the key: {e}");
                            continue;
                        }
                    };
                    if owner == LOST_OWNER {
                        lost += 1;
                    }
                    dir.set_owner(table, key, owner);
                }
            }
        }
        for ((table, key), _) in claims {
            tracing::warn!(node = rank, table, key, "a census claim for a key this node does not serve");
        }
        for (table, resv) in own_superseded {
            self.send_refusal(rank, FailureCode::Superseded, table, &[resv]);
        }
        if !met.is_empty() {
            let tables = dir.tables().len();
            self.core.census().lock().drop_held_requests(|from, message| {
                let m = Move::decode(message, tables).ok()?;
                if message.first() != Some(&msg::LOCALIZE) {
                    return Some(message.to_vec());
                }
                let items: Vec<MoveItem> = (0..m.count).map(|i| m.item(i)).filter(|item| !met.contains(&(from, m.table, item.key))).collect();
                if items.is_empty() {
                    return None;
                }
                let mut out = Vec::new();
                crate::protocol::wire::encode_move(&mut out, msg::LOCALIZE, m.flags, m.table, m.new_owner, &items);
                Some(out[4..].to_vec())
            });
        }
        self.deliver_arrived(arrived);
        if adopted + written > 0 {
            core.backup_counters().note_adopted(adopted + written);
            let counters = core.backup_counters();
            counters.want(counters.round_after_now());
        }
        tracing::info!(node = rank, adopted, written, lost, "the census settled this node's keys");
    }

    /// Puts `image` of `key` into the slot `node` reserved for it (`resv`, at `at`): with a
    /// one-sided write, or here by landing it at once.
    #[allow(clippy::too_many_arguments)]
    fn write_image(&mut self, node: u16, table: u16, key: u64, resv: u32, at: RemoteAddr, image: &[u8], arrived: &mut Vec<crate::protocol::OpId>) {
        let store = self.core.store();
        let t = store.table(table);
        if image.len() != 4 * (t.value_len() + t.state_len()) {
            tracing::error!(node = self.directory().rank(), table, key, "an image of the wrong size");
            return;
        }
        if node == self.directory().rank() {
            self.land_image_here(table, key, resv, image, arrived);
            return;
        }
        let mut slot = match store.reserve(table) {
            Ok(slot) => slot,
            Err(e) => {
                tracing::error!(node = self.directory().rank(), table, key, "no slot to send a key's image from: {e}");
                return;
            }
        };
        store.reserved(&mut slot).write_all_le_bytes(image);
        self.stamp(&mut slot);
        self.send_slot(slot, table, key, node, MoveItem { key, resv, to: at });
    }

    /// Lands `image` of `key` in the slot this node reserved for it (`resv`, its shard held),
    /// as a relocation's write would: the key is published here and what queued for it goes on.
    fn land_image_here(&mut self, table: u16, key: u64, resv: u32, image: &[u8], arrived: &mut Vec<crate::protocol::OpId>) {
        let store = self.core.store();
        if let Some(slot) = self.shard_of(table, key).transits.get_mut(&(table, key)).and_then(|t| t.slot.as_mut()) {
            store.reserved(slot).write_all_le_bytes(image);
            // (No stamp: no hand-over's blocking time to measure.)
            store.stamp_outgoing(slot, 0);
        }
        self.landed(resv, arrived);
    }

    /// The items of the held moves of type `ty` (LOCALIZE or RELOCATE): (sender, table, key,
    /// new owner — the sender, for a LOCALIZE).
    fn held_moves_of(&self, ty: u8) -> Vec<(u16, u16, u64, u16)> {
        let tables = self.directory().tables().len();
        let census = self.core.census().lock();
        let mut items = Vec::new();
        for (from, message) in census.held_moves().iter().filter(|(_, m)| m.first() == Some(&ty)) {
            let Ok(m) = Move::decode(message, tables) else { continue };
            let to = if ty == msg::LOCALIZE { *from } else { m.new_owner };
            items.extend((0..m.count).map(|i| (*from, m.table, m.item(i).key, to)));
        }
        items
    }

    /// The census ended here: requests and moves go again, the moves held meanwhile first.
    fn end_census(&mut self, held: Vec<(u16, Vec<u8>)>) {
        let dir = self.directory();
        dir.set_recovering(false);
        // (Without pieces: this step cannot end to send a piece of writes and come back, and
        // a move that stopped at one would be dropped.)
        for (from, message) in held {
            let mut start = 0;
            loop {
                let handled =
                    if message[0] == msg::LOCALIZE { self.handle_localize(from, &message, start, false) } else { self.handle_relocate(&message, start, false) };
                match handled {
                    Ok(Some(next)) if next > start => start = next,
                    Ok(_) => break,
                    Err(e) => {
                        tracing::warn!(node = dir.rank(), from, "a move held during the census was refused: {e}");
                        break;
                    }
                }
            }
        }
        tracing::info!(node = dir.rank(), "the census is over");
        self.release_held_forwards();
        self.post_hand_overs();
        self.begin_backup_round_if_due();
    }

    /// The link to `node`, which left, closed before its own LEFT arrived (it was lost on its
    /// way out): the census waits for it no more.
    pub fn left_link_closed(&mut self, node: u16) -> Progress {
        if !self.try_acquire(self.all_shards()) {
            return Progress::Yield { at: 0, item: 0 };
        }
        if self.core.census().lock().note_left(node) {
            self.advance_census();
        }
        Progress::Done
    }

    /// Holds a LOCALIZE or RELOCATE from `from` (`message` from its type byte on) if a census
    /// is under way; returns whether it did. Called with the message's shards held, so that
    /// no census begins between the check and the move.
    pub(crate) fn hold_move_during_census(&mut self, from: u16, message: &[u8]) -> bool {
        if !self.core.census_active() {
            return false;
        }
        self.core.census().lock().hold_move(from, message.to_vec());
        true
    }

    /// CENSUS_FLUSH (`ty`) or CENSUS_DONE from `from`: it flushed, or settled its keys.
    pub(crate) fn handle_census_mark(&mut self, ty: u8, from: u16, body: &[u8]) -> Result<Progress> {
        let epoch = census_wire::decode_short(body)?;
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        {
            let mut census = self.core.census().lock();
            if !census.current(epoch) {
                return Ok(Progress::Done);
            }
            if ty == msg::CENSUS_FLUSH {
                census.note_flush(from);
            } else {
                census.note_done(from);
            }
        }
        self.advance_census();
        Ok(Progress::Done)
    }

    /// CENSUS from `from`: its claims on keys this node is home for.
    pub(crate) fn handle_census(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let m = CensusMessage::decode(body)?;
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        let dir = self.directory();
        let rank = dir.rank();
        {
            let mut census = self.core.census().lock();
            if !census.current(m.epoch) {
                return Ok(Progress::Done);
            }
            let mut strays = 0usize;
            for claim in m.claims(dir.nodes()) {
                let (key, claim) = claim?;
                let Some(meta) = dir.table(m.table) else {
                    return Err(Error::Protocol(format!("CENSUS of unknown table {}", m.table)));
                };
                if key >= meta.keys {
                    return Err(Error::Protocol(format!("CENSUS claim for key {key} beyond table {}", m.table)));
                }
                if dir.home(m.table, key) != rank {
                    strays += 1;
                    continue;
                }
                census.claim(from, m.table, key, claim);
            }
            if strays > 0 {
                tracing::warn!(node = rank, from, strays, "census claims for keys homed elsewhere were dropped");
            }
            if m.last {
                census.note_report(from);
            }
        }
        self.advance_census();
        Ok(Progress::Done)
    }
}

/// The first node of a chain awaiting a key no live node holds: one awaiting it that no one
/// hands it to, and whose request is not held here (`held`), with its reservation and slot.
fn first_arrival(claims: &[(u16, Claim)], held: impl Fn(u16) -> bool) -> Option<(u16, u32, RemoteAddr)> {
    claims.iter().find_map(|&(node, claim)| match claim {
        Claim::Arriving(resv, at) if !held(node) && !claims.iter().any(|&(_, c)| c == Claim::Then(node) || c == Claim::Handing(node)) => Some((node, resv, at)),
        _ => None,
    })
}
