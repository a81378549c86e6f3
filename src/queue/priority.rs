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

/// The share rule's state: credit earned by each class. Used one slot at a
/// time: [`ShareCredit::pick`] says which class the next slot goes to, and
/// [`ShareCredit::record`] books the choice.
#[derive(Debug, Clone)]
pub struct ShareCredit {
    /// Least share of slots owed to lower classes.
    share: f64,
    /// Turns earned by class `rank` (index 0 is never used: nothing is
    /// above high).
    credit: [f64; CLASSES],
}

impl ShareCredit {
    pub fn new(share: f64) -> Self {
        ShareCredit {
            share: share.clamp(0.0, 0.5),
            credit: [0.0; CLASSES],
        }
    }

    /// The class the next slot goes to, given which classes have something
    /// waiting: a lower class that has earned a whole turn (the lowest
    /// first, since every class above it owes it), else the highest class
    /// waiting. `None` when nothing waits.
    pub fn pick(&self, waiting: [bool; CLASSES]) -> Option<usize> {
        (1..CLASSES)
            .rev()
            .find(|&rank| waiting[rank] && self.credit[rank] >= 1.0)
            .or_else(|| (0..CLASSES).find(|&rank| waiting[rank]))
    }

    /// Books a slot given to `rank` while `waiting` (which includes `rank`)
    /// had something waiting: a turn taken out of order spends a credit, and
    /// every class below `rank` earns its share while it has something
    /// waiting and forgets its credit while it has nothing.
    pub fn record(&mut self, rank: usize, waiting: [bool; CLASSES]) {
        if (0..rank).any(|higher| waiting[higher]) {
            self.credit[rank] = (self.credit[rank] - 1.0).max(0.0);
        }
        for (credit, waits) in self.credit.iter_mut().zip(waiting).skip(rank + 1) {
            if waits {
                *credit += self.share;
            } else {
                *credit = 0.0;
            }
        }
    }
}

/// The share rule for one lane's receives.
#[derive(Debug)]
pub struct PriorityShare(Mutex<ShareCredit>);

impl PriorityShare {
    pub fn new(share: f64) -> Self {
        PriorityShare(Mutex::new(ShareCredit::new(share)))
    }

    /// Given how many messages each class has ready (`available[rank]`),
    /// decides how many of a batch of `max` to take from each, and records
    /// the credit that choice earns or spends.
    pub fn split(&self, available: [usize; CLASSES], max: usize) -> [usize; CLASSES] {
        let mut credit = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut left = available;
        let mut take = [0; CLASSES];
        for _ in 0..max {
            let waiting = left.map(|count| count > 0);
            let Some(rank) = credit.pick(waiting) else {
                break;
            };
            credit.record(rank, waiting);
            left[rank] -= 1;
            take[rank] += 1;
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
