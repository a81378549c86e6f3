//! Recipients' addresses: the syntax a send's `to`, `cc` and `bcc` must
//! have (E.164 numbers, email addresses), and email addresses as the
//! providers take them. SES v2 takes 7-bit ASCII
//! addresses, the domain in Punycode (IDNA), and no internationalised
//! local part (SMTPUTF8): an address with a non-ASCII domain is converted
//! at accept, with the `idna` crate (UTS #46, as browsers and mail clients
//! do), and one with a non-ASCII local part is refused.

use serde_json::{Map, Value};

use super::{Errors, MAX_EMAIL_LEN, MAX_RECIPIENTS};
use crate::model::Channel;

/// True for an E.164 number: `+`, a non-zero digit, then 7 to 14 digits.
pub fn is_e164(number: &str) -> bool {
    let Some(digits) = number.strip_prefix('+') else {
        return false;
    };
    (8..=15).contains(&digits.len())
        && digits.bytes().all(|b| b.is_ascii_digit())
        && !digits.starts_with('0')
}

/// True for a deliverable-looking address: RFC 5322 `local@domain` syntax
/// (checked by the `email_address` crate), no display name, at most 254
/// characters, and a domain with at least one dot.
pub fn is_email_address(address: &str) -> bool {
    if address.len() > MAX_EMAIL_LEN || address.trim() != address {
        return false;
    }
    let Ok(parsed) = address.parse::<email_address::EmailAddress>() else {
        return false;
    };
    let domain = parsed.domain();
    parsed.as_str() == address
        && !address.contains('<')
        && domain.contains('.')
        && !domain.starts_with('.')
        && !domain.ends_with('.')
}

/// A valid email address as the provider takes it ([`ascii_address`]),
/// still within [`MAX_EMAIL_LEN`] once converted.
pub(super) fn sendable_address(address: &str) -> Result<String, &'static str> {
    let ascii = ascii_address(address)?;
    if ascii.len() > MAX_EMAIL_LEN {
        return Err("is longer than 254 characters once its domain is in Punycode");
    }
    Ok(ascii)
}

/// An email's `cc` and `bcc`: arrays of addresses, each valid, none
/// repeating another recipient, at most [`MAX_RECIPIENTS`] with `to`.
pub(super) fn copies(
    object: &Map<String, Value>,
    to: Option<&str>,
    errors: &mut Errors,
) -> (Vec<String>, Vec<String>) {
    let mut seen: Vec<String> = to
        .map(|to| {
            sendable_address(to)
                .unwrap_or_else(|_| to.to_owned())
                .to_lowercase()
        })
        .into_iter()
        .collect();
    let mut lists = [Vec::new(), Vec::new()];
    for (field, list) in ["cc", "bcc"].into_iter().zip(lists.iter_mut()) {
        let items = match object.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::Array(items)) => items,
            Some(_) => {
                errors.insert(field.into(), "must be an array of email addresses".into());
                continue;
            }
        };
        for (i, item) in items.iter().enumerate() {
            let name = format!("{field}[{i}]");
            let address = match item.as_str().map(|given| (given, is_email_address(given))) {
                Some((given, true)) => {
                    sendable_address(given).map_err(|refused| (name.clone(), refused))
                }
                Some((_, false)) => Err((
                    name.clone(),
                    "must be an email address like name@example.com",
                )),
                None => Err((name.clone(), "must be a string")),
            };
            match address {
                Err((name, refused)) => {
                    errors.insert(name, refused.into());
                }
                Ok(address) if seen.contains(&address.to_lowercase()) => {
                    errors.insert(name, "repeats another recipient of the message".into());
                }
                Ok(address) => {
                    seen.push(address.to_lowercase());
                    list.push(address);
                }
            }
            if seen.len() > MAX_RECIPIENTS {
                errors.insert(
                    field.into(),
                    format!("to, cc and bcc together must be at most {MAX_RECIPIENTS} addresses"),
                );
                break;
            }
        }
    }
    let [cc, bcc] = lists;
    (cc, bcc)
}

/// The recipient checked for its channel.
pub(super) fn check_to(channel: Channel, to: &str, errors: &mut Errors) {
    let refused = match channel {
        Channel::Email if !is_email_address(to) => {
            "must be an email address like name@example.com (at most 254 characters, no display name)"
        }
        Channel::Email => match sendable_address(to) {
            Ok(_) => return,
            Err(refused) => refused,
        },
        Channel::Sms if !is_e164(to) => "must be a phone number in E.164 form, like +15551234567",
        _ => return,
    };
    errors.insert("to".into(), refused.into());
}

/// Why an address cannot go to the provider as it is given.
pub const LOCAL_PART_NOT_ASCII: &str = "has non-ASCII characters before the @: the email provider (SES) takes only ASCII there (no SMTPUTF8); a non-ASCII domain is fine";
/// The domain has no IDNA form.
pub const DOMAIN_NOT_IDNA: &str = "has a domain that is not a valid internationalised domain name";

/// `address` (a syntactically valid email address) as the provider takes
/// it: its domain in ASCII (Punycode for an internationalised domain,
/// lower-cased by IDNA's mapping), its local part unchanged; an ASCII
/// address comes back as it is. `Err` says why the address cannot be sent.
pub fn ascii_address(address: &str) -> Result<String, &'static str> {
    let Some((local, domain)) = address.rsplit_once('@') else {
        return Ok(address.to_owned());
    };
    if !local.is_ascii() {
        return Err(LOCAL_PART_NOT_ASCII);
    }
    if domain.is_ascii() {
        return Ok(address.to_owned());
    }
    let ascii = idna::domain_to_ascii(domain).map_err(|_| DOMAIN_NOT_IDNA)?;
    if ascii.is_empty() || !ascii.is_ascii() {
        return Err(DOMAIN_NOT_IDNA);
    }
    Ok(format!("{local}@{ascii}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_internationalised_domain_is_sent_in_punycode() {
        assert_eq!(
            ascii_address("user@bücher.example").unwrap(),
            "user@xn--bcher-kva.example"
        );
        assert_eq!(
            ascii_address("Ada@BÜCHER.example").unwrap(),
            "Ada@xn--bcher-kva.example",
            "IDNA maps the domain to lower case; the local part stays as given"
        );
        assert_eq!(ascii_address("ada@example.com").unwrap(), "ada@example.com");
    }

    #[test]
    fn a_non_ascii_local_part_is_refused() {
        assert_eq!(ascii_address("üser@example.com"), Err(LOCAL_PART_NOT_ASCII));
    }
}
