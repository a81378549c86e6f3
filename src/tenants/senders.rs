//! Sender identities: who a tenant's email and SMS come from.
//!
//! An admin gives a tenant its identities (an email identity is a from
//! address with an optional display name, reply-to addresses and SES
//! configuration set; an SMS identity is a sender number or alphanumeric id,
//! or a messaging service). At most one per channel is the tenant's default.
//! A send names one with `sender_id`, or gets the tenant's default, or the
//! configured `providers.<channel>.from`. What the chosen identity says is
//! copied into the message's delivery payload ([`SenderOnMessage`]) when it
//! is accepted, so a message sends as it was accepted even if the identity
//! is changed or removed while it waits.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{RegistryError, invalid};
pub use crate::message::SenderOnMessage;
use crate::message::{is_e164, is_email_address};
use crate::model::Channel;

/// Most identities one tenant may have.
pub const MAX_SENDERS_PER_TENANT: usize = 100;
/// Most reply-to addresses of one email identity.
pub const MAX_REPLY_TO: usize = 10;
/// Longest display name, in characters.
pub const MAX_DISPLAY_NAME_CHARS: usize = 100;
/// What validation takes as a display name, for the spec: no control
/// character (`char::is_control`), and one character that `str::trim`
/// would keep.
const DISPLAY_NAME_PATTERN: &str = r"^[^\u0000-\u001F\u007F-\u009F]*[^\u0000-\u0020\u007F-\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000][^\u0000-\u001F\u007F-\u009F]*$";

/// A tenant's sender identity.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct SenderIdentity {
    /// `snd_` and 32 hex digits (time-ordered); what a send names in
    /// `sender_id`.
    pub id: String,
    pub tenant_id: String,
    pub channel: Channel,
    /// Email: the from address (an SES-verified identity). SMS: the sender
    /// number (E.164) or alphanumeric sender id; absent when a messaging
    /// service sends.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Email: the name shown with the from address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// Email: where replies go.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reply_to: Vec<String>,
    /// Email: the SES configuration set its messages are sent with
    /// (instead of `providers.email.configuration_set`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub configuration_set: Option<String>,
    /// SMS: the messaging service that picks the sender (`MG` and 32 hex
    /// digits), instead of `from`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messaging_service_sid: Option<String>,
    /// The tenant's default for its channel.
    pub default: bool,
    /// RFC 3339.
    pub created_at: String,
}

/// Body of `POST /v1/admin/tenants/{id}/senders`: one shape per channel
/// (see its schema, [`NewSender::schema`]), checked by [`validate`].
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSender {
    pub channel: Channel,
    /// Email: the from address (required). SMS: a sender number or
    /// alphanumeric sender id (this or `messaging_service_sid`).
    pub from: Option<String>,
    /// Email only.
    pub display_name: Option<String>,
    /// Email only.
    #[serde(default)]
    pub reply_to: Vec<String>,
    /// Email only.
    pub configuration_set: Option<String>,
    /// SMS only (this or `from`).
    pub messaging_service_sid: Option<String>,
    /// Make it the tenant's default for its channel.
    #[serde(default)]
    pub default: bool,
}

/// The document says what [`validate`] takes: `oneOf` an email identity,
/// an SMS identity with a sender, and an SMS identity with a messaging
/// service, each a named schema with only its own fields.
impl utoipa::PartialSchema for NewSender {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::{OneOfBuilder, Ref};
        let mut one_of = OneOfBuilder::new().description(Some(
            "Body of `POST /v1/admin/tenants/{id}/senders`: an email identity, an SMS identity \
             with a sender, or one with a messaging service.",
        ));
        for (name, _) in sender_shapes() {
            one_of = one_of.item(Ref::from_schema_name(name));
        }
        one_of.into()
    }
}

impl utoipa::ToSchema for NewSender {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        for (name, shape) in sender_shapes() {
            schemas.push((name.to_owned(), shape.into()));
        }
    }
}

