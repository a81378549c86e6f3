//! The book (docs/src/) and README.md against what the service says about
//! itself: the API summary against the OpenAPI document (every operation
//! listed, nothing listed that is not there, and an example of each), the
//! environment variables the book lists against those `fairlane --help`
//! names, the configuration reference against the config structs and
//! `config/default.toml`, and README's two commands against what CI runs.
//! (The metrics table is checked against the first scrape in `ops.rs`.)

use std::collections::BTreeSet;
use std::process::Command;

use serde_json::Value;

const README: &str = include_str!("../../README.md");
const CI_RUN: &str = include_str!("../../.ci/run");
const API: &str = include_str!("../../docs/src/api/index.md");
const ENDPOINTS: &str = include_str!("../../docs/src/api/endpoints.md");
const CONFIGURATION: &str = include_str!("../../docs/src/configuration.md");
const REFERENCE: &str = include_str!("../../docs/src/reference/configuration.md");
const OPENAPI: &str = include_str!("../../openapi/openapi.json");

/// The text of `page`'s level-2 section `heading`, up to the next one.
fn section(page: &'static str, heading: &str) -> &'static str {
    page.split(&format!("\n## {heading}\n"))
        .nth(1)
        .unwrap_or_else(|| panic!("no \"## {heading}\" section"))
        .split("\n## ")
        .next()
        .unwrap()
}

/// The cells of a Markdown table row, trimmed; `None` for other lines.
fn cells(line: &str) -> Option<Vec<&str>> {
    let inner = line.trim().strip_prefix('|')?.strip_suffix('|')?;
    Some(inner.split('|').map(str::trim).collect())
}

/// `(METHOD, /path)` of every row of the API summary table.
fn summarised_operations() -> BTreeSet<(String, String)> {
    API.lines()
        .filter_map(cells)
        .filter(|row| row.len() >= 2)
        .filter(|row| {
            ["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&row[0]) && row[1].starts_with('`')
        })
        .map(|row| (row[0].to_owned(), row[1].trim_matches('`').to_owned()))
        .collect()
}

/// `(METHOD, /path)` of every operation of the OpenAPI document.
fn documented_operations() -> BTreeSet<(String, String)> {
    let document: Value = serde_json::from_str(OPENAPI).unwrap();
    let mut operations = BTreeSet::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        for method in ["get", "post", "put", "patch", "delete"] {
            if item.get(method).is_some() {
                operations.insert((method.to_ascii_uppercase(), path.clone()));
            }
        }
    }
    operations
}

#[test]
fn the_api_summary_lists_exactly_the_operations_of_the_openapi_document() {
    let operations = documented_operations();
    let summarised = summarised_operations();
    for wanted in [
        ("GET", "/v1/admin/queues"),
        ("GET", "/v1/admin/dlq"),
        ("POST", "/v1/admin/dlq/redrive"),
        ("GET", "/metrics"),
    ] {
        let wanted = (wanted.0.to_owned(), wanted.1.to_owned());
        assert!(
            operations.contains(&wanted),
            "{wanted:?} not in the document"
        );
    }
    let missing: Vec<_> = operations.difference(&summarised).collect();
    let unknown: Vec<_> = summarised.difference(&operations).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "the API summary (docs/src/api/index.md) lacks {missing:?} and lists {unknown:?}, which the OpenAPI document does not have"
    );
}

/// `fairlane ARGS --help`, with no `FAIRLANE_CONFIG` to show a value of.
fn help(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_fairlane"))
        .args(args)
        .arg("--help")
        .env_remove("FAIRLANE_CONFIG")
        .output()
        .expect("fairlane --help runs");
    assert!(output.status.success(), "{args:?} --help failed");
    String::from_utf8(output.stdout).unwrap()
}

/// Names that look like environment variables (upper case, digits and
/// underscores, with an underscore); every `FAIRLANE__…` example counts as
/// the form `FAIRLANE__SECTION__KEY`.
fn variable_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
        .filter(|word| word.len() > 3 && word.contains('_') && !word.starts_with('_'))
        .filter(|word| word.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|word| {
            if word.starts_with("FAIRLANE__") {
                "FAIRLANE__SECTION__KEY".to_owned()
            } else {
                word.to_owned()
            }
        })
        .collect()
}

