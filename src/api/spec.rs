//! The OpenAPI document, [`ApiDoc`]: the operations and schemas utoipa
//! derives from the handlers, and the modifiers that finish what its
//! derives cannot say (responses every operation shares, the batch's item
//! schemas, the request shapes by content or by template, the views that
//! flatten a request's schema).

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::model::Channel;

use super::{
    admin, admins, attachments, audit, dlq, error, health, message_list, messages, providers,
    receipts, senders, suppressions, templates, tenant_queue, unsubscribe, usage, webhooks,
};

/// Responses every operation can give, whatever it does: 500 (an
/// unexpected failure, logged; the problem shows no internals) and 503 (the
/// request took longer than `server.request_timeout_secs`, or the store or
/// queue could not be reached), added where an operation does not describe
/// them itself. Operations that need no credentials say so (`security:
/// [{}]`), so every operation names its security.
struct CommonResponses;

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::header::HeaderBuilder;
        use utoipa::openapi::security::SecurityRequirement;
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let problem = || {
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("Problem")))
                .build()
        };
        let internal = ResponseBuilder::new()
            .description("Unexpected failure; it is logged, and the problem shows no internals.")
            .content("application/problem+json", problem())
            .build();
        let unavailable = ResponseBuilder::new()
            .description(
                "The request took longer than server.request_timeout_secs, or the store could \
                 not be reached; see Retry-After.",
            )
            .content("application/problem+json", problem())
            .header(
                "Retry-After",
                HeaderBuilder::new()
                    .schema(Some(
                        utoipa::openapi::ObjectBuilder::new()
                            .schema_type(utoipa::openapi::schema::Type::Integer)
                            .build(),
                    ))
                    .description(Some("Seconds"))
                    .build(),
            )
            .build();
        for item in openapi.paths.paths.values_mut() {
            for operation in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ]
            .into_iter()
            .flatten()
            {
                let responses = &mut operation.responses.responses;
                responses
                    .entry("500".to_owned())
                    .or_insert_with(|| internal.clone().into());
                responses
                    .entry("503".to_owned())
                    .or_insert_with(|| unavailable.clone().into());
                operation
                    .security
                    .get_or_insert_with(|| vec![SecurityRequirement::default()]);
            }
        }
    }
}

/// Whether a request body may be left out, where utoipa cannot say it.
/// utoipa marks a body `required` unless its type is an `Option`, and an
/// `Option` becomes a `oneOf` with `null`, which client generators send as
/// a JSON `null`; so an optional body is documented as its plain schema and
/// marked optional here. An upload's body is raw bytes that no type
/// describes, so utoipa leaves it optional: a file must have one (a
/// request without a Content-Type is 415).
struct BodyRequirements;

impl Modify for BodyRequirements {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::Required;
        for (path, required) in [
            ("/v1/admin/tenants/{id}/keys", Required::False),
            ("/v1/attachments", Required::True),
        ] {
            let body = openapi
                .paths
                .paths
                .get_mut(path)
                .and_then(|item| item.post.as_mut())
                .and_then(|op| op.request_body.as_mut());
            if let Some(utoipa::openapi::RefOr::T(body)) = body {
                body.required = Some(required);
            }
        }
    }
}

/// A batch's messages are send requests that may each carry an
/// `idempotency_key` of their own: `BatchEmailItem` and `BatchSmsItem` are
/// the send request schemas with that one property more, told apart by
/// `channel` like the single sends, and `SendBatchRequest.messages` lists
/// them. Built from the single sends' schemas, so the two never drift.
struct BatchItems;

