//! `[providers]`: each channel's pool of providers, and each provider as
//! its kind: a `log`, `ses` or `http` provider holds its own settings and
//! no other kind's, so a setting of another kind (an SMS `base_url` under
//! a `ses` provider) is refused at start, named, instead of being ignored.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::bail;
use schemars::JsonSchema;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::{
    MAX_PROVIDER_PAUSE, MAX_PROVIDER_REFILL_SECS, MAX_RATE_PER_SECOND, MIN_RATE_PER_SECOND,
    is_sensible_rate,
};
use crate::model::Channel;

#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProvidersSettings {
    /// The first email provider (a pool of one unless `email_pool` names
    /// more).
    #[serde(deserialize_with = "email_provider")]
    pub email: ProviderSettings,
    /// The first SMS provider.
    #[serde(deserialize_with = "sms_provider")]
    pub sms: ProviderSettings,
    /// Further email providers, by name: `[providers.email_pool.NAME]`
    /// (`FAIRLANE__PROVIDERS__EMAIL_POOL__NAME__KIND=ses`). Each message
    /// goes to one provider of its channel's pool, chosen by weight and
    /// health (see [`crate::limits::gate`]).
    #[serde(default, deserialize_with = "email_pool")]
    pub email_pool: BTreeMap<String, ProviderSettings>,
    /// Further SMS providers, by name.
    #[serde(default, deserialize_with = "sms_pool")]
    pub sms_pool: BTreeMap<String, ProviderSettings>,
    /// When a provider of a pool loses its share and how it wins it back.
    #[serde(default)]
    pub health: ProviderHealthSettings,
}

/// One provider of a channel's pool, as configured.
#[derive(Debug, Clone, Copy)]
pub struct PoolEntry<'a> {
    /// The provider's name: the Redis gate key, the `provider` metrics
    /// label, the message's `provider`, the admin view.
    pub name: &'a str,
    /// Where it is configured (`providers.sms`, `providers.sms_pool.backup`),
    /// for error messages.
    pub path: &'a str,
    pub settings: &'a ProviderSettings,
}

impl ProvidersSettings {
    /// `channel`'s providers in order: its table first (named by its
    /// `name`, the channel's own name by default), then its pool by name.
    pub fn pool(&self, channel: Channel) -> Vec<PoolEntry<'_>> {
        let (first, path, more, more_path) = match channel {
            Channel::Email => (
                &self.email,
                "providers.email",
                &self.email_pool,
                "providers.email_pool",
            ),
            Channel::Sms => (
                &self.sms,
                "providers.sms",
                &self.sms_pool,
                "providers.sms_pool",
            ),
        };
        let mut entries = vec![PoolEntry {
            name: first.name.as_deref().unwrap_or(channel.as_str()),
            path,
            settings: first,
        }];
        entries.extend(more.iter().map(|(name, settings)| PoolEntry {
            name: name.as_str(),
            path: more_path,
            settings,
        }));
        entries
    }

    /// Every provider of both channels, with its channel.
    pub fn all(&self) -> impl Iterator<Item = (Channel, PoolEntry<'_>)> {
        Channel::ALL
            .iter()
            .copied()
            .flat_map(move |channel| self.pool(channel).into_iter().map(move |e| (channel, e)))
    }
}

/// `[providers.health]`: how a pool's routing judges its providers by
/// their recent calls. A provider whose calls in the last `window_secs`
/// (at least `min_calls` of them) failed more often than
/// `max_failure_rate` (5xx, timeouts, refused connections, and SMS
/// receipts reporting `failed`), or took longer than `max_latency_ms` on
/// average, is marked down: it gets no new messages for `down_secs`
/// while another provider of its channel can take them, then wins its
/// weight back in a straight line over `recover_secs`. Its window starts
/// empty when it is marked down, so one bad spell is not judged twice;
/// failing again while it recovers marks it down again.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ProviderHealthSettings {
    /// The span of recent calls (and, apart, SMS receipts) a provider is
    /// judged by.
    pub window_secs: u64,
    /// Calls (or receipts) in the window before it is judged at all.
    pub min_calls: u32,
    /// Share of failed calls in the window past which it is marked down.
    pub max_failure_rate: f64,
    /// Mean time of the calls that worked past which it is marked down.
    pub max_latency_ms: u64,
    /// Receipts (SMS status callbacks) coming longer than this after their
    /// sends on average, over at least `min_calls` of them, mark the
    /// provider down too.
    pub max_receipt_delay_ms: u64,
    /// How long a provider marked down gets no new messages while another
    /// provider of its channel can take them.
    pub down_secs: u64,
    /// How long it then takes to win its weight back, in a straight line
    /// from a tenth.
    pub recover_secs: u64,
}

