//! Relocation with backups: handing a key over is a write.
//!
//! The old owner's answers to pushes of a key it hands over wait for a round that began after
//! them, as any write's; but once the key has left, the old owner's rounds no longer carry it,
//! so the round that releases them must carry the key's last image — to the nodes that back
//! the key up once the *new* owner holds it ([`super::super::Directory::backup_targets_of`]),
//! and to the node that would sort the key out should the old owner be lost before the key
//! lands (its home, or the home's successor when the old owner is the home). So the old owner
//! takes the key out of service, keeps its slot, and sends the one-sided write only once a
//! round carrying that image completed ([`Step::post_hand_overs`]).
//!
//! Sending the write only then also orders every image of the key: the old owner's last image
//! is on each backup before the new owner holds the key, so anything the new owner sends of it
//! arrives later, on whatever link — a backup keeps the image that came last (see
//! [`super::Origin`] for two rounds of one node).
//!
//! The cost is one round trip to the backups on every relocation with backups (none without).

use super::wire::{ImageWriter, RUN_HEADER};
use super::{Backups, Origin, later};
use crate::protocol::Step;
use crate::protocol::wire::MoveItem;
use crate::store::Reserved;

/// A key taken out of service for a relocation, its write waiting for a round that carries its
/// last image.
#[derive(Debug)]
pub(crate) struct HandOver {
    /// The key's slot, no longer served here.
    slot: Reserved,
    table: u16,
    key: u64,
    /// The node it goes to, and that node's reservation.
    new_owner: u16,
    item: MoveItem,
    /// The key's last image here.
    image: Vec<u8>,
    /// Where the image goes (this node kept its own copy already, if it is one of them).
    targets: Vec<u16>,
    /// The round that carried the image, once one did.
    shipped: Option<u32>,
}

impl Backups {
    /// Holds `hand_over` until a round carries its image.
    fn defer(&mut self, hand_over: HandOver) {
        self.hand_overs.push(hand_over);
    }

    /// The keys of the hand-overs whose rounds completed (their writes may go).
    pub fn ready_keys(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        self.ready.iter().map(|h| (h.table, h.key))
    }

    /// Takes the hand-overs whose rounds completed and whose keys `held` says the caller's
    /// step holds the shards of: their writes go now. The others stay for a step that holds
    /// theirs.
    pub fn take_ready(&mut self, held: impl Fn(u16, u64) -> bool) -> Vec<HandOver> {
        let (taken, kept) = std::mem::take(&mut self.ready).into_iter().partition(|h| held(h.table, h.key));
        self.ready = kept;
        taken
    }

    /// Whether hand-overs wait for a step to send their writes.
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Round `number` completed: the hand-overs it (or an earlier round) carried are ready.
    pub(super) fn hand_overs_completed(&mut self, number: u32) {
        let (done, waiting): (Vec<HandOver>, Vec<HandOver>) =
            std::mem::take(&mut self.hand_overs).into_iter().partition(|h| h.shipped.is_some_and(|r| !later(r, number)));
        self.hand_overs = waiting;
        self.ready.extend(done);
    }

    /// The keys handed over and not yet written to their new owners: (table, key, new owner).
    pub fn leaving(&self) -> impl Iterator<Item = (u16, u64, u16)> + '_ {
        self.hand_overs.iter().chain(&self.ready).map(|h| (h.table, h.key, h.new_owner))
    }

    /// Takes back the hand-overs to nodes `lost` names, not yet written: their slots, tables
    /// and keys (the keys stay here).
    pub fn take_back(&mut self, lost: impl Fn(u16) -> bool) -> Vec<(Reserved, u16, u64)> {
        let mut back = Vec::new();
        for list in [&mut self.hand_overs, &mut self.ready] {
            let (gone, kept): (Vec<HandOver>, Vec<HandOver>) = std::mem::take(list).into_iter().partition(|h| lost(h.new_owner));
            *list = kept;
            back.extend(gone.into_iter().map(|h| (h.slot, h.table, h.key)));
        }
        back
    }

    /// The rounds under way were given up: their hand-overs' images go again with the next.
    pub(super) fn hand_overs_given_up(&mut self) {
        for h in &mut self.hand_overs {
            h.shipped = None;
        }
    }
}

