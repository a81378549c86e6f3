//! What a batch costs, bounded: its body is read as a list of raw items
//! (borrowed from the request's bytes, never one tree of the whole body),
//! each item is parsed only when its turn comes and dropped after, an item
//! larger than [`MAX_ITEM_BYTES`] is refused unread, and a tenant has at
//! most `server.max_batches_per_tenant` batches in progress.
//!
//! So a batch's memory follows what it accepts: a body of thousands of
//! unknown keys costs one item's parse at a time and a few errors per item
//! (see [`crate::message::MAX_UNKNOWN_FIELDS_NAMED`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Deserializer;
use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::idempotency::feed_hash;
use super::{LimitReason, MAX_BATCH, Refused};
use crate::message::{MAX_PAYLOAD_BYTES, field_name};

/// Largest batch item, in bytes of JSON: what one message may take in the
/// queue. A larger item is refused (413) without being parsed.
pub const MAX_ITEM_BYTES: usize = MAX_PAYLOAD_BYTES;

/// A batch body's `messages`, each item still raw JSON.
pub(crate) fn items(body: &[u8]) -> Result<Vec<&RawValue>, Refused> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let top = deserializer
        .deserialize_any(TopVisitor)
        .and_then(|top| deserializer.end().map(|()| top))
        .map_err(|err| Refused::Malformed(format!("Request body is not valid JSON: {err}.")))?;
    let top = match top {
        Top::NotAnObject => {
            return Err(Refused::field(
                "body",
                "must be a JSON object with a `messages` list",
            ));
        }
        Top::Object {
            unknown: Some(key), ..
        } => {
            return Err(Refused::field(
                &field_name(&key),
                "unknown field; a batch has only `messages`",
            ));
        }
        Top::Object { messages, .. } => messages,
    };
    match top {
        None => Err(Refused::field("messages", "is required")),
        Some(List::Other) => Err(Refused::field(
            "messages",
            "must be a list of send requests",
        )),
        Some(List::TooLong) => Err(Refused::field(
            "messages",
            format!("must hold at most {MAX_BATCH} messages"),
        )),
        Some(List::Items(items)) if items.is_empty() => {
            Err(Refused::field("messages", "must hold at least one message"))
        }
        Some(List::Items(items)) => Ok(items),
    }
}

/// An item too large to be read: refused on its own, like a single send
/// of that size.
pub(crate) fn refuse_oversized(item: &RawValue) -> Result<(), Refused> {
    let size = item.get().len();
    if size > MAX_ITEM_BYTES {
        return Err(Refused::TooLarge(format!(
            "This message is {size} bytes of JSON; a batch item may have at most {MAX_ITEM_BYTES}."
        )));
    }
    Ok(())
}

/// The request hash of a batch body: the same as
/// [`super::request_hash`] of `{"messages": items}`, computed one item at
/// a time (an oversized item by its raw text, as it is refused anyway).
pub(crate) fn request_hash(items: &[&RawValue]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"{\"messages\":[");
    for item in items {
        match serde_json::from_str(item.get()) {
            Ok(value) if refuse_oversized(item).is_ok() => feed_hash(&mut hasher, &value),
            _ => hasher.update(item.get().as_bytes()),
        }
        hasher.update(b",");
    }
    hasher.update(b"],}");
    hex::encode(hasher.finalize())
}

enum Top<'a> {
    NotAnObject,
    Object {
        messages: Option<List<'a>>,
        /// The first key other than `messages`.
        unknown: Option<String>,
    },
}

enum List<'a> {
    Other,
    TooLong,
    Items(Vec<&'a RawValue>),
}

struct TopVisitor;

impl<'de> Visitor<'de> for TopVisitor {
    type Value = Top<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut messages = None;
        let mut unknown = None;
        while let Some(key) = map.next_key::<String>()? {
            if key == "messages" {
                messages = Some(map.next_value_seed(ListSeed)?);
            } else {
                unknown.get_or_insert(key);
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(Top::Object { messages, unknown })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Top::NotAnObject)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(Top::NotAnObject)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(Top::NotAnObject)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(Top::NotAnObject)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(Top::NotAnObject)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(Top::NotAnObject)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Top::NotAnObject)
    }
}

/// `messages`: up to [`MAX_BATCH`] raw items kept, the rest skipped.
struct ListSeed;

impl<'de> serde::de::DeserializeSeed<'de> for ListSeed {
    type Value = List<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(ListVisitor)
    }
}

struct ListVisitor;

