//! The book's configuration reference (`docs/src/reference/configuration.md`),
//! rendered from the config structs of [`crate::config`]: their JSON Schema
//! (derived with `schemars`, which reads the doc comments, the types and
//! serde's defaults) gives every key and its meaning, and the built-in
//! `config/default.toml` gives the defaults it sets.
//!
//! Regenerate with
//! `cargo run --example config_reference > docs/src/reference/configuration.md`;
//! `tests/api/docs.rs` fails while the committed file differs, and checks
//! its keys against `config/default.toml` key for key.

use figment::Figment;
use figment::providers::{Format, Toml};
use serde_json::{Map, Value};

use crate::config::{DEFAULT_TOML, Settings};

/// One level of a key's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// A fixed name: `server`, `listen`.
    Name(String),
    /// Sibling tables of one shape, written once: `<fast|slow>`.
    OneOf(Vec<String>),
    /// Any name the operator chooses (a map's keys): `<name>`.
    Any,
}

/// A key of the configuration, possibly standing for several
/// (`lanes.<fast|slow>.concurrency`, `plans.<name>.burst`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPattern(pub Vec<Segment>);

impl KeyPattern {
    /// As written in the reference: `lanes.<fast|slow>.concurrency`.
    pub fn dotted(&self) -> String {
        self.render(".", |name| name.to_owned())
    }

    /// The environment variable that sets it: `FAIRLANE__LANES__<FAST|SLOW>__CONCURRENCY`.
    pub fn env_var(&self) -> String {
        format!(
            "{}{}",
            crate::config::ENV_PREFIX,
            self.render("__", str::to_ascii_uppercase)
        )
    }

    fn render(&self, separator: &str, case: impl Fn(&str) -> String) -> String {
        self.0
            .iter()
            .map(|segment| match segment {
                Segment::Name(name) => case(name),
                Segment::OneOf(names) => {
                    let names: Vec<String> = names.iter().map(|name| case(name)).collect();
                    format!("<{}>", names.join("|"))
                }
                Segment::Any => format!("<{}>", case("name")),
            })
            .collect::<Vec<_>>()
            .join(separator)
    }

    /// Whether the concrete dotted `key` (`lanes.fast.concurrency`) is this
    /// key, or lies inside it when this key is a table written as a whole
    /// (`providers.<email_pool|sms_pool>.<name>` holds
    /// `providers.sms_pool.backup.kind`).
    pub fn covers(&self, key: &str, whole_table: bool) -> bool {
        let parts: Vec<&str> = key.split('.').collect();
        let length_fits = if whole_table {
            parts.len() >= self.0.len()
        } else {
            parts.len() == self.0.len()
        };
        length_fits
            && self
                .0
                .iter()
                .zip(&parts)
                .all(|(segment, part)| match segment {
                    Segment::Name(name) => name == part,
                    Segment::OneOf(names) => names.iter().any(|name| name == part),
                    Segment::Any => true,
                })
    }
}

/// One key of the reference.
#[derive(Debug, Clone)]
pub struct Key {
    pub pattern: KeyPattern,
    /// A table described elsewhere, written as a whole (a pool entry takes
    /// the keys of `providers.<email|sms>`).
    pub whole_table: bool,
    /// `integer`, `string or unset`, `one of "log", "ses", "http"`, ….
    pub kind: String,
    /// The built-in default, per concrete key when they differ.
    pub default: String,
    pub description: String,
}

/// A table of the configuration and its keys.
#[derive(Debug, Clone)]
pub struct Section {
    pub pattern: KeyPattern,
    pub description: String,
    pub keys: Vec<Key>,
}

/// Every table of the configuration with its keys, in the order of the
/// reference (tables and keys by name).
pub fn sections() -> Vec<Section> {
    let schema = schemars::schema_for!(Settings);
    let root = schema.as_value();
    let defaults = Figment::from(Toml::string(DEFAULT_TOML));
    let mut walker = Walker {
        root,
        defaults: &defaults,
        sections: Vec::new(),
        rendered: Vec::new(),
    };
    walker.table(KeyPattern(Vec::new()), root, String::new());
    walker.sections.retain(|section| !section.keys.is_empty());
    walker.sections
}

/// Every key of the reference.
pub fn keys() -> Vec<Key> {
    sections()
        .into_iter()
        .flat_map(|section| section.keys)
        .collect()
}

struct Walker<'a> {
    root: &'a Value,
    defaults: &'a Figment,
    sections: Vec<Section>,
    /// Struct definitions already written out, with the table that shows them.
    rendered: Vec<(String, String)>,
}