impl Step<'_, '_> {
    /// Hands the slot of `key` (out of service here, its shard held) to `new_owner`'s
    /// reservation `item`: at once without backups, otherwise once a round carried its last
    /// image (see the module documentation).
    pub(crate) fn hand_over_slot(&mut self, mut slot: Reserved, table: u16, key: u64, new_owner: u16, item: MoveItem) {
        let core = self.core;
        if core.settings().backups == 0 {
            self.send_slot(slot, table, key, new_owner, item);
            return;
        }
        let (dir, store) = (core.directory(), core.store());
        let rank = dir.rank();
        let home = dir.home(table, key);
        let mut targets = dir.backup_targets_of(new_owner, home);
        // Should this node be lost before the key lands, the key's home sorts it out — or,
        // if this node is the home, the node that then stands in for it — from the image it
        // keeps (even when it is the new owner: the key may never land there).
        let settles = if home != rank { Some(home) } else { dir.successor(rank) };
        if let Some(node) = settles.filter(|n| !targets.contains(n)) {
            targets.push(node);
        }
        let mut image = Vec::new();
        store.reserved(&mut slot).append_all_le_bytes(&mut image);
        let meta = &dir.tables()[table as usize];
        let (start_home, index) = (meta.partitioner.home(key), meta.partitioner.home_index(key));
        let mut backups = core.backups().lock();
        let round = core.backup_counters().round_after_now();
        if targets.contains(&rank) {
            targets.retain(|&t| t != rank);
            let origin = Origin { from: rank, round };
            backups.images().keep_all(table, origin, std::iter::once((start_home as u16, index, &image[..])), |h| meta.partitioner.home_count(h as usize));
        }
        // The key's next image here (should it come back) is sent whatever its version.
        backups.sent_versions(table, start_home as u16, meta.partitioner.home_count(start_home))[index] = super::NEVER;
        backups.defer(HandOver { slot, table, key, new_owner, item, image, targets, shipped: None });
        drop(backups);
        core.backup_counters().want(round);
        self.tx.touch_backup();
        // The new owner waits for this round: begin it now (after the one under way, if any,
        // when that completes), not when the watchdog next looks.
        self.begin_backup_round_if_due();
    }

    /// Sends the writes of the hand-overs whose rounds completed, if this step can take their
    /// shards (a step that holds others leaves them to the next; the backup watchdog takes one
    /// when nothing else does).
    ///
    /// The shards come first, the hand-overs second: a hand-over is out of [`Backups`] only
    /// while this step holds its key's shard, until its write is counted out
    /// (`Core::writes_out`). So a step that holds every
    /// shard sees each relocation in one of those two places — a census taking its claims, a
    /// leaving node deciding it hands nothing over any more. (Taking them before waiting for
    /// the shards let a leaver begin its last round while 600 of its writes were in a blocked
    /// step's hands, to go out after it left.)
    pub(crate) fn post_hand_overs(&mut self) {
        let core = self.core;
        // A census after a loss sees every relocation where it is: none starts meanwhile.
        if core.census_active() {
            return;
        }
        let dir = core.directory();
        let mask = core.backups().lock().ready_keys().fold(0u64, |mask, (table, key)| mask | 1 << dir.shard_of(table, key));
        if mask == 0 {
            return;
        }
        if !self.try_acquire(mask) {
            self.tx.touch_backup();
            return;
        }
        // (A census may have begun while this step waited for the shards.)
        if core.census_active() {
            return;
        }
        let held = self.held_shards();
        let ready = core.backups().lock().take_ready(|table, key| held & 1 << dir.shard_of(table, key) != 0);
        for h in ready {
            self.send_slot(h.slot, h.table, h.key, h.new_owner, h.item);
        }
    }

