//! A checker for per-key sequential consistency of recorded histories.
//!
//! Histories are built so that every pulled value tells exactly what it includes: values have
//! `lanes` elements; lane 0 holds the tag of the last `set` (0 for the initial value) and every
//! push adds `1.0` to a lane of its own (`1..lanes`), which a set clears. A pull therefore reveals
//! the set it reads from and the exact pushes applied since.
//!
//! Per key, a history is sequentially consistent when one total order of all its operations
//! respects every worker's program order and makes every pull return the value of the operations
//! before it. The check builds, for every set, the *segment* of the pushes observed after it and
//! the pulls that read it; a valid order must keep each segment contiguous, so the question
//! reduces to acyclicity: of the ordering constraints inside each segment (set before its pushes
//! and pulls, a pull after the pushes it includes and before those of its segment it does not),
//! and of the program order between segments (pushes no pull observed form segments of their
//! own). Both checks are linear in the history size.

use std::collections::HashMap;
use std::fmt;

/// One operation on one key, as a worker saw it.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A push of `1.0` into `lane` (unique per key, `1..lanes`).
    Push {
        /// The push's lane.
        lane: u32,
    },
    /// A set to `[tag, 0, 0, …]` (tag unique per key, above 0).
    Set {
        /// The set's tag.
        tag: u32,
    },
    /// A pull and the value it returned.
    Pull {
        /// The returned value (`lanes` elements).
        value: Vec<f32>,
    },
}

/// The value a [`Event::Set`] with `tag` writes.
pub fn set_value(tag: u32, lanes: usize) -> Vec<f32> {
    let mut v = vec![0.0; lanes];
    v[0] = tag as f32;
    v
}

/// The update a [`Event::Push`] into `lane` adds.
pub fn push_update(lane: u32, lanes: usize) -> Vec<f32> {
    let mut v = vec![0.0; lanes];
    v[lane as usize] = 1.0;
    v
}

/// Why a history is not sequentially consistent (or not well-formed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The key.
    pub key: u64,
    /// What was found.
    pub reason: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "key {}: {}", self.key, self.reason)
    }
}

impl std::error::Error for Violation {}

/// The operations on one key: one sequence per worker in program order, plus operations that
/// happened after all others in real time (final reads).
#[derive(Debug, Clone, Default)]
pub struct KeyHistory {
    /// Per worker, its operations on this key in program order.
    pub workers: Vec<Vec<Event>>,
    /// Operations that follow every other operation (e.g. reads after the run quiesced).
    pub after_all: Vec<Event>,
    /// Writes that may or may not have taken effect (their operation failed, or their node
    /// crashed before they were acknowledged): each in no program order, and not before the
    /// after-all operations either — one that never happened is as one after everything.
    pub floating: Vec<Event>,
}

/// A node of the constraint graph.
struct Op {
    kind: OpKind,
    /// Cluster (segment) this operation belongs to.
    cluster: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Push(u32),
    Set(u32),
    /// A pull and the set tag it read.
    Pull(u32),
}

