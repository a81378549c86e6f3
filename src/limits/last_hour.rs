//! Each tenant's sends admitted in each of the last 60 minutes, in this
//! instance's memory: the console's chart of the last hour against the
//! plan's limit. A minute's count is the sends its rate limit let
//! through (test keys' sends apart), whether the commit then kept them.

use std::collections::HashMap;
use std::sync::Mutex;

/// Minutes a tenant's counts cover.
pub const MINUTES: usize = 60;

const MINUTE_MS: i64 = 60_000;

/// One tenant's counts: slot `minute % 60` holds that minute's, for the
/// 60 minutes up to `newest`.
#[derive(Debug, Clone, Copy)]
struct Minutes {
    counts: [u32; MINUTES],
    newest: i64,
}

impl Minutes {
    /// Clears the slots of the minutes after `newest` up to `minute`
    /// (all of them after an hour's silence) and makes `minute` the newest.
    fn advance(&mut self, minute: i64) {
        if minute <= self.newest {
            return;
        }
        let gap = (minute - self.newest).min(MINUTES as i64);
        for step in 0..gap {
            self.counts[((minute - step).rem_euclid(MINUTES as i64)) as usize] = 0;
        }
        self.newest = minute;
    }
}

/// Every tenant's last hour.
#[derive(Debug, Default)]
pub struct LastHour {
    tenants: Mutex<HashMap<String, Minutes>>,
}

impl LastHour {
    /// Counts `sends` admitted sends of `tenant` at `now_ms`.
    pub fn record(&self, tenant: &str, now_ms: i64, sends: u32) {
        let minute = now_ms.div_euclid(MINUTE_MS);
        let mut tenants = self.tenants.lock().expect("last hour lock");
        let minutes = match tenants.get_mut(tenant) {
            Some(minutes) => minutes,
            None => tenants.entry(tenant.to_owned()).or_insert(Minutes {
                counts: [0; MINUTES],
                newest: minute,
            }),
        };
        minutes.advance(minute);
        let slot = minute.rem_euclid(MINUTES as i64) as usize;
        minutes.counts[slot] = minutes.counts[slot].saturating_add(sends);
    }

    /// `tenant`'s counts for the 60 minutes up to the one of `now_ms`,
    /// oldest first.
    pub fn of(&self, tenant: &str, now_ms: i64) -> [u32; MINUTES] {
        let minute = now_ms.div_euclid(MINUTE_MS);
        let Some(mut minutes) = self
            .tenants
            .lock()
            .expect("last hour lock")
            .get(tenant)
            .copied()
        else {
            return [0; MINUTES];
        };
        minutes.advance(minute);
        std::array::from_fn(|age| {
            let at = minute - (MINUTES as i64 - 1) + age as i64;
            minutes.counts[at.rem_euclid(MINUTES as i64) as usize]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_fall_into_their_minutes_and_age_out_after_an_hour() {
        let hour = LastHour::default();
        let start = 1_000 * MINUTE_MS;
        hour.record("a", start, 1);
        hour.record("a", start + 59_999, 1);
        hour.record("a", start + MINUTE_MS, 1);
        let now = hour.of("a", start + MINUTE_MS);
        assert_eq!(&now[58..], &[2, 1]);
        assert_eq!(now.iter().sum::<u32>(), 3);
        // 59 minutes on, the first minute is the oldest shown.
        let later = hour.of("a", start + 59 * MINUTE_MS);
        assert_eq!((later[0], later[1]), (2, 1));
        // An hour on, it is gone; two hours of silence clear everything.
        assert_eq!(hour.of("a", start + 60 * MINUTE_MS)[0], 1);
        hour.record("a", start + 120 * MINUTE_MS, 1);
        assert_eq!(hour.of("a", start + 120 * MINUTE_MS).iter().sum::<u32>(), 1);
        assert_eq!(hour.of("b", start), [0; MINUTES]);
    }
}