impl<'de> Visitor<'de> for ListVisitor {
    type Value = List<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of send requests")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<&'de RawValue>()? {
            if items.len() == MAX_BATCH {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                return Ok(List::TooLong);
            }
            items.push(item);
        }
        Ok(List::Items(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(List::Other)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(List::Other)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(List::Other)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(List::Other)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(List::Other)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(List::Other)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(List::Other)
    }
}

/// Batches in progress, by tenant.
#[derive(Default)]
pub(crate) struct BatchSlots {
    max_per_tenant: usize,
    taken: Arc<Mutex<HashMap<String, usize>>>,
}

/// One batch in progress; its slot is given back when dropped.
pub(crate) struct BatchSlot {
    taken: Arc<Mutex<HashMap<String, usize>>>,
    tenant_id: String,
}

impl BatchSlots {
    pub(crate) fn new(max_per_tenant: usize) -> Self {
        BatchSlots {
            max_per_tenant: max_per_tenant.max(1),
            taken: Arc::default(),
        }
    }

    /// A slot for a batch of `tenant_id`, or 429 while it has
    /// `max_per_tenant` in progress.
    pub(crate) fn take(&self, tenant_id: &str) -> Result<BatchSlot, Refused> {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        let count = taken.entry(tenant_id.to_owned()).or_default();
        if *count >= self.max_per_tenant {
            return Err(Refused::Limited {
                reason: LimitReason::Batches,
                detail: format!(
                    "This tenant already has {} batches in progress, the most server.max_batches_per_tenant allows.",
                    self.max_per_tenant
                ),
                retry_after: Duration::from_secs(1),
                rate: None,
            });
        }
        *count += 1;
        Ok(BatchSlot {
            taken: self.taken.clone(),
            tenant_id: tenant_id.to_owned(),
        })
    }
}

impl Drop for BatchSlot {
    fn drop(&mut self) {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = taken.get_mut(&self.tenant_id) {
            *count -= 1;
            if *count == 0 {
                taken.remove(&self.tenant_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn field_of(refused: Refused) -> String {
        match refused {
            Refused::Invalid(errors) => errors.into_keys().next().unwrap(),
            other => panic!("not a 422: {other:?}"),
        }
    }

    #[test]
    fn a_batch_body_gives_its_raw_items() {
        let body = br#"{"messages": [{"a": 1}, [2], "three"]}"#;
        let items = items(body).unwrap();
        let texts: Vec<&str> = items.iter().map(|item| item.get()).collect();
        assert_eq!(texts, [r#"{"a": 1}"#, "[2]", r#""three""#]);
    }

    #[test]
    fn a_body_that_is_not_a_batch_is_refused_naming_what_is_wrong() {
        for (body, field) in [
            (r#"[1]"#, "body"),
            (r#""x""#, "body"),
            (r#"{}"#, "messages"),
            (r#"{"messages": []}"#, "messages"),
            (r#"{"messages": {"a": 1}}"#, "messages"),
            (r#"{"messages": [1], "extra": 1, "more": 2}"#, "extra"),
        ] {
            assert_eq!(
                field_of(items(body.as_bytes()).unwrap_err()),
                field,
                "{body}"
            );
        }
        let long = json!({"messages": vec![1; MAX_BATCH + 1]}).to_string();
        assert_eq!(field_of(items(long.as_bytes()).unwrap_err()), "messages");
        assert!(matches!(
            items(b"{\"messages\": [1,"),
            Err(Refused::Malformed(_))
        ));
        assert!(matches!(
            items(b"{\"messages\": [1]} trailing"),
            Err(Refused::Malformed(_))
        ));
    }

    #[test]
    fn the_batch_hash_is_the_hash_of_the_whole_body() {
        let body = json!({"messages": [{"b": 2, "a": [1, {"z": null}]}, "x", 3]});
        let text = body.to_string();
        assert_eq!(
            request_hash(&items(text.as_bytes()).unwrap()),
            super::super::request_hash(&body)
        );
    }

    #[test]
    fn a_tenant_has_at_most_its_batches_in_progress() {
        let slots = BatchSlots::new(2);
        let first = slots.take("a").unwrap();
        let _second = slots.take("a").unwrap();
        assert!(matches!(
            slots.take("a"),
            Err(Refused::Limited {
                reason: LimitReason::Batches,
                ..
            })
        ));
        let _other = slots.take("b").unwrap();
        drop(first);
        let _third = slots.take("a").unwrap();
    }
}
