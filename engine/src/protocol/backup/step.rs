//! The steps of backups: a round's scan and shipment, the backup's side (keep the images,
//! acknowledge the round), the acknowledgement's release of held answers, and failover's
//! adoption of a lost node's images.

use super::wire::{self as backup_wire, ImageWriter, decode_ack, decode_backup};
use super::{Backups, Origin, Released, RoundStart};
use crate::error::{Error, Result};
use crate::protocol::Step;
use crate::stats::MessageKind;

impl Step<'_, '_> {
    /// Begins a backup round: sends each of its backups the images of the slots this node
    /// serves whose version moved since the last round — of the keys in blocks writes marked,
    /// or of every key in a full round — closing with the round's last message. A round that has no
    /// backup to go to, or nothing to send, completes at once (what it would acknowledge is on
    /// the backup already) and releases the answers held for it.
    ///
    /// Returns `None` when no round may begin now (as many as may be are under way: another
    /// thread began them; see `Backups::can_begin`), or, with `only_if_due`, when no round is
    /// due (see [`Step::begin_backup_round_if_due`]): checked under the same lock that begins
    /// the round, so two threads never begin the same round.
    pub fn begin_backup_round(&mut self, only_if_due: bool) -> Option<RoundStart> {
        self.begin_round(only_if_due, false)
    }

    /// [`Step::begin_backup_round`]; `last`: the round this node leaves with (LEFT follows its
    /// completion, see [`Released`]).
    pub(crate) fn begin_round(&mut self, only_if_due: bool, last: bool) -> Option<RoundStart> {
        self.post_hand_overs();
        let core = self.core;
        let dir = core.directory();
        let mut backups = core.backups().lock();
        let targets = dir.backup_targets();
        if !backups.can_begin(&targets) || (only_if_due && !backups.round_due(&targets, core.backup_counters())) {
            return None;
        }
        let start = backups.begin(targets, core.backup_counters());
        if last {
            backups.set_last_round(start.number);
        }
        let full = backups.take_full();
        if start.targets.is_empty() {
            let released = backups.complete(start.number, core.backup_counters());
            drop(backups);
            self.release_held(released);
            return Some(start);
        }
        let targets = &start.targets;
        let mut images = 0usize;
        let homes = dir.served_homes();
        let relocation = core.settings().relocation;
        // Every node the round sends images to (with relocation, more than this node's own
        // backups): each gets the round's last message and acknowledges it.
        let mut awaiting = targets.clone();
        for table in 0..dir.tables().len() as u16 {
            let marked = core.dirty_blocks().take(table);
            let meta = &dir.tables()[table as usize];
            if relocation {
                let keys = meta.keys;
                let scan: Box<dyn Iterator<Item = u64>> =
                    if full { Box::new(0..keys) } else { Box::new(marked.into_iter().flat_map(move |first| first..(first + super::BLOCK_KEYS).min(keys))) };
                images += self.ship_images_by_home(&mut backups, targets, start.number, table, scan, &mut awaiting);
            } else if full {
                for &home in &homes {
                    let keys = meta.partitioner.home_keys(home as usize);
                    images += self.ship_images(&mut backups, targets, start.number, table, keys, meta.partitioner.home_count(home as usize));
                }
            } else {
                let most = marked.len() * super::BLOCK_KEYS as usize;
                let keys = marked.into_iter().flat_map(|first| first..(first + super::BLOCK_KEYS).min(meta.keys));
                images += self.ship_images(&mut backups, targets, start.number, table, keys, most);
            }
        }
        let (handed, reached) = self.ship_hand_over_images(&mut backups, start.number);
        images += handed;
        add_all(&mut awaiting, &reached);
        if images == 0 && backups.alone(start.number) {
            // Every version sent went out in rounds that completed (one given up forgets them
            // all): nothing to wait for. (With rounds before it under way, it goes out empty,
            // and completes after them.)
            let released = backups.complete(start.number, core.backup_counters());
            drop(backups);
            self.release_held(released);
            return Some(RoundStart { number: start.number, targets: Vec::new() });
        }
        backups.await_also(start.number, &awaiting);
        drop(backups);
        let last = ImageWriter::backup(self.tx.buf(awaiting[0]), 0, start.number);
        self.finish_images(&awaiting, last, true);
        core.backup_counters().note_images(images);
        Some(start)
    }

