//! `((name))` placeholders: how a template's text is cut into literal
//! text and the fields a send fills, and how it is filled.
//!
//! The syntax is GOV.UK Notify's, which the teams who move from it know:
//! a name between double parentheses, spaces around it ignored. It is not
//! a language: there are no loops, conditions or expressions, so a
//! template's author cannot write one that fails at delivery, and the
//! placeholders a template needs are exactly the ones it names, which is
//! what lets a send missing one, or naming one the template lacks, be
//! refused with the field named. A `(` before the `((` stays literal:
//! `(((name)))` renders as `(value)`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

/// Longest placeholder name, in characters.
pub const MAX_NAME_CHARS: usize = 64;

/// A piece of a template's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece<'a> {
    Text(&'a str),
    Field(&'a str),
}

/// True for a placeholder name: 1-64 letters, digits, spaces, `_`, `-`
/// and `.`, not starting or ending with a space.
fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name.chars().count() <= MAX_NAME_CHARS
        && name.trim() == name
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, ' ' | '_' | '-' | '.'))
}

/// `text` cut into literal text and placeholders, or why it cannot be: an
/// opened placeholder not closed, or a name that is not one.
pub fn pieces(text: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while let Some(mut open) = rest.find("((") {
        // `(((name)))`: the outer parentheses are text.
        while rest[open + 2..].starts_with('(') {
            open += 1;
        }
        let after = &rest[open + 2..];
        let Some(close) = after.find("))") else {
            let at = text.len() - rest.len() + open;
            return Err(format!(
                "has a placeholder opened at byte {at} and not closed with ))"
            ));
        };
        let name = after[..close].trim();
        if !is_name(name) {
            return Err(format!(
                "has a placeholder {:?} whose name is not 1-{MAX_NAME_CHARS} letters, digits, spaces, _, - or .",
                crate::message::field_name(name)
            ));
        }
        if open > 0 {
            pieces.push(Piece::Text(&rest[..open]));
        }
        pieces.push(Piece::Field(name));
        rest = &after[close + 2..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

/// The placeholder names of `text`, which must parse (see [`pieces`]).
pub fn names(text: &str) -> BTreeSet<String> {
    pieces(text)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|piece| match piece {
            Piece::Field(name) => Some(name.to_owned()),
            Piece::Text(_) => None,
        })
        .collect()
}

/// How a value is written into the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escape {
    /// As given (plain text, an SMS, a subject).
    None,
    /// HTML: `&`, `<`, `>`, `"` and `'` as entities, so a value is never
    /// read as markup. The template's own HTML stays as written.
    Html,
}

/// `text` with each placeholder replaced by its value; one with no value
/// is left as written (the caller checked they all have one).
pub fn fill(text: &str, values: &BTreeMap<String, String>, escape: Escape) -> String {
    let Ok(pieces) = pieces(text) else {
        return text.to_owned();
    };
    let mut out = String::with_capacity(text.len() + 64);
    for piece in pieces {
        match piece {
            Piece::Text(literal) => out.push_str(literal),
            Piece::Field(name) => match (values.get(name), escape) {
                (Some(value), Escape::None) => out.push_str(value),
                (Some(value), Escape::Html) => escape_html(value, &mut out),
                (None, _) => {
                    out.push_str("((");
                    out.push_str(name);
                    out.push_str("))");
                }
            },
        }
    }
    out
}

/// What a length is counted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Bytes,
    Chars,
}

/// How long `text` is once filled (see [`fill`]), in `unit`, worked out
/// from its pieces and the values' lengths with escaping counted, without
/// building it: a template that uses one placeholder 2,000 times with a
/// long value is refused before any of its 2,000 copies is written. Each
/// value is measured once, however often it is used.
pub fn filled_len(
    text: &str,
    values: &BTreeMap<String, String>,
    escape: Escape,
    unit: Unit,
) -> usize {
    let Ok(pieces) = pieces(text) else {
        return measure(text, unit);
    };
    let mut measured: BTreeMap<&str, usize> = BTreeMap::new();
    pieces.iter().fold(0usize, |total, piece| {
        let len = match *piece {
            Piece::Text(literal) => measure(literal, unit),
            Piece::Field(name) => match values.get(name) {
                Some(value) => *measured.entry(name).or_insert_with(|| {
                    let extra = match escape {
                        Escape::None => 0,
                        Escape::Html => value.bytes().map(escape_extra).sum(),
                    };
                    measure(value, unit).saturating_add(extra)
                }),
                None => measure(name, unit) + 4,
            },
        };
        total.saturating_add(len)
    })
}