impl Default for ProviderHealthSettings {
    fn default() -> Self {
        ProviderHealthSettings {
            window_secs: 10,
            min_calls: 10,
            max_failure_rate: 0.5,
            max_latency_ms: 5000,
            max_receipt_delay_ms: 600_000,
            down_secs: 5,
            recover_secs: 20,
        }
    }
}

/// One provider of a pool, as configured: what every kind has (its name,
/// weight, rate, timeout and circuit breaker) and its kind with that kind's
/// own settings. Read from a table through [`ProviderTable`], which refuses
/// a setting the kind does not have, in a channel's pool, which refuses a
/// kind of another channel.
#[derive(Debug, Clone)]
pub struct ProviderSettings {
    /// The first provider of a channel only: its name (see
    /// [`ProviderTable::name`]). Pool entries are named by their key.
    pub name: Option<String>,
    /// Its share of the channel's messages beside the pool's others.
    pub weight: u32,
    /// Sends per second the provider allows (with `burst`).
    pub rate_per_second: f64,
    /// Sends allowed at once after idle.
    pub burst: u32,
    /// Timeout of one provider call (and of the test world's simulated one).
    pub timeout_ms: Option<u64>,
    /// Failed calls in a row that open the circuit breaker; 0 turns it off.
    pub breaker_failures: u32,
    /// How long the breaker stays open the first time.
    pub breaker_open_ms: u64,
    /// The longest the breaker stays open.
    pub breaker_max_open_secs: u64,
    /// The kind, holding its own settings.
    pub kind: ProviderKind,
}

/// A provider's kind with its own settings.
#[derive(Debug, Clone)]
pub enum ProviderKind {
    /// Writes each delivery as a JSON line (development default; either
    /// channel).
    Log(LogSettings),
    /// Amazon SES v2 (email).
    Ses(SesSettings),
    /// A Twilio-compatible Messages API (SMS).
    Http(HttpSmsSettings),
}

/// `kind = "log"`.
#[derive(Debug, Clone, Default)]
pub struct LogSettings {
    /// The sender address (an email pool's first provider needs one).
    pub from: Option<String>,
    /// The file the JSON lines are appended to; stdout when absent.
    pub log_path: Option<PathBuf>,
}

/// `kind = "ses"`.
#[derive(Debug, Clone)]
pub struct SesSettings {
    /// The sender address.
    pub from: String,
    /// AWS region; the standard AWS chain's when absent.
    pub region: Option<String>,
    /// Endpoint override (a local SES-compatible server).
    pub endpoint_url: Option<String>,
    /// Static access key id; the standard credential chain when absent.
    pub access_key_id: Option<String>,
    /// The secret belonging to `access_key_id`.
    pub secret_access_key: Option<SecretString>,
    /// The configuration set sent with every email.
    pub configuration_set: Option<String>,
    /// The SQS queue the configuration set's events are read from.
    pub events_queue_url: Option<String>,
    /// Send each email with `TenantName` = the fairlane tenant's id.
    pub ses_tenants: bool,
}

/// `kind = "http"`.
#[derive(Debug, Clone)]
pub struct HttpSmsSettings {
    /// Base URL of the Twilio-compatible API.
    pub base_url: String,
    /// Account SID (basic-auth user).
    pub account_sid: String,
    /// Auth token (basic-auth password, and the key of the callbacks'
    /// signatures); never empty.
    pub auth_token: SecretString,
    /// Sender number.
    pub from: String,
}

