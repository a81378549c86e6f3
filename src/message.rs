//! The send request: field-by-field validation of `POST /v1/messages` and
//! the delivery payload that travels through the queue.
//!
//! Validation reads the JSON object key by key instead of deserializing into
//! a struct, so one answer names every bad field at once, and a misspelt key
//! (`subjet`) is refused instead of silently dropped.
//!
//! Also the message's other shapes that cross the service: what goes on a
//! lane ([`OutboundMessage`]), its status row ([`MessageRecord`]) and its
//! status as clients and webhooks see it ([`MessageView`]).

pub mod addresses;
mod view;

use addresses::{check_to, copies, sendable_address};
pub use addresses::{is_e164, is_email_address};
use std::collections::BTreeMap;
use std::time::Duration;
pub use view::{MessageRecord, MessageView, RecipientRecord, RecipientView};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use crate::model::{Channel, Lane, Priority};

/// A message to put on a lane.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboundMessage {
    pub message_id: String,
    pub tenant_id: String,
    pub channel: Channel,
    pub priority: Priority,
    /// The delivery payload (JSON); at most 256 KiB.
    pub body: String,
    /// Not receivable before this has passed.
    pub delay: Duration,
}

/// Longest email address (RFC 5321 path limit).
pub const MAX_EMAIL_LEN: usize = 254;
/// Longest subject line (RFC 5322 line limit).
pub const MAX_SUBJECT_CHARS: usize = 998;
/// Largest text or html part of an email, in bytes.
pub const MAX_EMAIL_PART_BYTES: usize = 100 * 1024;
/// Largest text + html of one email, in bytes; with the envelope this stays
/// under SQS's 256 KiB message limit.
pub const MAX_EMAIL_BODY_BYTES: usize = 160 * 1024;
/// Longest SMS text (ten concatenated segments).
pub const MAX_SMS_CHARS: usize = 1600;
/// Longest caller reference.
pub const MAX_REFERENCE_CHARS: usize = 255;
/// Largest metadata object, serialized.
pub const MAX_METADATA_BYTES: usize = 4096;
/// Most keys in the metadata object.
pub const MAX_METADATA_KEYS: usize = 50;
/// Largest queue payload (SQS's limit).
pub const MAX_PAYLOAD_BYTES: usize = 256 * 1024;

const EMAIL_FIELDS: &[&str] = &[
    "channel",
    "to",
    "subject",
    "text",
    "html",
    "priority",
    "reference",
    "metadata",
    "send_at",
    "sender_id",
    "unsubscribe",
    "headers",
    "cc",
    "bcc",
    "template_id",
    "template_version",
    "personalisation",
    "locale",
    "attachments",
];
const SMS_FIELDS: &[&str] = &[
    "channel",
    "to",
    "text",
    "priority",
    "reference",
    "metadata",
    "send_at",
    "sender_id",
    "template_id",
    "template_version",
    "personalisation",
    "locale",
];

/// Most custom headers on one email.
pub const MAX_CUSTOM_HEADERS: usize = 10;
/// Longest custom header value, in characters: SES v2's limit
/// (`MessageHeader.Value`, 1-870 printable ASCII characters).
pub const MAX_HEADER_VALUE_CHARS: usize = 870;
/// Headers an email's `headers` may set besides `X-…` ones (any case).
/// The sender, the recipients, the subject, the structure of the message,
/// its signatures and the unsubscribe headers are fairlane's to write.
pub const ALLOWED_HEADERS: &[&str] = &[
    "List-Id",
    "List-Help",
    "List-Subscribe",
    "List-Owner",
    "List-Archive",
    "List-Post",
    "Precedence",
    "Auto-Submitted",
    "In-Reply-To",
    "References",
    "Keywords",
    "Comments",
];

/// True for a header a tenant may set: one of [`ALLOWED_HEADERS`], or an
/// `X-` header other than SES's own `X-SES-…`; 1-64 letters, digits and
/// `-`.
pub fn is_allowed_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && ((lower.starts_with("x-") && lower.len() > 2 && !lower.starts_with("x-ses-"))
            || ALLOWED_HEADERS
                .iter()
                .any(|allowed| allowed.eq_ignore_ascii_case(name)))
}

/// One header of an email, as the delivery payload carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmailHeader {
    pub name: String,
    pub value: String,
}

/// The part of an identity a message carries in its delivery payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SenderOnMessage {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reply_to: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configuration_set: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messaging_service_sid: Option<String>,
}

/// Longest `sender_id` accepted.
pub const MAX_SENDER_ID_CHARS: usize = 64;

/// Furthest a message may be scheduled ahead.
pub const MAX_SCHEDULE_AHEAD_MS: i64 = 30 * 24 * 60 * 60 * 1000;

/// A validated send request.
#[derive(Debug, Clone, PartialEq)]
pub struct NewMessage {
    pub channel: Channel,
    pub to: String,
    pub subject: Option<String>,
    pub text: String,
    pub html: Option<String>,
    pub priority: Priority,
    pub reference: Option<String>,
    pub metadata: Option<Map<String, Value>>,
    /// When to send (ms since the epoch), if later than now.
    pub send_at: Option<i64>,
    /// The sender identity the caller named, not yet checked against the
    /// tenant's (that happens where the tenant is known).
    pub sender_id: Option<String>,
    /// Email: one-click unsubscribe asked for (`Some(true)`), refused
    /// (`Some(false)`), or the tenant's default (`None`).
    pub unsubscribe: Option<bool>,
    /// Email: the caller's own headers, from the allowed ones.
    pub headers: Vec<EmailHeader>,
    /// Email: copies to these addresses, named in the message.
    pub cc: Vec<String>,
    /// Email: copies to these addresses, named in no header.
    pub bcc: Vec<String>,
    /// Copies left out because the address is suppressed (found where the
    /// tenant is known).
    pub suppressed: Vec<String>,
    /// Sent by template: which, and its personalisation. The content
    /// fields are then empty until the template is rendered.
    pub template: Option<TemplateSend>,
    /// The lane the template names (none: the plan's).
    pub lane: Option<Lane>,
    /// Email: the ids of uploaded files to attach, as asked; once the
    /// tenant is known, each file's name, type and size.
    pub attachments: Vec<AttachmentOnMessage>,
}