impl Modify for BatchItems {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{ArrayItems, Discriminator, Schema};
        use utoipa::openapi::{ObjectBuilder, OneOfBuilder, Ref, RefOr};
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        let key = ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .min_length(Some(1))
            .max_length(Some(255))
            .pattern(Some("^[!-~]+$"))
            .description(Some(
                "Makes a retry of this message safe, like the Idempotency-Key header of a single send.",
            ))
            .build();
        let mut mapping = Vec::new();
        for (single, item, channel) in [
            ("SendEmailRequest", "BatchEmailItem", "email"),
            ("SendSmsRequest", "BatchSmsItem", "sms"),
        ] {
            let Some(RefOr::T(Schema::Object(mut object))) =
                components.schemas.get(single).cloned()
            else {
                continue;
            };
            object
                .properties
                .insert("idempotency_key".to_owned(), key.clone().into());
            object.description = Some(format!("One message of a batch: {channel}."));
            components
                .schemas
                .insert(item.to_owned(), RefOr::T(Schema::Object(object)));
            mapping.push((channel, item));
        }
        let mut union = OneOfBuilder::new().description(Some(
            "One message of a batch: an email or an SMS, told apart by `channel`.",
        ));
        for (_, item) in &mapping {
            union = union.item(Ref::from_schema_name(*item));
        }
        let mut union = union.build();
        let mut discriminator = Discriminator::new("channel");
        for (channel, item) in &mapping {
            discriminator.mapping.insert(
                (*channel).to_owned(),
                format!("#/components/schemas/{item}"),
            );
        }
        union.discriminator = Some(discriminator);
        components
            .schemas
            .insert("BatchMessage".to_owned(), RefOr::T(Schema::OneOf(union)));
        if let Some(RefOr::T(Schema::Object(batch))) =
            components.schemas.get_mut("SendBatchRequest")
            && let Some(RefOr::T(Schema::Array(messages))) = batch.properties.get_mut("messages")
        {
            messages.items =
                ArrayItems::RefOrSchema(Box::new(Ref::from_schema_name("BatchMessage").into()));
        }
    }
}

/// A send names its content or a template, never both: each send schema
/// (single and batch, email and SMS) becomes a `oneOf` of its two shapes,
/// each closed (`additionalProperties: false`), so a schema-valid request
/// is one that validation takes. By content, the template's fields are
/// gone and the content is required (an email's subject, and its text or
/// its HTML; an SMS's text); by template, the content fields are gone and
/// `template_id` is required. utoipa's derive cannot say "this field or
/// that one" on one struct, and OpenAPI 3.1's `not` is not in utoipa, so the
/// shapes are cut here from the derived schema, which keeps every field's
/// own bounds in one place.
struct SendShapes;

/// The fields only a send by template has.
const TEMPLATE_FIELDS: [&str; 4] = [
    "template_id",
    "template_version",
    "personalisation",
    "locale",
];

impl Modify for SendShapes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::Schema;
        use utoipa::openapi::{OneOfBuilder, Ref, RefOr};
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        for (name, channel) in [
            ("SendEmailRequest", Channel::Email),
            ("SendSmsRequest", Channel::Sms),
            ("BatchEmailItem", Channel::Email),
            ("BatchSmsItem", Channel::Sms),
        ] {
            let Some(RefOr::T(Schema::Object(mut whole))) = components.schemas.get(name).cloned()
            else {
                continue;
            };
            if channel == Channel::Email {
                whole = patched(&whole, email_fields);
            }
            let by_content = format!("{name}ByContent");
            let by_template = format!("{name}ByTemplate");
            components
                .schemas
                .insert(by_content.clone(), content_shape(&whole, channel).into());
            components
                .schemas
                .insert(by_template.clone(), template_shape(&whole, channel).into());
            let union = OneOfBuilder::new()
                .description(whole.description.clone())
                .item(Ref::from_schema_name(by_content))
                .item(Ref::from_schema_name(by_template))
                .build();
            components
                .schemas
                .insert(name.to_owned(), RefOr::T(Schema::OneOf(union)));
        }
    }
}

/// A locale's name as `message::is_locale` takes it.
pub const LOCALE_PATTERN: &str = r"^[A-Za-z]{2,3}(?:-[A-Za-z0-9]{2,8})*$";

/// `object` as JSON, changed by `change`: the document's own types
/// have no builder for a property's items or names once built.
fn patched(
    object: &utoipa::openapi::schema::Object,
    change: impl FnOnce(&mut serde_json::Value),
) -> utoipa::openapi::schema::Object {
    let mut json = serde_json::to_value(object).expect("a schema is JSON");
    change(&mut json);
    serde_json::from_value(json).expect("a changed schema is a schema")
}

/// What follows `X-` in a header a tenant may set: 1-62 letters, digits
/// and `-`, not starting `SES-` in any case. Written without look-ahead,
/// which some clients' regex engines lack (RE2, Rust's `regex`).
const X_NOT_SES: &str = "(?:[A-RT-Za-rt-z0-9-][A-Za-z0-9-]{0,61}\
    |[Ss](?:[A-DF-Za-df-z0-9-][A-Za-z0-9-]{0,60})?\
    |[Ss][Ee](?:[A-RT-Za-rt-z0-9-][A-Za-z0-9-]{0,59})?\
    |[Ss][Ee][Ss](?:[A-Za-z0-9][A-Za-z0-9-]{0,58})?)";

