//! The simulated provider of test keys: it takes a message like a real
//! provider, calls nobody, and answers as the recipient says, so a tenant
//! can try every outcome (and the receipts, events and webhooks each one
//! brings) without reaching a person.
//!
//! Magic recipients (any other recipient is delivered):
//!
//! | outcome | email | SMS |
//! |---|---|---|
//! | delivered | `delivered@simulator.fairlane.test` | `+15005550001` |
//! | bounced, address suppressed | `bounced@simulator.fairlane.test` | `+15005550002` (undelivered, number suppressed) |
//! | failed permanently (dead-lettered at once) | `failed@simulator.fairlane.test` | `+15005550003` |
//! | a temporary failure, then delivered | `temporary@simulator.fairlane.test` | `+15005550004` |
//! | never answers: every attempt times out | `timeout@simulator.fairlane.test` | `+15005550005` |

use std::time::Duration;

use async_trait::async_trait;

use super::{Delivered, Failure, Provider, ProviderError};
use crate::message::DeliveryPayload;
use crate::model::Channel;

/// The domain of the magic email recipients.
pub const EMAIL_DOMAIN: &str = "simulator.fairlane.test";
/// The provider's name (metrics, receipts).
pub const NAME: &str = "test";

/// What the simulated provider does with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Delivered,
    Bounced,
    Failed,
    Temporary,
    Timeout,
}

impl Outcome {
    /// The outcome `to` asks for.
    pub fn of(channel: Channel, to: &str) -> Outcome {
        let word = match channel {
            Channel::Email => to
                .to_ascii_lowercase()
                .strip_suffix(&format!("@{EMAIL_DOMAIN}"))
                .map(str::to_owned),
            Channel::Sms => match to {
                "+15005550002" => Some("bounced".into()),
                "+15005550003" => Some("failed".into()),
                "+15005550004" => Some("temporary".into()),
                "+15005550005" => Some("timeout".into()),
                _ => None,
            },
        };
        match word.as_deref() {
            Some("bounced") => Outcome::Bounced,
            Some("failed") => Outcome::Failed,
            Some("temporary") => Outcome::Temporary,
            Some("timeout") => Outcome::Timeout,
            _ => Outcome::Delivered,
        }
    }
}

/// Answers test keys' messages; see the module documentation. It keeps no
/// memory of its own: a `temporary@` recipient's first attempt fails and
/// the one after succeeds because the store says an attempt failed
/// (`DeliveryPayload::retrying`), so any instance answers alike.
pub struct SimulatedProvider {
    /// How long a call that never answers takes to time out: the real
    /// provider's timeout for the channel.
    timeout: Duration,
}

impl SimulatedProvider {
    pub fn new(timeout: Duration) -> Self {
        SimulatedProvider { timeout }
    }
}

#[async_trait]
impl Provider for SimulatedProvider {
    async fn send(&self, message: &DeliveryPayload) -> Result<Delivered, ProviderError> {
        match Outcome::of(message.channel, &message.to) {
            Outcome::Failed => Err(ProviderError::Permanent(Failure::plain(
                "provider rejected: the test recipient always fails (simulated)",
            ))),
            Outcome::Timeout => {
                tokio::time::sleep(self.timeout).await;
                Err(ProviderError::Transient(Failure::plain("timeout")))
            }
            Outcome::Temporary if !message.retrying => Err(ProviderError::Transient(
                Failure::plain("HTTP 503 (simulated)"),
            )),
            Outcome::Temporary | Outcome::Delivered | Outcome::Bounced => Ok(Delivered {
                provider_message_id: format!("test-{}", uuid::Uuid::new_v4()),
            }),
        }
    }

    fn name(&self) -> &'static str {
        NAME
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recipient_decides_the_outcome() {
        assert_eq!(
            Outcome::of(Channel::Email, "Bounced@Simulator.Fairlane.Test"),
            Outcome::Bounced
        );
        assert_eq!(
            Outcome::of(Channel::Email, "timeout@simulator.fairlane.test"),
            Outcome::Timeout
        );
        assert_eq!(
            Outcome::of(Channel::Email, "bounced@example.com"),
            Outcome::Delivered
        );
        assert_eq!(Outcome::of(Channel::Sms, "+15005550003"), Outcome::Failed);
        assert_eq!(
            Outcome::of(Channel::Sms, "+15551234567"),
            Outcome::Delivered
        );
    }

    /// What the store says decides a temporary failure, not which
    /// instance's provider answers: the first attempt fails on one, the
    /// retry succeeds on another that never saw the message.
    #[tokio::test]
    async fn a_temporary_recipient_fails_its_first_attempt_and_succeeds_on_any_instance_after() {
        let mut message =
            crate::providers::tests::payload(Channel::Email, "temporary@simulator.fairlane.test");
        let first = SimulatedProvider::new(Duration::from_millis(1));
        let second = SimulatedProvider::new(Duration::from_millis(1));
        assert!(matches!(
            first.send(&message).await,
            Err(ProviderError::Transient(_))
        ));
        assert!(matches!(
            second.send(&message).await,
            Err(ProviderError::Transient(_))
        ));
        message.retrying = true;
        assert!(second.send(&message).await.is_ok());
        assert!(first.send(&message).await.is_ok());
    }
}