/// The three shapes of [`NewSender`], by schema name.
fn sender_shapes() -> [(&'static str, utoipa::openapi::ObjectBuilder); 3] {
    use utoipa::openapi::ObjectBuilder;
    use utoipa::openapi::schema::{OneOfBuilder, Type};
    let null = || ObjectBuilder::new().schema_type(Type::Null);
    // 1-11 letters, digits and spaces, at least one letter, no space at
    // either end: the letter first, last, or in between.
    let alphanumeric = r"^(?:[A-Za-z]|[A-Za-z][A-Za-z0-9 ]*[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9 ]*[A-Za-z]|[A-Za-z0-9][A-Za-z0-9 ]*[A-Za-z][A-Za-z0-9 ]*[A-Za-z0-9])$";
    let sender = sender_shape(
        "An SMS identity with a sender number or alphanumeric sender id.",
        "sms",
    )
    .property(
        "from",
        OneOfBuilder::new()
            .description(Some(
                "A sender number in E.164 form, or an alphanumeric sender id of 1-11 \
                     letters, digits and spaces with at least one letter.",
            ))
            .item(string_field("E.164").pattern(Some(r"^\+[1-9][0-9]{7,14}$")))
            .item(
                string_field("Alphanumeric")
                    .max_length(Some(11))
                    .pattern(Some(alphanumeric)),
            ),
    )
    .property("messaging_service_sid", null())
    .required("from");
    let service = sender_shape(
        "An SMS identity whose messaging service picks the sender.",
        "sms",
    )
    .property(
        "messaging_service_sid",
        string_field("`MG` and 32 hex digits: the messaging service picks the sender.")
            .pattern(Some(r"^MG[0-9a-fA-F]{32}$")),
    )
    .property("from", null())
    .required("messaging_service_sid");
    [
        ("NewEmailSender", email_sender_shape()),
        ("NewSmsSender", sender),
        ("NewSmsServiceSender", service),
    ]
}

/// [`NewSender`]'s email shape.
fn email_sender_shape() -> utoipa::openapi::ObjectBuilder {
    use utoipa::openapi::ObjectBuilder;
    use utoipa::openapi::schema::{ArrayBuilder, SchemaType, Type};
    // An optional field may also be sent as `null` (absent, as serde
    // reads it); a field of the other shapes only as `null`.
    let optional = |description: &str| {
        ObjectBuilder::new()
            .schema_type(SchemaType::from_iter([Type::String, Type::Null]))
            .description(Some(description))
    };
    sender_shape("An email identity.", "email")
        .property(
            "from",
            email_address_field("The from address, an SES-verified identity."),
        )
        .property(
            "display_name",
            optional("1-100 characters, not blank, no control characters.")
                .min_length(Some(1))
                .max_length(Some(MAX_DISPLAY_NAME_CHARS))
                .pattern(Some(DISPLAY_NAME_PATTERN)),
        )
        .property(
            "reply_to",
            ArrayBuilder::new()
                .items(email_address_field("An address replies go to."))
                .max_items(Some(MAX_REPLY_TO))
                .description(Some("Up to 10 addresses.")),
        )
        .property(
            "configuration_set",
            optional("An SES configuration set name (1-64 of `A-Z a-z 0-9 _ -`).")
                .pattern(Some(r"^[A-Za-z0-9_-]{1,64}$")),
        )
        .required("from")
}

/// What every shape of [`NewSender`] has: its `channel` and `default`, and
/// no other field than its own.
fn sender_shape(description: &str, channel: &str) -> utoipa::openapi::ObjectBuilder {
    use utoipa::openapi::ObjectBuilder;
    use utoipa::openapi::schema::{AdditionalProperties, Type};
    ObjectBuilder::new()
        .description(Some(description))
        .property(
            "channel",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some([channel])),
        )
        .property(
            "default",
            ObjectBuilder::new()
                .schema_type(Type::Boolean)
                .description(Some(
                    "Make it the tenant's default for its channel (the previous default \
                     stops being one).",
                )),
        )
        .required("channel")
        .additional_properties(Some(AdditionalProperties::FreeForm(false)))
}

/// A string field of a sender shape.
fn string_field(description: &str) -> utoipa::openapi::ObjectBuilder {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .description(Some(description))
}

