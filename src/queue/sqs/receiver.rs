//! Receiving from a lane's three class queues with the priority share rule.
//!
//! SQS has no priorities, so a lane has one queue per class. A receive hands
//! out messages from small per-class stashes (at most ten each) of messages
//! already received from SQS, split by [`PriorityShare::split`] over what
//! the stashes hold: high first, while lower classes keep their share. The
//! stashes are filled by polls, at most one in flight per class queue, each
//! asking for ten:
//!
//! - a class whose stash is empty gets a long poll when a receive finds
//!   nothing to hand out, and (with a long-poll wait) right after a receive
//!   handed out something, so the next high message is already being waited
//!   for while lower ones are handed out;
//! - a class with a backlog (its last poll came back full) gets a short
//!   poll as soon as its stash is down to half, and a receive that would
//!   otherwise hand out lower classes in its place waits for that answer;
//! - before a receive hands out a lower class in place of a higher one
//!   whose last poll brought messages, a short poll checks the higher queue
//!   for more, and the receive waits for it;
//! - otherwise a partly filled stash is drained before it is polled again,
//!   so a class with a backlog is read in batches.
//!
//! A receive returns as soon as a stash holds something; polls that answer
//! later fill their stash for the next receive. A receive with nothing to
//! hand out ends with the error of a poll it started that failed, so the
//! caller's backoff, not the receive's wait, paces the calls to a failing
//! SQS. Each long poll lasts the
//! receive's wait (rounded up to whole seconds, at most 20 s), whoever ends
//! up using its answer, so an idle class queue costs one empty
//! ReceiveMessage per wait: three a minute with the 20 s default.
//!
//! Stashed messages are invisible in SQS for the lane's visibility timeout,
//! counted from their receive. While the lane is being received from, a
//! message that waited half of it (a low one waiting for its share under a
//! flood of high ones) gets its visibility extended, which, unlike a
//! release, does not raise its receive count. When nothing receives any
//! more, it is released (made visible at once) instead. A receive that is
//! dropped loses nothing: its polls still fill the stashes.
//! [`Receiver::release_all`] (consumer shutdown) releases the stashes, and
//! polls answering after it release what they bring.
//!
//! Receipts handed out carry their class (`high:…`), so that deletes and
//! visibility changes reach the queue the message came from.
//!
//! At the consumer's parking bound (tenants at their in-flight cap, their
//! further messages parked up to the bound), [`Receiver::receive_skipping`]
//! hands out only stashed messages of other tenants. When the stashes hold
//! none, it polls past the capped tenants' messages: the lane's stashes may
//! then grow to its look-ahead (`queue.sqs.look_ahead_messages`, and at
//! most [`LOOK_AHEAD_BYTES`] of message bodies), so a quiet tenant's
//! message queued behind a noisy tenant's backlog is found without waiting
//! for the backlog to drain through the parked places. These looking polls
//! are apart from the polls above: a look starts them, up to
//! [`LOOKING_POLLS`] at once on a class with a backlog, and each that
//! brings messages starts the next itself while the consumer keeps looking
//! (within [`LOOKING_FOR`] of its last look), so the lane is read at the
//! pace of SQS's answers; the one that finds nothing ends the reading and
//! counts as an arrival, so the consumer looks again and its look waits
//! with a long poll. A backlog that fits in the look-ahead is held whole,
//! so the next message to arrive is received as it comes. On SQS fair
//! queues (`MessageGroupId` = the tenant) such a message comes first in
//! the next poll anyway; on a queue that hands messages out in the order
//! they came, it is found if it lies within the look-ahead of the front. Every poll that brings messages counts as
//! an arrival ([`Receiver::arrivals`]) too, which wakes a consumer waiting
//! at the bound to look again.
//!
//! Upkeep (extending, releasing and dropping stale stashed messages) sorts
//! the stashes at once under the lock, and makes its SQS calls (several at
//! a time) on a task of its own when a receive asks for it, so that a deep
//! stash coming of age does not hold up the receive.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::MessageSystemAttributeName;
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::MAX_WAIT_SECS;
use super::batch::{MAX_BATCH_ENTRIES, ceil_secs, change_visibility_at_once, release, sdk_error};
use super::envelope::Parsed;
use crate::model::{Lane, Priority};
use crate::queue::ReceivedMessage;
use crate::queue::priority::{CLASSES, PriorityShare};

