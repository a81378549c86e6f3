//! SMS receipts from a Twilio-compatible API: with `server.public_url`
//! set, every SMS request carries `StatusCallback =
//! {public_url}/v1/callbacks/sms`, and the provider POSTs each status
//! change of the message there as a form.
//!
//! The callback is trusted only with a valid `X-Twilio-Signature`: the
//! Base64 HMAC-SHA1, keyed with the account's auth token, of the full URL
//! the provider called followed by every POST parameter's name and value,
//! sorted by name. Anything else is answered 403 and changes nothing.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use sha1::Sha1;

use super::Receipt;
use crate::model::MessageStatus;

/// Path of the callback endpoint, which each SMS request names.
pub use crate::providers::sms_http::CALLBACK_PATH;

/// Twilio error codes after which the number is suppressed: 21610, the
/// recipient replied STOP (a complaint); 30005 (unknown or inactive
/// number) and 30006 (landline or unreachable carrier), hard bounces.
const SUPPRESSING_CODES: &[(&str, &str)] = &[
    ("21610", "complaint"),
    ("30005", "bounce"),
    ("30006", "bounce"),
];

/// The HMAC Twilio keys with the auth token over `url` and the form
/// `params`, sorted by name (and value, for a repeated name).
fn mac(auth_token: &str, url: &str, params: &[(String, String)]) -> Hmac<Sha1> {
    let mut sorted: Vec<&(String, String)> = params.iter().collect();
    sorted.sort();
    let mut mac = Hmac::<Sha1>::new_from_slice(auth_token.as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(url.as_bytes());
    for (name, value) in sorted {
        mac.update(name.as_bytes());
        mac.update(value.as_bytes());
    }
    mac
}

/// The signature Twilio computes over `url` and the form `params`.
pub fn signature(auth_token: &str, url: &str, params: &[(String, String)]) -> String {
    BASE64.encode(mac(auth_token, url, params).finalize().into_bytes())
}

/// True when `given` is the signature of `url` and `params` (compared in
/// constant time).
pub fn verify(auth_token: &str, url: &str, params: &[(String, String)], given: &str) -> bool {
    match BASE64.decode(given.trim()) {
        Ok(given) => mac(auth_token, url, params).verify_slice(&given).is_ok(),
        Err(_) => false,
    }
}

/// Reads a verified callback's form into a receipt; Err names the missing
/// field.
pub fn receipt(params: &[(String, String)]) -> Result<Receipt, (&'static str, &'static str)> {
    let get = |name: &str| {
        params
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
            .filter(|value| !value.is_empty())
    };
    let sid = get("MessageSid")
        .or_else(|| get("SmsSid"))
        .ok_or(("MessageSid", "is required"))?;
    let status = get("MessageStatus")
        .or_else(|| get("SmsStatus"))
        .ok_or(("MessageStatus", "is required"))?
        .to_ascii_lowercase();
    let code = get("ErrorCode");
    let (outcome, event) = match status.as_str() {
        "delivered" => (Some(MessageStatus::Delivered), "delivered".to_owned()),
        "undelivered" | "failed" => (Some(MessageStatus::Failed), "failed".to_owned()),
        other => (None, format!("sms_{other}")),
    };
    let detail = match (code, get("ErrorMessage")) {
        (Some(code), Some(text)) => Some(format!("{status}: error {code}: {text}")),
        (Some(code), None) => Some(format!("{status}: error {code}")),
        (None, _) if outcome == Some(MessageStatus::Failed) => Some(status.clone()),
        (None, _) => None,
    };
    let suppressing = code.and_then(|code| {
        SUPPRESSING_CODES
            .iter()
            .find(|(listed, _)| *listed == code)
            .map(|(_, reason)| *reason)
    });
    let (suppress, suppress_reason) = match (suppressing, get("To")) {
        (Some(reason), Some(to)) if outcome.is_some() => {
            (vec![to.to_owned()], Some(reason.to_owned()))
        }
        _ => (Vec::new(), None),
    };
    Ok(Receipt {
        provider: "http".into(),
        provider_message_id: sid.to_owned(),
        // The callback's URL carries it (read by the endpoint).
        message_id: None,
        outcome,
        event,
        detail,
        suppress,
        suppress_reason,
        // An SMS has one recipient: the message's status is its status.
        recipients: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_signature_matches_twilios_documented_example() {
        // Twilio's security documentation's example; the signature is the
        // one the `twilio` Python library's RequestValidator computes.
        let params = form(&[
            ("CallSid", "CA1234567890ABCDE"),
            ("Caller", "+12349013030"),
            ("Digits", "1234"),
            ("From", "+12349013030"),
            ("To", "+18005551212"),
        ]);
        let url = "https://mycompany.com/myapp.php?foo=1&bar=2";
        let token = "12345";
        assert_eq!(
            signature(token, url, &params),
            "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
        );
        assert!(verify(token, url, &params, "0/KCTR6DLpKmkAf8muzZqo1nDgQ="));
        assert!(!verify(
            "54321",
            url,
            &params,
            "0/KCTR6DLpKmkAf8muzZqo1nDgQ="
        ));
        assert!(!verify(token, url, &params, "not base64!"));
    }

    #[test]
    fn statuses_map_to_outcomes_and_events() {
        let delivered = receipt(&form(&[
            ("MessageSid", "SM1"),
            ("MessageStatus", "delivered"),
        ]))
        .unwrap();
        assert_eq!(delivered.outcome, Some(MessageStatus::Delivered));
        let failed = receipt(&form(&[
            ("MessageSid", "SM1"),
            ("MessageStatus", "undelivered"),
            ("ErrorCode", "30006"),
            ("To", "+15551234567"),
        ]))
        .unwrap();
        assert_eq!(failed.outcome, Some(MessageStatus::Failed));
        assert_eq!(failed.detail.as_deref(), Some("undelivered: error 30006"));
        assert_eq!(failed.suppress, vec!["+15551234567".to_owned()]);
        let sent = receipt(&form(&[("MessageSid", "SM1"), ("MessageStatus", "sent")])).unwrap();
        assert_eq!((sent.outcome, sent.event.as_str()), (None, "sms_sent"));
        assert!(receipt(&form(&[("MessageStatus", "sent")])).is_err());
    }
}