/// An email's copies are addresses as `to` is one, and its headers as
/// validation takes them (`message::is_allowed_header`, values of SES's
/// printable ASCII).
fn email_fields(email: &mut serde_json::Value) {
    use serde_json::json;
    let properties = &mut email["properties"];
    let mut address = properties["to"].clone();
    if let Some(address) = address.as_object_mut() {
        address.remove("description");
    }
    for copies in ["cc", "bcc"] {
        properties[copies]["items"] = address.clone();
    }
    // JSON Schema's patterns have no flag for case: each letter of an
    // allowed name is a class of both its cases.
    let any_case = |name: &str| -> String {
        name.chars()
            .map(|c| match c {
                c if c.is_ascii_alphabetic() => {
                    format!("[{}{}]", c.to_ascii_uppercase(), c.to_ascii_lowercase())
                }
                c => c.to_string(),
            })
            .collect()
    };
    let allowed: Vec<String> = crate::message::ALLOWED_HEADERS
        .iter()
        .map(|name| any_case(name))
        .collect();
    let headers = &mut properties["headers"];
    headers["maxProperties"] = json!(crate::message::MAX_CUSTOM_HEADERS);
    headers["propertyNames"] = json!({
        "type": "string",
        "pattern": format!("^(?:[Xx]-{X_NOT_SES}|{})$", allowed.join("|")),
    });
    headers["additionalProperties"] = json!({
        "type": "string",
        "pattern": format!("^[ -~]{{1,{}}}$", crate::message::MAX_HEADER_VALUE_CHARS),
    });
}

/// `object` without `fields` and with `required` required, each of those
/// as a value (not `null`), closed to other fields.
fn shape(
    object: &utoipa::openapi::schema::Object,
    without: &[&str],
    required: &[&str],
    description: String,
) -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::AdditionalProperties;
    let mut shape = object.clone();
    shape
        .properties
        .retain(|field, _| !without.contains(&field.as_str()));
    for field in required {
        if let Some(property) = shape.properties.get_mut(*field) {
            not_null(property);
        }
        shape.required.push((*field).to_owned());
    }
    shape.description = Some(description);
    shape.additional_properties = Some(Box::new(AdditionalProperties::FreeForm(false)));
    shape
}

/// A property's schema that admits `null` admits it no more.
fn not_null(property: &mut utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>) {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::{Schema, SchemaType, Type};
    if let RefOr::T(Schema::Object(object)) = property
        && let SchemaType::Array(types) = &object.schema_type
    {
        let types: Vec<Type> = types
            .iter()
            .filter(|t| **t != Type::Null)
            .cloned()
            .collect();
        object.schema_type = match types.as_slice() {
            [one] => SchemaType::Type(one.clone()),
            _ => SchemaType::Array(types),
        };
    }
}

/// A send by content: no template field; an email has a subject and its
/// text or its HTML, an SMS its text.
fn content_shape(
    whole: &utoipa::openapi::schema::Object,
    channel: Channel,
) -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::RefOr;
    use utoipa::openapi::schema::Schema;
    match channel {
        Channel::Sms => Schema::Object(shape(
            whole,
            &TEMPLATE_FIELDS,
            &["text"],
            "An SMS with its own text.".to_owned(),
        )),
        Channel::Email => {
            let mut object = shape(
                whole,
                &TEMPLATE_FIELDS,
                &["subject"],
                "An email with its own subject and its text, its HTML or both.".to_owned(),
            );
            // The text given alone must not be blank; beside a non-blank
            // HTML it may be empty (and is then derived from the HTML).
            let text = given(&object, "text");
            if let Some(RefOr::T(Schema::Object(property))) = object.properties.get_mut("text")
                && let Some(pattern) = property.pattern.take()
            {
                property.pattern = Some(format!("^$|{pattern}"));
                property.min_length = None;
            }
            // HTML alone must not be blank: the text is derived from it,
            // and a text must not be blank.
            let mut html = given(&object, "html");
            let not_blank = match text.properties.get("text") {
                Some(RefOr::T(Schema::Object(text))) => text.pattern.clone(),
                _ => None,
            };
            if let Some(RefOr::T(Schema::Object(property))) = html.properties.get_mut("html") {
                property.pattern = not_blank;
                property.min_length = Some(1);
            }
            text_or_html(object, text, html)
        }
    }
}

