//! Domain vocabulary shared by the API, the store and the queues: lanes,
//! priorities, channels and the states a message and a tenant can be in.
//!
//! Each enum stores and prints as the same lowercase word the public contract
//! uses, so the database, the JSON and the metrics labels agree.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

macro_rules! word_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $word:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The contract's word for this value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $word),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($word => Ok($name::$variant),)+
                    _ => Err(format!(
                        "must be one of {}",
                        [$($word),+].join(", ")
                    )),
                }
            }
        }
    };
}

word_enum!(
    /// A queue lane: paid plans use `fast`, free plans `slow`.
    Lane { Fast => "fast", Slow => "slow" }
);

/// The shortest retention a tenant may have, in days.
pub const MIN_RETENTION_DAYS: u16 = 1;
/// The longest retention a tenant may have, in days.
pub const MAX_RETENTION_DAYS: u16 = 90;
/// The retention of tenants that set none, unless configured otherwise.
pub const DEFAULT_RETENTION_DAYS: u16 = 7;

word_enum!(
    /// Delivery priority; the provider gate serves high before normal before low.
    Priority { High => "high", Normal => "normal", Low => "low" }
);

word_enum!(
    /// Delivery channel.
    Channel { Email => "email", Sms => "sms" }
);

word_enum!(
    /// Where a message is in its life.
    MessageStatus {
        /// Accepted with a `send_at` in the future; queued when due.
        Scheduled => "scheduled",
        /// Durably queued, waiting for a consumer.
        Queued => "queued",
        /// A consumer is calling the provider.
        Sending => "sending",
        /// The last attempt failed transiently; another will follow.
        Retrying => "retrying",
        /// The provider accepted it.
        Sent => "sent",
        /// The provider reported it delivered to the recipient (receipt).
        Delivered => "delivered",
        /// The recipient's server refused it for good: a permanent bounce
        /// (receipt). The address is added to the tenant's suppression list.
        Bounced => "bounced",
        /// The recipient marked it as spam (receipt). The address is added
        /// to the tenant's suppression list.
        Complained => "complained",
        /// The provider took it but then reported it undelivered or failed
        /// (receipt); `last_error` carries the provider's code.
        Failed => "failed",
        /// Not sent: the address is on the tenant's suppression list.
        Suppressed => "suppressed",
        /// Failed permanently or ran out of attempts; listed in the DLQ.
        DeadLettered => "dead_lettered",
        /// SQS mode only: the queue did not take the message, its request
        /// was answered 503, and it is never delivered.
        Rejected => "rejected",
        /// Cancelled by the tenant before it was sent; never sent.
        Cancelled => "cancelled",
    }
);

word_enum!(
    /// What a tenant may do.
    TenantStatus {
        /// Sends accepted and delivered.
        Active => "active",
        /// Sends accepted (202); delivery held until the tenant is active again.
        Paused => "paused",
        /// Sends answer 403; queued messages are held, not sent.
        Disabled => "disabled",
    }
);

word_enum!(
    /// Where a tenant's messages wait: in its lane's shared queue, or in a
    /// queue of its own that attention workers consume in bounded slices.
    Isolation {
        /// The lane's shared queue (fair dequeue among its tenants).
        Shared => "shared",
        /// A queue of the tenant's own, consumed on demand.
        Dedicated => "dedicated",
    }
);

impl MessageStatus {
    /// True once nothing more will be sent for the message (receipts may
    /// still move a sent message on to `delivered`, `bounced`, …).
    pub fn is_settled(self) -> bool {
        !matches!(
            self,
            MessageStatus::Scheduled
                | MessageStatus::Queued
                | MessageStatus::Sending
                | MessageStatus::Retrying
        )
    }

    /// True for the states only a provider's receipt sets, after `sent`.
    pub fn is_receipt(self) -> bool {
        matches!(
            self,
            MessageStatus::Delivered
                | MessageStatus::Bounced
                | MessageStatus::Complained
                | MessageStatus::Failed
        )
    }
}

