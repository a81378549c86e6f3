//! The accept path: a send request becomes a durable message. Validation
//! and the answer's shape are the API's; here the accepted messages are
//! made durable through the store's one [`Writer`](crate::store::Writer)
//! and, on SQS, handed to their lane through the [`outbox`].

pub mod outbox;

pub use crate::store::{AcceptEntry, FailureStreak, NotDurable};