/// Most files one email may carry.
pub const MAX_ATTACHMENTS: usize = 10;

/// A file an email carries: the queue holds its id, name, type and size,
/// never its bytes, which the consumer reads from the store just before
/// the provider call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachmentOnMessage {
    pub id: String,
    #[serde(default)]
    pub filename: String,
    #[serde(default)]
    pub content_type: String,
    #[serde(default)]
    pub size: i64,
    /// Its bytes, read at delivery; never queued.
    #[serde(skip)]
    pub data: bytes::Bytes,
}

/// A send by template, as asked: its version and locale are resolved
/// against the tenant's templates where the tenant is known.
#[derive(Debug, Clone, PartialEq)]
pub struct TemplateSend {
    pub id: String,
    /// None: the newest; once resolved, the version used.
    pub version: Option<u32>,
    /// The locale asked for; once resolved, the variant used (none: the
    /// default).
    pub locale: Option<String>,
    pub personalisation: BTreeMap<String, String>,
}

/// The template a queued message is rendered from at delivery: the
/// version it was accepted with, the variant chosen then, and the values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateOnMessage {
    pub id: String,
    pub version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locale: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub personalisation: BTreeMap<String, String>,
}

/// Most recipients of one email, `to`, `cc` and `bcc` together (SES's
/// limit per message).
pub const MAX_RECIPIENTS: usize = 50;

/// Width the text derived from an email's HTML is wrapped at.
const DERIVED_TEXT_WIDTH: usize = 78;

/// The plain-text alternative of an HTML part: its text, wrapped, with
/// links listed as footnotes (html2text's plain rendering).
pub fn text_of_html(html: &str) -> String {
    html2text::config::plain()
        .string_from_read(html.as_bytes(), DERIVED_TEXT_WIDTH)
        .unwrap_or_default()
        .trim_end()
        .to_owned()
}

/// Longest template id a send may name.
pub const MAX_TEMPLATE_ID_CHARS: usize = 64;
/// Most personalisation values in one send.
pub const MAX_PERSONALISATION_KEYS: usize = 100;
/// Longest personalisation value, in characters.
pub const MAX_PERSONALISATION_VALUE_CHARS: usize = 10_000;
/// Largest personalisation object, as JSON.
pub const MAX_PERSONALISATION_BYTES: usize = 64 * 1024;

/// True for a locale name: a 2-3 letter language, then `-` subtags of
/// 2-8 letters or digits (`fr`, `fr-CA`, `zh-Hant-TW`), at most 35 bytes.
pub fn is_locale(locale: &str) -> bool {
    let mut parts = locale.split('-');
    let language = parts.next().unwrap_or("");
    locale.len() <= 35
        && (2..=3).contains(&language.len())
        && language.bytes().all(|b| b.is_ascii_alphabetic())
        && parts.all(|part| {
            (2..=8).contains(&part.len()) && part.bytes().all(|b| b.is_ascii_alphanumeric())
        })
}

/// What a consumer needs to deliver a message; the queue entry's body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeliveryPayload {
    pub id: String,
    pub tenant_id: String,
    pub channel: Channel,
    pub to: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// Empty for a send by template until it is rendered at delivery.
    #[serde(default)]
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub html: Option<String>,
    pub priority: Priority,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// Email: copies, named in the message's Cc.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cc: Vec<String>,
    /// Email: blind copies, in the provider call's destination only.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bcc: Vec<String>,
    /// The tenant's identity it goes out with; none: the configured sender.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sender: Option<SenderOnMessage>,
    /// Email: headers to add, the caller's and `List-Unsubscribe`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<EmailHeader>,
    /// Sent with a test key: the simulated provider answers it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub test: bool,
    /// Set by the consumer from the store, never queued: an earlier
    /// attempt failed (the status read before this one was `retrying`). The
    /// simulated provider decides a `temporary@` recipient's outcome from
    /// it, so every instance answers the same attempt alike.
    #[serde(skip)]
    pub retrying: bool,
    /// Sent by template: rendered into `subject`, `text` and `html` just
    /// before the provider call, so the queue holds no rendered body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<TemplateOnMessage>,
    /// Email: the files it carries, by reference.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attachments: Vec<AttachmentOnMessage>,
    /// With traces on: the W3C `traceparent` of the span that queued it,
    /// which the consumer's span continues. Kept last: see
    /// `telemetry::traceparent_in`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

// The channel of each request kind has exactly one value, so exactly one
// branch of `SendMessageRequest`'s `oneOf` matches a request.

/// `email`
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
enum EmailChannel {
    Email,
}

/// `sms`
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
enum SmsChannel {
    Sms,
}

// Patterns of the documentation schemas: `NON_BLANK` is text that is not
// blank (Rust's `char::is_whitespace` set, spelt out so every regex engine
// reads it alike) and holds no U+FFFE or U+FFFF (an SQS message cannot carry
// them); the shorter one only the latter. utoipa takes literals only, so
// they are written out where used.