/// Checks one key's history.
pub fn check_key(key: u64, history: &KeyHistory, lanes: usize) -> Result<(), Violation> {
    let fail = |reason: String| Violation { key, reason };
    // Nodes: 0 is the initial value (a set with tag 0); then every event.
    let mut ops = vec![Op { kind: OpKind::Set(0), cluster: 0 }];
    let mut pulls: Vec<(usize, u32, Vec<u32>)> = Vec::new(); // (node, tag read, lanes included)
    let mut push_node: HashMap<u32, usize> = HashMap::new();
    let mut set_node: HashMap<u32, usize> = HashMap::from([(0, 0)]);
    let mut program: Vec<(usize, usize)> = Vec::new();
    let floating: Vec<Vec<Event>> = history.floating.iter().map(|e| vec![e.clone()]).collect();
    let sequences: Vec<&Vec<Event>> = history.workers.iter().chain(&floating).chain(std::iter::once(&history.after_all)).collect();
    let mut after_all_nodes = Vec::new();
    let mut floating_nodes = Vec::new();
    for (w, seq) in sequences.iter().enumerate() {
        let is_after_all = w == sequences.len() - 1;
        let is_floating = w >= history.workers.len() && !is_after_all;
        let mut prev: Option<usize> = None;
        for e in seq.iter() {
            let id = ops.len();
            let kind = match e {
                Event::Push { lane } => {
                    if *lane == 0 || *lane as usize >= lanes || push_node.insert(*lane, id).is_some() {
                        return Err(fail(format!("push lane {lane} is invalid or used twice")));
                    }
                    OpKind::Push(*lane)
                }
                Event::Set { tag } => {
                    if *tag == 0 || set_node.insert(*tag, id).is_some() {
                        return Err(fail(format!("set tag {tag} is invalid or used twice")));
                    }
                    OpKind::Set(*tag)
                }
                Event::Pull { value } => {
                    if value.len() != lanes {
                        return Err(fail(format!("pull returned {} elements, expected {lanes}", value.len())));
                    }
                    let tag = value[0];
                    if tag < 0.0 || tag.fract() != 0.0 || tag > u32::MAX as f32 {
                        return Err(fail(format!("pull returned {tag} in the set lane")));
                    }
                    let mut included = Vec::new();
                    for (lane, &v) in value.iter().enumerate().skip(1) {
                        if v == 1.0 {
                            included.push(lane as u32);
                        } else if v != 0.0 {
                            return Err(fail(format!("pull returned {v} in lane {lane}: a push was applied twice or torn")));
                        }
                    }
                    pulls.push((id, tag as u32, included));
                    OpKind::Pull(tag as u32)
                }
            };
            ops.push(Op { kind, cluster: usize::MAX });
            if is_floating {
                floating_nodes.push(id);
            }
            if is_after_all {
                after_all_nodes.push(id);
            } else if let Some(p) = prev {
                program.push((p, id));
            }
            prev = Some(id);
        }
    }
    // Every operation precedes the after-all ones; the initial value precedes everything.
    let regular: Vec<usize> = (1..ops.len()).filter(|i| !after_all_nodes.contains(i) && !floating_nodes.contains(i)).collect();
    for &a in &after_all_nodes {
        for &r in &regular {
            program.push((r, a));
        }
    }

    // Segments: the set each pull read, and the pushes observed after each set.
    let mut segment_of_push: HashMap<u32, u32> = HashMap::new();
    for (_, tag, included) in &pulls {
        if !set_node.contains_key(tag) {
            return Err(fail(format!("a pull read set tag {tag}, which no set wrote")));
        }
        for lane in included {
            if !push_node.contains_key(lane) {
                return Err(fail(format!("a pull includes lane {lane}, which no push wrote")));
            }
            if let Some(prev) = segment_of_push.insert(*lane, *tag)
                && prev != *tag
            {
                return Err(fail(format!("push {lane} is seen after set {prev} and after set {tag}")));
            }
        }
    }
    // Assign clusters: one per set (with its observed pushes and its pulls), one per unobserved
    // push.
    let mut cluster_of_tag: HashMap<u32, usize> = HashMap::new();
    let mut clusters = 0usize;
    for op in ops.iter_mut() {
        if let OpKind::Set(tag) = op.kind {
            cluster_of_tag.insert(tag, clusters);
            op.cluster = clusters;
            clusters += 1;
        }
    }
    for op in ops.iter_mut() {
        match op.kind {
            OpKind::Push(lane) => {
                op.cluster = match segment_of_push.get(&lane) {
                    Some(tag) => cluster_of_tag[tag],
                    None => {
                        clusters += 1;
                        clusters - 1
                    }
                };
            }
            OpKind::Pull(tag) => op.cluster = cluster_of_tag[&tag],
            OpKind::Set(_) => {}
        }
    }

    // Constraints inside segments.
    let mut inner: Vec<(usize, usize)> = Vec::new();
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); clusters];
    for (id, op) in ops.iter().enumerate() {
        members[op.cluster].push(id);
    }
    for (node, tag, included) in &pulls {
        let set = set_node[tag];
        inner.push((set, *node));
        let cluster = ops[*node].cluster;
        for &m in &members[cluster] {
            if let OpKind::Push(lane) = ops[m].kind {
                if included.contains(&lane) {
                    inner.push((m, *node));
                } else {
                    inner.push((*node, m));
                }
            }
        }
    }
    for (id, op) in ops.iter().enumerate() {
        if let OpKind::Push(lane) = op.kind
            && let Some(tag) = segment_of_push.get(&lane)
        {
            inner.push((set_node[tag], id));
        }
    }
    let mut between: Vec<(usize, usize)> = Vec::new();
    for &(a, b) in &program {
        if ops[a].cluster == ops[b].cluster {
            inner.push((a, b));
        } else {
            between.push((ops[a].cluster, ops[b].cluster));
        }
    }
    if let Some(cycle) = find_cycle(ops.len(), &inner) {
        return Err(fail(format!("no order within a segment satisfies the reads: cycle through {}", describe(&ops, &cycle))));
    }
    // The initial segment comes first.
    let init = ops[0].cluster;
    for c in 0..clusters {
        if c != init {
            between.push((init, c));
        }
    }
    if let Some(cycle) = find_cycle(clusters, &between) {
        return Err(fail(format!("program order forces segments into a cycle ({} segments)", cycle.len())));
    }
    Ok(())
}

