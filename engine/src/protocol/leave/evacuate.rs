//! A graceful leave in a cluster that relocates keys (the design is in docs/ARCHITECTURE.md,
//! "A node that leaves").
//!
//! Without relocation a node's keys are its home keys, and a request for one goes to it
//! directly, so the cut (every peer's READY behind its last request) is the last write it
//! gets. With relocation, homes pass requests on to owners, and an owner that no longer holds
//! a key passes them back to its home: messages reach the leaver that no peer's cut stops.
//! So:
//!
//! 1. **It gives back**, from its ask on (before the others pause for its departure), every
//!    key of another home it holds: GIVE_BACK asks that home to take the key back, which it
//!    does as it would localize it for itself (a relocation like any other, through the
//!    hand-over and its backup round). The leaver no longer asks for keys (its workers are
//!    gone), so what arrives here still is given back on landing. It begins its last backup
//!    round only once it holds no other home's key, awaits none, hands none over and has no
//!    write out: from then on no home passes it a request, because no home records it as an
//!    owner.
//! 2. **Nodes hold what they would pass back to it as a home** once its departure is current
//!    there (and everything after such an item, in order), and send it on once the census
//!    after the leave is over, to the stand-in. An item queued here behind a hand-over, for a
//!    key that moved on at once, goes straight to the new owner instead while the home is on
//!    its way out: held, it could be overtaken by a later request of its worker that brings
//!    the key back here.
//! 3. **As a home it moves nothing once its last round began:** a LOCALIZE reaching it then is
//!    dropped. Its requester still awaits the key when the leaver is gone; the census that
//!    follows (`protocol::census`) settles the key from the image the stand-in keeps, as after
//!    a loss — into that requester's slot when no live node holds the key.
//! 4. **LEFT is followed by a census** at every other node (as a loss is), whose claims wait
//!    for the leaver's own LEFT: a relayed one may overtake the last writes the leaver sent.

use crate::error::{Error, Result};
use crate::protocol::shard::Waiters;
use crate::protocol::wire::{self, Move, MoveItem, msg};
use crate::protocol::{Progress, Step};
use crate::stats::MessageKind;
use crate::util::FastSet;
use std::sync::atomic::Ordering;

impl Step<'_, '_> {
    /// On a node leaving a cluster that relocates keys (every shard held): gives
    /// every key of another home held here back to that home (once per key), and returns
    /// whether nothing is left that its last round must wait for — no key of another home
    /// here, none on its way here, no hand-over pending and no one-sided write out.
    pub(super) fn evacuate(&mut self) -> bool {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let rank = dir.rank();
        let arriving = (0..dir.shards()).any(|s| !self.shard_ref(s).transits.is_empty());
        if arriving {
            core.departures().lock().arriving();
        }
        // Every key held here is looked at until that happened with none on its way here;
        // after that only those given back and not yet gone (O(keys) once, not per step).
        let held_elsewhere = if core.departures().lock().needs_scan() {
            let mut held = FastSet::default();
            for table in 0..dir.tables().len() as u16 {
                let t = store.table(table);
                held.extend(
                    (0..dir.tables()[table as usize].keys).filter(|&key| t.slot_of(key).is_some() && dir.home(table, key) != rank).map(|key| (table, key)),
                );
            }
            let any = !held.is_empty();
            let new = core.departures().lock().scanned(held, !arriving);
            let mut give: Vec<Vec<MoveItem>> = vec![Vec::new(); dir.nodes()];
            for group in new.chunk_by(|a, b| a.0 == b.0) {
                let table = group[0].0;
                for &(_, key) in group {
                    give[dir.home(table, key) as usize].push(MoveItem { key, resv: 0, to: Default::default() });
                }
                for (home, items) in give.iter_mut().enumerate() {
                    if !items.is_empty() {
                        core.backup_counters().note_given_back(items.len());
                        self.send_move(home as u16, msg::GIVE_BACK, 0, table, rank, items);
                        items.clear();
                    }
                }
            }
            any
        } else {
            core.departures().lock().still_given_back(|table, key| store.table(table).slot_of(key).is_some())
        };
        let handing = core.backups().lock().leaving().next().is_some();
        let writing = core.writes_out().load(Ordering::Acquire) > 0;
        !(held_elsewhere || arriving || handing || writing)
    }