/// A class with a backlog is polled again once its stash is down to this,
/// so that it does not run dry while lower classes are handed out in its
/// place, yet every poll still brings at least half a batch.
const REFILL_AT: usize = MAX_BATCH_ENTRIES / 2;

/// The most message bytes a lane's stashes may hold while a receive looks
/// past capped tenants' messages for another tenant's (besides the
/// lane's `queue.sqs.look_ahead_messages`), so that large messages bound
/// the look-ahead by memory.
pub(super) const LOOK_AHEAD_BYTES: usize = 16 * 1024 * 1024;

/// Polls at once that read a class queue's backlog into its stash while
/// receives look past capped tenants' messages.
const LOOKING_POLLS: usize = 4;

/// How long after the consumer's last look past capped tenants' messages
/// a looking poll that brought messages still starts the next: once the
/// consumer is no longer at its parking bound, reading ahead stops.
const LOOKING_FOR: Duration = Duration::from_secs(1);

/// A message received from SQS and not yet handed out.
#[derive(Debug)]
struct Stashed {
    /// As handed out: the receipt carries the class.
    message: ReceivedMessage,
    /// SQS's receipt handle.
    raw_receipt: String,
    /// When its visibility timeout started (the poll's answer, or the last
    /// extension).
    since: Instant,
}

#[derive(Debug, Default)]
struct State {
    /// Received, not yet handed out, per class (index: priority rank).
    stash: [VecDeque<Stashed>; CLASSES],
    /// The number of the poll in flight on each class queue, if any.
    in_flight: [Option<u64>; CLASSES],
    /// Polls looking past capped tenants' messages in flight on each class
    /// queue (besides `in_flight`), and how many messages the short ones
    /// among them asked for in all (a long one waits for messages still to
    /// come, and may bring up to ten beyond the look-ahead).
    looking: [usize; CLASSES],
    looking_asked: usize,
    /// When a receive last looked past capped tenants' messages: reading
    /// ahead goes on only while the consumer keeps looking.
    last_look: Option<Instant>,
    /// The last failed poll of each class queue and its error, for the
    /// receive waiting on it.
    failed: [Option<(u64, String)>; CLASSES],
    /// Whether the last poll of each class queue came back full: the queue
    /// probably holds more.
    backlog: [bool; CLASSES],
    /// How many messages the last poll of each class queue brought.
    last_count: [usize; CLASSES],
    /// Whether the poll in flight on each class queue is a short one (a
    /// refill), which a receive may wait for.
    refilling: [bool; CLASSES],
    /// Numbers polls.
    polls: u64,
    /// Set by [`Receiver::release_all`], cleared by the next receive: polls
    /// answering meanwhile release what they bring.
    released: bool,
    /// Receives running now.
    receiving: usize,
    /// When a receive last ran.
    last_receive: Option<Instant>,
}

/// The SQS calls of one upkeep, per class (index: priority rank).
#[derive(Debug, Default)]
struct Upkeep {
    /// Receipts whose visibility is to be extended.
    extend: [Vec<String>; CLASSES],
    /// Receipts to release (make visible at once).
    give_back: [Vec<String>; CLASSES],
}

impl Upkeep {
    fn is_empty(&self) -> bool {
        self.extend.iter().chain(&self.give_back).all(Vec::is_empty)
    }
}

/// The receiving side of one lane: its stashes and polls.
pub(super) struct Receiver {
    lane: Lane,
    client: Client,
    /// Class queue URLs, indexed by priority rank.
    urls: [String; CLASSES],
    share: PriorityShare,
    /// The visibility timeout every poll asks for.
    visibility: Duration,
    /// How many messages the stashes may hold while receives look past
    /// capped tenants' messages.
    look_ahead: usize,
    state: Mutex<State>,
    /// Woken whenever a poll answers.
    answers: Notify,
    /// Polls so far that brought messages; see [`Receiver::arrivals`].
    arrived: AtomicU64,
    /// Woken when a poll brings messages.
    arrivals: Notify,
}

