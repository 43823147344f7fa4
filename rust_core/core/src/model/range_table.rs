//! The least or greatest of any range of values in O(1), after O(n log n):
//! a sparse table, row r holding the pick of each run of 2^r values. The
//! cost model asks it for the largest backward working memory over a
//! stage's layers; the block partition for the least best time over a
//! range of cuts.

use std::marker::PhantomData;

/// Which of two values a table keeps.
pub(crate) trait Pick {
    fn pick(a: f64, b: f64) -> f64;
}

#[derive(Debug, Clone)]
pub(crate) struct Least;

impl Pick for Least {
    fn pick(a: f64, b: f64) -> f64 {
        a.min(b)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Greatest;

impl Pick for Greatest {
    fn pick(a: f64, b: f64) -> f64 {
        a.max(b)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RangeTable<P> {
    rows: Vec<Vec<f64>>,
    pick: PhantomData<P>,
}

impl<P: Pick> RangeTable<P> {
    pub(crate) fn new(values: Vec<f64>) -> Self {
        let mut rows = vec![values];
        let mut width = 1;
        while 2 * width <= rows[0].len() {
            let last = rows.last().expect("row 0");
            let next = (0..=rows[0].len() - 2 * width)
                .map(|i| P::pick(last[i], last[i + width]))
                .collect();
            rows.push(next);
            width *= 2;
        }
        RangeTable {
            rows,
            pick: PhantomData,
        }
    }

    /// The pick of values `start..end`, a range of at least one value.
    pub(crate) fn over(&self, start: usize, end: usize) -> f64 {
        debug_assert!(start < end, "an empty range {start}..{end}");
        let k = (usize::BITS - 1 - (end - start).leading_zeros()) as usize;
        P::pick(self.rows[k][start], self.rows[k][end - (1 << k)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_range_gets_its_least_and_greatest() {
        let values = vec![3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0];
        let (least, greatest) = (
            RangeTable::<Least>::new(values.clone()),
            RangeTable::<Greatest>::new(values.clone()),
        );
        for start in 0..values.len() {
            for end in start + 1..=values.len() {
                let run = values[start..end].iter().copied();
                assert_eq!(least.over(start, end), run.clone().fold(f64::MAX, f64::min));
                assert_eq!(greatest.over(start, end), run.fold(f64::MIN, f64::max));
            }
        }
    }
}