fn describe(ops: &[Op], cycle: &[usize]) -> String {
    cycle
        .iter()
        .map(|&i| match ops[i].kind {
            OpKind::Push(l) => format!("push#{l}"),
            OpKind::Set(t) => format!("set#{t}"),
            OpKind::Pull(t) => format!("pull@{i}(set#{t})"),
        })
        .collect::<Vec<_>>()
        .join(" -> ")
}

/// Returns a cycle of the directed graph, if any (iterative three-colour DFS).
fn find_cycle(nodes: usize, edges: &[(usize, usize)]) -> Option<Vec<usize>> {
    let mut adj: Vec<Vec<usize>> = vec![Vec::new(); nodes];
    for &(a, b) in edges {
        if a != b {
            adj[a].push(b);
        }
    }
    let mut colour = vec![0u8; nodes];
    let mut parent = vec![usize::MAX; nodes];
    for start in 0..nodes {
        if colour[start] != 0 {
            continue;
        }
        let mut stack = vec![(start, 0usize)];
        colour[start] = 1;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if *next < adj[node].len() {
                let to = adj[node][*next];
                *next += 1;
                match colour[to] {
                    0 => {
                        colour[to] = 1;
                        parent[to] = node;
                        stack.push((to, 0));
                    }
                    1 => {
                        let mut cycle = vec![to];
                        let mut at = node;
                        while at != to && at != usize::MAX {
                            cycle.push(at);
                            at = parent[at];
                        }
                        cycle.reverse();
                        return Some(cycle);
                    }
                    _ => {}
                }
            } else {
                colour[node] = 2;
                stack.pop();
            }
        }
    }
    None
}

/// Histories of many keys, recorded per worker.
#[derive(Debug, Clone, Default)]
pub struct History {
    keys: HashMap<u64, KeyHistory>,
    workers: usize,
}

impl History {
    /// An empty history for `workers` workers.
    pub fn new(workers: usize) -> History {
        History { keys: HashMap::new(), workers }
    }

    /// Records the next operation of `worker` on `key`.
    pub fn record(&mut self, worker: usize, key: u64, event: Event) {
        self.key_mut(key).workers[worker].push(event);
    }

    /// Records a write that may or may not have taken effect (see [`KeyHistory::floating`]).
    pub fn record_floating(&mut self, key: u64, event: Event) {
        self.key_mut(key).floating.push(event);
    }

    /// Records an operation that happened after all others (a final read).
    pub fn record_after_all(&mut self, key: u64, event: Event) {
        self.key_mut(key).after_all.push(event);
    }

    /// The history of `key`, empty for every worker the first time.
    fn key_mut(&mut self, key: u64) -> &mut KeyHistory {
        let workers = self.workers;
        self.keys.entry(key).or_insert_with(|| KeyHistory { workers: vec![Vec::new(); workers], ..KeyHistory::default() })
    }

    /// The recorded operations on `key`.
    pub fn key(&self, key: u64) -> Option<&KeyHistory> {
        self.keys.get(&key)
    }

