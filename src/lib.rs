//! fairlane: a multi-tenant notification gateway. See the book (`docs/`,
//! "Internals") for the architecture; `app` builds and runs the whole service.

pub mod accept;
pub mod api;
pub mod app;
pub mod attachments;
pub mod aws;
pub mod config;
pub mod config_reference;
pub mod consumer;
pub mod limits;
pub mod message;
pub mod metrics;
pub mod model;
pub mod providers;
pub mod queue;
pub mod receipts;
pub mod scheduler;
pub mod serve;
pub mod sms;
pub mod store;
pub mod telemetry;
pub mod templates;
pub mod tenants;
pub mod unsubscribe;
pub mod webhooks;

/// The servers the unit tests need (moto, Redis, PostgreSQL), shared with
/// the integration tests.
#[cfg(test)]
#[path = "../tests/servers/mod.rs"]
mod test_servers;