impl ProviderKind {
    /// The kind as configured: `log`, `ses` or `http`.
    pub fn name(&self) -> &'static str {
        KindName::of(self).as_str()
    }

    /// Whether a provider of this kind can deliver `channel`'s messages.
    pub fn serves(&self, channel: Channel) -> bool {
        KindName::of(self).channels().contains(&channel)
    }

    /// The `ses` settings, when this is an SES provider.
    pub fn ses(&self) -> Option<&SesSettings> {
        match self {
            ProviderKind::Ses(ses) => Some(ses),
            _ => None,
        }
    }

    /// The `http` settings, when this is a Twilio-compatible provider.
    pub fn http(&self) -> Option<&HttpSmsSettings> {
        match self {
            ProviderKind::Http(http) => Some(http),
            _ => None,
        }
    }
}

impl ProviderSettings {
    /// A provider of `kind` with the figures of a fresh `[providers.*]`
    /// table (rate 10/s, burst 10, the default breaker); for tests and
    /// benchmarks that build settings in code.
    pub fn of_kind(kind: ProviderKind) -> Self {
        ProviderSettings {
            name: None,
            weight: default_weight(),
            rate_per_second: 10.0,
            burst: 10,
            timeout_ms: None,
            breaker_failures: default_breaker_failures(),
            breaker_open_ms: default_breaker_open_ms(),
            breaker_max_open_secs: default_breaker_max_open_secs(),
            kind,
        }
    }
}

/// The kind's name as written in `kind = "…"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum KindName {
    /// Writes each delivery as a JSON line (development default).
    Log,
    /// Amazon SES v2 (email only).
    Ses,
    /// Twilio-compatible Messages API (SMS only).
    Http,
}

impl KindName {
    fn of(kind: &ProviderKind) -> Self {
        match kind {
            ProviderKind::Log(_) => KindName::Log,
            ProviderKind::Ses(_) => KindName::Ses,
            ProviderKind::Http(_) => KindName::Http,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            KindName::Log => "log",
            KindName::Ses => "ses",
            KindName::Http => "http",
        }
    }

    fn channels(self) -> &'static [Channel] {
        match self {
            KindName::Log => Channel::ALL,
            KindName::Ses => &[Channel::Email],
            KindName::Http => &[Channel::Sms],
        }
    }

    /// The settings of this kind beside those every kind has.
    fn own_settings(self) -> &'static [&'static str] {
        match self {
            KindName::Log => &["from", "log_path"],
            KindName::Ses => &[
                "from",
                "region",
                "endpoint_url",
                "access_key_id",
                "secret_access_key",
                "configuration_set",
                "events_queue_url",
                "ses_tenants",
            ],
            KindName::Http => &["base_url", "account_sid", "auth_token", "from"],
        }
    }
}

