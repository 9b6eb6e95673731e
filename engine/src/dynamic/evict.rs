//! Eviction of a dynamic table's ids ([`Eviction`]): a home takes back the slot keys of ids no
//! node has used lately, so that new ids keep finding room in a bounded table.
//!
//! A slot key can be handed to a new id only once no node maps the old id to it and no
//! operation in flight uses it. A home therefore evicts in **rounds**, a distributed CLOCK with
//! a second chance:
//!
//! 1. The home offers ids of its range (its clock hand goes round its slots): those its own
//!    workers used since the last look get a second chance, the others leave its index and wait
//!    in the round ([`super::IdIndex::offer_round`]). An ASSIGN that names one meanwhile
//!    *rescues* it: the asker gets the same slot key and the id stays.
//! 2. Every node (the home too) is offered the ids (EVICT): those its workers used since its
//!    last look stay in its index (and lose their mark), the others leave it
//!    ([`super::IdIndex::offer`]). It then waits for a **grace period** ([`Pins`]): until every
//!    worker operation that began before the ids left has ended, so that nothing still uses a
//!    slot key it looked up.
//! 3. After the grace period, a node answers (EVICTED) with the ids it keeps: those still in its
//!    index (used, or learnt again meanwhile) and those whose slot it holds (moved to it).
//! 4. With every live node's answer ([`Evictor`]), the home frees the slots of the ids nobody
//!    kept, if it holds them (a slot moved away stays its id's), and writes them back to zeros
//!    with a fresh optimizer state; the next new id takes one and gets its initial value.
//!
//! The intent service moves and replicates slot keys without going through ids, so a slot key
//! that some node intends is in use: its home does not offer its id, an intent or a granted
//! move that arrives during a round rescues it, one for a free slot key is not acted on, and a
//! node keeps an id whose slot it has a run-time replica of (`protocol::evict`,
//! `protocol::intent`).
//!
//! So an evicted id reads as a new id afterwards, wherever it is touched next. A round costs one
//! EVICT and one EVICTED per node, eight bytes per id offered and per id kept; the mark costs a
//! worker one store to a line its lookup already read, once per round per id.

use crate::util::{FastMap, FastSet};

/// When a dynamic table's homes evict ids ([`crate::TableSpec::evicting`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Eviction {
    /// Never: a full home refuses new ids ([`crate::Error::TableFull`]).
    #[default]
    Never,
    /// When a home's free slot keys fall to a sixteenth of its capacity, it evicts the ids used
    /// least often lately (an approximate least-frequently-used with aging: each node counts an
    /// id's uses up to 15, summed at the home as rounds close). While a home is short of room
    /// it admits a new id only if a sketch of past uses says it was used more than the ids it
    /// evicted last (TinyLFU's admission). A new id that finds its home full, or is not used
    /// enough, is not admitted yet (pulls read its initial value, pushes are dropped) rather
    /// than failing.
    Lfu,
    /// As [`Eviction::Lfu`], and besides a round every `millis` milliseconds that evicts the
    /// ids no node used since the last such round: an id unused for the time to live is
    /// evicted within two to four times it (a node's uses count until the home's round after
    /// next asks for them).
    Ttl {
        /// The time to live of an unused id, in milliseconds.
        millis: u64,
    },
}

impl Eviction {
    /// The rule as [`Eviction::from_str`](std::str::FromStr) reads it.
    pub fn name(&self) -> String {
        match self {
            Eviction::Never => "never".into(),
            Eviction::Lfu => "lfu".into(),
            Eviction::Ttl { millis } => format!("ttl:{}", *millis as f64 / 1000.0),
        }
    }

    /// Whether ids are evicted at all.
    pub fn evicts(&self) -> bool {
        *self != Eviction::Never
    }

    /// The time to live, if any, in milliseconds.
    pub fn ttl_millis(&self) -> Option<u64> {
        match self {
            Eviction::Ttl { millis } => Some(*millis),
            _ => None,
        }
    }
}

impl std::str::FromStr for Eviction {
    type Err = String;