/// Every operation of the OpenAPI document has a heading `### METHOD `/path``
/// in "Endpoints by example", with an example under it, and no other.
#[test]
fn every_operation_has_an_example() {
    let mut shown = BTreeSet::new();
    for part in ENDPOINTS.split("\n### ").skip(1) {
        let (heading, body) = part.split_once('\n').unwrap();
        let (method, path) = heading.split_once(' ').unwrap();
        assert!(
            body.trim_start().starts_with("```sh\ncurl") || body.contains("\ncurl "),
            "{heading} has no curl example"
        );
        shown.insert((method.to_owned(), path.trim_matches('`').to_owned()));
    }
    let operations = documented_operations();
    let missing: Vec<_> = operations.difference(&shown).collect();
    let unknown: Vec<_> = shown.difference(&operations).collect();
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "docs/src/api/endpoints.md has no example of {missing:?} and shows {unknown:?}, which the OpenAPI document does not have"
    );
}

#[test]
fn the_book_lists_every_environment_variable_help_shows_and_no_other() {
    let mut shown = BTreeSet::new();
    for args in [&[][..], &["serve"], &["admin-token"], &["openapi"]] {
        shown.extend(variable_names(&help(args)));
    }
    for expected in ["FAIRLANE_CONFIG", "FAIRLANE__SECTION__KEY", "RUST_LOG"] {
        assert!(
            shown.contains(expected),
            "--help does not show {expected}: {shown:?}"
        );
    }

    let table = section(CONFIGURATION, "Environment variables");
    let documented: BTreeSet<String> = table
        .lines()
        .filter_map(cells)
        .filter_map(|row| row.first().map(|first| variable_names(first)))
        .flatten()
        .collect();
    assert_eq!(
        shown, documented,
        "environment variables in --help (left) and in the table of docs/src/configuration.md (right) differ"
    );
}

#[test]
fn every_option_of_serve_and_admin_token_has_help_text() {
    let serve = help(&["serve"]);
    assert!(serve.contains("FAIRLANE__SECTION__KEY"), "{serve}");
    let admin = help(&["admin-token"]);
    let config = &admin[admin.find("--config").expect("admin-token has --config")..];
    assert!(
        config[..config.len().min(200)].contains("The configuration file"),
        "admin-token --config has no help text:\n{admin}"
    );
}

/// README's quickstart keeps the two commands, and the test command is the
/// one `.ci/run` runs.
#[test]
fn the_readme_shows_the_quickstart_and_the_test_command_ci_runs() {
    let quickstart = section(README, "Quickstart");
    let commands: Vec<&str> = quickstart
        .split("```sh\n")
        .nth(1)
        .expect("README's quickstart has a sh block")
        .split("```")
        .next()
        .unwrap()
        .lines()
        .map(|line| line.split('#').next().unwrap().trim())
        .collect();
    assert_eq!(
        commands,
        ["cargo run -- serve", "cargo test --locked"],
        "README's quickstart"
    );
    assert!(
        CI_RUN
            .lines()
            .any(|line| line.trim() == "cargo test --locked"),
        ".ci/run does not run README's test command"
    );
}

/// `docs/src/reference/configuration.md` is what
/// `cargo run --example config_reference` prints: regenerate it with that
/// command (redirected into the file) when this fails.
#[test]
fn the_configuration_reference_is_generated_from_the_config_structs() {
    let generated = fairlane::config_reference::render();
    if generated != REFERENCE {
        let first = generated
            .lines()
            .zip(REFERENCE.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| generated.lines().count().min(REFERENCE.lines().count()));
        panic!(
            "docs/src/reference/configuration.md is stale (first difference at line {}); run\n  \
             cargo run --example config_reference > docs/src/reference/configuration.md",
            first + 1
        );
    }
}

/// Every key of the reference is in `config/default.toml` (set, or shown
/// in a comment), and every key of that file is in the reference.
#[test]
fn the_configuration_reference_and_default_toml_have_the_same_keys() {
    let keys = fairlane::config_reference::keys();
    let in_file = fairlane::config_reference::default_toml_keys();
    assert!(in_file.len() > 50, "read only {in_file:?}");
    let not_in_file: Vec<String> = keys
        .iter()
        .filter(|key| {
            !in_file
                .iter()
                .any(|name| key.pattern.covers(name, key.whole_table))
        })
        .map(|key| key.pattern.dotted())
        .collect();
    let not_in_reference: Vec<&String> = in_file
        .iter()
        .filter(|name| {
            !keys
                .iter()
                .any(|key| key.pattern.covers(name, key.whole_table))
        })
        .collect();
    assert!(
        not_in_file.is_empty() && not_in_reference.is_empty(),
        "keys of the reference missing from config/default.toml (set them, or show them in a \
         comment): {not_in_file:?}; keys of config/default.toml the config structs do not read: \
         {not_in_reference:?}"
    );
}
