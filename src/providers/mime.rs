//! An email as raw MIME (RFC 5322 headers, MIME parts), built by
//! mail-builder: the From with its display name, To and Cc, Reply-To, the
//! subject, the tenant's headers and `List-Unsubscribe`, and a body that is
//! `text/plain` alone or, with HTML, a `multipart/alternative` of the text
//! and the HTML; with files, that body and one part per file (base64,
//! `Content-Disposition: attachment` with its name) in a
//! `multipart/mixed`. Header values are encoded (RFC 2047) and long lines folded
//! by the builder; bodies are quoted-printable or base64 as their content
//! needs, so no line passes SES's 1,000 characters.
//!
//! Bcc recipients are not written into the message: they travel in the
//! call's destination only.

use mail_builder::MessageBuilder;
use mail_builder::headers::address::Address;
use mail_builder::headers::raw::Raw;

use crate::message::DeliveryPayload;

/// Who an email is from, as the provider decided.
pub struct Sender<'a> {
    pub address: &'a str,
    pub display_name: Option<&'a str>,
    pub reply_to: &'a [String],
}

/// The raw message of `message`, which has its subject and text (a send
/// by template is rendered before it reaches a provider).
pub fn raw_email(message: &DeliveryPayload, sender: &Sender<'_>) -> std::io::Result<Vec<u8>> {
    let domain = sender
        .address
        .rsplit_once('@')
        .map_or("fairlane.invalid", |(_, domain)| domain);
    let mut builder = MessageBuilder::new()
        .from(Address::new_address(sender.display_name, sender.address))
        .to(addresses(std::iter::once(message.to.as_str())))
        .subject(message.subject.as_deref().unwrap_or(""))
        // The message's own id: one per message, the same on a retry, and
        // no host name of ours in it.
        .message_id(format!("{}@{domain}", message.id))
        .text_body(message.text.as_str());
    if !message.cc.is_empty() {
        builder = builder.cc(addresses(message.cc.iter().map(String::as_str)));
    }
    if !sender.reply_to.is_empty() {
        builder = builder.reply_to(addresses(sender.reply_to.iter().map(String::as_str)));
    }
    if let Some(html) = &message.html {
        builder = builder.html_body(html.as_str());
    }
    for header in &message.headers {
        builder = builder.header(header.name.as_str(), Raw::new(header.value.as_str()));
    }
    for file in &message.attachments {
        builder = builder.attachment(
            file.content_type.as_str(),
            file.filename.as_str(),
            file.data.as_ref(),
        );
    }
    builder.write_to_vec()
}

/// One address, or a list of them.
fn addresses<'a>(mut list: impl ExactSizeIterator<Item = &'a str>) -> Address<'a> {
    if list.len() == 1 {
        let only = list.next().unwrap_or_default();
        return Address::new_address(None::<&str>, only);
    }
    Address::new_list(
        list.map(|address| Address::new_address(None::<&str>, address))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::EmailHeader;
    use crate::model::Channel;
    use mail_parser::{MessageParser, MimeHeaders};

    fn parsed(raw: &[u8]) -> mail_parser::Message<'_> {
        MessageParser::default().parse(raw).expect("a MIME message")
    }

    #[test]
    fn text_and_html_make_a_multipart_alternative_with_every_header() {
        let mut message = crate::providers::tests::payload(Channel::Email, "a@example.com");
        message.subject = Some("Café ✓ receipt".into());
        message.html = Some("<p>Paid: <b>€10</b></p>".into());
        message.cc = vec!["c@example.com".into(), "d@example.com".into()];
        message.bcc = vec!["hidden@example.com".into()];
        message.headers = vec![EmailHeader {
            name: "X-Campaign".into(),
            value: "spring".into(),
        }];
        let reply_to = vec!["help@acme.example".to_owned()];
        let raw = raw_email(
            &message,
            &Sender {
                address: "news@acme.example",
                display_name: Some("Acme \"News\" é"),
                reply_to: &reply_to,
            },
        )
        .unwrap();
        assert!(
            raw.split(|b| *b == b'\n').all(|line| line.len() <= 1000),
            "no line over 1,000 characters"
        );
        let mail = parsed(&raw);
        assert_eq!(mail.subject(), Some("Café ✓ receipt"));
        let from = mail.from().unwrap().first().unwrap();
        assert_eq!(from.address(), Some("news@acme.example"));
        assert_eq!(from.name(), Some("Acme \"News\" é"));
        let cc: Vec<_> = mail
            .cc()
            .unwrap()
            .iter()
            .filter_map(|a| a.address())
            .collect();
        assert_eq!(cc, ["c@example.com", "d@example.com"]);
        assert!(mail.bcc().is_none(), "Bcc is not written into the message");
        assert!(!String::from_utf8_lossy(&raw).contains("hidden@example.com"));
        assert_eq!(
            mail.reply_to().unwrap().first().unwrap().address(),
            Some("help@acme.example")
        );
        assert_eq!(
            mail.header("X-Campaign").and_then(|v| v.as_text()),
            Some("spring")
        );
        assert_eq!(
            mail.content_type().map(|c| (c.ctype(), c.subtype())),
            Some(("multipart", Some("alternative")))
        );
        assert_eq!(mail.body_text(0).as_deref(), Some("Your code is 123456"));
        assert_eq!(
            mail.body_html(0).as_deref(),
            Some("<p>Paid: <b>€10</b></p>")
        );
        assert_eq!(
            mail.message_id(),
            Some(format!("{}@acme.example", message.id).as_str())
        );
    }

    #[test]
    fn text_alone_is_a_single_plain_part() {
        let message = crate::providers::tests::payload(Channel::Email, "a@example.com");
        let sender = Sender {
            address: "noreply@example.com",
            display_name: None,
            reply_to: &[],
        };
        let raw = raw_email(&message, &sender).unwrap();
        let mail = parsed(&raw);
        assert_eq!(
            mail.content_type().map(|c| (c.ctype(), c.subtype())),
            Some(("text", Some("plain")))
        );
        assert_eq!(
            mail.to().unwrap().first().unwrap().address(),
            Some("a@example.com")
        );
    }
    #[test]
    fn files_make_a_multipart_mixed_whose_parts_decode_to_the_same_bytes() {
        let mut message = crate::providers::tests::payload(Channel::Email, "a@example.com");
        message.html = Some("<p>Your invoice</p>".into());
        let pdf: Vec<u8> = b"%PDF-1.7\n"
            .iter()
            .copied()
            .chain((0..200_000u32).map(|n| (n * 7 % 251) as u8))
            .collect();
        message.attachments = vec![crate::message::AttachmentOnMessage {
            id: "att_1".into(),
            filename: "Facture é.pdf".into(),
            content_type: "application/pdf".into(),
            size: pdf.len() as i64,
            data: pdf.clone().into(),
        }];
        let raw = raw_email(
            &message,
            &Sender {
                address: "news@acme.example",
                display_name: None,
                reply_to: &[],
            },
        )
        .unwrap();
        assert!(raw.split(|b| *b == b'\n').all(|line| line.len() <= 1000));
        let mail = parsed(&raw);
        assert_eq!(
            mail.content_type().map(|c| (c.ctype(), c.subtype())),
            Some(("multipart", Some("mixed")))
        );
        assert_eq!(mail.attachment_count(), 1);
        let file = mail.attachment(0).unwrap();
        assert_eq!(file.attachment_name(), Some("Facture é.pdf"));
        assert_eq!(file.contents(), pdf.as_slice());
        assert_eq!(mail.body_html(0).as_deref(), Some("<p>Your invoice</p>"));
    }
}
