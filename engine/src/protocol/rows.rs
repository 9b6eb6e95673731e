//! Sets of operation rows: a run (`first..first+len`, the bulk case, no per-row memory) or a
//! list.

/// Rows of an operation, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rows {
    /// `first..first + len`.
    Run {
        /// The first row.
        first: u32,
        /// Number of rows.
        len: u32,
    },
    /// Any rows.
    List(Vec<u32>),
}

impl Default for Rows {
    fn default() -> Rows {
        Rows::Run { first: 0, len: 0 }
    }
}

impl Rows {
    /// One row.
    pub fn one(row: u32) -> Rows {
        Rows::Run { first: row, len: 1 }
    }

    /// Appends a row, staying a run while rows are consecutive.
    #[inline(always)]
    pub fn push(&mut self, row: u32) {
        match self {
            Rows::Run { first, len } if *len == 0 => {
                *first = row;
                *len = 1;
            }
            Rows::Run { first, len } if *first + *len == row => *len += 1,
            Rows::List(v) => v.push(row),
            Rows::Run { first, len } => {
                // First gap: become a list.
                let mut v: Vec<u32> = (*first..*first + *len).collect();
                v.push(row);
                *self = Rows::List(v);
            }
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        match self {
            Rows::Run { len, .. } => *len as usize,
            Rows::List(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `i`.
    #[inline]
    pub fn get(&self, i: usize) -> Option<u32> {
        match self {
            Rows::Run { first, len } => ((i as u32) < *len).then(|| first + i as u32),
            Rows::List(v) => v.get(i).copied(),
        }
    }

    /// The run, when this is one.
    pub fn run(&self) -> Option<(u32, u32)> {
        match self {
            Rows::Run { first, len } => Some((*first, *len)),
            Rows::List(_) => None,
        }
    }

    /// All rows in order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let (run, list) = match self {
            Rows::Run { first, len } => (*first..*first + *len, &[][..]),
            Rows::List(v) => (0..0, &v[..]),
        };
        run.chain(list.iter().copied())
    }

    /// The first `n` rows (at least one) and the rest.
    pub fn split_at(self, n: usize) -> (Rows, Rows) {
        let n = n.max(1);
        match self {
            Rows::Run { first, len } if (len as usize) <= n => (Rows::Run { first, len }, Rows::default()),
            Rows::Run { first, len } => (Rows::Run { first, len: n as u32 }, Rows::Run { first: first + n as u32, len: len - n as u32 }),
            Rows::List(mut v) if v.len() > n => {
                let rest = v.split_off(n);
                (Rows::List(v), Rows::List(rest))
            }
            list => (list, Rows::default()),
        }
    }

    /// Splits into pieces of at most `n` rows.
    #[cfg(test)]
    pub fn chunks(&self, n: usize) -> Vec<Rows> {
        let n = n.max(1);
        match self {
            Rows::Run { first, len } => (0..*len).step_by(n).map(|start| Rows::Run { first: first + start, len: (*len - start).min(n as u32) }).collect(),
            Rows::List(v) => v.chunks(n).map(|c| Rows::List(c.to_vec())).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_stay_runs_and_lists_keep_order() {
        let mut r = Rows::default();
        for i in 5..10 {
            r.push(i);
        }
        assert_eq!(r, Rows::Run { first: 5, len: 5 });
        assert_eq!(r.chunks(2), vec![Rows::Run { first: 5, len: 2 }, Rows::Run { first: 7, len: 2 }, Rows::Run { first: 9, len: 1 }]);
        r.push(20);
        r.push(21);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![5, 6, 7, 8, 9, 20, 21]);
        assert_eq!(r.get(5), Some(20));
        assert_eq!(r.get(7), None);
        assert_eq!(r.chunks(4).iter().map(Rows::len).collect::<Vec<_>>(), vec![4, 3]);
        let mut one = Rows::default();
        one.push(3);
        assert_eq!(one, Rows::Run { first: 3, len: 1 });
        assert_eq!(Rows::default().len(), 0);
        let mut gap = Rows::one(1);
        gap.push(1);
        assert_eq!(gap.iter().collect::<Vec<_>>(), vec![1, 1]);
    }
}