/// Email send request (documentation schema).
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct SendEmailRequest {
    // No doc comment: utoipa would wrap the inlined enum in an `allOf` with
    // an `object` schema to carry it, which no string satisfies.
    #[schema(inline)]
    channel: EmailChannel,
    /// Recipient address, e.g. `a@example.com` (at most 254 characters).
    #[schema(format = Email, min_length = 3, max_length = 254)]
    to: String,
    /// Subject line: 1-998 characters, not blank, no line breaks. Required
    /// unless the send names a `template_id`, and then not allowed.
    #[schema(
        min_length = 1,
        max_length = 998,
        pattern = r"^[^\r\n\uFFFE\uFFFF]*[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFFFE\uFFFF][^\r\n\uFFFE\uFFFF]*$"
    )]
    subject: Option<String>,
    /// Plain-text body, not blank, at most 100 KiB. Required unless `html`
    /// is given (the text is then derived from the HTML) or the send names
    /// a `template_id` (then not allowed).
    #[schema(
        min_length = 1,
        max_length = 102400,
        pattern = r"^[^\uFFFE\uFFFF]*[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFFFE\uFFFF][^\uFFFE\uFFFF]*$"
    )]
    text: Option<String>,
    /// HTML body, at most 100 KiB (text + html at most 160 KiB); sent with
    /// the text as `multipart/alternative`. Not allowed with `template_id`.
    #[schema(max_length = 102400, pattern = r"^[^\uFFFE\uFFFF]*$")]
    html: Option<String>,
    /// Copies, named in the message (`to`, `cc` and `bcc` at most 50
    /// addresses together, none repeated). An address on the tenant's
    /// suppression list is left out and named in the answer's `suppressed`.
    #[schema(max_items = 49)]
    cc: Option<Vec<String>>,
    /// Blind copies, named in no header; as `cc` otherwise.
    #[schema(max_items = 49)]
    bcc: Option<Vec<String>>,
    /// Files to attach: at most 10 ids of the caller's uploads
    /// (`POST /v1/attachments`), none repeated, 25 MiB in all. A file serves
    /// any number of sends until it expires (`expires_at`, a day after its
    /// upload) or is deleted.
    #[schema(max_items = 10)]
    attachments: Option<Vec<String>>,
    /// Send by template (`tpl_…`): the template gives the subject, text
    /// and HTML, filled from `personalisation`.
    #[schema(min_length = 1, max_length = 64)]
    template_id: Option<String>,
    /// The template's version (default: the newest).
    #[schema(minimum = 1)]
    template_version: Option<u32>,
    /// Placeholder names to values (strings, numbers or true/false), at
    /// most 100 values of at most 10,000 characters, 64 KiB in all.
    #[schema(value_type = Option<std::collections::HashMap<String, String>>)]
    personalisation: Option<Value>,
    /// The template variant's locale (`fr-CA` falls back to `fr`, then to
    /// the default).
    #[schema(max_length = 35, pattern = r"^[A-Za-z]{2,3}(?:-[A-Za-z0-9]{2,8})*$")]
    locale: Option<String>,
    priority: Option<Priority>,
    /// Caller's own reference, at most 255 characters; returned by the status endpoint.
    #[schema(max_length = 255, pattern = r"^[^\uFFFE\uFFFF]*$")]
    reference: Option<String>,
    /// Free-form JSON object, at most 50 keys and 4 KiB.
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
    /// Send later: an RFC 3339 date-time with a time zone, at most 30 days
    /// ahead (a time already past means now). The message is `scheduled`
    /// until then.
    #[schema(format = DateTime)]
    send_at: Option<String>,
    /// One of the tenant's email sender identities (`snd_…`); without it
    /// the tenant's default email identity, then the configured sender.
    #[schema(min_length = 1, max_length = 64)]
    sender_id: Option<String>,
    /// One-click unsubscribe (RFC 8058): `List-Unsubscribe` with a signed
    /// link under the server's public URL and `List-Unsubscribe-Post`.
    /// Default: the tenant's `unsubscribe_default`.
    unsubscribe: Option<bool>,
    /// Headers of the tenant's own, at most 10: `X-…` headers (not
    /// `X-SES-…`) and `List-Id`, `List-Help`, `List-Subscribe`,
    /// `List-Owner`, `List-Archive`, `List-Post`, `Precedence`,
    /// `Auto-Submitted`, `In-Reply-To`, `References`, `Keywords`,
    /// `Comments`; values 1-870 printable ASCII characters (space to `~`),
    /// as SES takes them.
    #[schema(value_type = Option<std::collections::HashMap<String, String>>)]
    headers: Option<Value>,
}