/// One provider: the settings every kind has (`name`, `weight`,
/// `rate_per_second`, `burst`, `timeout_ms`, the breaker's) and its kind's
/// own, marked `log:`, `ses:` or `http:` below. A setting of another kind
/// is refused at start, named with its table.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ProviderTable {
    /// `log` (development), `ses` (email) or `http` (SMS).
    kind: KindName,
    /// The first provider of a channel only: its name (default the
    /// channel's, `email` or `sms`; 1-32 of `a-z 0-9 - _`), used as the
    /// metrics label, the Redis gate key, the message's `provider` and in
    /// the admin view. Pool entries are named by their key.
    #[serde(default)]
    name: Option<String>,
    /// Its share of the channel's messages beside the pool's other
    /// providers (1 to 1000; default 1).
    #[serde(default = "default_weight")]
    weight: u32,
    /// Sends per second the provider allows: with `burst`, the provider's
    /// contract of at most `burst + rate × t` calls in any window t. From
    /// 0.001 to 1000000, and `burst / rate_per_second` (the time an empty
    /// bucket takes to fill) at most a year. The gate starts empty at every
    /// start.
    rate_per_second: f64,
    /// Sends allowed at once after idle.
    burst: u32,
    /// log, ses and http: the sender address (email) or number (SMS).
    #[serde(default)]
    from: Option<String>,
    /// ses: AWS region; defaults to the standard AWS chain.
    #[serde(default)]
    region: Option<String>,
    /// ses: endpoint override.
    #[serde(default)]
    endpoint_url: Option<String>,
    /// ses: static access key id, for local SES-compatible servers; leave
    /// unset on AWS so the standard credential chain (env, profile, role) is used.
    #[serde(default)]
    access_key_id: Option<String>,
    /// ses: the secret belonging to `access_key_id`.
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    secret_access_key: Option<SecretString>,
    /// http: base URL of the Twilio-compatible API.
    #[serde(default)]
    base_url: Option<String>,
    /// http: account SID (basic-auth user).
    #[serde(default)]
    account_sid: Option<String>,
    /// http: auth token (basic-auth password).
    #[serde(default)]
    #[schemars(with = "Option<String>")]
    auth_token: Option<SecretString>,
    /// Timeout of one provider call (default 10 s); the test world's
    /// simulated provider of the channel times out after it too.
    #[serde(default)]
    timeout_ms: Option<u64>,
    /// log: file to append JSON lines to; stdout when absent.
    #[serde(default)]
    log_path: Option<PathBuf>,
    /// ses: the configuration set sent with every email, whose event
    /// destination publishes delivery, bounce and complaint events to SNS.
    #[serde(default)]
    configuration_set: Option<String>,
    /// ses: the SQS queue subscribed to that SNS topic; fairlane reads the
    /// events from it (with this provider's region, endpoint and keys).
    #[serde(default)]
    events_queue_url: Option<String>,
    /// ses: send each email with `TenantName` = the fairlane tenant's id,
    /// so SES keeps each tenant's reputation apart (the SES tenants must
    /// exist; see the book's "Sender identities"). Off when unset.
    #[serde(default)]
    ses_tenants: Option<bool>,
    /// Failed calls in a row (5xx, timeouts, refused connections) that open
    /// this provider's circuit breaker; 0 turns it off.
    #[serde(default = "default_breaker_failures")]
    breaker_failures: u32,
    /// How long the breaker stays open the first time, in milliseconds; it
    /// doubles each time the failures go on, up to `breaker_max_open_secs`
    /// (each at most an hour, as a provider's `Retry-After`).
    #[serde(default = "default_breaker_open_ms")]
    breaker_open_ms: u64,
    /// The longest the breaker stays open, in seconds (at most an hour).
    #[serde(default = "default_breaker_max_open_secs")]
    breaker_max_open_secs: u64,
}

impl ProviderTable {
    /// The kind-specific settings this table sets, by name.
    fn kind_settings_set(&self) -> Vec<&'static str> {
        let set = [
            ("from", self.from.is_some()),
            ("region", self.region.is_some()),
            ("endpoint_url", self.endpoint_url.is_some()),
            ("access_key_id", self.access_key_id.is_some()),
            ("secret_access_key", self.secret_access_key.is_some()),
            ("base_url", self.base_url.is_some()),
            ("account_sid", self.account_sid.is_some()),
            ("auth_token", self.auth_token.is_some()),
            ("log_path", self.log_path.is_some()),
            ("configuration_set", self.configuration_set.is_some()),
            ("events_queue_url", self.events_queue_url.is_some()),
            ("ses_tenants", self.ses_tenants.is_some()),
        ];
        set.into_iter()
            .filter(|(_, on)| *on)
            .map(|(name, _)| name)
            .collect()
    }
}

/// `value`, which `kind` needs and must not be empty.
fn required(value: Option<String>, key: &str, kind: KindName) -> Result<String, String> {
    value
        .filter(|value| !value.trim().is_empty())
        .ok_or_else(|| format!("{key} is required when kind = \"{}\"", kind.as_str()))
}

impl TryFrom<ProviderTable> for ProviderSettings {
    type Error = String;

