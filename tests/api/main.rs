//! Integration tests: each test starts the whole service on a random port
//! with its own temporary SQLite file and talks to it over real HTTP.

mod admin;
mod attachments;
mod audit;
mod auth;
mod aws_policy;
#[macro_use]
mod backends;
mod batch;
mod cancel;
mod console;
mod crash;
mod dedicated;
mod delivery;
mod docs;
mod faults;
mod full_store;
mod hostile;
mod idempotency;
mod instances;
mod limits;
mod logging;
mod message_list;
mod messages;
mod openapi;
mod ops;
mod panics;
mod pools;
mod priority;
mod receipts;
mod recipients;
mod redis_limits;
mod restart;
mod retention;
mod scheduled;
mod senders;
#[path = "../servers/mod.rs"]
mod servers;
mod shutdown;
mod slow_clients;
mod sqs;
mod storms;
mod support;
mod templates;
mod test_keys;
mod traces;
mod unsubscribe;
mod webhook_batches;
mod webhook_transport;
mod webhooks;
mod worlds;
