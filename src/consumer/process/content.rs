//! What a message carries besides its payload, read at delivery: a
//! template's rendering and the files of an email.

use tracing::warn;

use super::lease::defer;
use super::{Context, Known, dead_letter};
use crate::message::DeliveryPayload;
use crate::queue::ReceivedMessage;

/// The bytes of the files an email carries read from the store into its
/// payload; false when they could not be (deferred while the store is
/// away, dead-lettered when a file is gone), and then it is settled here.
pub(super) async fn read_files(
    context: &Context,
    message: &ReceivedMessage,
    payload: &mut DeliveryPayload,
) -> bool {
    for index in 0..payload.attachments.len() {
        let id = payload.attachments[index].id.clone();
        match context.delivery.db.attachment_bytes(&payload.id, &id).await {
            Ok(Some(bytes)) => payload.attachments[index].data = bytes.into(),
            Ok(None) => {
                let reason = format!("attachment {id} is not in the store");
                dead_letter(context, message, Known::unsent(payload), &reason, false).await;
                return false;
            }
            Err(err) => {
                warn!(message_id = %payload.id, error = %err, "Could not read the message's attachments; trying again soon.");
                let pause = context.delivery.store_trouble.retry_after();
                defer(context, message, pause, "store").await;
                return false;
            }
        }
    }
    true
}

/// A send by template rendered into the payload's subject, text and HTML
/// from the version it was accepted with; false when it could not be
/// (deferred while the store is away, dead-lettered when the version is
/// gone or no longer renders), and then it is settled here.
pub(super) async fn render_template(
    context: &Context,
    message: &ReceivedMessage,
    payload: &mut DeliveryPayload,
) -> bool {
    let Some(template) = payload.template.take() else {
        return true;
    };
    let found = context
        .delivery
        .templates
        .version(&payload.tenant_id, &template.id, template.version)
        .await;
    let content = match found {
        Ok(Some(content)) => content,
        Ok(None) => {
            let reason = format!(
                "template {:?} version {} is not in the store",
                template.id, template.version
            );
            dead_letter(context, message, Known::unsent(payload), &reason, false).await;
            return false;
        }
        Err(err) => {
            warn!(message_id = %payload.id, error = %err, "Could not read the message's template; trying again soon.");
            let pause = context.delivery.store_trouble.retry_after();
            defer(context, message, pause, "store").await;
            return false;
        }
    };
    match content.render(template.locale.as_deref(), &template.personalisation) {
        Ok(rendered) => {
            payload.subject = rendered.subject;
            payload.text = rendered.text;
            payload.html = rendered.html;
            true
        }
        Err(errors) => {
            let reason = format!("the template no longer renders: {errors:?}");
            dead_letter(context, message, Known::unsent(payload), &reason, false).await;
            false
        }
    }
}