/// SMS send request (documentation schema).
#[derive(Debug, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct SendSmsRequest {
    #[schema(inline)]
    channel: SmsChannel,
    /// Recipient in E.164 form, e.g. `+15551234567`.
    #[schema(pattern = r"^\+[1-9][0-9]{7,14}$")]
    to: String,
    /// Message text, 1-1600 characters, not blank. Required unless the
    /// send names a `template_id`, and then not allowed.
    #[schema(
        min_length = 1,
        max_length = 1600,
        pattern = r"^[^\uFFFE\uFFFF]*[^\t\n\u000B\f\r \u0085\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFFFE\uFFFF][^\uFFFE\uFFFF]*$"
    )]
    text: Option<String>,
    priority: Option<Priority>,
    /// Caller's own reference, at most 255 characters.
    #[schema(max_length = 255, pattern = r"^[^\uFFFE\uFFFF]*$")]
    reference: Option<String>,
    #[schema(value_type = Option<Object>)]
    metadata: Option<Value>,
    /// Send later, as for email.
    #[schema(format = DateTime)]
    send_at: Option<String>,
    /// One of the tenant's SMS sender identities (`snd_…`); without it the
    /// tenant's default SMS identity, then the configured sender.
    #[schema(min_length = 1, max_length = 64)]
    sender_id: Option<String>,
    /// Send by template (`tpl_…`), as for email.
    #[schema(min_length = 1, max_length = 64)]
    template_id: Option<String>,
    /// The template's version (default: the newest).
    #[schema(minimum = 1)]
    template_version: Option<u32>,
    /// Placeholder names to values, as for email.
    #[schema(value_type = Option<std::collections::HashMap<String, String>>)]
    personalisation: Option<Value>,
    /// The template variant's locale, as for email.
    #[schema(max_length = 35, pattern = r"^[A-Za-z]{2,3}(?:-[A-Za-z0-9]{2,8})*$")]
    locale: Option<String>,
}

/// A send request: an email or an SMS, told apart by `channel`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
#[schema(discriminator(property_name = "channel", mapping(
    ("email" = "#/components/schemas/SendEmailRequest"),
    ("sms" = "#/components/schemas/SendSmsRequest"),
)))]
#[allow(dead_code)]
pub enum SendMessageRequest {
    Email(SendEmailRequest),
    Sms(SendSmsRequest),
}

type Errors = BTreeMap<String, String>;

/// Most unknown fields of one request object named in its errors; the rest
/// are counted in one more error, so the answer to a body of thousands of
/// unknown keys stays small.
pub const MAX_UNKNOWN_FIELDS_NAMED: usize = 3;

/// Longest field name echoed in an error, in characters; a longer one is
/// cut and ends in `…`.
pub const MAX_FIELD_NAME_ECHOED: usize = 64;

/// `key` as an error names it: cut to [`MAX_FIELD_NAME_ECHOED`] characters.
pub fn field_name(key: &str) -> String {
    match key.char_indices().nth(MAX_FIELD_NAME_ECHOED) {
        None => key.to_owned(),
        Some((cut, _)) => format!("{}…", &key[..cut]),
    }
}

fn optional_string<'a>(
    object: &'a Map<String, Value>,
    field: &str,
    errors: &mut Errors,
) -> Option<&'a str> {
    match object.get(field) {
        None | Some(Value::Null) => None,
        // U+FFFE and U+FFFF are valid JSON but not allowed in an SQS
        // message: refused here rather than failing at the queue.
        Some(Value::String(s)) if s.contains(['\u{FFFE}', '\u{FFFF}']) => {
            errors.insert(
                field.to_owned(),
                "must not contain the noncharacters U+FFFE or U+FFFF".to_owned(),
            );
            None
        }
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => {
            errors.insert(field.to_owned(), "must be a string".to_owned());
            None
        }
    }
}

fn required_string<'a>(
    object: &'a Map<String, Value>,
    field: &str,
    errors: &mut Errors,
) -> Option<&'a str> {
    if matches!(object.get(field), None | Some(Value::Null)) {
        errors.insert(field.to_owned(), "is required".to_owned());
        return None;
    }
    optional_string(object, field, errors)
}

/// Validates a parsed JSON body; on failure, every bad field with a message.
pub fn validate(body: &Value) -> Result<NewMessage, Errors> {
    let mut errors = Errors::new();
    let Value::Object(object) = body else {
        errors.insert("body".into(), "must be a JSON object".into());
        return Err(errors);
    };

    let channel = channel_of(object, &mut errors);

    refuse_unknown_fields(object, channel, &mut errors);

    let to = required_string(object, "to", &mut errors);
    if let (Some(channel), Some(to)) = (channel, to) {
        check_to(channel, to, &mut errors);
    }
    let template = template_of(object, &mut errors);
    let html_given =
        channel == Some(Channel::Email) && matches!(object.get("html"), Some(Value::String(_)));
    let text = match template {
        Some(_) => Some(""),
        // An email's text may be left to be derived from its HTML.
        None if html_given && matches!(object.get("text"), None | Some(Value::Null)) => Some(""),
        None => required_string(object, "text", &mut errors),
    };
    let (cc, bcc) = copies(object, to, &mut errors);
    let (subject, html) = match (channel, &template) {
        (Some(Channel::Email), None) => email_content(object, text, &mut errors),
        (Some(Channel::Sms), None) => {
            check_sms_content(text, &mut errors);
            (None, None)
        }
        _ => (None, None),
    };

    let priority = priority_of(object, &mut errors);
    let reference = reference_of(object, &mut errors);

    let metadata = metadata_of(object, &mut errors);
    let send_at = send_at_of(object, &mut errors);

    let sender_id = sender_id_of(object, &mut errors);
    let unsubscribe = unsubscribe_of(object, &mut errors);
    let headers = custom_headers(object.get("headers"), &mut errors);
    let attachments = attachments_of(object.get("attachments"), &mut errors);

    match (errors.is_empty(), channel, to, text) {
        (true, Some(channel), Some(to), Some(text)) => Ok(NewMessage {
            channel,
            // An email address as the provider takes it (its domain in
            // Punycode): stored, sent and matched against suppressions so.
            to: match channel {
                Channel::Email => sendable_address(to).unwrap_or_else(|_| to.to_owned()),
                Channel::Sms => to.to_owned(),
            },
            subject: subject.map(str::to_owned),
            text: match (text.is_empty(), html) {
                (true, Some(html)) => text_of_html(html),
                _ => text.to_owned(),
            },
            html: html.map(str::to_owned),
            priority,
            reference: reference.map(str::to_owned),
            metadata,
            send_at,
            sender_id: sender_id.map(str::to_owned),
            unsubscribe,
            headers,
            cc,
            bcc,
            suppressed: Vec::new(),
            template,
            lane: None,
            attachments,
        }),
        _ => Err(errors),
    }
}

