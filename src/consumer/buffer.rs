//! `TieredBuffer`: the bounded hand-off between a lane's poller and its
//! dispatcher. It drains high before normal before low, shares one capacity
//! across the three tiers, and a slot is given back only when processing of
//! the message that took it has finished (the [`Slot`] is dropped), not when
//! the message leaves the buffer. So the poller can never fetch more than
//! `capacity` messages ahead of what the workers have completed.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::model::Priority;

/// One unit of buffer capacity; dropping it frees the slot.
#[derive(Debug)]
pub struct Slot(#[allow(dead_code)] OwnedSemaphorePermit);

pub struct TieredBuffer<T> {
    /// One FIFO per priority, index = `Priority::rank()`.
    tiers: Mutex<[VecDeque<(T, Slot)>; 3]>,
    /// Free capacity; the poller takes slots before it receives.
    capacity: Arc<Semaphore>,
    /// Wakes the dispatcher when an item arrives.
    arrivals: Notify,
    /// Total slots, so a batch request never asks for more than exist.
    total: usize,
}

/// How long the poller waits for a whole batch of free slots while the
/// buffer still has work queued, before it takes what is free.
const BATCH_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

impl<T> TieredBuffer<T> {
    pub fn new(capacity: usize) -> Self {
        TieredBuffer {
            tiers: Mutex::new([VecDeque::new(), VecDeque::new(), VecDeque::new()]),
            capacity: Arc::new(Semaphore::new(capacity.max(1))),
            arrivals: Notify::new(),
            total: capacity.max(1),
        }
    }

    /// Takes up to `max` free slots. While messages that hold slots are
    /// still being processed (more slots will free soon), it first waits a
    /// moment for `max` slots together, so that receives stay batched
    /// instead of fetching one message per finished send; otherwise it waits
    /// for one slot and takes whatever else is free.
    pub async fn reserve(&self, max: usize) -> Vec<Slot> {
        let max = max.clamp(1, self.total);
        if self.available() < max
            && let Ok(Ok(mut block)) = tokio::time::timeout(
                BATCH_WAIT,
                self.capacity.clone().acquire_many_owned(max as u32),
            )
            .await
        {
            let mut slots = Vec::with_capacity(max);
            while let Some(one) = block.split(1) {
                slots.push(Slot(one));
            }
            return slots;
        }
        let first = self
            .capacity
            .clone()
            .acquire_owned()
            .await
            .expect("buffer semaphore is never closed");
        let mut slots = vec![Slot(first)];
        while slots.len() < max {
            match self.capacity.clone().try_acquire_owned() {
                Ok(permit) => slots.push(Slot(permit)),
                Err(_) => break,
            }
        }
        slots
    }

    /// Adds an item holding `slot`.
    pub fn push(&self, item: T, priority: Priority, slot: Slot) {
        self.tiers.lock().expect("buffer lock")[priority.rank()].push_back((item, slot));
        self.arrivals.notify_one();
    }

    /// The oldest item of the highest non-empty tier, without waiting.
    pub fn try_pop(&self) -> Option<(T, Slot)> {
        let mut tiers = self.tiers.lock().expect("buffer lock");
        tiers.iter_mut().find_map(VecDeque::pop_front)
    }

    /// Waits for an item; highest priority first.
    pub async fn pop(&self) -> (T, Slot) {
        loop {
            if let Some(entry) = self.try_pop() {
                return entry;
            }
            self.arrivals.notified().await;
        }
    }

    /// Removes every buffered item (shutdown returns them to the queue).
    pub fn drain(&self) -> Vec<T> {
        let mut tiers = self.tiers.lock().expect("buffer lock");
        tiers
            .iter_mut()
            .flat_map(|tier| tier.drain(..).map(|(item, _slot)| item))
            .collect()
    }

    /// Items waiting per tier.
    pub fn len(&self) -> usize {
        self.tiers
            .lock()
            .expect("buffer lock")
            .iter()
            .map(VecDeque::len)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Free slots right now.
    pub fn available(&self) -> usize {
        self.capacity.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn drains_high_before_normal_before_low_and_fifo_within_a_tier() {
        let buffer = TieredBuffer::new(10);
        let mut slots = buffer.reserve(6).await.into_iter();
        for (item, priority) in [
            ("l1", Priority::Low),
            ("n1", Priority::Normal),
            ("h1", Priority::High),
            ("l2", Priority::Low),
            ("h2", Priority::High),
            ("n2", Priority::Normal),
        ] {
            buffer.push(item, priority, slots.next().unwrap());
        }
        let mut order = Vec::new();
        while let Some((item, _slot)) = buffer.try_pop() {
            order.push(item);
        }
        assert_eq!(order, ["h1", "h2", "n1", "n2", "l1", "l2"]);
    }

    #[tokio::test]
    async fn a_slot_is_freed_when_processing_ends_not_when_the_item_leaves() {
        let buffer = TieredBuffer::new(2);
        let slots = buffer.reserve(5).await;
        assert_eq!(slots.len(), 2, "capacity is shared and bounded");
        for (n, slot) in slots.into_iter().enumerate() {
            buffer.push(n, Priority::Normal, slot);
        }
        let (_item, slot) = buffer.pop().await;
        assert_eq!(buffer.available(), 0, "popping alone frees nothing");
        drop(slot);
        assert_eq!(buffer.available(), 1);
        let more =
            tokio::time::timeout(std::time::Duration::from_millis(50), buffer.reserve(1)).await;
        assert!(more.is_ok());
    }

    #[tokio::test]
    async fn reserve_waits_while_the_buffer_is_full() {
        let buffer = TieredBuffer::<u8>::new(1);
        let held = buffer.reserve(1).await;
        let blocked =
            tokio::time::timeout(std::time::Duration::from_millis(50), buffer.reserve(1)).await;
        assert!(blocked.is_err());
        drop(held);
        assert_eq!(buffer.reserve(1).await.len(), 1);
    }
}