/// `object` with the field `field` required, as `object` describes it
/// but not `null`.
fn given(object: &utoipa::openapi::schema::Object, field: &str) -> utoipa::openapi::schema::Object {
    let mut one = utoipa::openapi::ObjectBuilder::new()
        .required(field)
        .build();
    if let Some(property) = object.properties.get(field) {
        let mut property = property.clone();
        not_null(&mut property);
        one.properties.insert(field.to_owned(), property);
    }
    one
}

/// `object`, and one of `text` and `html` at least.
fn text_or_html(
    object: utoipa::openapi::schema::Object,
    text: utoipa::openapi::schema::Object,
    html: utoipa::openapi::schema::Object,
) -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{AllOfBuilder, AnyOfBuilder, Schema};
    let either = AnyOfBuilder::new().item(text).item(html).build();
    Schema::AllOf(
        AllOfBuilder::new()
            .description(object.description.clone())
            .item(object)
            .item(Schema::AnyOf(either))
            .build(),
    )
}

/// A send by template: no content field, `template_id` required.
fn template_shape(
    whole: &utoipa::openapi::schema::Object,
    channel: Channel,
) -> utoipa::openapi::schema::Schema {
    let (content, what): (&[&str], _) = match channel {
        Channel::Email => (&["subject", "text", "html"], "An email"),
        Channel::Sms => (&["text"], "An SMS"),
    };
    utoipa::openapi::schema::Schema::Object(shape(
        whole,
        content,
        &["template_id"],
        format!(
            "{what} by template: the template gives its content, filled from `personalisation`."
        ),
    ))
}

/// A view that flattens a request's schema into its own fields (serde's
/// `flatten`) gets one object of all of them: utoipa writes it as an
/// `allOf` of the request's schema and the view's, and the request's
/// schema is closed (`additionalProperties: false`), so no answer would
/// match the composition.
struct FlatViews;

impl Modify for FlatViews {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::RefOr;
        use utoipa::openapi::schema::Schema;
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        for name in ["TemplateView"] {
            let Some(RefOr::T(Schema::AllOf(parts))) = components.schemas.get(name).cloned() else {
                continue;
            };
            let mut view = utoipa::openapi::schema::Object::new();
            view.description = parts.description.clone();
            for part in &parts.items {
                let part = match part {
                    RefOr::Ref(reference) => components.schemas.get(
                        reference
                            .ref_location
                            .trim_start_matches("#/components/schemas/"),
                    ),
                    own => Some(own),
                };
                if let Some(RefOr::T(Schema::Object(part))) = part {
                    for (field, property) in &part.properties {
                        view.properties.insert(field.clone(), property.clone());
                    }
                    view.required.extend(part.required.iter().cloned());
                }
            }
            components
                .schemas
                .insert(name.to_owned(), RefOr::T(Schema::Object(view)));
        }
    }
}

/// A template's content is one of two shapes, by its channel, as
/// validation takes it: an SMS template has its text and no subject or
/// HTML; an email template its subject and its text, its HTML or both.
/// Runs after [`FlatViews`], whose template view lists every field.
struct TemplateShapes;