/// The body's `channel`, when it names one.
fn channel_of(object: &Map<String, Value>, errors: &mut Errors) -> Option<Channel> {
    let word = required_string(object, "channel", errors)?;
    match word.parse::<Channel>() {
        Ok(channel) => Some(channel),
        Err(message) => {
            errors.insert("channel".into(), message);
            None
        }
    }
}

/// The body's `priority`, `normal` when it names none.
fn priority_of(object: &Map<String, Value>, errors: &mut Errors) -> Priority {
    match optional_string(object, "priority", errors) {
        None => Priority::Normal,
        Some(word) => word.parse().unwrap_or_else(|message: String| {
            errors.insert("priority".into(), message);
            Priority::Normal
        }),
    }
}

/// The body's `reference`, at most [`MAX_REFERENCE_CHARS`] characters.
fn reference_of<'a>(object: &'a Map<String, Value>, errors: &mut Errors) -> Option<&'a str> {
    let reference = optional_string(object, "reference", errors);
    if let Some(r) = reference
        && r.chars().count() > MAX_REFERENCE_CHARS
    {
        errors.insert(
            "reference".into(),
            format!("must be at most {MAX_REFERENCE_CHARS} characters"),
        );
    }
    reference
}

/// The body's `sender_id`, 1-[`MAX_SENDER_ID_CHARS`] characters.
fn sender_id_of<'a>(object: &'a Map<String, Value>, errors: &mut Errors) -> Option<&'a str> {
    let sender_id = optional_string(object, "sender_id", errors);
    if let Some(id) = sender_id
        && (id.is_empty() || id.chars().count() > MAX_SENDER_ID_CHARS)
    {
        errors.insert(
            "sender_id".into(),
            format!("must be 1-{MAX_SENDER_ID_CHARS} characters"),
        );
    }
    sender_id
}

/// The body's `unsubscribe`: true, false, or absent (the tenant's default).
fn unsubscribe_of(object: &Map<String, Value>, errors: &mut Errors) -> Option<bool> {
    match object.get("unsubscribe") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(wanted)) => Some(*wanted),
        Some(_) => {
            errors.insert("unsubscribe".into(), "must be true or false".into());
            None
        }
    }
}

/// Names each field the channel does not take (at most
/// `MAX_UNKNOWN_FIELDS_NAMED`, then a count).
fn refuse_unknown_fields(
    object: &Map<String, Value>,
    channel: Option<Channel>,
    errors: &mut Errors,
) {
    let allowed: &[&str] = match channel {
        Some(Channel::Email) => EMAIL_FIELDS,
        Some(Channel::Sms) => SMS_FIELDS,
        None => EMAIL_FIELDS,
    };
    let mut unknown = 0usize;
    for key in object.keys() {
        if !allowed.contains(&key.as_str()) {
            unknown += 1;
            if unknown > MAX_UNKNOWN_FIELDS_NAMED {
                continue;
            }
            let message = if channel == Some(Channel::Sms) && EMAIL_FIELDS.contains(&key.as_str()) {
                "is not allowed for sms messages".to_owned()
            } else {
                format!("unknown field; allowed fields are {}", allowed.join(", "))
            };
            errors.insert(field_name(key), message);
        }
    }
    if unknown > MAX_UNKNOWN_FIELDS_NAMED {
        errors.insert(
            "body".into(),
            format!(
                "has {} more unknown fields, not named here",
                unknown - MAX_UNKNOWN_FIELDS_NAMED
            ),
        );
    }
}

/// An email's recipient, subject, text and HTML checked; its subject and
/// HTML as given.
fn email_content<'a>(
    object: &'a Map<String, Value>,
    text: Option<&str>,
    errors: &mut Errors,
) -> (Option<&'a str>, Option<&'a str>) {
    let subject = required_string(object, "subject", errors);
    if let Some(s) = subject {
        if s.trim().is_empty() {
            errors.insert("subject".into(), "must not be empty".into());
        } else if s.chars().count() > MAX_SUBJECT_CHARS {
            errors.insert(
                "subject".into(),
                format!("must be at most {MAX_SUBJECT_CHARS} characters"),
            );
        } else if s.contains(['\r', '\n']) {
            errors.insert("subject".into(), "must not contain line breaks".into());
        }
    }
    let html = optional_string(object, "html", errors);
    if let Some(h) = html
        && h.len() > MAX_EMAIL_PART_BYTES
    {
        errors.insert(
            "html".into(),
            format!("must be at most {MAX_EMAIL_PART_BYTES} bytes"),
        );
    }
    if let Some(t) = text {
        if t.trim().is_empty() && !(t.is_empty() && html.is_some_and(|h| !h.trim().is_empty())) {
            errors.insert("text".into(), "must not be empty".into());
        } else if t.len() > MAX_EMAIL_PART_BYTES {
            errors.insert(
                "text".into(),
                format!("must be at most {MAX_EMAIL_PART_BYTES} bytes"),
            );
        } else if t.len() + html.map_or(0, str::len) > MAX_EMAIL_BODY_BYTES {
            errors.insert(
                "html".into(),
                format!("text and html together must be at most {MAX_EMAIL_BODY_BYTES} bytes"),
            );
        }
    }
    (subject, html)
}