    /// `never`, `lfu` or `ttl:SECONDS` (a millisecond at least).
    fn from_str(s: &str) -> Result<Eviction, String> {
        match s.trim().split_once(':') {
            None if s.trim() == "never" => Ok(Eviction::Never),
            None if s.trim() == "lfu" => Ok(Eviction::Lfu),
            Some(("ttl", secs)) => {
                let secs: f64 = secs.parse().map_err(|_| format!("'{s}': the time to live '{secs}' is not a number of seconds"))?;
                if !(0.001..=1e9).contains(&secs) {
                    return Err(format!("'{s}': the time to live must be from 0.001 to 1e9 seconds"));
                }
                Ok(Eviction::Ttl { millis: (secs * 1000.0).round() as u64 })
            }
            _ => Err(format!("'{s}': expected never, lfu or ttl:SECONDS")),
        }
    }
}

/// Ids a home offers in one round at most (an EVICT of 1 MiB).
pub(crate) const ROUND_IDS: usize = 65_536;

/// A home's eviction rounds of one table: which round is open, and who has answered it. Fed
/// the round's start, the nodes' answers and losses; says when the round is complete and which
/// ids a node kept. No I/O, no clock, no lock.
#[derive(Debug, Default)]
pub(crate) struct Evictor {
    rounds: u32,
    open: Option<OpenRound>,
}

#[derive(Debug)]
struct OpenRound {
    number: u32,
    /// Ranks whose answer the round waits for.
    waiting: FastSet<u16>,
    /// Ids some node kept, with the uses the nodes that kept them counted.
    kept: FastMap<u64, u64>,
}

impl Evictor {
    /// Whether a round is open.
    pub fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// Opens a round that waits for the answers of `members` (every live node, this one too);
    /// returns its number.
    pub fn begin(&mut self, members: impl IntoIterator<Item = u16>) -> u32 {
        debug_assert!(self.open.is_none(), "an eviction round begun while one is open");
        self.rounds = self.rounds.wrapping_add(1);
        self.open = Some(OpenRound { number: self.rounds, waiting: members.into_iter().collect(), kept: FastMap::default() });
        self.rounds
    }

    /// Node `from` answered round `round`, keeping `kept` (ids with the uses it counted).
    /// Returns the ids kept by any node, with their uses summed, once every node answered (the
    /// round is then closed). An answer to a round that is not open, or a second answer, is
    /// ignored.
    pub fn answer(&mut self, from: u16, round: u32, kept: impl IntoIterator<Item = (u64, u64)>) -> Option<FastMap<u64, u64>> {
        let open = self.open.as_mut().filter(|o| o.number == round)?;
        if !open.waiting.remove(&from) {
            return None;
        }
        for (id, uses) in kept {
            let sum = open.kept.entry(id).or_default();
            *sum = sum.saturating_add(uses);
        }
        self.close_if_answered()
    }

    /// Node `node` is lost (or left): the open round no longer waits for it (what it mapped
    /// went with it). Returns the ids kept if that completes the round.
    pub fn lost(&mut self, node: u16) -> Option<FastMap<u64, u64>> {
        let open = self.open.as_mut()?;
        if !open.waiting.remove(&node) {
            return None;
        }
        self.close_if_answered()
    }

    fn close_if_answered(&mut self) -> Option<FastMap<u64, u64>> {
        if self.open.as_ref().is_some_and(|o| o.waiting.is_empty()) {
            return self.open.take().map(|o| o.kept);
        }
        None
    }
}

/// A node's answer to one round, waiting for its grace period: the home and table, the round,
/// the ids offered with their slot keys, and the epoch the workers must all have passed.
#[derive(Debug)]
pub(crate) struct Grace {
    /// The home that offered the ids.
    pub home: u16,
    /// The table.
    pub table: u16,
    /// The home's round.
    pub round: u32,
    /// The ids offered, with their slot keys.
    pub offered: Vec<(u64, u64)>,
    /// The epoch every worker must be idle in or past.
    pub epoch: u64,
}

/// A pin's value while its worker runs no operation on an evicting table.
const IDLE: u64 = u64::MAX;

