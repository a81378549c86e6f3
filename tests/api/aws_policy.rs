//! The IAM policy in `deploy/aws/fairlane.json` against the code (issue 31):
//! every SQS and SES operation fairlane's source calls needs its action in
//! the policy, and the policy grants no action the code does not use. The
//! operations are those of the SDK crates this build uses (their
//! `src/operation/` directories, found with `cargo metadata`), looked for
//! in `src/` as builder calls (`.send_message_batch()`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The SDK crates whose calls need permissions, with their IAM prefix.
const SDKS: [(&str, &str); 2] = [("aws-sdk-sqs", "sqs"), ("aws-sdk-sesv2", "ses")];

/// `snake_case` operation → IAM action. SQS's batch operations are
/// authorised by the single-message action.
fn action(prefix: &str, operation: &str) -> String {
    let base = operation.strip_suffix("_batch").unwrap_or(operation);
    let pascal: String = base
        .split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars
                .next()
                .map(|first| first.to_ascii_uppercase().to_string() + chars.as_str())
                .unwrap_or_default()
        })
        .collect();
    format!("{prefix}:{pascal}")
}

/// This machine's target triple (`cargo metadata --offline` must not
/// resolve other platforms' dependencies, which may not be downloaded).
fn host() -> String {
    let output = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("host: "))
        .expect("rustc -vV names the host")
        .to_owned()
}

fn sdk_operations(krate: &str) -> Vec<String> {
    let output = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", &host()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: Value = serde_json::from_slice(&output.stdout).unwrap();
    let manifest = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|package| package["name"] == krate)
        .and_then(|package| package["manifest_path"].as_str())
        .unwrap_or_else(|| panic!("{krate} is not a dependency"));
    let operations = Path::new(manifest).with_file_name("src").join("operation");
    let mut names: Vec<String> = std::fs::read_dir(&operations)
        .unwrap_or_else(|err| panic!("reading {}: {err}", operations.display()))
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.path().is_dir())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        names.len() > 10,
        "{krate}: only {names:?} in {}",
        operations.display()
    );
    names
}

fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, into);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            into.push(path);
        }
    }
}

/// The IAM actions fairlane's source needs, from its SDK builder calls.
fn actions_the_code_uses() -> BTreeSet<String> {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    let code: Vec<String> = files
        .iter()
        .map(|file| {
            std::fs::read_to_string(file)
                .unwrap()
                .lines()
                .filter(|line| !line.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n")
        })
        .collect();
    let mut used = BTreeSet::new();
    for (krate, prefix) in SDKS {
        for operation in sdk_operations(krate) {
            let call = format!(".{operation}()");
            if code.iter().any(|text| text.contains(&call)) {
                used.insert(action(prefix, &operation));
            }
        }
    }
    used
}

fn actions_the_policy_grants() -> BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/aws/fairlane.json");
    let template: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let statements =
        template["Resources"]["FairlanePolicy"]["Properties"]["PolicyDocument"]["Statement"]
            .as_array()
            .expect("the template has FairlanePolicy with statements");
    let mut granted = BTreeSet::new();
    for statement in statements {
        assert_eq!(statement["Effect"], "Allow", "{statement}");
        match &statement["Action"] {
            Value::String(action) => {
                granted.insert(action.clone());
            }
            Value::Array(actions) => granted.extend(
                actions
                    .iter()
                    .map(|action| action.as_str().expect("an action").to_owned()),
            ),
            other => panic!("unexpected Action {other}"),
        }
    }
    granted
}

#[test]
fn the_policy_grants_exactly_the_sdk_calls_the_code_makes() {
    let used = actions_the_code_uses();
    let granted = actions_the_policy_grants();
    // What this test knows fairlane to call today: a sanity check of the
    // scan itself (an empty scan would make the comparison meaningless).
    for expected in ["sqs:SendMessage", "sqs:ReceiveMessage", "ses:SendEmail"] {
        assert!(
            used.contains(expected),
            "the scan missed {expected}: {used:?}"
        );
    }
    let missing: Vec<_> = used.difference(&granted).collect();
    let unused: Vec<_> = granted.difference(&used).collect();
    assert!(
        missing.is_empty(),
        "the code calls these without a permission in deploy/aws/fairlane.json: {missing:?}"
    );
    assert!(
        unused.is_empty(),
        "deploy/aws/fairlane.json grants what the code never calls: {unused:?}"
    );
}

#[test]
fn batch_operations_map_to_their_single_message_action() {
    assert_eq!(action("sqs", "send_message_batch"), "sqs:SendMessage");
    assert_eq!(
        action("sqs", "change_message_visibility_batch"),
        "sqs:ChangeMessageVisibility"
    );
    assert_eq!(action("sqs", "get_queue_url"), "sqs:GetQueueUrl");
    assert_eq!(action("ses", "send_email"), "ses:SendEmail");
}