/// An email's `attachments`: an array of at most [`MAX_ATTACHMENTS`]
/// distinct upload ids (`att_…`), each resolved where the tenant is known.
fn attachments_of(value: Option<&Value>, errors: &mut Errors) -> Vec<AttachmentOnMessage> {
    let items = match value {
        None | Some(Value::Null) => return Vec::new(),
        Some(Value::Array(items)) => items,
        Some(_) => {
            errors.insert(
                "attachments".into(),
                "must be an array of attachment ids".into(),
            );
            return Vec::new();
        }
    };
    if items.len() > MAX_ATTACHMENTS {
        errors.insert(
            "attachments".into(),
            format!("must hold at most {MAX_ATTACHMENTS} attachment ids"),
        );
        return Vec::new();
    }
    let mut out: Vec<AttachmentOnMessage> = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let field = format!("attachments[{index}]");
        match item {
            Value::String(id) if id.starts_with("att_") && id.len() <= MAX_TEMPLATE_ID_CHARS => {
                if out.iter().any(|seen| seen.id == *id) {
                    errors.insert(field, "names a file already attached".into());
                } else {
                    out.push(AttachmentOnMessage {
                        id: id.clone(),
                        filename: String::new(),
                        content_type: String::new(),
                        size: 0,
                        data: bytes::Bytes::new(),
                    });
                }
            }
            _ => {
                errors.insert(
                    field,
                    "must be an attachment id (att_…) from POST /v1/attachments".into(),
                );
            }
        }
    }
    out
}

/// A send by template: its id, version, locale and personalisation, each
/// checked; content fields beside `template_id` are refused, as are the
/// template's fields without it.
fn template_of(object: &Map<String, Value>, errors: &mut Errors) -> Option<TemplateSend> {
    const ITS_FIELDS: [&str; 3] = ["template_version", "personalisation", "locale"];
    let Some(id) = optional_string(object, "template_id", errors) else {
        for field in ITS_FIELDS {
            if !matches!(object.get(field), None | Some(Value::Null)) {
                errors.insert(field.into(), "is only allowed with template_id".into());
            }
        }
        return None;
    };
    if id.is_empty() || id.chars().count() > MAX_TEMPLATE_ID_CHARS {
        errors.insert(
            "template_id".into(),
            format!("must be 1-{MAX_TEMPLATE_ID_CHARS} characters"),
        );
    }
    for field in ["subject", "text", "html"] {
        if object.contains_key(field) {
            errors.insert(
                field.into(),
                "is not allowed with template_id: the template gives it".into(),
            );
        }
    }
    let version = match object.get("template_version") {
        None | Some(Value::Null) => None,
        Some(value) => match value.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(n) if n >= 1 => Some(n),
            _ => {
                errors.insert(
                    "template_version".into(),
                    "must be a whole number from 1".into(),
                );
                None
            }
        },
    };
    let locale = optional_string(object, "locale", errors);
    if let Some(locale) = locale
        && !is_locale(locale)
    {
        errors.insert("locale".into(), "must be a locale like fr or fr-CA".into());
    }
    Some(TemplateSend {
        id: id.to_owned(),
        version,
        locale: locale.map(str::to_owned),
        personalisation: personalisation_of(object.get("personalisation"), errors),
    })
}

/// The `personalisation` object: names to text (numbers and true/false
/// are written as text), bounded in keys, value length and size.
pub fn personalisation_of(value: Option<&Value>, errors: &mut Errors) -> BTreeMap<String, String> {
    let map = match value {
        None | Some(Value::Null) => return BTreeMap::new(),
        Some(Value::Object(map)) => map,
        Some(_) => {
            errors.insert(
                "personalisation".into(),
                "must be an object of placeholder names to values".into(),
            );
            return BTreeMap::new();
        }
    };
    if map.len() > MAX_PERSONALISATION_KEYS {
        errors.insert(
            "personalisation".into(),
            format!("must have at most {MAX_PERSONALISATION_KEYS} values"),
        );
        return BTreeMap::new();
    }
    if serde_json::to_string(map).map_or(usize::MAX, |s| s.len()) > MAX_PERSONALISATION_BYTES {
        errors.insert(
            "personalisation".into(),
            format!("must be at most {MAX_PERSONALISATION_BYTES} bytes as JSON"),
        );
        return BTreeMap::new();
    }
    let mut values = BTreeMap::new();
    for (name, value) in map {
        let field = format!("personalisation.{}", field_name(name));
        let text = match value {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            _ => {
                errors.insert(field, "must be a string, a number or true/false".into());
                continue;
            }
        };
        if text.contains(['\u{FFFE}', '\u{FFFF}']) {
            errors.insert(
                field,
                "must not contain the noncharacters U+FFFE or U+FFFF".into(),
            );
        } else if text.chars().count() > MAX_PERSONALISATION_VALUE_CHARS {
            errors.insert(
                field,
                format!("must be at most {MAX_PERSONALISATION_VALUE_CHARS} characters"),
            );
        } else {
            values.insert(name.clone(), text);
        }
    }
    values
}