    fn try_from(table: ProviderTable) -> Result<Self, String> {
        let kind = table.kind;
        let own = kind.own_settings();
        if let Some(foreign) = table
            .kind_settings_set()
            .into_iter()
            .find(|key| !own.contains(key))
        {
            return Err(format!(
                "{foreign} is not a setting of a provider of kind \"{}\" (its own: {})",
                kind.as_str(),
                own.join(", ")
            ));
        }
        let settings = match kind {
            KindName::Log => ProviderKind::Log(LogSettings {
                from: table.from,
                log_path: table.log_path,
            }),
            KindName::Ses => ProviderKind::Ses(SesSettings {
                from: required(table.from, "from", kind)?,
                region: table.region,
                endpoint_url: table.endpoint_url,
                access_key_id: table.access_key_id,
                secret_access_key: table.secret_access_key,
                configuration_set: table.configuration_set,
                events_queue_url: table.events_queue_url,
                ses_tenants: table.ses_tenants.unwrap_or(false),
            }),
            KindName::Http => {
                // An empty token would sign callbacks with an empty key,
                // which anyone can forge.
                let token = table
                    .auth_token
                    .map(|token| token.expose_secret().to_owned());
                ProviderKind::Http(HttpSmsSettings {
                    base_url: required(table.base_url, "base_url", kind)?,
                    account_sid: required(table.account_sid, "account_sid", kind)?,
                    auth_token: required(token, "auth_token", kind)?.into(),
                    from: required(table.from, "from", kind)?,
                })
            }
        };
        Ok(ProviderSettings {
            name: table.name,
            weight: table.weight,
            rate_per_second: table.rate_per_second,
            burst: table.burst,
            timeout_ms: table.timeout_ms,
            breaker_failures: table.breaker_failures,
            breaker_open_ms: table.breaker_open_ms,
            breaker_max_open_secs: table.breaker_max_open_secs,
            kind: settings,
        })
    }
}

/// A provider table of one channel's pool: a kind of another channel is
/// refused first, then the table is made into its kind's settings.
struct OfChannel<const EMAIL: bool>(ProviderSettings);

impl<'de, const EMAIL: bool> Deserialize<'de> for OfChannel<EMAIL> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let channel = if EMAIL { Channel::Email } else { Channel::Sms };
        let table = ProviderTable::deserialize(deserializer)?;
        if !table.kind.channels().contains(&channel) {
            let kinds: Vec<String> = [KindName::Log, KindName::Ses, KindName::Http]
                .into_iter()
                .filter(|kind| kind.channels().contains(&channel))
                .map(|kind| format!("\"{}\"", kind.as_str()))
                .collect();
            return Err(D::Error::custom(format!(
                "kind \"{}\" cannot deliver {channel} (a provider of {channel} is {})",
                table.kind.as_str(),
                kinds.join(" or ")
            )));
        }
        ProviderSettings::try_from(table)
            .map(OfChannel)
            .map_err(D::Error::custom)
    }
}

fn email_provider<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ProviderSettings, D::Error> {
    OfChannel::<true>::deserialize(d).map(|provider| provider.0)
}

fn sms_provider<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ProviderSettings, D::Error> {
    OfChannel::<false>::deserialize(d).map(|provider| provider.0)
}

fn email_pool<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, ProviderSettings>, D::Error> {
    let pool = BTreeMap::<String, OfChannel<true>>::deserialize(d)?;
    Ok(pool
        .into_iter()
        .map(|(name, provider)| (name, provider.0))
        .collect())
}

fn sms_pool<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, ProviderSettings>, D::Error> {
    let pool = BTreeMap::<String, OfChannel<false>>::deserialize(d)?;
    Ok(pool
        .into_iter()
        .map(|(name, provider)| (name, provider.0))
        .collect())
}

/// The reference documents a provider as the table it is written as.
impl JsonSchema for ProviderSettings {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ProviderSettings".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        ProviderTable::json_schema(generator)
    }
}

fn default_weight() -> u32 {
    1
}

fn default_breaker_failures() -> u32 {
    5
}

fn default_breaker_open_ms() -> u64 {
    1000
}

fn default_breaker_max_open_secs() -> u64 {
    30
}