/// An email address field of a sender shape.
fn email_address_field(description: &str) -> utoipa::openapi::ObjectBuilder {
    use utoipa::openapi::schema::{KnownFormat, SchemaFormat};
    string_field(description)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Email)))
        .min_length(Some(3))
        .max_length(Some(254))
}

impl SenderIdentity {
    pub fn on_message(&self) -> SenderOnMessage {
        SenderOnMessage {
            id: self.id.clone(),
            from: self.from.clone(),
            display_name: self.display_name.clone(),
            reply_to: self.reply_to.clone(),
            configuration_set: self.configuration_set.clone(),
            messaging_service_sid: self.messaging_service_sid.clone(),
        }
    }
}

/// The identity a `channel` send of a tenant with `senders` goes out
/// with: the one it names (`requested`), else the tenant's default, else
/// none (the configured sender). Naming an unknown identity, another
/// tenant's or one of the other channel is refused with the reason.
pub fn choose<'a>(
    senders: &'a [SenderIdentity],
    requested: Option<&str>,
    channel: Channel,
) -> Result<Option<&'a SenderIdentity>, String> {
    match requested {
        Some(id) => match senders.iter().find(|sender| sender.id == id) {
            None => Err(format!(
                "no sender identity {:?} belongs to this tenant",
                crate::message::field_name(id)
            )),
            Some(sender) if sender.channel != channel => Err(format!(
                "sender identity {id:?} is for {}, not {channel}",
                sender.channel
            )),
            Some(sender) => Ok(Some(sender)),
        },
        None => Ok(senders
            .iter()
            .find(|sender| sender.default && sender.channel == channel)),
    }
}

/// True for an alphanumeric SMS sender id: 1-11 ASCII letters, digits and
/// spaces, at least one letter, not starting or ending with a space.
fn is_alphanumeric_sender(from: &str) -> bool {
    (1..=11).contains(&from.len())
        && from.bytes().all(|b| b.is_ascii_alphanumeric() || b == b' ')
        && from.bytes().any(|b| b.is_ascii_alphabetic())
        && from.trim() == from
}