/// An SMS's text checked.
fn check_sms_content(text: Option<&str>, errors: &mut Errors) {
    if let Some(t) = text {
        if t.trim().is_empty() {
            errors.insert("text".into(), "must not be empty".into());
        } else if t.chars().count() > MAX_SMS_CHARS {
            errors.insert(
                "text".into(),
                format!("must be at most {MAX_SMS_CHARS} characters"),
            );
        }
    }
}

/// The `metadata` object, bounded in keys and size.
fn metadata_of(object: &Map<String, Value>, errors: &mut Errors) -> Option<Map<String, Value>> {
    match object.get("metadata") {
        None | Some(Value::Null) => None,
        Some(Value::Object(map)) => {
            let size = serde_json::to_string(map).map_or(usize::MAX, |s| s.len());
            if map.len() > MAX_METADATA_KEYS {
                errors.insert(
                    "metadata".into(),
                    format!("must have at most {MAX_METADATA_KEYS} keys"),
                );
            } else if size > MAX_METADATA_BYTES {
                errors.insert(
                    "metadata".into(),
                    format!("must be at most {MAX_METADATA_BYTES} bytes as JSON"),
                );
            }
            Some(map.clone())
        }
        Some(_) => {
            errors.insert("metadata".into(), "must be a JSON object".into());
            None
        }
    }
}

/// `send_at` in ms, at most 30 days ahead; a time already past is "now"
/// (`None`).
fn send_at_of(object: &Map<String, Value>, errors: &mut Errors) -> Option<i64> {
    match optional_string(object, "send_at", errors) {
        None => None,
        Some(text) => match chrono::DateTime::parse_from_rfc3339(text) {
            Err(_) => {
                errors.insert(
                    "send_at".into(),
                    "must be an RFC 3339 date-time with a time zone, like 2026-12-01T09:00:00Z"
                        .into(),
                );
                None
            }
            Ok(at) => {
                let at = at.timestamp_millis();
                let now = crate::model::now_ms();
                if at > now + MAX_SCHEDULE_AHEAD_MS {
                    errors.insert("send_at".into(), "must be at most 30 days ahead".into());
                }
                // A time already past means "now".
                (at > now).then_some(at)
            }
        },
    }
}