impl Modify for TemplateShapes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::Schema;
        use utoipa::openapi::{OneOfBuilder, Ref, RefOr};
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        let Some(RefOr::T(Schema::Object(whole))) =
            components.schemas.get("TemplateContent").cloned()
        else {
            return;
        };
        let for_channel = |mut object: utoipa::openapi::schema::Object, channel: Channel| {
            let only = utoipa::openapi::ObjectBuilder::new()
                .schema_type(utoipa::openapi::schema::Type::String)
                .enum_values(Some([channel.as_str()]))
                .build();
            object.properties.insert("channel".to_owned(), only.into());
            object
        };
        let sms = for_channel(
            shape(
                &whole,
                &["subject", "html"],
                &["text"],
                "An SMS template: its text.".to_owned(),
            ),
            Channel::Sms,
        );
        let email = for_channel(
            shape(
                &whole,
                &[],
                &["subject"],
                "An email template: its subject, and its text, its HTML or both.".to_owned(),
            ),
            Channel::Email,
        );
        // Each locale's variant as the channel's default content is.
        if let Some(RefOr::T(Schema::Object(variant))) = components.schemas.get("Variant").cloned()
        {
            let sms_variant = shape(
                &variant,
                &["subject", "html"],
                &["text"],
                "An SMS template's variant: its text.".to_owned(),
            );
            let email_variant = shape(
                &variant,
                &[],
                &["subject"],
                "An email template's variant: its subject, and its text, its HTML or both."
                    .to_owned(),
            );
            let (text, html) = (given(&email_variant, "text"), given(&email_variant, "html"));
            components
                .schemas
                .insert("SmsVariant".to_owned(), Schema::Object(sms_variant).into());
            components.schemas.insert(
                "EmailVariant".to_owned(),
                text_or_html(email_variant, text, html).into(),
            );
        }
        let with_variants = |object: utoipa::openapi::schema::Object, variant: &str| {
            patched(&object, |json| {
                let locales = &mut json["properties"]["locales"];
                locales["maxProperties"] = serde_json::json!(crate::templates::MAX_LOCALES);
                locales["propertyNames"] = serde_json::json!({"type": "string", "maxLength": 35, "pattern": LOCALE_PATTERN});
                locales["additionalProperties"] =
                    serde_json::json!({"$ref": format!("#/components/schemas/{variant}")});
            })
        };
        let (sms, email) = (
            with_variants(sms, "SmsVariant"),
            with_variants(email, "EmailVariant"),
        );
        let (text, html) = (given(&email, "text"), given(&email, "html"));
        components
            .schemas
            .insert("SmsTemplateContent".to_owned(), Schema::Object(sms).into());
        components.schemas.insert(
            "EmailTemplateContent".to_owned(),
            text_or_html(email, text, html).into(),
        );
        let union = OneOfBuilder::new()
            .description(whole.description.clone())
            .item(Ref::from_schema_name("EmailTemplateContent"))
            .item(Ref::from_schema_name("SmsTemplateContent"))
            .build();
        components
            .schemas
            .insert("TemplateContent".to_owned(), RefOr::T(Schema::OneOf(union)));
    }
}

struct SecurityAddon;