    /// With relocation: sends the images of those of `keys` (of `table`) held here whose
    /// version moved, each to the nodes that back it up while this node holds it — this
    /// node's own backups (`own`) for keys homed here, the key's home (and its successors) for
    /// keys away from home ([`crate::protocol::Directory::backup_targets_of`]). Adds the nodes
    /// it sent images to to `awaiting`; returns how many images went.
    fn ship_images_by_home(
        &mut self,
        backups: &mut Backups,
        own: &[u16],
        round: u32,
        table: u16,
        keys: impl Iterator<Item = u64>,
        awaiting: &mut Vec<u16>,
    ) -> usize {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let rank = dir.rank();
        let t = store.table(table);
        // Per group of keys with the same backups: the backups and the keys; the group of
        // each home, once it has one (keys homed here are group 0).
        let mut groups: Vec<(Vec<u16>, Vec<u64>)> = vec![(own.to_vec(), Vec::new())];
        let mut group_of: Vec<Option<usize>> = vec![None; dir.nodes()];
        for key in keys {
            if t.version_hint(key).is_none() {
                continue;
            }
            let home = dir.home(table, key);
            let group = if home == rank {
                0
            } else {
                *group_of[home as usize].get_or_insert_with(|| {
                    groups.push((dir.backup_targets_of(rank, home), Vec::new()));
                    groups.len() - 1
                })
            };
            groups[group].1.push(key);
        }
        let mut images = 0;
        for (targets, keys) in groups {
            if keys.is_empty() || targets.is_empty() {
                continue;
            }
            let shipped = self.ship_images(backups, &targets, round, table, keys.iter().copied(), keys.len());
            if shipped > 0 {
                add_all(awaiting, &targets);
            }
            images += shipped;
        }
        images
    }

    /// Sends each of `targets` the images of those of `keys` (of `table`) held here whose
    /// version moved since they were last sent, in messages of at most the largest message;
    /// returns how many. Each slot is copied once, under its latch, into the first target's
    /// message; the others get a copy of each message. `most`, how many keys `keys` yields at
    /// most, sizes each message's buffer once instead of growing it image by image.
    fn ship_images(&mut self, backups: &mut Backups, targets: &[u16], round: u32, table: u16, keys: impl Iterator<Item = u64>, most: usize) -> usize {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let meta = &dir.tables()[table as usize];
        let t = store.table(table);
        let image_bytes = 4 * (t.value_len() + t.state_len());
        let max_bytes = core.settings().max_message_bytes;
        let Some(&first) = targets.first() else { return 0 };
        // The message being filled (in the first target's buffer).
        let mut open: Option<ImageWriter> = None;
        let mut images = 0;
        // The versions sent of the keys of the home the last key had (keys come in runs of
        // one home), and the last run of keys of one home found.
        let mut sent: Option<(usize, &mut Vec<u32>)> = None;
        let mut run = (0, 0, 0);
        for key in keys {
            let Some(version) = t.version_hint(key) else { continue };
            let (home, index) = meta.partitioner.locate_cached(key, &mut run);
            if sent.as_ref().is_none_or(|(h, _)| *h != home) {
                sent = Some((home, backups.sent_versions(table, home as u16, meta.partitioner.home_count(home))));
            }
            let Some((_, versions)) = sent.as_mut() else { continue };
            if versions[index] == version {
                continue;
            }
            if let Some(full) = open.take_if(|w| w.len(self.tx.buf(first)) + backup_wire::RUN_HEADER + image_bytes > max_bytes) {
                self.finish_images(targets, full, false);
            }
            let writer = open.get_or_insert_with(|| {
                let buf = self.tx.buf(first);
                buf.reserve((most.saturating_sub(images) * image_bytes).min(max_bytes) + 64);
                ImageWriter::backup(buf, table, round)
            });
            let guard = store.lock(table, key);
            let Some(slot) = guard.slot() else {
                continue;
            };
            versions[index] = slot.version();
            let buf = self.tx.buf(first);
            writer.key(buf, key);
            let before = buf.len();
            slot.append_all_le_bytes(buf);
            drop(guard);
            debug_assert_eq!(buf.len() - before, image_bytes);
            images += 1;
        }
        if let Some(writer) = open {
            self.finish_images(targets, writer, false);
        }
        images
    }

