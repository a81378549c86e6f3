//! The priority share rule both queue backends follow when a receive fills
//! its batch.
//!
//! A receive takes high before normal before low, so a one-time code goes
//! ahead of a marketing blast however deep the blast is. Strict priority
//! alone would let a flood of high messages stop the others for good, so
//! lower classes keep a guaranteed share: every message taken from a higher
//! class while a lower class has messages waiting earns that lower class
//! `share` of a turn, and each whole turn it has earned takes one slot of a
//! later batch. With the default share of 0.1, normal gets at least one
//! message in eleven while high is flooding, and low gets at least one in
//! eleven of everything taken above it. Credit is not banked while a class
//! has nothing waiting, so a class that was idle cannot come back with a
//! burst of old credit.

use std::sync::Mutex;

/// Number of priority classes, indexed by [`crate::model::Priority::rank`].
pub const CLASSES: usize = 3;

/// The share rule's memory for one lane: credit earned by each class.
#[derive(Debug)]
pub struct PriorityShare {
    /// Least share of received messages owed to lower classes.
    share: f64,
    /// Turns earned by class `rank` (index 0 is never used: nothing is
    /// above high).
    credit: Mutex<[f64; CLASSES]>,
}

impl PriorityShare {
    pub fn new(share: f64) -> Self {
        PriorityShare {
            share: share.clamp(0.0, 0.5),
            credit: Mutex::new([0.0; CLASSES]),
        }
    }

    /// Given how many messages each class has ready (`available[rank]`),
    /// decides how many of a batch of `max` to take from each, and records
    /// the credit that choice earns or spends.
    pub fn split(&self, available: [usize; CLASSES], max: usize) -> [usize; CLASSES] {
        let mut credit = self.credit.lock().unwrap_or_else(|e| e.into_inner());
        let mut left = available;
        let mut take = [0; CLASSES];
        for _ in 0..max {
            // A lower class that has earned a whole turn takes this slot;
            // the lowest first, since it is owed by every class above it.
            let owed = (1..CLASSES)
                .rev()
                .find(|&rank| left[rank] > 0 && credit[rank] >= 1.0);
            let rank = match owed {
                Some(rank) => {
                    credit[rank] -= 1.0;
                    rank
                }
                None => match (0..CLASSES).find(|&rank| left[rank] > 0) {
                    Some(rank) => rank,
                    None => break,
                },
            };
            left[rank] -= 1;
            take[rank] += 1;
            // Every class below the one served earns its share while it has
            // messages waiting, and forgets its credit while it has none.
            for lower in rank + 1..CLASSES {
                if available[lower] > 0 {
                    credit[lower] += self.share;
                } else {
                    credit[lower] = 0.0;
                }
            }
        }
        take
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_classes_fill_the_batch_first() {
        let rule = PriorityShare::new(0.0);
        assert_eq!(rule.split([3, 5, 5], 10), [3, 5, 2]);
        assert_eq!(rule.split([0, 0, 4], 10), [0, 0, 4]);
        assert_eq!(rule.split([0, 0, 0], 10), [0, 0, 0]);
    }

    #[test]
    fn lower_classes_keep_their_share_under_a_flood_of_high() {
        let rule = PriorityShare::new(0.1);
        let mut got = [0usize; CLASSES];
        for _ in 0..1000 {
            let take = rule.split([10, 10, 0], 10);
            for rank in 0..CLASSES {
                got[rank] += take[rank];
            }
        }
        let share = got[1] as f64 / 10_000.0;
        assert!(
            (0.085..=0.1).contains(&share),
            "normal got {share} of the receives"
        );
    }

    #[test]
    fn low_keeps_its_share_when_high_and_normal_both_flood() {
        let rule = PriorityShare::new(0.1);
        let mut got = [0usize; CLASSES];
        for _ in 0..1000 {
            let take = rule.split([10, 10, 10], 10);
            for rank in 0..CLASSES {
                got[rank] += take[rank];
            }
        }
        assert!(got[2] >= 850, "low got {got:?}");
        assert!(got[1] >= 700, "normal got {got:?}");
        assert!(got[0] > got[1] + got[2], "high got {got:?}");
    }

    #[test]
    fn an_idle_class_does_not_bank_credit() {
        let rule = PriorityShare::new(0.5);
        for _ in 0..100 {
            rule.split([10, 0, 0], 10);
        }
        // Normal had nothing waiting, so it earned nothing meanwhile.
        let take = rule.split([10, 10, 0], 10);
        assert!(take[1] <= 5, "{take:?}");
    }
}