impl Modify for SecurityAddon {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "tenant_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("Tenant API key (`fl_…`), issued by an admin."))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "Admin token: `server.admin_token`, or the one generated on first start.",
                    ))
                    .build(),
            ),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "fairlane",
        description = "Multi-tenant notification gateway: email and SMS with fair queues, provider rate gates and a dead-letter queue. Errors are application/problem+json (RFC 9457)."
    ),
    paths(
        messages::send_message,
        messages::send_batch,
        messages::get_message,
        message_list::list_messages,
        usage::tenant_usage,
        messages::cancel_message,
        messages::cancel_by_reference,
        receipts::list_events,
        receipts::sms_callback,
        receipts::sms_callback_of,
        unsubscribe::unsubscribe_page,
        unsubscribe::unsubscribe,
        webhooks::put_webhook,
        webhooks::get_webhook,
        webhooks::delete_webhook,
        webhooks::rotate_webhook,
        suppressions::list_suppressions,
        suppressions::add_suppression,
        suppressions::get_suppression,
        suppressions::remove_suppression,
        admin::put_plan,
        admin::list_plans,
        admin::get_plan,
        admin::create_tenant,
        admin::list_tenants,
        admin::get_tenant,
        admin::patch_tenant,
        admin::delete_tenant,
        admin::issue_key,
        admin::revoke_key,
        admins::create_admin,
        admins::list_admins,
        admins::revoke_admin,
        audit::list_audit,
        webhooks::put_tenant_webhook,
        webhooks::get_tenant_webhook,
        webhooks::delete_tenant_webhook,
        webhooks::rotate_tenant_webhook,
        webhooks::redrive_tenant_webhook,
        webhooks::list_failing,
        suppressions::list_tenant_suppressions,
        suppressions::add_tenant_suppression,
        suppressions::get_tenant_suppression,
        suppressions::remove_tenant_suppression,
        message_list::list_tenant_messages,
        usage::admin_tenant_usage,
        usage::admin_usage,
        providers::list_providers,
        senders::list_own_senders,
        senders::list_senders,
        senders::add_sender,
        senders::patch_sender,
        senders::remove_sender,
        templates::list_own,
        templates::create_own,
        templates::get_own,
        templates::replace_own,
        templates::delete_own,
        templates::preview,
        templates::list_tenant_templates,
        templates::create_tenant_template,
        templates::get_tenant_template,
        templates::replace_tenant_template,
        templates::delete_tenant_template,
        attachments::upload_attachment,
        attachments::get_attachment,
        attachments::delete_attachment,
        tenant_queue::tenant_queue,
        tenant_queue::purge_tenant_queue,
        tenant_queue::tenant_dlq,
        tenant_queue::redrive_tenant_dlq,
        dlq::queues,
        dlq::list_dlq,
        dlq::redrive,
        dlq::metrics_text,
        health::healthz,
        health::readyz,
    ),
    components(
        schemas(
            error::Problem,
            crate::message::SendMessageRequest,
            crate::message::SendEmailRequest,
            crate::message::SendSmsRequest,
            dlq::RedriveRequest,
        ),
        responses(
            error::AdminUnauthorized,
            error::AdminForbidden,
            error::TenantUnauthorized,
            error::TenantDisabled,
            error::TenantDisabledChange,
            error::LiveKeyChange,
            error::TooManyChanges,
            error::TooManyUploads,
            error::IdempotencyInFlight,
            error::Malformed,
            error::PayloadTooLarge,
            error::UnsupportedMediaType,
        )
    ),
    modifiers(
        &SecurityAddon,
        &CommonResponses,
        &BatchItems,
        &SendShapes,
        &FlatViews,
        &TemplateShapes,
        &BodyRequirements
    ),
    tags(
        (name = "messages", description = "Send and track messages (tenant API key)."),
        (name = "templates", description = "The tenant's templates, their versions and previews (tenant API key; changes need a live key)."),
        (name = "attachments", description = "Files to attach to emails, uploaded before the send that names them (tenant API key)."),
        (name = "webhooks", description = "The tenant's signed webhook endpoint (tenant API key)."),
        (name = "suppressions", description = "The tenant's suppression list (tenant API key)."),
        (name = "receipts", description = "Delivery reports from providers (signed by the provider)."),
        (name = "unsubscribe", description = "One-click unsubscribe links in emails (signed token, no key)."),
        (name = "admin", description = "Plans, tenants, keys, webhooks, suppressions, queues, dead letters, admins and the audit log (an admin token: any role reads, an operator or owner changes, an owner manages admins)."),
        (name = "ops", description = "Health, readiness and metrics."),
    )
)]
pub struct ApiDoc;

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's pattern for a header name takes exactly what
    /// `message::is_allowed_header` takes.
    #[test]
    fn the_header_name_pattern_is_validation_s_rule() {
        let mut email = serde_json::json!({"properties": {"to": {}, "headers": {}}});
        email_fields(&mut email);
        let pattern = email["properties"]["headers"]["propertyNames"]["pattern"]
            .as_str()
            .unwrap();
        let pattern = regex::Regex::new(pattern).unwrap();
        let long = format!("X-{}", "a".repeat(62));
        let too_long = format!("X-{}", "a".repeat(63));
        for name in [
            "X-Tag",
            "x-tag",
            "X-S",
            "X-SE",
            "X-SES",
            "X-SESx",
            "X-SE-S",
            "X-SES-",
            "x-ses-tag",
            "X-Ses-Id",
            "X-",
            "X",
            "X-a b",
            "X-é",
            "List-Id",
            "list-ID",
            "List-Ids",
            "From",
            "Subject",
            "X--",
            "X-S-",
            &long,
            &too_long,
            "Y-Tag",
            "Precedence",
            "Auto-Submitted",
            "X-SEZ-1",
            "X-SES1",
        ] {
            assert_eq!(
                pattern.is_match(name),
                crate::message::is_allowed_header(name),
                "{name}"
            );
        }
    }

    /// `openapi/openapi.json` is what `fairlane openapi` prints; regenerate it
    /// with `cargo run -- openapi > openapi/openapi.json` when this fails.
    #[test]
    fn committed_openapi_document_is_current() {
        let committed =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json"))
                .expect("openapi/openapi.json is committed");
        let current = ApiDoc::openapi().to_pretty_json().unwrap();
        assert!(
            committed.trim_end() == current.trim_end(),
            "openapi/openapi.json is stale: run `cargo run -- openapi > openapi/openapi.json`"
        );
    }

    #[test]
    fn every_route_is_documented() {
        let doc = ApiDoc::openapi();
        for path in [
            "/v1/messages",
            "/v1/messages/{id}",
            "/v1/admin/plans",
            "/v1/admin/plans/{name}",
            "/v1/admin/tenants",
            "/v1/admin/tenants/{id}",
            "/v1/admin/tenants/{id}/keys",
            "/v1/admin/tenants/{id}/keys/{key_id}",
            "/healthz",
            "/readyz",
            "/v1/admin/queues",
            "/v1/admin/dlq",
            "/v1/admin/dlq/redrive",
            "/metrics",
        ] {
            assert!(
                doc.paths.paths.contains_key(path),
                "{path} is not documented"
            );
        }
    }
}