/// An email's `headers` object, checked name by name; the first bad one
/// is named in the error.
fn custom_headers(value: Option<&Value>, errors: &mut Errors) -> Vec<EmailHeader> {
    let map = match value {
        None | Some(Value::Null) => return Vec::new(),
        Some(Value::Object(map)) => map,
        Some(_) => {
            errors.insert(
                "headers".into(),
                "must be an object of header names to values".into(),
            );
            return Vec::new();
        }
    };
    if map.len() > MAX_CUSTOM_HEADERS {
        errors.insert(
            "headers".into(),
            format!("must have at most {MAX_CUSTOM_HEADERS} headers"),
        );
        return Vec::new();
    }
    let mut headers = Vec::with_capacity(map.len());
    for (name, value) in map {
        if !is_allowed_header(name) {
            errors.insert(
                "headers".into(),
                format!(
                    "{:?} may not be set; allowed are X-… headers (not X-SES-…) and {}",
                    field_name(name),
                    ALLOWED_HEADERS.join(", ")
                ),
            );
            return Vec::new();
        }
        let Some(text) = value.as_str() else {
            errors.insert(
                "headers".into(),
                format!("the value of {name} must be a string"),
            );
            return Vec::new();
        };
        // SES refuses anything else when the email is sent; refused here,
        // the caller hears of it now rather than in a dead letter.
        if text.is_empty()
            || text.len() > MAX_HEADER_VALUE_CHARS
            || !text.bytes().all(|byte| (b' '..=b'~').contains(&byte))
        {
            errors.insert(
                "headers".into(),
                format!(
                    "the value of {name} must be 1-{MAX_HEADER_VALUE_CHARS} printable ASCII characters (space to ~), as SES takes it"
                ),
            );
            return Vec::new();
        }
        headers.push(EmailHeader {
            name: name.clone(),
            value: text.to_owned(),
        });
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn a_complete_email_is_accepted() {
        let message = validate(&json!({
            "channel": "email", "to": "a@example.com", "subject": "Hi", "text": "Hello",
            "html": "<p>Hello</p>", "priority": "high", "reference": "r-1", "metadata": {"k": 1}
        }))
        .unwrap();
        assert_eq!(message.channel, Channel::Email);
        assert_eq!(message.priority, Priority::High);
        assert_eq!(message.subject.as_deref(), Some("Hi"));
    }

    #[test]
    fn a_send_by_template_takes_no_content_and_checks_its_personalisation() {
        let message = validate(&json!({
            "channel": "sms", "to": "+15551234567", "template_id": "tpl_1",
            "template_version": 2, "locale": "fr-CA",
            "personalisation": {"name": "Ann", "count": 3, "vip": true}
        }))
        .unwrap();
        let asked = message.template.unwrap();
        assert_eq!(asked.version, Some(2));
        assert_eq!(asked.locale.as_deref(), Some("fr-CA"));
        assert_eq!(asked.personalisation["count"], "3");
        assert_eq!(asked.personalisation["vip"], "true");

        let errors = validate(&json!({
            "channel": "email", "to": "a@example.com", "template_id": "tpl_1",
            "subject": "Hi", "text": "Hello", "template_version": 0, "locale": "french",
            "personalisation": {"list": [1], "long": "x".repeat(MAX_PERSONALISATION_VALUE_CHARS + 1)}
        }))
        .unwrap_err();
        for field in [
            "subject",
            "text",
            "template_version",
            "locale",
            "personalisation.list",
            "personalisation.long",
        ] {
            assert!(errors.contains_key(field), "{field}: {errors:?}");
        }
        let errors = validate(&json!({
            "channel": "email", "to": "a@example.com", "subject": "Hi", "text": "Hello",
            "personalisation": {"a": "b"}
        }))
        .unwrap_err();
        assert_eq!(
            errors["personalisation"],
            "is only allowed with template_id"
        );
    }

    #[test]
    fn a_misspelt_field_is_named_and_refused() {
        let errors = validate(&json!({
            "channel": "email", "to": "a@example.com", "subjet": "Hi", "text": "Hello"
        }))
        .unwrap_err();
        assert!(errors["subjet"].starts_with("unknown field"));
        assert_eq!(errors["subject"], "is required");
    }

    #[test]
    fn thousands_of_unknown_fields_give_a_few_errors_and_a_count() {
        let mut body =
            json!({"channel": "email", "to": "a@example.com", "subject": "Hi", "text": "Hello"});
        for n in 0..5_000 {
            body[format!("x{n:05}")] = json!(n);
        }
        body["y".repeat(10_000)] = json!(1);
        let errors = validate(&body).unwrap_err();
        assert_eq!(errors.len(), MAX_UNKNOWN_FIELDS_NAMED + 1, "{errors:?}");
        assert_eq!(
            errors["body"],
            "has 4998 more unknown fields, not named here"
        );
        assert!(errors.contains_key("x00000"), "{errors:?}");
        let size: usize = errors.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(size < 1_000, "{size} bytes of errors");
    }

    #[test]
    fn a_long_unknown_field_name_is_cut_in_its_error() {
        let long = "é".repeat(1_000);
        let errors = validate(&json!({
            "channel": "sms", "to": "+15551234567", "text": "hi", long.clone(): 1
        }))
        .unwrap_err();
        let named = format!("{}…", "é".repeat(MAX_FIELD_NAME_ECHOED));
        assert!(errors.contains_key(&named), "{errors:?}");
    }

    #[test]
    fn text_an_sqs_message_cannot_carry_is_refused_naming_the_field() {
        let errors = validate(&json!({
            "channel": "email", "to": "a@example.com", "subject": "Hi\u{FFFF}", "text": "ok \u{FFFE}"
        }))
        .unwrap_err();
        assert!(errors["subject"].contains("U+FFFF"), "{errors:?}");
        assert!(errors["text"].contains("U+FFFE"), "{errors:?}");
        // Other characters outside the BMP are fine.
        validate(&json!({"channel": "sms", "to": "+15551234567", "text": "ok \u{1F600}"})).unwrap();
    }

    #[test]
    fn every_bad_field_is_reported_at_once() {
        let errors = validate(&json!({
            "channel": "sms", "to": "5551234", "text": "", "priority": "urgent", "subject": "x"
        }))
        .unwrap_err();
        assert_eq!(
            errors.keys().map(String::as_str).collect::<Vec<_>>(),
            vec!["priority", "subject", "text", "to"]
        );
        assert_eq!(errors["subject"], "is not allowed for sms messages");
    }

    #[test]
    fn subject_with_a_line_break_is_refused() {
        let errors = validate(&json!({
            "channel": "email", "to": "a@example.com", "subject": "Hi\r\nBcc: x@y.z", "text": "t"
        }))
        .unwrap_err();
        assert_eq!(errors["subject"], "must not contain line breaks");
    }

    #[test]
    fn known_addresses_and_numbers() {
        for ok in [
            "a@example.com",
            "first.last+tag@sub.example.co.uk",
            "x_y@a-b.io",
        ] {
            assert!(is_email_address(ok), "{ok}");
        }
        for bad in [
            "",
            "a",
            "a@",
            "@example.com",
            "a@localhost",
            "A <a@example.com>",
            " a@example.com",
            "a@example.com.",
            "a@@example.com",
        ] {
            assert!(!is_email_address(bad), "{bad}");
        }
        for ok in ["+15551234567", "+447911123456", "+4930123456"] {
            assert!(is_e164(ok), "{ok}");
        }
        for bad in [
            "15551234567",
            "+0551234567",
            "+1555",
            "+1234567890123456",
            "+1555-123-4567",
            "+",
        ] {
            assert!(!is_e164(bad), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn e164_accepts_exactly_plus_and_8_to_15_digits(digits in "[1-9][0-9]{7,14}") {
            let number = format!("+{digits}");
            prop_assert!(is_e164(&number));
        }

        #[test]
        fn e164_refuses_any_non_digit(prefix in "[1-9][0-9]{3,6}", junk in "[^0-9]", suffix in "[0-9]{4,6}") {
            let number = format!("+{prefix}{junk}{suffix}");
            prop_assert!(!is_e164(&number));
        }

        #[test]
        fn e164_never_panics(input in "\\PC{0,40}") {
            let _ = is_e164(&input);
        }

        #[test]
        fn generated_addresses_are_accepted(local in "[a-z0-9]{1,20}([.+_-][a-z0-9]{1,10})?", domain in "[a-z0-9]{1,20}", tld in "[a-z]{2,6}") {
            let address = format!("{local}@{domain}.{tld}");
            prop_assert!(is_email_address(&address), "{}", address);
        }

        #[test]
        fn addresses_without_at_are_refused(input in "[a-z0-9.]{0,40}") {
            prop_assert!(!is_email_address(&input));
        }

        #[test]
        fn validation_never_panics(input in "\\PC{0,60}") {
            let _ = validate(&json!({"channel": "email", "to": input.clone(), "subject": input.clone(), "text": input}));
        }
    }
}
