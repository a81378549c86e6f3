//! A console form as the admin API's JSON body: the fields an HTML form
//! posts (all text) become a JSON object, which the API's own input types
//! then check, so a console change is refused for exactly what the API
//! would refuse, naming the same field.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::api::error::ApiError;
use crate::api::typed_from_slice;

/// What kind of JSON value a form field stands for.
#[derive(Clone, Copy)]
pub enum Kind {
    /// A number; text that is not one is left as text, for the input
    /// type to refuse by name.
    Number,
    /// A checkbox: present means `true`, absent `false`.
    Checkbox,
}

/// `fields` (as posted) as a `T`: the CSRF token left out, empty fields
/// left out (the input type's default), those named in `kinds` converted.
pub fn typed<T: DeserializeOwned>(
    fields: &[(String, String)],
    kinds: &[(&str, Kind)],
) -> Result<T, ApiError> {
    let mut object = Map::new();
    for (name, kind) in kinds {
        if matches!(kind, Kind::Checkbox) {
            object.insert((*name).to_owned(), Value::Bool(false));
        }
    }
    for (name, text) in fields {
        let text = text.trim();
        if name == "csrf" || text.is_empty() {
            continue;
        }
        let kind = kinds.iter().find(|(known, _)| known == name).map(|k| k.1);
        let value = match kind {
            Some(Kind::Number) => serde_json::from_str::<serde_json::Number>(text)
                .map_or_else(|_| Value::String(text.to_owned()), Value::Number),
            Some(Kind::Checkbox) => Value::Bool(true),
            None => Value::String(text.to_owned()),
        };
        object.insert(name.clone(), value);
    }
    let bytes = serde_json::to_vec(&Value::Object(object)).expect("a JSON object serializes");
    typed_from_slice(&bytes)
}

/// The value of field `name`, trimmed; `""` when absent.
pub fn field<'a>(fields: &'a [(String, String)], name: &str) -> &'a str {
    fields
        .iter()
        .find(|(known, _)| known == name)
        .map_or("", |(_, value)| value.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        name: String,
        count: Option<u32>,
        flag: bool,
    }

    fn posted(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    const KINDS: [(&str, Kind); 2] = [("count", Kind::Number), ("flag", Kind::Checkbox)];

    #[test]
    fn a_form_becomes_the_input_type_and_its_faults_name_the_field() {
        let sample: Sample = typed(
            &posted(&[
                ("csrf", "x"),
                ("name", " a "),
                ("count", "3"),
                ("flag", "on"),
            ]),
            &KINDS,
        )
        .unwrap();
        assert_eq!(
            sample,
            Sample {
                name: "a".into(),
                count: Some(3),
                flag: true
            }
        );
        let sample: Sample = typed(&posted(&[("name", "a"), ("count", "")]), &KINDS).unwrap();
        assert_eq!((sample.count, sample.flag), (None, false));
        let err = typed::<Sample>(&posted(&[("name", "a"), ("count", "many")]), &KINDS)
            .unwrap_err()
            .problem();
        assert!(err.errors.unwrap().contains_key("count"));
        let err = typed::<Sample>(&posted(&[("name", "a"), ("colour", "red")]), &KINDS)
            .unwrap_err()
            .problem();
        assert!(err.errors.unwrap().contains_key("colour"));
    }
}