impl ProvidersSettings {
    /// Checks every provider of both pools: figures in range, what its
    /// kind needs, names that can be Redis keys and metric labels.
    pub(super) fn validate(&self) -> anyhow::Result<()> {
        // One name, one provider, across both channels: the gate's Redis
        // bucket (`{prefix}:gate:{name}`), its metrics and its callback URL
        // are keyed by the name alone, so an email and an SMS provider of
        // one name would share a bucket.
        let mut seen: std::collections::HashMap<&str, Channel> = std::collections::HashMap::new();
        for channel in Channel::ALL.iter().copied() {
            for entry in self.pool(channel) {
                let path = if entry.path.ends_with("_pool") {
                    format!("{}.{}", entry.path, entry.name)
                } else {
                    entry.path.to_owned()
                };
                if entry.path.ends_with("_pool") && entry.settings.name.is_some() {
                    bail!("{path}.name must not be set: a pool entry is named by its key");
                }
                validate_provider(&path, channel, entry.name, entry.settings)?;
                match seen.insert(entry.name, channel) {
                    Some(first) if first == channel => bail!(
                        "{path}: the name {:?} is used twice among the {channel} providers",
                        entry.name
                    ),
                    Some(first) => bail!(
                        "{path}: the name {:?} is already one of the {first} providers; a \
                         name is one provider across both channels (its rate limit, metrics \
                         and callbacks are keyed by it)",
                        entry.name
                    ),
                    None => {}
                }
            }
        }
        let health = &self.health;
        if health.window_secs == 0 || health.window_secs > 3600 {
            bail!("providers.health.window_secs must be between 1 and 3600");
        }
        if health.min_calls == 0 {
            bail!("providers.health.min_calls must be at least 1");
        }
        if !(health.max_failure_rate > 0.0 && health.max_failure_rate <= 1.0) {
            bail!("providers.health.max_failure_rate must be above 0 and at most 1");
        }
        if health.max_latency_ms == 0 || health.max_receipt_delay_ms == 0 {
            bail!("providers.health.max_latency_ms and max_receipt_delay_ms must be at least 1");
        }
        if health.down_secs > 3600 || health.recover_secs > 3600 {
            bail!("providers.health.down_secs and recover_secs must be at most 3600");
        }
        Ok(())
    }
}

/// Checks one provider, configured at `path`, of `channel`'s pool.
fn validate_provider(
    path: &str,
    channel: Channel,
    name: &str,
    provider: &ProviderSettings,
) -> anyhow::Result<()> {
    if name.is_empty()
        || name.len() > 32
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_".contains(&b))
    {
        bail!(
            "{path}: a provider's name must be 1-32 characters of a-z, 0-9, '-' or '_' (got {name:?})"
        );
    }
    if provider.weight == 0 || provider.weight > 1000 {
        bail!("{path}.weight must be between 1 and 1000");
    }
    if !is_sensible_rate(provider.rate_per_second) {
        bail!(
            "{path}.rate_per_second must be a number from {MIN_RATE_PER_SECOND} to {MAX_RATE_PER_SECOND}"
        );
    }
    if provider.burst == 0 {
        bail!("{path}.burst must be at least 1");
    }
    if f64::from(provider.burst) / provider.rate_per_second > MAX_PROVIDER_REFILL_SECS {
        bail!(
            "{path}.burst / rate_per_second (the time an empty bucket takes to fill) must be at most {MAX_PROVIDER_REFILL_SECS} s"
        );
    }
    let max_open = MAX_PROVIDER_PAUSE.as_secs();
    if provider.breaker_open_ms > max_open * 1000 || provider.breaker_max_open_secs > max_open {
        bail!("{path}.breaker_open_ms and breaker_max_open_secs must be at most {max_open} s");
    }
    if !provider.kind.serves(channel) {
        let kinds: Vec<String> = [KindName::Log, KindName::Ses, KindName::Http]
            .into_iter()
            .filter(|kind| kind.channels().contains(&channel))
            .map(|kind| format!("\"{}\"", kind.as_str()))
            .collect();
        bail!("{path}.kind must be {}", kinds.join(" or "));
    }
    match &provider.kind {
        ProviderKind::Ses(ses) => {
            if ses.access_key_id.is_some() != ses.secret_access_key.is_some() {
                bail!("{path}.access_key_id and secret_access_key must be set together");
            }
        }
        ProviderKind::Log(log) => {
            if channel == Channel::Email && log.from.as_deref().unwrap_or("").is_empty() {
                bail!("{path}.from is required");
            }
        }
        ProviderKind::Http(_) => {}
    }
    Ok(())
}
