//! The steps of a join: the joining node's ask and its reception (welcome, images, JOINED),
//! the coordinator's begin and completion, each node's READY to the giver, and the giver's
//! hand-over (see `join.rs`).

use super::join::{GONE_BEFORE_JOIN, JOIN_BIT};
use super::wire::{decode, decode_handed, decode_joined, decode_welcome, encode, encode_handed, encode_joined, encode_welcome};
use crate::error::{Error, Result};
use crate::protocol::backup::wire::{self as image_wire, decode_backup};
use crate::protocol::directory::LOST_OWNER;
use crate::protocol::wire::msg;
use crate::protocol::{Progress, Step};
use crate::stats::MessageKind;

impl Step<'_, '_> {
    /// This node, started afresh in the rank of a node that left or was lost, asks to join
    /// (`Node::join`): it drops its home keys (whoever serves them hands their images over)
    /// and sends JOIN_ASK to `contact`, the lowest-ranked member it reached, which
    /// coordinates. Needs backups and no shared clocks, and a rank above the coordinator's (a
    /// joining node never takes coordination over). Asking twice changes nothing.
    pub fn ask_to_join(&mut self, contact: u16) -> Result<Progress> {
        let core = self.core;
        let dir = core.directory();
        let rank = dir.rank();
        if core.settings().backups == 0 {
            return Err(Error::Config(
                "a node can join only with backups (FERRY_BACKUPS=1): its keys come back from the backups of whoever serves them".into(),
            ));
        }
        if core.settings().share_clocks {
            return Err(Error::Config(
                "a node cannot join a cluster whose workers share clocks (bounded delay): they would wait for its workers' past clocks".into(),
            ));
        }
        if core.settings().relocation {
            return Err(Error::Config(
                "a node can join only a cluster that does not relocate keys, so far (Config::relocation = false; the training commands' --mode classic)".into(),
            ));
        }
        if contact >= rank || contact as usize >= dir.nodes() {
            return Err(Error::Config(format!(
                "node {rank} can join only above the coordinator, the lowest-ranked member; the lowest it reached is node {contact}"
            )));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        if !core.departures().lock().joins.ask() {
            return Ok(Progress::Done);
        }
        let store = core.store();
        for table in 0..dir.tables().len() as u16 {
            let meta = &dir.tables()[table as usize];
            for key in meta.partitioner.home_keys(rank as usize) {
                let mut guard = store.lock(table, key);
                let slot = guard.unpublish();
                drop(guard);
                if let Some(slot) = slot {
                    store.free(slot);
                }
                dir.set_owner(table, key, LOST_OWNER);
            }
        }
        dir.set_joining(rank, true);
        tracing::info!(node = rank, contact, "asking to join the cluster");
        let bytes = encode(self.tx.buf(contact), msg::JOIN_ASK, rank);
        self.tx.sent(contact, MessageKind::Membership, bytes);
        Ok(Progress::Done)
    }

    /// JOIN_ASK from `from`, at the coordinator: begins its join at every live node (see
    /// [`Step::begin_everywhere`]), or holds the ask while this node does not know yet that it
    /// coordinates, waits for a takeover's reports, or has a join queued. Needs every shard.
    pub(crate) fn handle_join_ask(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let node = decode(body)?;
        let dir = self.directory();
        if node != from || !dir.failover() {
            return Err(Error::Protocol(format!("JOIN_ASK for node {node} from node {from}")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        self.core.departures().lock().joins.asks_afresh(node);
        if !dir.is_lost(node) {
            // Its join completed here under a coordinator since lost, whose JOINED did not
            // reach it: JOINED again, with the generations it was given.
            let from_generations = self.core.barriers().lock().first_generations(node);
            let bytes = encode_joined(self.tx.buf(node), node, from_generations);
            self.tx.sent(node, MessageKind::Membership, bytes);
            return Ok(Progress::Done);
        }
        self.begin_or_hold(JOIN_BIT | node);
        Ok(Progress::Done)
    }

    /// At the coordinator, as it begins `joining`'s join: JOIN_WELCOME to the joining node,
    /// naming every node gone from the cluster.
    pub(super) fn welcome(&mut self, joining: u16) {
        let dir = self.directory();
        let gone: Vec<u16> = (0..dir.nodes() as u16).filter(|&n| n != joining && dir.is_lost(n)).collect();
        let incarnations: Vec<u8> = (0..dir.nodes() as u16).map(|n| dir.incarnation(n)).collect();
        let bytes = encode_welcome(self.tx.buf(joining), &gone, &incarnations);
        self.tx.sent(joining, MessageKind::Membership, bytes);
    }

    /// `joining`'s join is the current change here (every shard held): requests to its giver
    /// wait, and READY goes to the giver behind every request sent before — or, on the giver,
    /// the hand-over may begin.
    pub(super) fn make_join_current(&mut self, joining: u16) {
        let dir = self.directory();
        let giver = dir.stand_in(joining);
        if giver == joining {
            // No live node serves its keys (every node but this one is gone?): nothing to wait for.
            return;
        }
        // From now on the joining node is backed up to if it will be one of this node's
        // backups, and it is one before its join completes: this node's READY (without which
        // the giver hands nothing over) waits for a round to it. Otherwise a write acknowledged
        // before the join would be on backups that are not this node's once it completes, and
        // lost with this node and its other backups.
        dir.set_join_target(Some(joining));
        if giver == dir.rank() {
            dir.set_departing(None);
            self.advance_give(joining);
        } else {
            dir.set_departing(Some(giver));
            self.core.departures().lock().joins.await_round_before_ready(joining);
            self.advance_join_ready();
        }
    }

    /// Sends JOIN_READY to the giver of the join current here once the backup round it waits
    /// for completed (see [`Step::make_join_current`]): at once when the joining node will not
    /// be one of this node's backups, else after a round begun since the join became current
    /// (every round to new backups sends every image). Called again as rounds complete.
    pub(crate) fn advance_join_ready(&mut self) {
        let core = self.core;
        let dir = core.directory();
        let Some((joining, round)) = core.departures().lock().joins.ready_after() else { return };
        if dir.backup_targets().contains(&joining) {
            let round = match round {
                Some(round) => round,
                None => {
                    // (No round may begin while rounds to the backups before are under way:
                    // this is called again as they complete.)
                    let Some(start) = self.begin_backup_round(false) else { return };
                    core.departures().lock().joins.set_ready_round(start.number);
                    start.number
                }
            };
            if !core.backup_counters().completed(round) {
                return;
            }
        }
        core.departures().lock().joins.ready_sent();
        let giver = dir.stand_in(joining);
        if giver != joining && giver != dir.rank() {
            let bytes = encode(self.tx.buf(giver), msg::JOIN_READY, joining);
            self.tx.sent(giver, MessageKind::Membership, bytes);
        }
    }

    /// JOIN_READY from `from`: it sends this node, the giver of `joining`'s keys, no more
    /// requests. Needs every shard.
    pub(crate) fn handle_join_ready(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let joining = decode(body)?;
        if joining as usize >= self.directory().nodes() || joining == from {
            return Err(Error::Protocol(format!("JOIN_READY for node {joining} from node {from}")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        self.core.departures().lock().joins.note_ready(joining, from);
        self.advance_give(joining);
        Ok(Progress::Done)
    }

    /// On the giver of `joining`'s keys (every shard held): hands them over once the join is
    /// current here and every live peer is ready.
    pub(crate) fn advance_give(&mut self, joining: u16) {
        let core = self.core;
        let dir = core.directory();
        let rank = dir.rank();
        if dir.stand_in(joining) != rank || !dir.is_lost(joining) {
            return;
        }
        {
            let mut departures = core.departures().lock();
            if departures.current() != Some(JOIN_BIT | joining) || !departures.joins.wants_to_give(joining, rank, dir.nodes(), |n| !dir.is_lost(n)) {
                return;
            }
            departures.joins.mark_given(joining);
        }
        self.hand_over_to(joining);
    }

    /// The hand-over (every shard held): the keys of the homes `joining` will stand in for
    /// leave this node's store; their images go to `joining` and are kept here as its backups
    /// (this node is its successor); `joining` is a member here from now on.
    fn hand_over_to(&mut self, joining: u16) {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let rank = dir.rank();
        // The joining node hears first of every loss this node knows of: it may have learnt
        // of none since its welcome (a loss here before the hand-over was not announced to
        // it), and from now on this node routes requests to it as the others' stand-in —
        // keys it can serve only once it counts the same nodes lost (PEER_LOST precedes the
        // requests on the link, as for any member; a loss it knows already is ignored).
        for (lost, reason) in dir.lost_nodes().into_iter().filter(|&(n, _)| n != joining) {
            let incarnation = dir.incarnation(lost);
            let bytes = crate::protocol::wire::encode_peer_lost(self.tx.buf(joining), lost, incarnation, &reason);
            self.tx.sent(joining, MessageKind::Failure, bytes);
        }
        let moving: Vec<u16> =
            (0..dir.nodes() as u16).filter(|&h| h != rank && dir.stand_in(h) == rank && dir.stand_in_once_joined(h, joining) == joining).collect();
        let max_bytes = core.settings().max_message_bytes;
        let mut handed = 0usize;
        let mut backups = core.backups().lock();
        // Images kept of the moving homes: when the giver before this one was lost during the
        // join, this node kept its images of them instead of adopting them (see `fail_over`).
        let earlier = backups.images().take(|home| moving.contains(&home));
        for table in 0..dir.tables().len() as u16 {
            let meta = &dir.tables()[table as usize];
            let t = store.table(table);
            let item_bytes = image_wire::RUN_HEADER + 4 * (t.value_len() + t.state_len());
            let mut open: Option<image_wire::ImageWriter> = None;
            let mut kept: Vec<(u16, usize, Vec<u8>)> = Vec::new();
            for &home in &moving {
                let from_kept = earlier.iter().find(|(at, _)| *at == (table, home)).map(|(_, set)| set);
                for (index, key) in meta.partitioner.home_keys(home as usize).enumerate() {
                    let mut guard = store.lock(table, key);
                    let image = match guard.unpublish() {
                        Some(mut slot) => {
                            let mut image = Vec::with_capacity(item_bytes - 8);
                            store.reserved(&mut slot).append_all_le_bytes(&mut image);
                            drop(guard);
                            store.free(slot);
                            image
                        }
                        None => match from_kept.and_then(|set| set.get(index)) {
                            Some(image) => image.to_vec(),
                            None => continue,
                        },
                    };
                    let buf = self.tx.buf(joining);
                    if let Some(full) = open.take_if(|w| w.len(buf) + item_bytes > max_bytes) {
                        let bytes = full.finish(buf, false);
                        self.tx.sent(joining, MessageKind::Membership, bytes);
                    }
                    let buf = self.tx.buf(joining);
                    let writer = open.get_or_insert_with(|| image_wire::ImageWriter::begin(buf, msg::JOIN_IMAGES, table, 0));
                    writer.key(buf, key);
                    buf.extend_from_slice(&image);
                    kept.push((home, index, image));
                }
            }
            if let Some(writer) = open {
                let bytes = writer.finish(self.tx.buf(joining), false);
                self.tx.sent(joining, MessageKind::Membership, bytes);
            }
            handed += kept.len();
            // Kept as the joining node's backup: as though they came in before its first round.
            let origin = crate::protocol::backup::Origin { from: joining, round: 0 };
            backups.images().keep_all(table, origin, kept.iter().map(|(h, i, image)| (*h, *i, &image[..])), |home| meta.partitioner.home_count(home as usize));
        }
        // What this node's backup was sent of the keys that moved is stale from now on: the
        // next round sends every image of what it serves. Writes to them are on the joining
        // node and in the images kept here once it holds them: no round completes until then.
        backups.forget_sent();
        backups.close_gate(joining);
        drop(backups);
        let buf = self.tx.buf(joining);
        let bytes = image_wire::ImageWriter::begin(buf, msg::JOIN_IMAGES, 0, 0).finish(buf, true);
        self.tx.sent(joining, MessageKind::Membership, bytes);
        dir.mark_joined(joining);
        dir.set_joining(joining, true);
        core.backup_counters().note_handed(handed);
        tracing::info!(node = rank, joining, homes = ?moving, keys = handed, "handed a joining node its keys");
    }

    /// JOIN_WELCOME from the coordinator, at the joining node: the nodes gone are recorded as
    /// lost. Needs every shard.
    pub(crate) fn handle_join_welcome(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let dir = self.directory();
        let (gone, incarnations) = decode_welcome(body, dir.nodes())?;
        if !self.core.departures().lock().joins.asked() {
            return Err(Error::Protocol(format!("JOIN_WELCOME from node {from} to node {}, which did not ask to join", dir.rank())));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        let mut gave_up = false;
        for node in gone {
            // A second welcome (a new coordinator's, after a loss during the join) may name a
            // node this one counted as a member: a backup round under way to it (rounds begin
            // as soon as keys came here) is given up, as a loss gives it up.
            if dir.mark_lost(node, GONE_BEFORE_JOIN) {
                gave_up |= self.core.backups().lock().handle_lost(node);
            }
        }
        if gave_up {
            self.tx.touch_backup();
            self.begin_backup_round_if_due();
        }
        if dir.joins() == 0 {
            // Its own incarnation moves on once it joined.
            for (node, incarnation) in incarnations.into_iter().enumerate() {
                dir.set_incarnation(node as u16, incarnation);
            }
        }
        self.core.departures().lock().joins.welcome(from);
        self.report_handed();
        Ok(Progress::Done)
    }

    /// JOIN_IMAGES from the giver, at the joining node: the images become slots of this node
    /// (owned here, if homed here). Needs every shard.
    pub(crate) fn handle_join_images(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let core = self.core;
        let (dir, store) = (core.directory(), core.store());
        let images = decode_backup(body, |t| store.tables().get(t as usize).map(|t| 4 * (t.value_len() + t.state_len())))?;
        {
            let mut departures = core.departures().lock();
            if !departures.joins.asked() {
                return Err(Error::Protocol(format!("JOIN_IMAGES from node {from} to node {}, which is not joining", dir.rank())));
            }
            if departures.joins.joined().is_some() {
                // From a giver that took over from one lost during the join, after this node
                // joined with the first giver's images (which it has written to since): nothing
                // to take, but the new giver's rounds wait for JOIN_SETTLED (at once if the
                // join is settled already).
                let settled = images.last && departures.joins.note_giver(from);
                drop(departures);
                if settled {
                    self.send_settled(from);
                }
                return Ok(Progress::Done);
            }
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        if let Some(meta) = dir.table(images.table) {
            let mut failed = 0usize;
            for (key, image) in images.items().filter(|&(key, _)| key < meta.keys) {
                match store.adopt(images.table, key, image) {
                    Ok(true) => {
                        if meta.partitioner.home(key) == dir.rank() as usize {
                            dir.set_owner(images.table, key, dir.rank());
                        }
                        core.note_written(images.table, key);
                    }
                    Ok(false) => {}
                    Err(_) => failed += 1,
                }
            }
            if failed > 0 {
                tracing::error!(node = dir.rank(), from, table = images.table, failed, "could not take over keys handed to this joining node");
            }
        }
        if images.last {
            let mut departures = core.departures().lock();
            departures.joins.images_done();
            // The giver's rounds wait for JOIN_SETTLED (see `Backups::close_gate`).
            departures.joins.note_giver(from);
            drop(departures);
            self.report_handed();
        }
        Ok(Progress::Done)
    }

    /// At the joining node: JOIN_HANDED to the coordinator once welcomed and every image is here.
    fn report_handed(&mut self) {
        let rank = self.directory().rank();
        let due = self.core.departures().lock().joins.handed_due();
        if let Some((coordinator, joined)) = due {
            let bytes = encode_handed(self.tx.buf(coordinator), rank, joined);
            self.tx.sent(coordinator, MessageKind::Membership, bytes);
        }
    }

    /// At the joined node: once every live node counts it as a member, begins a backup round,
    /// and once that round completed — every key handed to it is on its own backups then —
    /// tells each node that handed it keys (JOIN_SETTLED), whose rounds were held back since.
    /// Called again as JOIN_ACKs come, rounds complete and nodes are lost.
    ///
    /// A giver's round after the hand-over no longer carries the keys it handed over, and the
    /// joined node's other backups may hold their images from before the last writes to them
    /// (with two backups: the giver's second backup is not the joined node's first). Until the
    /// joined node's own round completes, a write the giver applied just before the hand-over
    /// is on the joined node and in the giver's kept images only, so the giver acknowledges
    /// nothing before. The round begins once every live node counts the joined node: a backup
    /// that does not yet drops its images as those of a node that serves none of the keys.
    pub(crate) fn advance_join_settled(&mut self) {
        let core = self.core;
        let dir = core.directory();
        let counters = core.backup_counters();
        loop {
            let state = {
                let departures = core.departures().lock();
                departures.joins.settle_round(departures.joins.ready_in(dir))
            };
            match state {
                None => return,
                Some(None) => {
                    let round = counters.round_after_now();
                    counters.want(round);
                    core.departures().lock().joins.set_settle_round(round);
                    // (It may complete at once: no live backup, or nothing to send.)
                    self.begin_backup_round_if_due();
                }
                Some(Some(round)) => {
                    if !counters.completed(round) {
                        return;
                    }
                    let givers = core.departures().lock().joins.settle();
                    for giver in givers {
                        if !dir.is_lost(giver) {
                            self.send_settled(giver);
                        }
                    }
                    return;
                }
            }
        }
    }

    /// JOIN_SETTLED to `giver`.
    fn send_settled(&mut self, giver: u16) {
        let rank = self.directory().rank();
        let bytes = encode(self.tx.buf(giver), msg::JOIN_SETTLED, rank);
        self.tx.sent(giver, MessageKind::Membership, bytes);
    }

    /// JOIN_SETTLED from a joined node, at a node that handed it keys: they are on the joined
    /// node's backups, and the rounds held back since the hand-over complete. Needs every
    /// shard.
    pub(crate) fn handle_join_settled(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let joined = decode(body)?;
        if joined != from || !self.directory().failover() {
            return Err(Error::Protocol(format!("JOIN_SETTLED for node {joined} from node {from}")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        let released = self.core.backups().lock().open_gate(joined, self.core.backup_counters());
        if !released.answers.is_empty() || released.last_round {
            self.release_held(released);
        }
        self.begin_backup_round_if_due();
        Ok(Progress::Done)
    }

    /// JOIN_HANDED from the joining node, at the coordinator: it is a member from the next
    /// barrier generations on and JOINED goes to every live node, the joining node included.
    /// Needs every shard.
    pub(crate) fn handle_join_handed(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let (joining, joined) = decode_handed(body)?;
        let dir = self.directory();
        if joining != from || !dir.failover() {
            return Err(Error::Protocol(format!("JOIN_HANDED for node {joining} from node {from}")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        if dir.coordinator() != dir.rank() {
            return Ok(Progress::Done);
        }
        if !self.core.departures().lock().queued(JOIN_BIT | joining) {
            // Joined already (its report to an earlier coordinator came through), or
            // abandoned here after its loss.
            return Ok(Progress::Done);
        }
        // A node that joined under a coordinator since lost keeps the generations it was given.
        let from_generations = joined.unwrap_or_else(|| self.core.barriers().lock().next_generations());
        self.announce_joined(joining, from_generations);
        self.complete_join(joining, from_generations);
        Ok(Progress::Done)
    }

    /// At the coordinator: JOINED of `joining` to every live node and to `joining` itself.
    pub(super) fn announce_joined(&mut self, joining: u16, from_generations: [u32; 2]) {
        let dir = self.directory();
        self.send_to_live(&[joining], MessageKind::Membership, |out| encode_joined(out, joining, from_generations));
        if joining != dir.rank() {
            let bytes = encode_joined(self.tx.buf(joining), joining, from_generations);
            self.tx.sent(joining, MessageKind::Membership, bytes);
        }
        tracing::info!(node = dir.rank(), joining, ?from_generations, "a node joined");
    }

    /// JOINED from the coordinator: at the joining node, it is a member; elsewhere the join
    /// ends (see [`Step::complete_join`]). Needs every shard.
    pub(crate) fn handle_joined(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let (joining, from_generations) = decode_joined(body)?;
        let dir = self.directory();
        // (From the joined node itself when it coordinates now: the members below it were lost
        // after it joined, and it announces its own join again to those that missed it.)
        if joining as usize >= dir.nodes() || joining == dir.rank() && from == joining {
            return Err(Error::Protocol(format!("JOINED of node {joining} from node {from}")));
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        if joining == dir.rank() {
            let core = self.core;
            let first = core.departures().lock().joins.note_joined(from_generations);
            if first {
                dir.note_own_join();
                dir.set_joining(joining, false);
                core.barriers().lock().start_at(from_generations);
                // Its keys are on its successor already (the giver kept them): a round now
                // makes the successor's images this node's own.
                let counters = core.backup_counters();
                counters.want(counters.round_after_now());
                self.begin_backup_round_if_due();
                tracing::info!(node = dir.rank(), ?from_generations, "this node joined the cluster");
                // (The members' JOIN_ACKs may have come first.)
                self.advance_join_settled();
            }
            return Ok(Progress::Done);
        }
        self.complete_join(joining, from_generations);
        Ok(Progress::Done)
    }

    /// JOIN_ACK from `from`, at the joining node: `from` counts it as a member.
    pub(crate) fn handle_join_ack(&mut self, from: u16, body: &[u8]) -> Result<()> {
        let joining = decode(body)?;
        let mut departures = self.core.departures().lock();
        if joining != self.directory().rank() || !departures.joins.asked() {
            return Err(Error::Protocol(format!("JOIN_ACK for node {joining} from node {from}")));
        }
        departures.joins.note_ack(from);
        Ok(())
    }

    /// `peer` is lost (every shard held): at the coordinator, a join of it that is queued
    /// there is abandoned everywhere (JOIN_ABANDONED) and here.
    pub(crate) fn abandon_join_of(&mut self, peer: u16) {
        let dir = self.directory();
        let entry = JOIN_BIT | peer;
        // Remembered, should this node coordinate later and hear of a join of it from the
        // others' reports (one that its loss ended here, or that completed here before it):
        // that join is over until a fresh node in the rank asks again.
        if dir.is_lost(peer) || dir.is_joining(peer) || dir.incarnation(peer) > 0 {
            self.core.departures().lock().joins.note_lost(peer);
        }
        if dir.is_lost(peer) || dir.is_joining(peer) {
            // A rank counted gone whose connection ends: a joining node, no longer backed up
            // to; rounds that await it are given up.
            if dir.join_target() == Some(peer) {
                dir.set_join_target(None);
            }
            if self.core.backups().lock().handle_lost(peer) {
                self.tx.touch_backup();
            }
        }
        if dir.coordinator() != dir.rank() || !self.core.departures().lock().queued(entry) {
            return;
        }
        self.abandon_join(peer);
    }

    /// At the coordinator (every shard held): the join of `joining`, which was lost, is
    /// abandoned everywhere (JOIN_ABANDONED) and here.
    pub(super) fn abandon_join(&mut self, joining: u16) {
        tracing::warn!(node = self.directory().rank(), joining, "a joining node was lost; its join is abandoned");
        self.send_to_live(&[joining], MessageKind::Membership, |out| encode(out, msg::JOIN_ABANDONED, joining));
        self.join_ended_unjoined(joining);
    }

    /// `joining`'s join ended here without it joining (it was lost, or refused; every shard
    /// held): the change ends, and the images kept of the homes that were to move to it —
    /// which a loss during the join left unadopted (see `fail_over`) — are adopted now where
    /// this node stands in for them.
    pub(super) fn join_ended_unjoined(&mut self, joining: u16) {
        self.end_departure(JOIN_BIT | joining);
        if self.directory().failover() && self.directory().is_lost(joining) {
            self.fail_over(joining, false);
        }
    }

    /// At the coordinator (every shard held): refuses the join of `joining`, which ranks below
    /// it — the members below it were lost during the join, and a joining node never takes
    /// coordination over. The join is abandoned everywhere as after the joining node's loss
    /// (JOIN_ABANDONED, relayed once), the joining node is told too and stops, and where it
    /// was handed its keys (here, if this node gave them) they are taken back.
    pub(super) fn refuse_join(&mut self, joining: u16) {
        let dir = self.directory();
        tracing::warn!(node = dir.rank(), joining, "refuses a join below the coordinator: its join is abandoned");
        self.send_to_live(&[joining], MessageKind::Membership, |out| encode(out, msg::JOIN_ABANDONED, joining));
        let bytes = encode(self.tx.buf(joining), msg::JOIN_ABANDONED, joining);
        self.tx.sent(joining, MessageKind::Membership, bytes);
        if !dir.is_lost(joining) {
            let _ = self.remove_peer(joining, "its join was refused: it ranks below the coordinator", false);
        }
        self.join_ended_unjoined(joining);
    }

    /// JOIN_ABANDONED from the coordinator, or relayed: `joining` was lost before it joined.
    /// Where it was handed its keys, it is lost as any member is (its keys fail over to the
    /// images kept); its join ends. The first time, this node relays it to every other live
    /// node ahead of anything it sends them later: a request it now routes to the giver must
    /// not get there before the giver knows the join failed and takes the keys back. Needs
    /// every shard.
    pub(crate) fn handle_join_abandoned(&mut self, from: u16, body: &[u8]) -> Result<Progress> {
        let joining = decode(body)?;
        let dir = self.directory();
        if joining as usize >= dir.nodes() || joining == from {
            return Err(Error::Protocol(format!("JOIN_ABANDONED of node {joining} from node {from}")));
        }
        if joining == dir.rank() {
            // The coordinator refused this node's join (it ranks below the coordinator, whose
            // lower members were lost): it stops.
            let mut departures = self.core.departures().lock();
            if !departures.joins.asked() {
                return Err(Error::Protocol(format!("JOIN_ABANDONED of this node from node {from}, which never asked to join")));
            }
            departures.joins.give_up(format!(
                "node {from}, which coordinates now, ranks above it (the members ranked below it were lost during its join), and a joining node never coordinates"
            ));
            return Ok(Progress::Done);
        }
        if !self.try_acquire(self.all_shards()) {
            return Ok(Progress::Yield { at: 0, item: 0 });
        }
        if self.core.departures().lock().queued(JOIN_BIT | joining) {
            self.send_to_live(&[joining, from], MessageKind::Membership, |out| encode(out, msg::JOIN_ABANDONED, joining));
        }
        if !dir.is_lost(joining) {
            let _ = self.remove_peer(joining, "it was lost while it joined", false);
        }
        self.join_ended_unjoined(joining);
        Ok(Progress::Done)
    }

    /// `joining` joined (every shard held): a member from barrier generations
    /// `from_generations` on, if its join is queued here (a node that already abandoned it,
    /// having learnt of the joining node's loss, keeps it lost); the change ends.
    fn complete_join(&mut self, joining: u16, from_generations: [u32; 2]) {
        let core = self.core;
        let dir = core.directory();
        let queued = core.departures().lock().queued(JOIN_BIT | joining);
        let coordinator_before = dir.coordinator();
        dir.set_joining(joining, false);
        dir.set_join_target(None);
        if !queued {
            if !dir.is_lost(joining) {
                core.barriers().lock().admit(joining, from_generations);
            }
            return;
        }
        dir.mark_joined(joining);
        core.barriers().lock().admit(joining, from_generations);
        let bytes = encode(self.tx.buf(joining), msg::JOIN_ACK, joining);
        self.tx.sent(joining, MessageKind::Membership, bytes);
        if dir.backup_targets().contains(&joining) {
            // This node's backups changed: a full round to them now, not at the next write.
            let counters = core.backup_counters();
            counters.want(counters.round_after_now());
        }
        self.end_departure(JOIN_BIT | joining);
        self.begin_backup_round_if_due();
        let coordinator = dir.coordinator();
        if coordinator != coordinator_before && coordinator != dir.rank() {
            // The joined node ranks below every other live member (those below it were lost
            // after its join was announced) and coordinates now: it hears from this node what
            // a lost coordinator's successor would.
            self.coordinator_lost(coordinator);
            self.core.barriers().lock().coordinator_moved(dir, self.tx);
        }
    }
}
