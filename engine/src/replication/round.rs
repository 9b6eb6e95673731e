//! A node's replication rounds as a state machine: no thread, clock, lock or I/O. The node's
//! replication thread and barriers drive it in the runtime (`runtime::replication`), the
//! simulator drives the same machine among its random events (see the module documentation
//! for what a round does).
//!
//! [`Rounds`] is what outlives a round: its number, whether the next one must ask for full
//! images, and when the last completed one began. [`Rounds::begin`] hands out the one
//! [`Round`] under way, which takes the driver's events — its shipment, the homes'
//! acknowledgements, lost homes, a deadline passed, the refresh reads' outcomes — and is
//! consumed by [`Rounds::end`], so that a round cannot end twice or be forgotten half-way.

use crate::error::{Error, Result};
use crate::protocol::wire::ReplicaImage;

use super::Ack;

/// One node's replication rounds (see the module documentation).
#[derive(Debug)]
pub(crate) struct Rounds {
    /// The last round's number.
    number: u32,
    /// Cluster time at which the last completed round began (0: none yet).
    last_completed_start: u64,
    /// The last round did not refresh everything (or none ran yet): the next one asks for
    /// full images. A home cuts its image when it acknowledges the shipment, whether or not
    /// this node then reads it, so after a round that missed an acknowledgement or a read
    /// only a full image brings back every slot the home changed.
    stale: bool,
}

impl Default for Rounds {
    fn default() -> Rounds {
        Rounds { number: 0, last_completed_start: 0, stale: true }
    }
}

/// The round under way: what it shipped, the acknowledgements it still waits for, and the
/// images it is to read.
#[derive(Debug)]
#[must_use = "a round ends with Rounds::end"]
pub(crate) struct Round {
    number: u32,
    /// Cluster time at which it began.
    began: u64,
    full: bool,
    /// Per message shipped, its (home, table), until acknowledged; a split shipment repeats
    /// its entry once per message.
    missing: Vec<(u16, u16)>,
    /// The images to read, in the order their acknowledgements arrived.
    images: Vec<ImageRead>,
    /// The first failure: a deadline passed, a read failed or came back torn.
    error: Option<Error>,
    /// Whether every acknowledgement came (from every home still alive).
    acknowledged: bool,
    /// Tables whose reads ended, and those one of whose reads failed.
    read: Vec<u16>,
    unrefreshed: Vec<u16>,
}

/// An image to read with one one-sided read and apply ([`super::apply_image`]).
#[derive(Debug)]
pub(crate) struct ImageRead {
    /// The home that cut it.
    pub home: u16,
    /// Its table.
    pub table: u16,
    /// Where it is and which replicas it holds.
    pub image: ReplicaImage,
}

/// How a round ended.
#[derive(Debug)]
pub(crate) struct RoundEnd {
    /// Whether every live home acknowledged it: the replicas of every table in `refreshed`
    /// include every push acknowledged before it began.
    pub complete: bool,
    /// Tables whose every refresh succeeded (meaningful when `complete`).
    pub refreshed: Vec<u16>,
    /// The round's first failure.
    pub outcome: Result<()>,
}

impl Rounds {
    /// Whether a round that began at or after cluster time `since` has completed.
    pub fn completed_since(&self, since: u64) -> bool {
        self.last_completed_start >= since && self.last_completed_start != 0
    }

    /// Begins the next round at cluster time `now`. The driver ships its deltas
    /// (`Step::ship_replica_deltas` with [`Round::number`] and [`Round::full`]) and hands
    /// what it sent to [`Round::shipped`].
    pub fn begin(&mut self, now: u64) -> Round {
        self.number = self.number.wrapping_add(1);
        Round {
            number: self.number,
            began: now,
            full: self.stale,
            missing: Vec::new(),
            images: Vec::new(),
            error: None,
            acknowledged: false,
            read: Vec::new(),
            unrefreshed: Vec::new(),
        }
    }

    /// Ends `round`: a failed one makes the next round ask for full images; a complete one
    /// (every acknowledgement in) counts as completed from the time it began.
    pub fn end(&mut self, round: Round) -> RoundEnd {
        debug_assert!(round.acknowledged || round.error.is_some(), "a round ends acknowledged or failed");
        self.stale = round.error.is_some();
        if round.acknowledged {
            self.last_completed_start = round.began.max(1);
        }
        let refreshed = if round.acknowledged { round.read.into_iter().filter(|t| !round.unrefreshed.contains(t)).collect() } else { Vec::new() };
        RoundEnd { complete: round.acknowledged, refreshed, outcome: round.error.map_or(Ok(()), Err) }
    }
}

impl Round {
    /// The round's number, carried by its deltas and their acknowledgements.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Whether the homes are to cut full images (after a failed round, or in the first).
    pub fn full(&self) -> bool {
        self.full
    }

    /// Cluster time at which the round began (the simulator records rounds by it).
    #[cfg(any(test, feature = "sim"))]
    pub fn began(&self) -> u64 {
        self.began
    }

    /// The deltas went out: one entry (home, table) per message, as `Step::ship_replica_deltas`
    /// returns them. A round that shipped nothing is acknowledged at once.
    pub fn shipped(&mut self, sent: Vec<(u16, u16)>) {
        self.missing = sent;
        self.acknowledged = self.missing.is_empty();
    }

    /// A home's acknowledgement arrived. Those of other rounds (one given up, a peer that
    /// misbehaves) and ones not waited for are dropped.
    pub fn handle_ack(&mut self, ack: Ack) {
        if ack.round != self.number || self.acknowledged {
            return;
        }
        let Some(i) = self.missing.iter().position(|&(h, t)| h == ack.from && t == ack.table) else { return };
        self.missing.swap_remove(i);
        // A split shipment is acknowledged once per message; the last one carries the image.
        if let Some(image) = ack.image {
            self.images.push(ImageRead { home: ack.from, table: ack.table, image });
        }
        self.acknowledged = self.missing.is_empty();
    }