impl Walker<'_> {
    /// `schema` with a `$ref` followed to its definition, and the
    /// definition's name.
    fn resolve<'s>(&'s self, schema: &'s Value) -> (&'s Value, Option<String>) {
        match schema.get("$ref").and_then(Value::as_str) {
            Some(reference) => {
                let name = reference.rsplit('/').next().unwrap_or(reference);
                (&self.root["$defs"][name], Some(name.to_owned()))
            }
            None => (schema, None),
        }
    }

    /// Writes the table at `pattern` (a struct's schema) as a section, and
    /// the tables below it after it.
    fn table(&mut self, pattern: KeyPattern, schema: &Value, description: String) {
        let index = self.sections.len();
        self.sections.push(Section {
            pattern: pattern.clone(),
            description,
            keys: Vec::new(),
        });
        let properties = schema["properties"]
            .as_object()
            .cloned()
            .unwrap_or_default();
        let mut done: Vec<String> = Vec::new();
        for (name, property) in &properties {
            if done.contains(name) {
                continue;
            }
            // Siblings of one shape (`fast` and `slow`) are written once.
            let (resolved, definition) = self.resolve(property);
            let definition = definition.filter(|_| resolved.get("properties").is_some());
            let siblings: Vec<String> = match &definition {
                Some(definition) => properties
                    .iter()
                    .filter(|(_, other)| self.resolve(other).1.as_ref() == Some(definition))
                    .map(|(other, _)| other.clone())
                    .collect(),
                None => vec![name.clone()],
            };
            done.extend(siblings.iter().cloned());
            // Each sibling's own doc comment, named.
            let own = if siblings.len() > 1 {
                let lines: Vec<String> = siblings
                    .iter()
                    .map(|sibling| {
                        format!("- `{sibling}`: {}", describe(&properties[sibling.as_str()]))
                    })
                    .collect();
                lines.join("\n")
            } else {
                describe(property)
            };
            let segment = if siblings.len() > 1 {
                Segment::OneOf(siblings)
            } else {
                Segment::Name(name.clone())
            };
            let mut child = pattern.clone();
            child.0.push(segment);
            self.property(index, child, property, own);
        }
    }

    /// One property of the table whose section is at `index`.
    fn property(&mut self, index: usize, pattern: KeyPattern, property: &Value, own: String) {
        let (schema, definition) = self.resolve(property);
        let schema = schema.clone();
        let is_struct = schema.get("properties").is_some();
        let map_values = schema
            .get("additionalProperties")
            .filter(|values| values.is_object());
        if is_struct {
            let definition = definition.unwrap_or_default();
            if let Some((_, shown)) = self.rendered.iter().find(|(name, _)| *name == definition) {
                let description = join(&own, &format!("A table with the keys of `{shown}`."));
                self.sections[index].keys.push(Key {
                    pattern,
                    whole_table: true,
                    kind: "table".into(),
                    default: "none".into(),
                    description,
                });
                return;
            }
            self.rendered.push((definition, pattern.dotted()));
            let description = join(&own, &strip_table_name(&describe(&schema)));
            self.table(pattern, &schema, description);
        } else if let Some(values) = map_values {
            let mut child = pattern.clone();
            child.0.push(Segment::Any);
            let (values, definition) = self.resolve(values);
            let values = values.clone();
            if values.get("properties").is_some() {
                if let Some((_, shown)) = self
                    .rendered
                    .iter()
                    .find(|(name, _)| Some(name) == definition.as_ref())
                {
                    let description =
                        join(&own, &format!("Each a table with the keys of `{shown}`."));
                    self.sections[index].keys.push(Key {
                        pattern: child,
                        whole_table: true,
                        kind: "table".into(),
                        default: "none".into(),
                        description,
                    });
                    return;
                }
                self.rendered
                    .push((definition.unwrap_or_default(), child.dotted()));
                let description = join(&own, &strip_table_name(&describe(&values)));
                self.table(child, &values, description);
            }
        } else {
            let key = Key {
                kind: kind_of(&schema),
                default: self
                    .default_of(&pattern, property.get("default").or(schema.get("default"))),
                description: join(&own, &variants(&schema)),
                pattern,
                whole_table: false,
            };
            self.sections[index].keys.push(key);
        }
    }

    /// The built-in default of every concrete key `pattern` stands for:
    /// what `config/default.toml` sets, else serde's default, else unset.
    fn default_of(&self, pattern: &KeyPattern, serde_default: Option<&Value>) -> String {
        let mut concrete: Vec<(Vec<String>, String)> = vec![(Vec::new(), String::new())];
        for segment in &pattern.0 {
            let mut next = Vec::new();
            for (labels, path) in concrete {
                let options: Vec<String> = match segment {
                    Segment::Name(name) => vec![name.clone()],
                    Segment::OneOf(names) => names.clone(),
                    Segment::Any => self
                        .defaults
                        .find_value(&path)
                        .ok()
                        .and_then(|value| value.into_dict())
                        .map(|dict| dict.into_keys().collect())
                        .unwrap_or_default(),
                };
                for option in options {
                    let mut labels = labels.clone();
                    if !matches!(segment, Segment::Name(_)) {
                        labels.push(option.clone());
                    }
                    let path = if path.is_empty() {
                        option
                    } else {
                        format!("{path}.{option}")
                    };
                    next.push((labels, path));
                }
            }
            concrete = next;
        }
        let values: Vec<(String, String)> = concrete
            .into_iter()
            .map(|(labels, path)| {
                let set = self.defaults.extract_inner::<Value>(&path).ok();
                let value = set.or_else(|| serde_default.cloned());
                let shown = match value {
                    Some(Value::Null) | None => "unset".to_owned(),
                    Some(value) => format!("`{}`", literal(&value)),
                };
                (labels.join(", "), shown)
            })
            .collect();
        match values.as_slice() {
            [] => "none".to_owned(),
            [(_, only), ..] if values.iter().all(|(_, shown)| shown == only) => only.clone(),
            _ => values
                .iter()
                .map(|(label, shown)| format!("{shown} ({label})"))
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// A value as TOML writes it.
fn literal(value: &Value) -> String {
    match value {
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(literal).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(_) => "{ … }".to_owned(),
        other => other.to_string(),
    }
}

/// The type of a leaf key, in words.
fn kind_of(schema: &Value) -> String {
    let mut optional = false;
    let mut kinds: Vec<String> = Vec::new();
    let mut values: Vec<String> = Vec::new();
    let types: Vec<&str> = match &schema["type"] {
        Value::String(one) => vec![one.as_str()],
        Value::Array(several) => several.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    for kind in types {
        match kind {
            "null" => optional = true,
            "integer" if schema["minimum"].as_f64() == Some(0.0) => {
                kinds.push("integer (0 or more)".into())
            }
            "array" => kinds.push(format!("array of {}s", kind_of(&schema["items"]))),
            other => kinds.push(other.to_owned()),
        }
    }
    for option in ["anyOf", "oneOf"] {
        for variant in schema[option].as_array().into_iter().flatten() {
            if variant["type"] == "null" {
                optional = true;
            } else if let Some(constant) = variant.get("const") {
                values.push(format!("`{constant}`"));
            }
        }
    }
    if let Some(listed) = schema["enum"].as_array() {
        values.extend(listed.iter().map(|value| format!("`{value}`")));
    }
    if !values.is_empty() {
        kinds = vec![format!("one of {}", values.join(", "))];
    }
    let mut text = match kinds.len() {
        0 => "any".to_owned(),
        1 => kinds.remove(0),
        _ => format!("one of {}", kinds.join(", ")),
    };
    if optional {
        text.push_str(", may be unset");
    }
    text
}

/// The meanings of an enumeration's values, one line each.
fn variants(schema: &Value) -> String {
    let lines: Vec<String> = schema["oneOf"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|variant| {
            let constant = variant.get("const")?;
            let meaning = describe(variant);
            (!meaning.is_empty()).then(|| format!("- `{constant}`: {meaning}"))
        })
        .collect();
    lines.join("\n")
}

/// A schema's title and description as one text, with rustdoc's
/// intra-doc links written as code.
fn describe(schema: &Value) -> String {
    let parts: Vec<&str> = ["title", "description"]
        .iter()
        .filter_map(|field| schema.get(*field).and_then(Value::as_str))
        .collect();
    plain(&parts.join("\n\n"))
}

/// Joins lines of a paragraph (doc comments keep rustdoc's line breaks)
/// and turns `` [`path`] `` links into code.
fn plain(text: &str) -> String {
    let paragraphs: Vec<String> = text
        .split("\n\n")
        .map(|paragraph| {
            let lines: Vec<&str> = paragraph.lines().map(str::trim).collect();
            lines.join(" ")
        })
        .filter(|paragraph| !paragraph.is_empty())
        .collect();
    let mut text = paragraphs.join("\n\n");
    while let Some(start) = text.find("[`") {
        let Some(length) = text[start..].find("`]") else {
            break;
        };
        let end = start + length;
        let inner = text[start + 1..end + 1].to_owned();
        let after = &text[end + 2..];
        if after.starts_with('(') {
            break;
        }
        text = format!("{}{inner}{after}", &text[..start]);
    }
    text
}

/// A struct's doc comment without its opening `` `[table]`: ``, which the
/// reference's heading already says.
fn strip_table_name(text: &str) -> String {
    let Some(rest) = text.strip_prefix("`[") else {
        return text.to_owned();
    };
    let Some(end) = rest.find("]`") else {
        return text.to_owned();
    };
    let rest = rest[end + 2..].trim_start_matches([':', '.']).trim_start();
    let mut chars = rest.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

fn join(first: &str, second: &str) -> String {
    match (first.is_empty(), second.is_empty()) {
        (true, _) => second.to_owned(),
        (_, true) => first.to_owned(),
        _ if first == second => first.to_owned(),
        _ => format!("{first}\n\n{second}"),
    }
}

/// mdBook's id for a heading: letters, digits, `-` and `_` kept (lower
/// case), spaces as `-`, the rest dropped.
fn anchor(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|ch| {
            if ch.is_alphanumeric() || ch == '_' || ch == '-' {
                Some(ch.to_ascii_lowercase())
            } else if ch.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

const INTRODUCTION: &str = "\
<!-- Generated from the config structs (src/config.rs) and config/default.toml by
     `cargo run --example config_reference > docs/src/reference/configuration.md`.
     Do not edit by hand: a test fails while this file differs from what the code generates. -->

# Configuration reference

Every key fairlane reads, generated from the structs that read them
(`src/config.rs`, their doc comments and types) and the built-in defaults
(`config/default.toml`, compiled into the binary). A test fails when this
page is stale, and when a key is here but not in `config/default.toml` (set,
or shown in a comment) or the other way round.

Layers, later wins: the built-in defaults ← `fairlane serve --config FILE`
← environment variables. A variable's name is the key's path in upper case
with double underscores between levels: `FAIRLANE__SERVER__LISTEN` sets
`server.listen`, `FAIRLANE__LANES__FAST__CONCURRENCY` sets
`lanes.fast.concurrency`. Environment values are read as numbers or
booleans where they look like one, except that a value starting with `+`
stays text (`FAIRLANE__PROVIDERS__SMS__FROM=+15550001111`). Unknown keys
are an error at start-up naming the key. See
[Configuration](../configuration.md) for how to pass them, the
other environment variables and what a mistake looks like.

A key written `lanes.<fast|slow>.concurrency` stands for each of the named
tables (`lanes.fast.concurrency`, `lanes.slow.concurrency`); `<name>` is a
name of your choosing (`plans.<name>.burst`: `plans.startup.burst`). A
default of *unset* means the key is absent unless you set it.
";

/// The reference as Markdown.
pub fn render() -> String {
    let sections = sections();
    let mut out = String::from(INTRODUCTION);
    out.push_str("\nTables:\n\n");
    for section in &sections {
        let heading = format!("`[{}]`", section.pattern.dotted());
        out.push_str(&format!("- [{heading}](#{})\n", anchor(&heading)));
    }
    for section in &sections {
        out.push_str(&format!("\n## `[{}]`\n", section.pattern.dotted()));
        if !section.description.is_empty() {
            out.push_str(&format!("\n{}\n", section.description));
        }
        for key in &section.keys {
            out.push_str(&format!("\n### `{}`\n\n", key.pattern.dotted()));
            if key.whole_table {
                out.push_str(&format!(
                    "Tables `[{}]`.\n",
                    key.pattern.dotted().replace('|', "\\|")
                ));
            } else {
                out.push_str(&format!(
                    "Type: {}. Default: {}. Environment: `{}`.\n",
                    key.kind,
                    key.default,
                    key.pattern.env_var()
                ));
            }
            if !key.description.is_empty() {
                out.push_str(&format!("\n{}\n", key.description));
            }
        }
    }
    out
}

/// The keys of `config/default.toml`, set or shown in a comment (a
/// comment line that reads as a TOML `key = value` or `[table]`, as in
/// `# admin_token = "change-me"`), as dotted paths.
pub fn default_toml_keys() -> Vec<String> {
    let mut table = String::new();
    let mut keys = Vec::new();
    for line in DEFAULT_TOML.lines() {
        let text = line.trim();
        let commented = text.starts_with('#');
        let text = text.trim_start_matches('#').trim();
        if text.starts_with('[') && text.ends_with(']') && !text.contains('=') {
            let parsed: Result<Map<String, Value>, _> = Figment::from(Toml::string(text)).extract();
            if parsed.is_ok() {
                table = text.trim_matches(['[', ']']).trim().to_owned();
            }
            continue;
        }
        let Some((name, _)) = text.split_once('=') else {
            continue;
        };
        let name = name.trim();
        let reads_as_toml = Figment::from(Toml::string(text))
            .extract_inner::<Value>(name)
            .is_ok();
        let is_key = !name.is_empty()
            && name
                .chars()
                .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_');
        if is_key && (reads_as_toml || !commented) {
            keys.push(if table.is_empty() {
                name.to_owned()
            } else {
                format!("{table}.{name}")
            });
        }
    }
    keys
}