/// Counts a receive as running while it exists (also when it is dropped
/// mid-wait).
struct Receiving<'a>(&'a Receiver);

impl Drop for Receiving<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.receiving -= 1;
        state.last_receive = Some(Instant::now());
    }
}

/// Whether a refill is in flight for a class that, with the classes above
/// it, has fewer than `max` stashed.
fn refill_pending(state: &State, max: usize) -> bool {
    let mut above = 0;
    (0..CLASSES).any(|rank| {
        above += state.stash[rank].len();
        state.refilling[rank] && above < max
    })
}

/// Whether any of the polls `mine` is still in flight.
fn pending(state: &State, mine: &[(usize, u64)]) -> bool {
    mine.iter()
        .any(|&(rank, id)| state.in_flight[rank] == Some(id))
}

/// The error of a failed poll among `mine`, if one failed.
fn failed_poll(state: &State, mine: &[(usize, u64)]) -> Option<String> {
    mine.iter().find_map(|&(rank, id)| {
        state.failed[rank]
            .as_ref()
            .filter(|(failed, _)| *failed == id)
            .map(|(_, error)| error.clone())
    })
}

/// The receipt handed out for a message of class `priority`.
pub(super) fn class_receipt(priority: Priority, raw: &str) -> String {
    format!("{priority}:{raw}")
}

/// The class and SQS receipt handle of a receipt made by [`class_receipt`].
pub(super) fn split_receipt(receipt: &str) -> Option<(Priority, &str)> {
    let (class, raw) = receipt.split_once(':')?;
    Some((class.parse().ok()?, raw))
}