    /// `home` is lost: its acknowledgements are no longer waited for.
    pub fn handle_lost(&mut self, home: u16) {
        self.missing.retain(|&(h, _)| h != home);
        self.acknowledged |= self.missing.is_empty();
    }

    /// The homes whose acknowledgements are still missing (each once, in order).
    pub fn waiting_for(&self) -> Vec<u16> {
        let mut homes: Vec<u16> = self.missing.iter().map(|&(h, _)| h).collect();
        homes.sort_unstable();
        homes.dedup();
        homes
    }

    /// Whether every acknowledgement the round waits for has come.
    pub fn acknowledged(&self) -> bool {
        self.acknowledged
    }

    /// The driver's deadline (`millis` after the shipment) passed with acknowledgements
    /// missing: the round fails naming the homes, and refreshes from the images that came.
    pub fn give_up(&mut self, millis: u64) {
        if self.acknowledged {
            return;
        }
        let nodes = self.waiting_for().into_iter().map(usize::from).collect();
        self.missing.clear();
        self.fail(Error::Timeout { what: "replica deltas to be acknowledged", millis, nodes });
    }

    /// The images to read now (each once): the driver reads each with one one-sided read,
    /// applies it and reports with [`Round::handle_read`].
    pub fn take_reads(&mut self) -> Vec<ImageRead> {
        std::mem::take(&mut self.images)
    }

    /// The read of `table`'s image from a home ended with `result` (a failed read, or one
    /// whose slot images were torn, is an error).
    pub fn handle_read(&mut self, table: u16, result: Result<()>) {
        if !self.read.contains(&table) {
            self.read.push(table);
        }
        if let Err(e) = result {
            if !self.unrefreshed.contains(&table) {
                self.unrefreshed.push(table);
            }
            self.fail(e);
        }
    }

    /// The round failed with `error` (the driver could not ship it, say); its first failure
    /// is the one it ends with.
    pub fn fail(&mut self, error: Error) {
        if self.error.is_none() {
            self.error = Some(error);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RemoteAddr;

    fn image() -> ReplicaImage {
        ReplicaImage { remote: RemoteAddr { region: 0, addr: 0 }, positions: vec![0] }
    }

    fn ack(from: u16, table: u16, round: u32, image: Option<ReplicaImage>) -> Ack {
        Ack { from, table, round, image }
    }

    #[test]
    fn a_round_completes_with_every_acknowledgement_and_refreshes_its_tables() {
        let mut rounds = Rounds::default();
        let mut round = rounds.begin(10);
        assert!(round.full(), "the first round asks for full images");
        round.shipped(vec![(1, 0), (1, 0), (2, 0), (2, 1)]);
        round.handle_ack(ack(1, 0, 1, None));
        round.handle_ack(ack(2, 0, 1, Some(image())));
        round.handle_ack(ack(2, 1, 2, Some(image()))); // another round's: dropped
        assert!(!round.acknowledged());
        assert_eq!(round.waiting_for(), vec![1, 2]);
        round.handle_ack(ack(1, 0, 1, Some(image())));
        round.handle_ack(ack(2, 1, 1, Some(image())));
        assert!(round.acknowledged());
        let reads = round.take_reads();
        assert_eq!(reads.iter().map(|r| (r.home, r.table)).collect::<Vec<_>>(), vec![(2, 0), (1, 0), (2, 1)]);
        for read in reads {
            round.handle_read(read.table, if read.table == 1 { Err(Error::Protocol("torn".into())) } else { Ok(()) });
        }
        let end = rounds.end(round);
        assert!(end.complete && end.outcome.is_err());
        assert_eq!(end.refreshed, vec![0]);
        assert!(rounds.completed_since(10) && !rounds.completed_since(11));
        // The failed read makes the next round ask for full images; a clean one does not.
        let mut round = rounds.begin(20);
        assert!(round.full() && round.number() == 2);
        round.shipped(Vec::new());
        assert!(round.acknowledged());
        assert!(rounds.end(round).outcome.is_ok());
        assert!(!rounds.begin(30).full());
    }

    #[test]
    fn a_round_given_up_fails_naming_the_homes_and_the_next_asks_for_full_images() {
        let mut rounds = Rounds::default();
        let mut first = rounds.begin(1);
        first.shipped(Vec::new());
        assert!(rounds.end(first).outcome.is_ok());
        let mut round = rounds.begin(5);
        assert!(!round.full());
        round.shipped(vec![(1, 0), (3, 0), (4, 0)]);
        round.handle_ack(ack(1, 0, 2, Some(image())));
        round.handle_lost(4);
        round.give_up(60_000);
        assert_eq!(round.take_reads().len(), 1, "the images that came are read");
        let end = rounds.end(round);
        assert!(!end.complete && end.refreshed.is_empty());
        match end.outcome {
            Err(Error::Timeout { nodes, millis, .. }) => assert_eq!((nodes, millis), (vec![3], 60_000)),
            other => panic!("{other:?}"),
        }
        assert!(!rounds.completed_since(5), "a round given up has not completed");
        assert!(rounds.begin(9).full(), "after a round given up the homes cut full images");
    }

    #[test]
    fn a_round_whose_homes_are_all_lost_is_acknowledged() {
        let mut rounds = Rounds::default();
        let mut round = rounds.begin(1);
        round.shipped(vec![(1, 0), (1, 1)]);
        round.handle_lost(1);
        assert!(round.acknowledged() && round.waiting_for().is_empty());
        assert!(rounds.end(round).complete);
    }
}