    /// Closes the message `writer` wrote into the first of `targets`' buffers and sends it,
    /// and a copy of it to each other target.
    pub(super) fn finish_images(&mut self, targets: &[u16], writer: ImageWriter, last: bool) {
        let Some((&first, others)) = targets.split_first() else { return };
        let start = writer.start();
        let bytes = writer.finish(self.tx.buf(first), last);
        // (Copied before it is handed over: `sent` may pass the buffer on.)
        let message = (!others.is_empty()).then(|| self.tx.buf(first)[start..].to_vec());
        self.tx.sent(first, MessageKind::Backup, bytes);
        if let Some(message) = message {
            for &to in others {
                self.tx.buf(to).extend_from_slice(&message);
                self.tx.sent(to, MessageKind::Backup, bytes);
            }
        }
    }

    /// Begins a backup round if one is due: answers are held or a worker waits for a round
    /// that none under way covers, and another may begin. Steps that hold an answer or
    /// complete a round call it, so rounds follow one another while writes wait, without a
    /// thread to wake.
    pub fn begin_backup_round_if_due(&mut self) {
        if self.core.settings().backups > 0 {
            self.post_hand_overs();
            let _ = self.begin_backup_round(true);
        }
    }

    /// Sends held answers on (LEFT, when the round this node leaves with completed, waits for
    /// the driver to hand them over: [`Step::handed_over`]).
    pub(crate) fn release_held(&mut self, released: Released) {
        self.tx.touch_backup();
        self.note_released(!released.answers.is_empty(), released.last_round);
        let dir = self.directory();
        for held in released.answers {
            if dir.is_lost(held.origin) {
                continue;
            }
            self.tx.buf(held.origin).extend_from_slice(&held.bytes);
            self.tx.sent(held.origin, MessageKind::Response, held.bytes.len());
        }
        // The round may also have carried the last images of keys handed over.
        self.post_hand_overs();
    }

    /// Holds an encoded RESPONSE to a write (push, set, push-pull) until a round that begins
    /// after now completes: its effect is on the backup by then.
    pub(crate) fn hold_answer(&mut self, origin: u16, bytes: Vec<u8>) {
        self.core.backups().lock().hold(origin, bytes);
        self.tx.touch_backup();
        self.begin_backup_round_if_due();
    }

    /// The backup round under way is given up (its backup did not answer in time): the next
    /// round sends every image. Returns whether one was under way.
    pub fn give_up_backup_round(&mut self) -> bool {
        self.tx.touch_backup();
        self.core.backups().lock().give_up()
    }

    /// BACKUP from `from`: keeps the images of keys `from` serves (others are dropped with a
    /// warning), and acknowledges the round with its last message.
    pub(crate) fn handle_backup(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let backup = decode_backup(body, |t| {
            let tables = store.tables();
            tables.get(t as usize).map(|t| 4 * (t.value_len() + t.state_len()))
        })?;
        if !dir.failover() {
            return Err(Error::Protocol("BACKUP to a node that keeps no backups".into()));
        }
        let mut strays = 0usize;
        let origin = Origin { from, round: backup.round };
        let relocation = core.settings().relocation;
        // A joining node keeps every image: its members' view of who serves what is the one
        // it learns when it is welcomed, which may come after (see `protocol::leave`, joins).
        let joining = {
            let departures = core.departures().lock();
            departures.joins.asked() && departures.joins.joined().is_none()
        };
        if let Some(meta) = dir.table(backup.table) {
            let mut backups = core.backups().lock();
            // The last run of keys of one home found, and whether `from` serves that home.
            let (mut run, mut served) = ((0, 0, 0), None);
            backups.images().keep_all(
                backup.table,
                origin,
                backup.items().filter(|&(key, _)| key < meta.keys).filter_map(|(key, image)| {
                    let (home, index) = meta.partitioner.locate_cached(key, &mut run);
                    // With relocation, keys move: a backup keeps whatever a live node sends
                    // (the images of one key come in the order they were taken, see
                    // `handover.rs`).
                    let serves = match served {
                        Some((h, serves)) if h == home => serves,
                        _ => served.insert((home, joining || relocation || dir.stand_in(home as u16) == from)).1,
                    };
                    if !serves {
                        strays += 1;
                    }
                    serves.then_some((home as u16, index, image))
                }),
                |home| meta.partitioner.home_count(home as usize),
            );
        }
        if strays > 0 {
            tracing::warn!(node = dir.rank(), from, table = backup.table, strays, "backup images of keys the sender does not serve were dropped");
        }
        if backup.last {
            let bytes = backup_wire::encode_ack(self.tx.buf(from), backup.round);
            self.tx.sent(from, MessageKind::Backup, bytes);
        }
        Ok(())
    }

