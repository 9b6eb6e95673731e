//! Intent mode across epoch boundaries: which mini-batches a worker declares when.
//!
//! A trainer that declares each batch a fixed number of clocks ahead, but only the batches of
//! the epoch it is in, declares an epoch's first batches when that epoch starts: their windows
//! start at once, the intent service acts on them while the worker already trains them, and
//! their keys are late (AdaPM, *Good Intentions*, Section 4.2: an action must complete before
//! its window starts). Logistic regression on SpamAssassin has 76 batches per worker and
//! epoch, and most of its late accesses were in the first four batches of each epoch. The
//! next epoch's order is known (it is drawn from the seed), so [`AheadCursor`] runs the
//! declarations over one stream of batches that continues from epoch to epoch: the next
//! epoch's first batches are declared during this epoch's last ones and are acted on while
//! this epoch ends and the model is evaluated.

/// Where a worker's declarations have got to in a stream of `epochs` epochs of `per_epoch`
/// batches each, batch `x` of epoch `e` (both counted from the first, epochs from 1) training
/// in clock `start + (e - 1) * per_epoch + x`: one clock per batch, none in between (barriers
/// and evaluations do not advance the clock).
#[derive(Debug, Clone)]
pub struct AheadCursor {
    start: u64,
    per_epoch: usize,
    /// Batches in the whole stream (`epochs * per_epoch`).
    total: usize,
    ahead: usize,
    /// The first batch of the stream not declared yet.
    next: usize,
}

/// One batch of the stream: its epoch (from 1), its place in the epoch, and its clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DueBatch {
    pub epoch: usize,
    pub index: usize,
    pub clock: u64,
}

impl AheadCursor {
    /// A stream starting in clock `start`, declaring `ahead` clocks early.
    pub fn new(start: u64, per_epoch: usize, epochs: usize, ahead: usize) -> Self {
        AheadCursor { start, per_epoch, total: per_epoch * epochs, ahead, next: 0 }
    }

    /// The place of batch `index` of epoch `epoch` in the stream.
    fn position(&self, epoch: usize, index: usize) -> usize {
        epoch.saturating_sub(1) * self.per_epoch + index
    }

    /// The clock batch `index` of epoch `epoch` trains in.
    pub fn clock(&self, epoch: usize, index: usize) -> u64 {
        self.start + self.position(epoch, index) as u64
    }

    /// The batches to declare now that batch `index` of epoch `epoch` is next to train: those
    /// up to `ahead` batches after it (into the next epoch when this one ends first) not
    /// declared yet, in order; none past the last epoch.
    pub fn due(&mut self, epoch: usize, index: usize) -> Vec<DueBatch> {
        let at = self.position(epoch, index);
        let through = (at + self.ahead + 1).min(self.total);
        let first = self.next.max(at);
        self.next = self.next.max(through);
        (first..through).map(|g| DueBatch { epoch: g / self.per_epoch + 1, index: g % self.per_epoch, clock: self.start + g as u64 }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_batch_is_declared_once_ahead_of_its_clock_across_epochs() {
        let (start, per_epoch, epochs, ahead) = (7, 5, 3, 3);
        let mut cursor = AheadCursor::new(start, per_epoch, epochs, ahead);
        let mut declared = Vec::new();
        for epoch in 1..=epochs {
            // Before the epoch's first batch (its barrier), then before each batch.
            declared.extend(cursor.due(epoch, 0).into_iter().map(|d| (d, cursor.clock(epoch, 0))));
            for index in 0..per_epoch {
                let now = cursor.clock(epoch, index);
                declared.extend(cursor.due(epoch, index).into_iter().map(|d| (d, now)));
            }
        }
        let batches: Vec<DueBatch> = declared.iter().map(|d| d.0).collect();
        let expected: Vec<DueBatch> =
            (1..=epochs).flat_map(|e| (0..per_epoch).map(move |x| DueBatch { epoch: e, index: x, clock: start + ((e - 1) * per_epoch + x) as u64 })).collect();
        assert_eq!(batches, expected, "each batch once, in order, with its clock");
        for (d, now) in &declared {
            let lead = d.clock - now;
            // Every batch after the first `ahead + 1` is declared exactly `ahead` clocks early,
            // also the first ones of epochs 2 and 3 (declared during the epoch before).
            let wanted = if d.clock - start <= ahead as u64 { d.clock - start } else { ahead as u64 };
            assert_eq!(lead, wanted, "{d:?} declared in clock {now}");
        }
        assert!(cursor.due(epochs, per_epoch - 1).is_empty(), "nothing past the last epoch");
    }

    #[test]
    fn an_epoch_shorter_than_the_lead_declares_several_epochs_ahead() {
        let mut cursor = AheadCursor::new(0, 2, 4, 5);
        let due = cursor.due(1, 0);
        assert_eq!(due.iter().map(|d| (d.epoch, d.index, d.clock)).collect::<Vec<_>>(), vec![(1, 0, 0), (1, 1, 1), (2, 0, 2), (2, 1, 3), (3, 0, 4), (3, 1, 5)]);
        assert_eq!(cursor.due(1, 1).iter().map(|d| d.clock).collect::<Vec<_>>(), vec![6]);
        assert_eq!(cursor.due(2, 0).iter().map(|d| d.clock).collect::<Vec<_>>(), vec![7], "the stream ends with the last epoch");
        assert!(cursor.due(4, 1).is_empty());
        // No batches at all (a worker without examples): nothing to declare.
        assert!(AheadCursor::new(0, 0, 3, 4).due(1, 0).is_empty());
    }
}