fn measure(text: &str, unit: Unit) -> usize {
    match unit {
        Unit::Bytes => text.len(),
        Unit::Chars => text.chars().count(),
    }
}

/// What [`escape_html`] adds to one byte: the entity's length less the
/// byte it stands for (entities are ASCII, so bytes and characters alike).
fn escape_extra(byte: u8) -> usize {
    match byte {
        b'&' => "&amp;".len() - 1,
        b'<' => "&lt;".len() - 1,
        b'>' => "&gt;".len() - 1,
        b'"' => "&quot;".len() - 1,
        b'\'' => "&#39;".len() - 1,
        _ => 0,
    }
}

/// `value` escaped for HTML text and attributes (quoted either way):
/// maud's escaper, and `'` too, which maud leaves alone.
fn escape_html(value: &str, out: &mut String) {
    for (i, part) in value.split('\'').enumerate() {
        if i > 0 {
            out.push_str("&#39;");
        }
        let _ = maud::Escaper::new(out).write_str(part);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Personalisation from pairs.
    pub(in crate::templates) fn values(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_text_is_cut_into_literals_and_named_fields() {
        assert_eq!(
            pieces("Hello (( first name )), code ((code)).").unwrap(),
            vec![
                Piece::Text("Hello "),
                Piece::Field("first name"),
                Piece::Text(", code "),
                Piece::Field("code"),
                Piece::Text("."),
            ]
        );
        assert_eq!(
            names("((a)) ((b)) ((a))"),
            BTreeSet::from(["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(pieces("no fields").unwrap(), vec![Piece::Text("no fields")]);
    }

    #[test]
    fn outer_parentheses_stay_text() {
        assert_eq!(
            fill("(((ref)))", &values(&[("ref", "A1")]), Escape::None),
            "(A1)"
        );
    }

    #[test]
    fn an_unclosed_or_misnamed_placeholder_is_refused_saying_where() {
        let err = pieces("Hi ((name").unwrap_err();
        assert!(err.contains("byte 3"), "{err}");
        assert!(pieces("Hi (())").unwrap_err().contains("name"));
        assert!(pieces("Hi ((a<b))").unwrap_err().contains("a<b"));
        assert!(pieces(&format!("(({}))", "x".repeat(65))).is_err());
    }

    #[test]
    fn values_are_escaped_in_html_and_not_elsewhere() {
        let v = values(&[("name", "<script>alert('x')</script> & co")]);
        assert_eq!(
            fill("<p>((name))</p>", &v, Escape::Html),
            "<p>&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; co</p>"
        );
        assert_eq!(
            fill("Hi ((name))", &v, Escape::None),
            "Hi <script>alert('x')</script> & co"
        );
    }

    #[test]
    fn the_filled_length_is_worked_out_exactly_without_filling() {
        let v = values(&[("a", "<\"é'&>"), ("b", "plain")]);
        for text in [
            "((a))",
            "<p title=\"((a))\">((b)) ((a)) ((missing))</p>",
            "(((b)))",
            "no fields",
            "((unclosed",
        ] {
            for escape in [Escape::None, Escape::Html] {
                let filled = fill(text, &v, escape);
                assert_eq!(
                    filled_len(text, &v, escape, Unit::Bytes),
                    filled.len(),
                    "{text}"
                );
                assert_eq!(
                    filled_len(text, &v, escape, Unit::Chars),
                    filled.chars().count(),
                    "{text}"
                );
            }
        }
        // 2,000 uses of a 10,000-character value, measured, not built.
        let text = "((a))".repeat(2_000);
        let v = values(&[("a", &"\"".repeat(10_000))]);
        assert_eq!(
            filled_len(&text, &v, Escape::Html, Unit::Bytes),
            120_000_000
        );
    }

    #[test]
    fn a_value_that_looks_like_a_placeholder_is_not_filled_again() {
        let v = values(&[("a", "((b))"), ("b", "no")]);
        assert_eq!(fill("((a))", &v, Escape::None), "((b))");
    }
}