    /// BACKUP_ACK from `from`: completes the round under way if it is the one acknowledged,
    /// releasing the answers held for it.
    pub(crate) fn handle_backup_ack(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let round = decode_ack(body)?;
        let core = self.core;
        let released = core.backups().lock().handle_ack(from, round, core.backup_counters());
        if let Some(released) = released {
            self.release_held(released);
            self.begin_backup_round_if_due();
        }
        Ok(())
    }

    /// `peer` is lost (the caller holds every shard, and has marked it lost): gives up a round
    /// under way to it, drops what was held for it, and adopts the images kept of the keys
    /// that are now this node's — those of the homes `peer` served. Keys of `peer` without an
    /// image here were never backed up and are lost. `left`: `peer` left gracefully, handing
    /// every key over.
    pub(crate) fn fail_over(&mut self, peer: u16, left: bool) {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let rank = dir.rank();
        let (sets, backups_changed) = {
            let mut backups = core.backups().lock();
            if backups.handle_lost(peer) {
                self.tx.touch_backup();
            }
            // With relocation the backups of keys away from home change with their homes'
            // (and the census, not this step, takes keys over).
            let relocation = core.settings().relocation;
            let backups_changed = relocation || backups.targets_differ(&dir.backup_targets());
            if relocation {
                backups.forget_sent();
            }
            // The homes now served here that were another node's: `peer`'s, and those it had
            // taken over — but not those a join current here moves to the joining node: `peer`
            // may have handed their keys over already, and this node then hands over what it
            // kept only if the joining node lacks them (`protocol::leave`, joins). A lost
            // joining node's keys are adopted as any.
            let joining = core.departures().lock().current().and_then(crate::protocol::leave::join_of).filter(|&j| j != peer);
            let moving = |home: u16| joining.is_some_and(|j| dir.stand_in_once_joined(home, j) == j);
            let sets = if relocation { Vec::new() } else { backups.images().take(|home| home != rank && dir.stand_in(home) == rank && !moving(home)) };
            (sets, backups_changed)
        };
        let (mut adopted, mut failed) = (0usize, 0usize);
        for ((table, home), set) in sets {
            let meta = &dir.tables()[table as usize];
            let keys: Vec<u64> = meta.partitioner.home_keys(home as usize).collect();
            for (index, image) in set.iter() {
                let Some(&key) = keys.get(index) else { continue };
                match store.adopt(table, key, image) {
                    Ok(true) => {
                        adopted += 1;
                        core.dirty_blocks().mark(table, key);
                    }
                    Ok(false) => {}
                    Err(e) => {
                        failed += 1;
                        tracing::error!(node = rank, table, key, "could not take over a key of lost node {peer}: {e}");
                    }
                }
            }
        }
        if adopted + failed > 0 {
            core.backup_counters().note_adopted(adopted);
            if left {
                tracing::info!(node = rank, peer, adopted, failed, "took over the keys of a node that left");
            } else {
                tracing::warn!(node = rank, peer, adopted, failed, "took over the keys of a lost node from its backups");
            }
        }
        if adopted > 0 || backups_changed {
            // The adopted keys are on this node alone until a round ships them, and a new
            // backup has none of this node's images (the one it replaced left or was lost
            // with them): a round is due now (after the one under way, if any), not when a
            // write next asks for one.
            let counters = core.backup_counters();
            counters.want(counters.round_after_now());
        }
        // A round given up is begun again towards the new backup; the adopted keys go with it.
        self.begin_backup_round_if_due();
    }
}

/// Adds the nodes of `more` not in `set` to it.
fn add_all(set: &mut Vec<u16>, more: &[u16]) {
    for &node in more {
        if !set.contains(&node) {
            set.push(node);
        }
    }
}