impl Priority {
    /// Index for tiered structures: 0 = high.
    pub fn rank(self) -> usize {
        match self {
            Priority::High => 0,
            Priority::Normal => 1,
            Priority::Low => 2,
        }
    }
}

// Written out because the enum comes from `word_enum!`, whose derive list
// is shared by every enum.
#[allow(clippy::derivable_impls)]
impl Default for Priority {
    fn default() -> Self {
        Priority::Normal
    }
}

/// Milliseconds since the Unix epoch; the store keeps times in this form.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// RFC 3339 rendering of a millisecond timestamp for the API.
pub fn ms_to_rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Which of a tenant's two worlds a message belongs to: the one its live
/// keys send in (real providers, the quota), or the one its test keys send
/// in (a simulated provider). Neither world can see or change the other's
/// messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum World {
    Live,
    Test,
}

impl World {
    /// The world of a message stored with this `test` mark.
    pub fn of_test(test: bool) -> Self {
        if test { World::Test } else { World::Live }
    }

    /// The `test` mark messages of this world are stored with.
    pub fn is_test(self) -> bool {
        self == World::Test
    }
}

/// A tenant in one of its worlds: what every tenant-facing read and write
/// of the store takes, so that a handler cannot forget which world its
/// caller is in. An authenticated caller's scope comes from its key; the
/// store's tenant-facing calls accept nothing less.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    tenant: String,
    world: World,
}

impl Scope {
    pub fn new(tenant: impl Into<String>, world: World) -> Self {
        Scope {
            tenant: tenant.into(),
            world,
        }
    }

    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    pub fn world(&self) -> World {
        self.world
    }

    /// The `test` mark of the messages this scope reaches.
    pub fn is_test(&self) -> bool {
        self.world.is_test()
    }
}

/// A plan: which lane a tenant's messages take and how much it may send.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Plan {
    pub name: String,
    pub lane: Lane,
    /// Sustained sends per second.
    pub rate_per_second: f64,
    /// Sends allowed at once after idle.
    pub burst: u32,
    /// Sends allowed per UTC day.
    pub daily_quota: u64,
    /// Messages of one tenant a lane consumer works on at once.
    pub max_in_flight: u32,
    /// Files a tenant may upload per minute in each of its worlds (a
    /// bucket of this many that refills over a minute).
    #[serde(default = "default_uploads_per_minute")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub uploads_per_minute: u32,
    /// Bytes of files a tenant may hold in the store in each of its worlds,
    /// used by messages or not, until their bytes are erased.
    #[serde(default = "default_upload_bytes_held")]
    #[schema(value_type = i64, minimum = 0)]
    pub upload_bytes_held: u64,
}

/// A plan's `uploads_per_minute` unless it says otherwise.
pub const DEFAULT_UPLOADS_PER_MINUTE: u32 = 60;
/// A plan's `upload_bytes_held` unless it says otherwise: 1 GiB.
pub const DEFAULT_UPLOAD_BYTES_HELD: u64 = 1 << 30;
/// The most `uploads_per_minute` a plan may give.
pub const MAX_UPLOADS_PER_MINUTE: u32 = 1_000_000;

pub fn default_uploads_per_minute() -> u32 {
    DEFAULT_UPLOADS_PER_MINUTE
}

pub fn default_upload_bytes_held() -> u64 {
    DEFAULT_UPLOAD_BYTES_HELD
}

/// A `Content-Type` value's media type, without its parameters, in lower
/// case: `application/json` of `Application/JSON; charset=utf-8`.
pub fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for status in MessageStatus::ALL {
            assert_eq!(status.as_str().parse::<MessageStatus>().unwrap(), *status);
        }
        assert_eq!(
            serde_json::to_string(&MessageStatus::DeadLettered).unwrap(),
            "\"dead_lettered\""
        );
        assert_eq!(
            "urgent".parse::<Priority>().unwrap_err(),
            "must be one of high, normal, low"
        );
    }
}