impl Receiver {
    pub(super) fn new(
        lane: Lane,
        client: Client,
        urls: [String; CLASSES],
        low_priority_share: f64,
        visibility: Duration,
        look_ahead: usize,
    ) -> Arc<Self> {
        Arc::new(Receiver {
            lane,
            client,
            urls,
            share: PriorityShare::new(low_priority_share),
            visibility,
            look_ahead,
            state: Mutex::new(State::default()),
            answers: Notify::new(),
            arrived: AtomicU64::new(0),
            arrivals: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A stashed message older than this gets its visibility extended (or
    /// is released when nothing receives).
    fn stale_after(&self) -> Duration {
        self.visibility / 2
    }

    /// Messages stashed now, per class.
    #[cfg(test)]
    pub(super) fn stashed(&self) -> [usize; CLASSES] {
        let state = self.lock();
        std::array::from_fn(|rank| state.stash[rank].len())
    }

    /// Counts a receive as running (until the guard drops), ends an earlier
    /// [`Receiver::release_all`], and sorts out stale stashed messages
    /// first: those past their visibility are dropped at once, and the
    /// calls extending or releasing the others run on a task of their own.
    fn begin_receive(self: &Arc<Self>) -> Receiving<'_> {
        let upkeep = {
            let mut state = self.lock();
            state.receiving += 1;
            state.released = false;
            self.sort_stale(&mut state)
        };
        if !upkeep.is_empty() {
            let this = self.clone();
            tokio::spawn(async move { this.upkeep_calls(upkeep).await });
        }
        Receiving(self)
    }

    /// Hands out up to `max` messages (at most ten), waiting up to `wait`
    /// for the first. `Err` when nothing could be handed out and a poll this
    /// receive was waiting on failed.
    pub(super) async fn receive(
        self: &Arc<Self>,
        max: usize,
        wait: Duration,
    ) -> anyhow::Result<Vec<ReceivedMessage>> {
        let max = max.clamp(1, MAX_BATCH_ENTRIES);
        let wait = wait.min(Duration::from_secs(MAX_WAIT_SECS));
        let poll_wait = ceil_secs(wait, MAX_WAIT_SECS);
        let deadline = tokio::time::Instant::now() + wait;
        let _receiving = self.begin_receive();
        // Polls this receive started and may report the failure of.
        let mut mine: Vec<(usize, u64)> = Vec::new();
        let mut first = true;
        loop {
            let answered = self.answers.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            {
                let mut state = self.lock();
                // A poll of this receive failed and nothing is stashed: the
                // error goes to the caller, whose backoff paces the next
                // try. Starting another poll here instead would call a
                // failing SQS again and again for the whole wait.
                if state.stash.iter().all(VecDeque::is_empty)
                    && let Some(error) = failed_poll(&state, &mine)
                {
                    return Err(anyhow!(error));
                }
                if first || poll_wait > 0 {
                    mine.extend(self.start_polls(&mut state, poll_wait));
                }
                first = false;
                mine.extend(self.start_guards(&mut state, max));
                let available: [usize; CLASSES] =
                    std::array::from_fn(|rank| state.stash[rank].len());
                let timed_out = tokio::time::Instant::now() >= deadline;
                // A refill of a backlogged higher class answers at once;
                // handing out lower classes before it would break priority.
                let refilling = refill_pending(&state, max);
                if available.iter().any(|&n| n > 0) {
                    if !refilling || (poll_wait > 0 && timed_out) {
                        let take = self.share.split(available, max);
                        let mut out = Vec::with_capacity(max);
                        for (rank, &n) in take.iter().enumerate() {
                            out.extend(state.stash[rank].drain(..n).map(|stashed| stashed.message));
                        }
                        if poll_wait > 0 {
                            // Have the next messages waited for while these
                            // are worked on.
                            self.start_polls(&mut state, poll_wait);
                        }
                        return Ok(out);
                    }
                } else {
                    if poll_wait == 0 && !pending(&state, &mine) && !refilling {
                        // Nothing now; long polls of earlier receives may
                        // still be waiting.
                        return Ok(Vec::new());
                    }
                    if poll_wait > 0 && timed_out {
                        return Ok(Vec::new());
                    }
                }
            }
            if poll_wait > 0 {
                tokio::select! {
                    _ = answered => {}
                    _ = tokio::time::sleep_until(deadline) => {}
                }
            } else {
                answered.await;
            }
        }
    }

    /// Hands out at once up to `max` stashed messages (at most ten) of
    /// tenants not in `skip`, highest class first, leaving the others
    /// stashed. With none to hand out, and while the stashes hold less than
    /// the look-ahead (in messages and in [`LOOK_AHEAD_BYTES`]), it starts a
    /// poll on each class queue that has none in flight, so that the next
    /// look sees further into the queue: a class with a backlog answers at
    /// once, an idle one when something arrives (a long poll). Each poll
    /// that brings messages is an arrival ([`Receiver::arrival`]), and so
    /// is the end of the looking on a class queue.
    pub(super) async fn receive_skipping(
        self: &Arc<Self>,
        max: usize,
        skip: &HashSet<String>,
    ) -> Vec<ReceivedMessage> {
        let max = max.clamp(1, MAX_BATCH_ENTRIES);
        let _receiving = self.begin_receive();
        let mut state = self.lock();
        state.last_look = Some(Instant::now());
        let mut out = Vec::new();
        for rank in 0..CLASSES {
            let stash = &mut state.stash[rank];
            let mut index = 0;
            while index < stash.len() && out.len() < max {
                if skip.contains(&stash[index].message.tenant_id) {
                    index += 1;
                } else if let Some(stashed) = stash.remove(index) {
                    out.push(stashed.message);
                }
            }
        }
        if out.is_empty() {
            for rank in 0..CLASSES {
                if state.looking[rank] > 0 {
                    continue;
                }
                if state.backlog[rank] {
                    while state.looking[rank] < LOOKING_POLLS
                        && self.start_looking(&mut state, rank, 0)
                    {}
                } else if state.in_flight[rank].is_none() {
                    self.start_looking(&mut state, rank, MAX_WAIT_SECS as i32);
                }
            }
        }
        out
    }

    /// Starts a poll looking past capped tenants' messages on class queue
    /// `rank`, if the look-ahead has room for what it asks; whether it did.
    /// One that brings messages starts the next itself ([`Receiver::poll`]).
    fn start_looking(self: &Arc<Self>, state: &mut State, rank: usize, wait_secs: i32) -> bool {
        let room = self
            .look_ahead_room(state)
            .saturating_sub(state.looking_asked);
        if room == 0 {
            return false;
        }
        let asked = room.min(MAX_BATCH_ENTRIES);
        state.looking[rank] += 1;
        if wait_secs == 0 {
            state.looking_asked += asked;
        }
        state.polls += 1;
        let id = state.polls;
        let this = self.clone();
        tokio::spawn(async move { this.poll(rank, id, asked, wait_secs, true).await });
        true
    }

    /// How many more messages the stashes may take while receives look past
    /// capped tenants' messages: none once they hold the look-ahead or
    /// [`LOOK_AHEAD_BYTES`].
    fn look_ahead_room(&self, state: &State) -> usize {
        let held = state.stash.iter().map(VecDeque::len).sum::<usize>();
        let bytes = state
            .stash
            .iter()
            .flatten()
            .map(|stashed| stashed.message.body.len())
            .sum::<usize>();
        if bytes >= LOOK_AHEAD_BYTES {
            0
        } else {
            self.look_ahead.saturating_sub(held)
        }
    }

    /// How many polls have brought messages so far.
    pub(super) fn arrivals(&self) -> u64 {
        self.arrived.load(Ordering::Relaxed)
    }

    /// Returns when a poll brings messages.
    pub(super) async fn arrival(&self) {
        self.arrivals.notified().await;
    }

    /// Starts a poll on every class queue that has none in flight and whose
    /// stash is empty, or (for a class with a backlog) down to
    /// [`REFILL_AT`]; returns their `(rank, number)`. A poll asks for what
    /// fills the stash to ten. It waits `wait_secs`, except on a class with
    /// a backlog: that one answers at once, so a receive may wait for it.
    fn start_polls(self: &Arc<Self>, state: &mut State, wait_secs: i32) -> Vec<(usize, u64)> {
        let mut started = Vec::new();
        for rank in 0..CLASSES {
            let stashed = state.stash[rank].len();
            if state.in_flight[rank].is_some()
                || !(stashed == 0 || state.backlog[rank] && stashed <= REFILL_AT)
            {
                continue;
            }
            let wait = if state.backlog[rank] { 0 } else { wait_secs };
            started.push(self.start_poll(state, rank, wait));
        }
        started
    }

    /// Before a receive hands out lower classes in place of class `rank`
    /// (`rank` and the classes above it hold fewer than `max`), a class whose
    /// last poll brought messages may hold more by now: a short poll asks,
    /// and the receive waits for its answer.
    fn start_guards(self: &Arc<Self>, state: &mut State, max: usize) -> Vec<(usize, u64)> {
        let mut started = Vec::new();
        let mut above = 0;
        for rank in 0..CLASSES - 1 {
            above += state.stash[rank].len();
            let lower_waiting = state.stash[rank + 1..].iter().any(|s| !s.is_empty());
            if above < max
                && lower_waiting
                && state.in_flight[rank].is_none()
                && state.last_count[rank] > 0
            {
                started.push(self.start_poll(state, rank, 0));
            }
        }
        started
    }

    /// Starts one poll on class queue `rank`, asking for what fills its
    /// stash to ten; a short one (`wait_secs` 0) is a refill a receive may
    /// wait for.
    fn start_poll(
        self: &Arc<Self>,
        state: &mut State,
        rank: usize,
        wait_secs: i32,
    ) -> (usize, u64) {
        let room = MAX_BATCH_ENTRIES.saturating_sub(state.stash[rank].len());
        state.polls += 1;
        let id = state.polls;
        state.in_flight[rank] = Some(id);
        state.refilling[rank] = wait_secs == 0;
        let asked = room.clamp(1, MAX_BATCH_ENTRIES);
        let this = self.clone();
        tokio::spawn(async move { this.poll(rank, id, asked, wait_secs, false).await });
        (rank, id)
    }

    /// One ReceiveMessage on class queue `rank`; what it brings goes to the
    /// stash (or back to SQS after [`Receiver::release_all`]).
    async fn poll(
        self: Arc<Self>,
        rank: usize,
        id: u64,
        asked: usize,
        wait_secs: i32,
        looking: bool,
    ) {
        let url = &self.urls[rank];
        let result = self
            .client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(asked as i32)
            .wait_time_seconds(wait_secs)
            .visibility_timeout(self.visibility.as_secs() as i32)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .message_attribute_names("All")
            .send()
            .await;
        let now = Instant::now();
        let priority = Priority::ALL[rank];
        let mut to_release = Vec::new();
        let mut stashed = 0;
        // Whether the consumer should look again: this poll brought
        // messages, or it ended the looking on its class queue without
        // failing (the next look then waits with a long poll).
        let look_again;
        {
            let mut state = self.lock();
            if looking {
                state.looking[rank] -= 1;
                if wait_secs == 0 {
                    state.looking_asked -= asked;
                }
            } else if state.in_flight[rank] == Some(id) {
                state.in_flight[rank] = None;
                state.refilling[rank] = false;
            }
            let brought = result.as_ref().map_or(0, |output| output.messages().len());
            state.backlog[rank] = brought >= asked;
            state.last_count[rank] = brought;
            match result {
                Ok(output) => {
                    stashed = self.stash(&mut state, rank, output.messages(), now, &mut to_release);
                }
                Err(err) => {
                    let error = format!(
                        "{:#}",
                        sdk_error(err)
                            .context(format!("ReceiveMessage from the {priority} queue failed"))
                    );
                    debug!(lane = %self.lane, class = %priority, %error, "Poll failed.");
                    state.failed[rank] = Some((id, error));
                }
            }
            let failed = state.failed[rank].as_ref().is_some_and(|(at, _)| *at == id);
            let still_looking = state
                .last_look
                .is_some_and(|at| now.duration_since(at) < LOOKING_FOR);
            if looking && stashed > 0 && still_looking {
                // Messages are coming: read on at once, with several polls
                // while they come in full batches, until a poll finds none
                // (the consumer's next look then waits with a long poll).
                let polls = if brought >= asked { LOOKING_POLLS } else { 1 };
                while state.looking[rank] < polls && self.start_looking(&mut state, rank, 0) {}
            }
            look_again = stashed > 0 || looking && !failed && state.looking[rank] == 0;
        }
        self.answers.notify_waiters();
        if look_again {
            self.arrived.fetch_add(1, Ordering::Relaxed);
            self.arrivals.notify_waiters();
        }
        if !to_release.is_empty() {
            debug!(lane = %self.lane, class = %priority, count = to_release.len(), "Poll answered after the stashes were released; returning its messages.");
            let receipts: Vec<&str> = to_release.iter().map(String::as_str).collect();
            release(&self.client, url, &receipts).await;
        }
        if stashed > 0 {
            // Whatever is still stashed by then is extended or released.
            tokio::time::sleep(self.stale_after() + Duration::from_millis(100)).await;
            self.upkeep().await;
        }
    }

    /// Puts what a poll of class queue `rank` brought in its stash, or, once
    /// the stashes were released, in `to_release`; what fairlane did not
    /// write is left to the redrive policy. Returns how many were stashed.
    fn stash(
        &self,
        state: &mut State,
        rank: usize,
        messages: &[aws_sdk_sqs::types::Message],
        now: Instant,
        to_release: &mut Vec<String>,
    ) -> usize {
        let priority = Priority::ALL[rank];
        let mut stashed = 0;
        for message in messages {
            match Parsed::from_sqs(message) {
                Ok(parsed) if state.released => to_release.push(parsed.receipt),
                Ok(parsed) => {
                    let raw_receipt = parsed.receipt.clone();
                    let mut message = parsed.into_received();
                    message.receipt = class_receipt(priority, &raw_receipt);
                    state.stash[rank].push_back(Stashed {
                        message,
                        raw_receipt,
                        since: now,
                    });
                    stashed += 1;
                }
                Err(reason) => {
                    warn!(lane = %self.lane, class = %priority, sqs_message_id = message.message_id().unwrap_or_default(), %reason, "Ignoring a queue message fairlane did not write; the redrive policy moves it to the DLQ.");
                }
            }
        }
        stashed
    }

    /// Keeps stashed messages from outliving their visibility: those stashed
    /// for [`Receiver::stale_after`] are to get their visibility extended
    /// while the lane is being received from (counted as extended from now
    /// on), and are taken out to be released otherwise; those past their
    /// visibility timeout (SQS has made them visible again) are dropped.
    /// Returns the SQS calls this needs, for [`Receiver::upkeep_calls`].
    fn sort_stale(&self, state: &mut State) -> Upkeep {
        let now = Instant::now();
        let stale_after = self.stale_after();
        let expired_after = self.visibility.saturating_sub(Duration::from_secs(1));
        let mut upkeep = Upkeep::default();
        let active = state.receiving > 0
            || state
                .last_receive
                .is_some_and(|at| now.duration_since(at) < stale_after);
        for rank in 0..CLASSES {
            let mut expired = 0;
            state.stash[rank].retain_mut(|stashed| {
                let age = now.duration_since(stashed.since);
                if age >= expired_after {
                    expired += 1;
                    false
                } else if age < stale_after {
                    true
                } else if active {
                    upkeep.extend[rank].push(stashed.raw_receipt.clone());
                    stashed.since = now;
                    true
                } else {
                    upkeep.give_back[rank].push(stashed.raw_receipt.clone());
                    false
                }
            });
            if expired > 0 {
                warn!(lane = %self.lane, class = %Priority::ALL[rank], expired, "Stashed messages outlived their visibility timeout; SQS delivers them again.");
            }
        }
        upkeep
    }

    /// [`Receiver::sort_stale`] and its calls, here and now.
    async fn upkeep(&self) {
        let upkeep = self.sort_stale(&mut self.lock());
        self.upkeep_calls(upkeep).await;
    }

    /// Releases and extends what [`Receiver::sort_stale`] picked, several
    /// calls at a time; a message whose extension failed is dropped from
    /// its stash (SQS delivers it again).
    async fn upkeep_calls(&self, upkeep: Upkeep) {
        let secs = self.visibility.as_secs() as i32;
        for rank in 0..CLASSES {
            let url = &self.urls[rank];
            if !upkeep.give_back[rank].is_empty() {
                debug!(lane = %self.lane, count = upkeep.give_back[rank].len(), "Nothing receives; releasing stashed messages.");
                let receipts: Vec<&str> =
                    upkeep.give_back[rank].iter().map(String::as_str).collect();
                release(&self.client, url, &receipts).await;
            }
            let extend = &upkeep.extend[rank];
            if extend.is_empty() {
                continue;
            }
            let changes: Vec<(&str, i32)> = extend.iter().map(|r| (r.as_str(), secs)).collect();
            let results = change_visibility_at_once(&self.client, url, &changes).await;
            let failed: HashSet<&str> = extend
                .iter()
                .zip(&results)
                .filter(|(_, result)| result.is_err())
                .map(|(receipt, _)| receipt.as_str())
                .collect();
            if let Some(Err(error)) = results.iter().find(|r| r.is_err()) {
                warn!(lane = %self.lane, failed = failed.len(), %error, "Could not extend the visibility of stashed messages; they are dropped and SQS delivers them again.");
                self.lock().stash[rank]
                    .retain(|stashed| !failed.contains(stashed.raw_receipt.as_str()));
            }
        }
    }

    /// Releases every stashed message at once; polls still in flight
    /// release what they bring, until the next receive.
    pub(super) async fn release_all(&self) {
        let taken: [Vec<String>; CLASSES] = {
            let mut state = self.lock();
            state.released = true;
            std::array::from_fn(|rank| {
                state.stash[rank]
                    .drain(..)
                    .map(|stashed| stashed.raw_receipt)
                    .collect()
            })
        };
        for (rank, receipts) in taken.iter().enumerate() {
            if receipts.is_empty() {
                continue;
            }
            debug!(lane = %self.lane, class = %Priority::ALL[rank], count = receipts.len(), "Releasing stashed messages.");
            let receipts: Vec<&str> = receipts.iter().map(String::as_str).collect();
            release(&self.client, &self.urls[rank], &receipts).await;
        }
    }
}