    /// GIVE_BACK from `from`, a leaving node, at the home of its keys (every shard held): each
    /// key this node still records `from` as the owner of, and neither holds nor awaits, is
    /// asked for as this node's own (a reservation here, and the move as a home makes it).
    /// A key another node asked for meanwhile goes there instead, which is as good.
    pub(crate) fn handle_give_back(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let m = Move::decode(body, self.directory().tables().len())?;
        let dir = self.directory();
        let Some(meta) = dir.table(m.table) else {
            return Err(Error::Protocol(format!("GIVE_BACK of unknown table {}", m.table)));
        };
        if let Some(key) = (0..m.count).map(|i| m.item(i).key).find(|&k| k >= meta.keys) {
            return Err(Error::Protocol(format!("GIVE_BACK from node {from} for key {key} beyond table {}", m.table)));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        let core = self.core;
        let store = core.store();
        let rank = dir.rank();
        let t = store.table(m.table);
        let mut items = Vec::new();
        for i in 0..m.count {
            let key = m.item(i).key;
            if dir.home(m.table, key) != rank || dir.owner(m.table, key) != from || dir.is_lost(from) || t.slot_of(key).is_some() {
                continue;
            }
            let shard = self.shard_of(m.table, key);
            if shard.transits.contains_key(&(m.table, key)) {
                continue;
            }
            let slot = match store.reserve(m.table) {
                Ok(slot) => slot,
                Err(e) => {
                    // The key stays with the leaver, which then waits for its departure's
                    // timeout: said here, where the cause is.
                    tracing::error!(node = rank, table = m.table, key, "no slot to take a leaving node's key back in: {e}");
                    continue;
                }
            };
            items.push(self.open_transit(m.table, key, slot, Waiters::default(), false));
        }
        if !items.is_empty() {
            core.note_arrival();
            self.request_move(rank, m.table, &items, 0);
        }
        Ok(Progress::Done)
    }

    /// Whether items passed on to `home`, the home of their keys, must wait: `home` is a
    /// node whose departure is current here (not this node), in a cluster that relocates keys
    /// — or items wait already, which this one must not overtake. They then go into the
    /// departure's held forwards ([`Step::hold_forward`]).
    pub(crate) fn forwards_held_for(&self, home: u16) -> bool {
        let dir = self.directory();
        self.core.settings().relocation && home != dir.rank() && (dir.departing() == Some(home) || self.core.forwards_held().load(Ordering::Acquire))
    }

    /// Holds a forwarded ACCESS (`message`, length-prefixed) until the census after the
    /// departure current here is over.
    pub(crate) fn hold_forward(&mut self, message: Vec<u8>) {
        let mut departures = self.core.departures().lock();
        departures.hold_forward(message);
        self.core.forwards_held().store(true, Ordering::Release);
    }

    /// The census after a departure (or a loss) ended here (every shard held): the forwards
    /// held for the departed node go to their keys' homes now — this node, or the departed
    /// node's stand-in — unless a departure now current holds them again. Not sooner: what the
    /// departed node passed on before it left must reach the stand-in first, and the census
    /// ends only once every survivor had everything the departed node sent it.
    pub(crate) fn release_held_forwards(&mut self) {
        let held = {
            let mut departures = self.core.departures().lock();
            self.core.forwards_held().store(false, Ordering::Release);
            departures.take_held_forwards()
        };
        let dir = self.directory();
        let rank = dir.rank();
        for message in held {
            let body = &message[4..];
            let Ok(a) = wire::Access::decode_cached(body, |t| dir.table(t).map(|m| m.value_len), |_| None) else { continue };
            let Some(key) = (a.count > 0).then(|| a.key(0)) else { continue };
            let home = dir.home(a.table, key);
            if dir.is_lost(home) {
                // (Every node that could serve the key is gone.)
                tracing::warn!(node = rank, key, "an item held for a departure has no home left to go to");
                continue;
            }
            if self.forwards_held_for(home) {
                self.hold_forward(message);
                continue;
            }
            if home == rank {
                self.route_access_here(body, "a held item for a key homed here");
                continue;
            }
            self.tx.buf(home).extend_from_slice(&message);
            self.tx.sent(home, MessageKind::Forward, message.len());
        }
    }
}