    /// Number of recorded events.
    pub fn len(&self) -> usize {
        self.keys.values().map(|h| h.workers.iter().map(Vec::len).sum::<usize>() + h.after_all.len() + h.floating.len()).sum()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks every key; returns the first violation.
    pub fn check(&self, lanes: usize) -> Result<(), Violation> {
        let mut keys: Vec<&u64> = self.keys.keys().collect();
        keys.sort();
        for key in keys {
            check_key(*key, &self.keys[key], lanes)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: usize = 8;

    fn pull(tag: u32, lanes: &[u32]) -> Event {
        let mut value = set_value(tag, L);
        for &l in lanes {
            value[l as usize] = 1.0;
        }
        Event::Pull { value }
    }

    fn push(lane: u32) -> Event {
        Event::Push { lane }
    }

    fn set(tag: u32) -> Event {
        Event::Set { tag }
    }

    fn check(workers: Vec<Vec<Event>>) -> Result<(), Violation> {
        check_key(0, &KeyHistory { workers, ..Default::default() }, L)
    }

    #[test]
    fn accepts_sequentially_consistent_histories() {
        check(vec![vec![push(1), pull(0, &[1]), push(2)], vec![pull(0, &[]), pull(0, &[1]), pull(0, &[1, 2])]]).unwrap();
        // Stale but consistent reads are allowed: sequential consistency is not linearizability.
        check(vec![vec![push(1), push(2)], vec![pull(0, &[]), pull(0, &[1])]]).unwrap();
        check(vec![vec![push(1), set(1), push(2), pull(1, &[2])], vec![pull(0, &[1]), pull(1, &[]), pull(1, &[2])]]).unwrap();
        // An unobserved push before a set.
        check(vec![vec![push(1), set(1)], vec![pull(1, &[])]]).unwrap();
    }

    #[test]
    fn rejects_violations() {
        // A worker does not see its own push.
        assert!(check(vec![vec![push(1), pull(0, &[])]]).is_err());
        // Reads go backwards in one worker.
        assert!(check(vec![vec![push(1)], vec![pull(0, &[1]), pull(0, &[])]]).is_err());
        // Two readers disagree on the order of two pushes.
        assert!(
            check(vec![vec![push(1)], vec![push(2)], vec![pull(0, &[1])], vec![pull(0, &[2])], vec![pull(0, &[1, 2])], vec![pull(0, &[1]), pull(0, &[2])]])
                .is_err()
        );
        // Program order of two pushes inverted by a reader.
        assert!(check(vec![vec![push(1), push(2)], vec![pull(0, &[2])]]).is_err());
        // A push applied twice.
        let mut twice = set_value(0, L);
        twice[1] = 2.0;
        assert!(check(vec![vec![push(1)], vec![Event::Pull { value: twice }]]).is_err());
        // A pull that includes a push but reads from a set the pusher issued after it.
        assert!(check(vec![vec![push(1), set(1)], vec![pull(1, &[1])]]).is_err());
        // Classic SC violation between two keys-free workers on one register: each sees the
        // other's set but not its own.
        assert!(check(vec![vec![set(1), pull(2, &[])], vec![set(2), pull(1, &[])]]).is_err());
        // A push unobserved although a later read of the same worker must include it.
        assert!(check(vec![vec![pull(0, &[]), push(1), pull(0, &[])]]).is_err());
    }

    #[test]
    fn final_reads_must_be_last() {
        let h = KeyHistory { workers: vec![vec![push(1), push(2)]], after_all: vec![pull(0, &[1])], ..Default::default() };
        assert!(check_key(0, &h, L).is_err());
        let h = KeyHistory { workers: vec![vec![push(1), push(2)]], after_all: vec![pull(0, &[1, 2])], ..Default::default() };
        check_key(0, &h, L).unwrap();
    }

    #[test]
    fn floating_writes_may_or_may_not_reach_the_final_read() {
        let floating = || vec![set(1), push(3)];
        // Neither happened, or both did (the set first), or only the push.
        for (tag, lanes) in [(0, vec![2]), (1, vec![3]), (0, vec![2, 3])] {
            let h = KeyHistory { workers: vec![vec![push(2)]], after_all: vec![pull(tag, &lanes)], floating: floating() };
            check_key(0, &h, L).unwrap_or_else(|v| panic!("tag {tag} lanes {lanes:?}: {v}"));
        }
        // An acknowledged push must still be there.
        let h = KeyHistory { workers: vec![vec![push(2)]], after_all: vec![pull(0, &[3])], floating: floating() };
        assert!(check_key(0, &h, L).is_err());
    }
}

/// A push to a replicated key with the times its worker saw (nanoseconds on one clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedPush {
    /// The pushing node.
    pub node: u16,
    /// The push's lane (unique per key, `1..lanes`; it adds `1.0` there).
    pub lane: u32,
    /// When the push was issued.
    pub issued: u64,
    /// When it was acknowledged (the call returned).
    pub acked: u64,
}

/// A pull of a replicated key with its times and value.
#[derive(Debug, Clone, PartialEq)]
pub struct TimedPull {
    /// The pulling node.
    pub node: u16,
    /// When the pull was issued.
    pub start: u64,
    /// When it returned.
    pub end: u64,
    /// The value (`lanes` elements).
    pub value: Vec<f32>,
}

/// Checks one replicated key's history against the bounded-staleness guarantee (see
/// [`crate::replication`]): every pull includes each push exactly once or not at all, includes
/// every push acknowledged at least `bound_ns` before it began and every push of its own node
/// acknowledged before it began, and includes no push issued after it returned.
pub fn check_bounded_staleness(key: u64, pushes: &[TimedPush], pulls: &[TimedPull], lanes: usize, bound_ns: u64) -> Result<(), Violation> {
    let fail = |reason: String| Err(Violation { key, reason });
    let mut by_lane: HashMap<u32, &TimedPush> = HashMap::new();
    for p in pushes {
        if p.lane == 0 || p.lane as usize >= lanes || by_lane.insert(p.lane, p).is_some() {
            return fail(format!("push lane {} is out of 1..{lanes} or used twice", p.lane));
        }
    }
    for (i, pull) in pulls.iter().enumerate() {
        if pull.value.len() != lanes {
            return fail(format!("pull {i} returned {} elements, not {lanes}", pull.value.len()));
        }
        for (lane, &x) in pull.value.iter().enumerate().skip(1) {
            let included = match x {
                0.0 => false,
                1.0 => true,
                other => return fail(format!("pull {i} holds {other} in lane {lane}: a push applied more than once or partly")),
            };
            let Some(push) = by_lane.get(&(lane as u32)) else {
                if included {
                    return fail(format!("pull {i} includes lane {lane}, which no push used"));
                }
                continue;
            };
            if included && push.issued > pull.end {
                return fail(format!("pull {i} (node {}) includes the push in lane {lane}, issued after the pull returned", pull.node));
            }
            if !included && push.acked.saturating_add(bound_ns) <= pull.start {
                return fail(format!(
                    "pull {i} (node {}) misses the push in lane {lane} (node {}), acknowledged {} µs before it began (bound {} µs)",
                    pull.node,
                    push.node,
                    (pull.start - push.acked) / 1000,
                    bound_ns / 1000
                ));
            }
            if !included && push.node == pull.node && push.acked <= pull.start {
                return fail(format!("pull {i} (node {}) misses its own node's push in lane {lane}", pull.node));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod staleness_tests {
    use super::*;

    fn value(lanes: &[usize]) -> Vec<f32> {
        let mut v = vec![0.0; 4];
        for &l in lanes {
            v[l] = 1.0;
        }
        v
    }

    #[test]
    fn bounded_staleness_rules() {
        let pushes = [TimedPush { node: 1, lane: 1, issued: 0, acked: 10 }, TimedPush { node: 0, lane: 2, issued: 20, acked: 30 }];
        let pull = |start: u64, lanes: &[usize]| TimedPull { node: 0, start, end: start + 5, value: value(lanes) };
        // Within the bound a remote push may be missing, never the node's own.
        assert!(check_bounded_staleness(7, &pushes, &[pull(40, &[2])], 4, 100).is_ok());
        assert!(check_bounded_staleness(7, &pushes, &[pull(40, &[])], 4, 100).is_err());
        // Past the bound it must be there.
        assert!(check_bounded_staleness(7, &pushes, &[pull(200, &[2])], 4, 100).is_err());
        assert!(check_bounded_staleness(7, &pushes, &[pull(200, &[1, 2])], 4, 100).is_ok());
        // Nothing from the future, nothing twice, no unknown lane.
        assert!(check_bounded_staleness(7, &pushes, &[TimedPull { node: 1, start: 0, end: 5, value: value(&[2]) }], 4, 100).is_err());
        let mut twice = value(&[1]);
        twice[1] = 2.0;
        assert!(check_bounded_staleness(7, &pushes, &[TimedPull { node: 1, start: 50, end: 55, value: twice }], 4, 100).is_err());
        assert!(check_bounded_staleness(7, &pushes, &[pull(40, &[2, 3])], 4, 100).is_err());
    }
}

/// Checks one replicated key's history against the guarantee in terms of replication rounds
/// (for simulations, where time says nothing about delivery): a push of node B acknowledged at
/// `p` reaches its home by the end of B's first round that began after `p` (at once when B is
/// the home), at `c`; a pull of node A at `t` must include it when A is the home and `t > c`,
/// or when A completed a round that began after `c` before `t`, or when A is B and `p < t`.
/// Pulls include each push at most once and none issued after they returned.
/// `rounds[n]` lists node n's completed rounds as (began, completed).
pub fn check_replica_rounds(key: u64, home: u16, pushes: &[TimedPush], pulls: &[TimedPull], rounds: &[Vec<(u64, u64)>], lanes: usize) -> Result<(), Violation> {
    let fail = |reason: String| Err(Violation { key, reason });
    // When each push is applied at its home (u64::MAX: not known to be).
    let applied: Vec<u64> = pushes
        .iter()
        .map(|x| {
            if x.node == home {
                x.acked
            } else {
                rounds.get(x.node as usize).and_then(|r| r.iter().filter(|&&(began, _)| began > x.acked).map(|&(_, done)| done).min()).unwrap_or(u64::MAX)
            }
        })
        .collect();
    // Exactly-once and no-future rules are the time-based checker's with an infinite bound.
    check_bounded_staleness(key, pushes, pulls, lanes, u64::MAX)?;
    for (i, pull) in pulls.iter().enumerate() {
        for (x, &c) in pushes.iter().zip(&applied) {
            if c == u64::MAX {
                continue;
            }
            let must = (pull.node == home && pull.start > c)
                || rounds.get(pull.node as usize).is_some_and(|r| r.iter().any(|&(began, done)| began > c && done < pull.start));
            if must && pull.value.get(x.lane as usize) != Some(&1.0) {
                return fail(format!(
                    "pull {i} (node {}, t={}) misses the push in lane {} (node {}, applied at home by t={c})",
                    pull.node, pull.start, x.lane, x.node
                ));
            }
        }
    }
    Ok(())
}

/// One worker's clocks as it saw them: `started[c]` and `finished[c]` are the times (any
/// monotonic unit shared by all workers) at which it started and completed clock `c`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClockTrace {
    /// Start time of each clock, from clock 0.
    pub started: Vec<u64>,
    /// Completion time of each clock, from clock 0.
    pub finished: Vec<u64>,
}

/// Checks bounded delay on recorded clocks: no worker started clock `c` before every worker had
/// completed clock `c − τ − 1` (strictly earlier in time). With `tau = None` every history
/// passes. The violation names the worker, the clock and the worker it ran ahead of (`key` holds
/// the starting worker's index).
pub fn check_bounded_delay(workers: &[ClockTrace], tau: Option<u64>) -> Result<(), Violation> {
    let Some(tau) = tau else { return Ok(()) };
    for (w, trace) in workers.iter().enumerate() {
        if trace.finished.len() > trace.started.len() || trace.started.windows(2).any(|p| p[1] < p[0]) {
            return Err(Violation { key: w as u64, reason: format!("worker {w}'s clock trace is not well-formed") });
        }
        for (c, &start) in trace.started.iter().enumerate() {
            let Some(needed) = (c as u64).checked_sub(tau + 1) else { continue };
            for (v, other) in workers.iter().enumerate() {
                match other.finished.get(needed as usize) {
                    Some(&done) if done < start => {}
                    Some(&done) => {
                        return Err(Violation {
                            key: w as u64,
                            reason: format!("worker {w} started clock {c} at {start}, but worker {v} completed clock {needed} only at {done} (τ = {tau})"),
                        });
                    }
                    None => {
                        return Err(Violation {
                            key: w as u64,
                            reason: format!("worker {w} started clock {c} at {start}, but worker {v} never completed clock {needed} (τ = {tau})"),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod delay_tests {
    use super::*;

    fn trace(clocks: &[(u64, u64)]) -> ClockTrace {
        ClockTrace { started: clocks.iter().map(|c| c.0).collect(), finished: clocks.iter().map(|c| c.1).collect() }
    }

    #[test]
    fn bounded_delay_accepts_and_rejects() {
        // Worker 0 is fast: it starts clock 2 at 21, after worker 1 completed clock 0 at 20.
        let fast = trace(&[(0, 5), (6, 10), (21, 30)]);
        let slow = trace(&[(0, 20), (21, 40), (41, 50)]);
        assert!(check_bounded_delay(&[fast.clone(), slow.clone()], Some(1)).is_ok());
        assert!(check_bounded_delay(&[fast.clone(), slow.clone()], None).is_ok());
        // With τ = 0 worker 0 may not start clock 1 (at 6) before worker 1 completed clock 0 (20).
        let e = check_bounded_delay(&[fast.clone(), slow.clone()], Some(0)).unwrap_err();
        assert!(e.reason.contains("worker 0 started clock 1"), "{e}");
        // A worker that never completed the clock needed.
        let stuck = trace(&[(0, 3)]);
        assert!(check_bounded_delay(&[fast, ClockTrace { started: vec![0], finished: vec![] }], Some(1)).is_err());
        assert!(check_bounded_delay(&[stuck], Some(0)).is_ok());
    }
}