    /// Ships the last images of the hand-overs no round carried yet, in round `round`
    /// (`backups` is this node's, locked). Returns how many images went and to which nodes.
    pub(super) fn ship_hand_over_images(&mut self, backups: &mut Backups, round: u32) -> (usize, Vec<u16>) {
        let dir = self.core.directory();
        let max_bytes = self.core.settings().max_message_bytes;
        let mut reached: Vec<u16> = Vec::new();
        let mut images = 0;
        let mut hand_overs = std::mem::take(&mut backups.hand_overs);
        // The message being filled: its table, its targets (it is in the first one's buffer).
        let mut open: Option<(u16, Vec<u16>, ImageWriter)> = None;
        for h in hand_overs.iter_mut().filter(|h| h.shipped.is_none()) {
            h.shipped = Some(round);
            h.targets.retain(|&t| !dir.is_lost(t));
            let Some(&first) = h.targets.first() else { continue };
            let fits = open.as_ref().is_some_and(|(table, targets, writer)| {
                *table == h.table && *targets == h.targets && writer.len(self.tx.buf(first)) + RUN_HEADER + h.image.len() <= max_bytes
            });
            if !fits {
                if let Some((_, targets, writer)) = open.take() {
                    self.finish_images(&targets, writer, false);
                }
                open = Some((h.table, h.targets.clone(), ImageWriter::backup(self.tx.buf(first), h.table, round)));
            }
            let Some((_, _, writer)) = open.as_mut() else { continue };
            let buf = self.tx.buf(first);
            writer.key(buf, h.key);
            buf.extend_from_slice(&h.image);
            images += 1;
            for &t in &h.targets {
                if !reached.contains(&t) {
                    reached.push(t);
                }
            }
        }
        if let Some((_, targets, writer)) = open {
            self.finish_images(&targets, writer, false);
        }
        backups.hand_overs = hand_overs;
        (images, reached)
    }
}

#[cfg(test)]
mod tests {
    use super::HandOver;
    use crate::protocol::tests::core_with_backups;
    use crate::protocol::wire::MoveItem;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    /// A hand-over whose round completed stays visible in `Backups` to a step that holds every
    /// shard until the step that sends its write holds the key's shard and has counted the
    /// write out: a leaver deciding that it hands nothing over any more, or a census taking
    /// its claims, cannot miss it while that step waits for the shard. (Taking the hand-overs
    /// out before waiting let a leaver begin its last round with 600 writes still to go.)
    #[test]
    fn a_ready_hand_over_is_never_out_of_sight_of_a_step_holding_every_shard() {
        let core = core_with_backups(0, 2, 1);
        let slot = core.store().reserve(0).unwrap();
        {
            let mut backups = core.backups().lock();
            let item = MoveItem { key: 3, resv: 7, to: Default::default() };
            backups.defer(HandOver { slot, table: 0, key: 3, new_owner: 1, item, image: Vec::new(), targets: Vec::new(), shipped: Some(1) });
            backups.hand_overs_completed(1);
            assert!(backups.has_ready());
        }
        let mut tx_all = core.transmit();
        let mut holder = core.step(&mut tx_all, 1);
        assert!(holder.try_acquire(holder.all_shards()));
        std::thread::scope(|s| {
            let poster = s.spawn(|| {
                let mut tx = core.transmit();
                let mut step = core.step(&mut tx, 2);
                step.post_hand_overs();
                drop(step);
                tx.poll_write().is_some()
            });
            // The poster now waits for the key's shard (given the time to get there).
            std::thread::sleep(Duration::from_millis(100));
            assert_eq!(core.backups().lock().leaving().count(), 1, "a hand-over went out of sight while its write waited for a shard");
            assert_eq!(core.writes_out().load(Ordering::Acquire), 0);
            drop(holder);
            assert!(poster.join().unwrap(), "the write went out once the shard was free");
        });
        assert_eq!(core.backups().lock().leaving().count(), 0);
        assert_eq!(core.writes_out().load(Ordering::Acquire), 1);
    }
}