fn is_configuration_set_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn is_messaging_service_sid(sid: &str) -> bool {
    sid.len() == 34 && sid.starts_with("MG") && sid[2..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// Checks `input` field by field; an error names the first bad field.
pub fn validate(input: &NewSender) -> Result<(), RegistryError> {
    let not_for =
        |field: &str, channel: &str| invalid(field, format!("is not used by {channel} identities"));
    match input.channel {
        Channel::Email => {
            if input.messaging_service_sid.is_some() {
                return Err(not_for("messaging_service_sid", "email"));
            }
            match input.from.as_deref() {
                None => return Err(invalid("from", "is required for an email identity")),
                Some(from) if !is_email_address(from) => {
                    return Err(invalid(
                        "from",
                        "must be an email address like news@example.com (no display name: use display_name)",
                    ));
                }
                Some(_) => {}
            }
            if let Some(name) = input.display_name.as_deref() {
                let chars = name.chars().count();
                if name.trim().is_empty() || chars > MAX_DISPLAY_NAME_CHARS {
                    return Err(invalid(
                        "display_name",
                        format!("must be 1-{MAX_DISPLAY_NAME_CHARS} characters, not blank"),
                    ));
                }
                if name.chars().any(char::is_control) {
                    return Err(invalid(
                        "display_name",
                        "must not contain control characters or line breaks",
                    ));
                }
            }
            if input.reply_to.len() > MAX_REPLY_TO {
                return Err(invalid(
                    "reply_to",
                    format!("must list at most {MAX_REPLY_TO} addresses"),
                ));
            }
            if let Some(bad) = input.reply_to.iter().find(|a| !is_email_address(a)) {
                return Err(invalid(
                    "reply_to",
                    format!(
                        "{:?} is not an email address",
                        crate::message::field_name(bad)
                    ),
                ));
            }
            if let Some(set) = input.configuration_set.as_deref()
                && !is_configuration_set_name(set)
            {
                return Err(invalid(
                    "configuration_set",
                    "must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'",
                ));
            }
        }
        Channel::Sms => {
            if input.display_name.is_some() {
                return Err(not_for("display_name", "sms"));
            }
            if !input.reply_to.is_empty() {
                return Err(not_for("reply_to", "sms"));
            }
            if input.configuration_set.is_some() {
                return Err(not_for("configuration_set", "sms"));
            }
            match (
                input.from.as_deref(),
                input.messaging_service_sid.as_deref(),
            ) {
                (None, None) | (Some(_), Some(_)) => {
                    return Err(invalid(
                        "from",
                        "an sms identity needs exactly one of from and messaging_service_sid",
                    ));
                }
                (Some(from), None) if !is_e164(from) && !is_alphanumeric_sender(from) => {
                    return Err(invalid(
                        "from",
                        "must be a number in E.164 form (+15551234567) or an alphanumeric sender id of 1-11 letters, digits and spaces with at least one letter",
                    ));
                }
                (None, Some(sid)) if !is_messaging_service_sid(sid) => {
                    return Err(invalid(
                        "messaging_service_sid",
                        "must be MG followed by 32 hex digits",
                    ));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn email(from: &str) -> NewSender {
        NewSender {
            channel: Channel::Email,
            from: Some(from.into()),
            display_name: None,
            reply_to: Vec::new(),
            configuration_set: None,
            messaging_service_sid: None,
            default: false,
        }
    }

    fn sms(from: Option<&str>, service: Option<&str>) -> NewSender {
        NewSender {
            channel: Channel::Sms,
            from: from.map(Into::into),
            messaging_service_sid: service.map(Into::into),
            ..email("x@example.com")
        }
    }

    fn refused_field(input: &NewSender) -> String {
        match validate(input) {
            Err(RegistryError::Invalid { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        }
    }

    #[test]
    fn each_bad_field_is_named() {
        assert!(validate(&email("news@example.com")).is_ok());
        assert_eq!(refused_field(&email("News <news@example.com>")), "from");
        let mut named = email("news@example.com");
        named.display_name = Some("Acme\r\nBcc: x@example.com".into());
        assert_eq!(refused_field(&named), "display_name");
        let mut replies = email("news@example.com");
        replies.reply_to = vec!["help@example.com".into(), "nope".into()];
        assert_eq!(refused_field(&replies), "reply_to");
        let mut set = email("news@example.com");
        set.configuration_set = Some("has space".into());
        assert_eq!(refused_field(&set), "configuration_set");

        assert!(validate(&sms(Some("+15550001111"), None)).is_ok());
        assert!(validate(&sms(Some("ACME"), None)).is_ok());
        assert!(validate(&sms(None, Some(&format!("MG{}", "a".repeat(32))))).is_ok());
        assert_eq!(refused_field(&sms(Some("TWELVECHARSX"), None)), "from");
        assert_eq!(refused_field(&sms(Some("12345"), None)), "from");
        assert_eq!(refused_field(&sms(None, None)), "from");
        assert_eq!(
            refused_field(&sms(None, Some("MG123"))),
            "messaging_service_sid"
        );
    }

    fn identity(id: &str, channel: Channel, default: bool) -> SenderIdentity {
        SenderIdentity {
            id: id.into(),
            tenant_id: "acme".into(),
            channel,
            from: None,
            display_name: None,
            reply_to: Vec::new(),
            configuration_set: None,
            messaging_service_sid: None,
            default,
            created_at: String::new(),
        }
    }

    #[test]
    fn a_named_identity_wins_then_the_channel_default_then_none() {
        let senders = [
            identity("snd_a", Channel::Email, false),
            identity("snd_b", Channel::Email, true),
            identity("snd_c", Channel::Sms, false),
        ];
        let chosen = |requested, channel| {
            choose(&senders, requested, channel).map(|s| s.map(|s| s.id.clone()))
        };
        assert_eq!(
            chosen(Some("snd_a"), Channel::Email),
            Ok(Some("snd_a".into()))
        );
        assert_eq!(chosen(None, Channel::Email), Ok(Some("snd_b".into())));
        assert_eq!(chosen(None, Channel::Sms), Ok(None));
        assert!(chosen(Some("snd_c"), Channel::Email).is_err());
        assert!(chosen(Some("snd_zz"), Channel::Sms).is_err());
    }
}