/// The grace periods of a node's evictions: an epoch counter and, per worker, the epoch in
/// which its operation on an evicting table began (epoch-based reclamation). A node that
/// removes ids from its index advances the epoch; once every worker is idle or pinned in the
/// new epoch, no operation that could have looked the ids up is still running.
#[derive(Default)]
pub(crate) struct Pins {
    epoch: std::sync::atomic::AtomicU64,
    pins: parking_lot::Mutex<Vec<std::sync::Weak<std::sync::atomic::AtomicU64>>>,
}

/// One worker's pin ([`Pins::register`]).
pub(crate) type Pin = std::sync::Arc<std::sync::atomic::AtomicU64>;

impl Pins {
    /// A pin for a new worker, idle.
    pub fn register(&self) -> Pin {
        let pin = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(IDLE));
        let mut pins = self.pins.lock();
        pins.retain(|p| p.strong_count() > 0);
        pins.push(std::sync::Arc::downgrade(&pin));
        pin
    }

    /// Pins `pin` in the current epoch, before its worker looks ids up. The pin is published
    /// before the lookup (sequentially consistent): a node that removes ids and then advances
    /// the epoch either sees the pin or is seen by the lookup.
    #[inline]
    pub fn pin(&self, pin: &Pin) {
        use std::sync::atomic::Ordering::SeqCst;
        if pin.load(std::sync::atomic::Ordering::Relaxed) == IDLE {
            pin.store(self.epoch.load(SeqCst), SeqCst);
        }
    }

    /// Its worker has no operation on an evicting table left.
    #[inline]
    pub fn unpin(pin: &Pin) {
        pin.store(IDLE, std::sync::atomic::Ordering::Release);
    }

    /// Advances the epoch, after ids left the index; returns the epoch the workers must reach.
    pub fn advance(&self) -> u64 {
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
    }

    /// Whether every worker is idle or pinned in `epoch` or later.
    pub fn passed(&self, epoch: u64) -> bool {
        self.pins.lock().iter().filter_map(std::sync::Weak::upgrade).all(|p| p.load(std::sync::atomic::Ordering::SeqCst) >= epoch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round closes with every member's answer, or its loss, and gathers what any kept;
    /// stray and repeated answers change nothing.
    #[test]
    fn a_round_closes_when_every_member_answered() {
        let mut e = Evictor::default();
        let round = e.begin([0, 1, 2]);
        assert!(e.is_open());
        assert_eq!(e.answer(1, round + 1, [(9, 1)]), None, "another round's answer");
        assert_eq!(e.answer(1, round, [(5, 2)]), None);
        assert_eq!(e.answer(1, round, [(6, 1)]), None, "a second answer");
        assert_eq!(e.answer(0, round, [(5, 3)]), None);
        let kept = e.lost(2).expect("the loss completes the round");
        assert_eq!(kept, [(5, 5)].into_iter().collect(), "uses summed over the nodes that kept it");
        assert!(!e.is_open());
        let next = e.begin([0]);
        assert_ne!(next, round);
        assert_eq!(e.answer(0, next, [(7, 0)]), Some([(7, 0)].into_iter().collect()));
    }

    /// A grace period ends once every worker pinned before the epoch advanced is idle again.
    #[test]
    fn a_grace_period_waits_for_workers_pinned_before_it() {
        let pins = Pins::default();
        let (a, b) = (pins.register(), pins.register());
        pins.pin(&a);
        let epoch = pins.advance();
        pins.pin(&b);
        assert!(!pins.passed(epoch), "a was pinned before the epoch advanced");
        Pins::unpin(&a);
        assert!(pins.passed(epoch), "b was pinned after");
        drop(b);
        pins.pin(&a);
        assert!(pins.passed(epoch));
        assert!(!pins.passed(pins.advance()));
    }

    /// Rules read back as written; bad ones are refused with what is wrong.
    #[test]
    fn rules_parse() {
        for text in ["never", "lfu", "ttl:2.5"] {
            assert_eq!(text.parse::<Eviction>().unwrap().name(), text);
        }
        assert_eq!("ttl:60".parse::<Eviction>().unwrap(), Eviction::Ttl { millis: 60_000 });
        for (text, says) in [("ttl:0", "from 0.001"), ("ttl:x", "not a number"), ("sometimes", "expected never"), ("lfu:1", "expected never")] {
            let e = text.parse::<Eviction>().unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
