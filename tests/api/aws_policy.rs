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

/// Each template parameter that names a setting in its description
/// defaults to that setting's built-in default (`config/default.toml`), so
/// a stack deployed with defaults matches fairlane run with defaults.
#[test]
fn the_template_defaults_are_the_configuration_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/aws/fairlane.json");
    let template: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read the template"))
            .expect("the template is JSON");
    let settings = fairlane::config::Settings::from_toml_overlay("").expect("the defaults");
    let lanes = [
        ("fast", &settings.lanes.fast),
        ("slow", &settings.lanes.slow),
    ];
    let mut compared = 0;
    for (name, parameter) in template["Parameters"].as_object().expect("parameters") {
        let key = parameter["Description"].as_str().unwrap_or_default();
        let default = &parameter["Default"];
        let want: Value = match key {
            "queue.sqs.queue_prefix" => settings.queue.sqs.queue_prefix.clone().into(),
            _ => match lanes.iter().find_map(|(lane, lane_settings)| {
                match key.strip_prefix(&format!("lanes.{lane}.")) {
                    Some("visibility_timeout_secs") => {
                        Some(lane_settings.visibility_timeout_secs.into())
                    }
                    // SQS's redrive is the backstop, a few receives after
                    // fairlane dead-letters a message itself.
                    Some("max_receive_count + 3") => Some(
                        fairlane::queue::sqs::lanes::redrive_receive_count(
                            lane_settings.max_receive_count,
                        )
                        .into(),
                    ),
                    _ => None,
                }
            }) {
                Some(value) => value,
                None => {
                    assert_eq!(
                        name, "RetentionSeconds",
                        "{name} names no known setting: {key}"
                    );
                    let retention = default.as_u64().expect("a number");
                    assert_eq!(
                        retention,
                        14 * 24 * 3600,
                        "fairlane's own queues keep 14 days"
                    );
                    assert!(retention > settings.retry.max_delay_secs);
                    continue;
                }
            },
        };
        assert_eq!(
            default, &want,
            "{name} (for {key}) defaults to {default}, the configuration to {want}"
        );
        compared += 1;
    }
    assert_eq!(
        compared, 5,
        "prefix, two visibility timeouts, two receive counts"
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

/// Deploys `deploy/aws/fairlane.json` into moto with `prefix` as its
/// `QueuePrefix` (boto3 from the test support's venv), then returns the
/// stack's outputs.
fn deploy_into_moto(moto: &str, prefix: &str) -> Value {
    const DEPLOY: &str = r#"
import json, sys, boto3
moto, prefix, path = sys.argv[1:4]
kw = dict(endpoint_url=moto, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test")
cf = boto3.client("cloudformation", **kw)
name = "stack-" + prefix
cf.create_stack(StackName=name, TemplateBody=open(path).read(),
                Parameters=[{"ParameterKey": "QueuePrefix", "ParameterValue": prefix}],
                Capabilities=["CAPABILITY_IAM"])
stack = cf.describe_stacks(StackName=name)["Stacks"][0]
print(json.dumps({"status": stack["StackStatus"], "outputs": stack.get("Outputs", [])}))
"#;
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/aws/fairlane.json");
    let output = std::process::Command::new(crate::servers::python())
        .args(["-c", DEPLOY, moto, prefix])
        .arg(&template)
        .output()
        .expect("the test support's Python runs");
    assert!(
        output.status.success(),
        "deploying the template into moto failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("the deploy script prints JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_template_deployed_into_moto_is_what_fairlane_needs_without_creating_a_queue() {
    use crate::backends::{moto_url, unique_prefix};
    use crate::delivery::{status_is, wait_for};
    use crate::support::{TestApp, email};
    let moto = moto_url();
    let prefix = unique_prefix("cfn");
    let stack = deploy_into_moto(&moto, &prefix);
    assert_eq!(stack["status"], "CREATE_COMPLETE", "{stack}");
    let events_queue = stack["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|output| output["OutputKey"] == "SesEventsQueueUrl")
        .expect("the stack names its SES events queue");
    assert!(
        events_queue["OutputValue"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/{prefix}-ses-events")),
        "{events_queue}"
    );
    let deliveries = tempfile::tempdir().unwrap();
    let log = deliveries.path().join("deliveries.jsonl");
    // create_queues = false: fairlane only looks the queues up, so it
    // starts only if the template made every queue it needs.
    let settings = format!(
        "[queue]\nbackend = \"sqs\"\n\n[queue.sqs]\nendpoint_url = \"{moto}\"\nregion = \"us-east-1\"\n\
         queue_prefix = \"{prefix}\"\ncreate_queues = false\naccess_key_id = \"test\"\nsecret_access_key = \"test\"\n\n\
         [consumers]\nenabled = true\nreceive_wait_secs = 1\n\n\
         [providers.email]\nkind = \"log\"\nrate_per_second = 100.0\nburst = 10\nfrom = \"noreply@example.com\"\nlog_path = \"{}\"\n",
        log.display()
    );
    let app = TestApp::start(&settings).await;
    // A shared tenant goes through the lanes; a dedicated one through its
    // own queues (made by fairlane) and the attention queues (the
    // template's: without them dedicated isolation is refused).
    let shared = app.tenant_with_key("acme", "pro").await;
    let created = app
        .admin(reqwest::Method::POST, "/v1/admin/tenants")
        .json(&serde_json::json!({"id": "own", "name": "own", "plan": "pro", "isolation": "dedicated"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        created.status(),
        reqwest::StatusCode::CREATED,
        "{}",
        created.text().await.unwrap()
    );
    let dedicated = app.issue_key("own").await.1;
    let mut sent = Vec::new();
    for key in [&shared, &dedicated] {
        let id = app.send_accepted(key, &email()).await;
        let view = wait_for(&app, key, &id, status_is("sent")).await;
        assert_eq!(view["status"], "sent", "{view}");
        sent.push(id);
    }
    let written = std::fs::read_to_string(&log).unwrap();
    for id in &sent {
        assert!(written.contains(id.as_str()), "the log provider got {id}");
    }
}

/// Runs `fairlane check-aws` with `config`; returns its exit code and output.
fn check_aws(config: &Path) -> (i32, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_fairlane"))
        .args(["check-aws", "--config"])
        .arg(config)
        .env_remove("FAIRLANE_CONFIG")
        .output()
        .expect("fairlane check-aws runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_aws_reports_a_removed_dlq_a_wrong_max_receive_count_and_a_missing_configuration_set_and_nothing_on_the_intact_stack()
 {
    use crate::backends::{moto_url, unique_prefix};
    let moto = moto_url();
    let prefix = unique_prefix("chk");
    let stack = deploy_into_moto(&moto, &prefix);
    assert_eq!(stack["status"], "CREATE_COMPLETE", "{stack}");
    // The SES side: the sender's identity and a configuration set.
    crate::backends::ses_identity(&moto).await;
    let ses = aws_sdk_sesv2::Client::from_conf(
        aws_sdk_sesv2::Config::builder()
            .behavior_version(aws_sdk_sesv2::config::BehaviorVersion::latest())
            .region(aws_sdk_sesv2::config::Region::new("us-east-1"))
            .endpoint_url(&moto)
            .credentials_provider(aws_sdk_sesv2::config::Credentials::new(
                "test", "test", None, None, "tests",
            ))
            .build(),
    );
    ses.create_configuration_set()
        .configuration_set_name(format!("{prefix}-set"))
        .send()
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let write_config_from = |set: &str, from: &str| {
        let config = dir.path().join(format!("{set}-{from}.toml"));
        std::fs::write(
            &config,
            format!(
                "[queue]\nbackend = \"sqs\"\n\n[queue.sqs]\nendpoint_url = \"{moto}\"\nregion = \"us-east-1\"\n\
                 queue_prefix = \"{prefix}\"\ncreate_queues = false\naccess_key_id = \"test\"\nsecret_access_key = \"test\"\n\n\
                 [providers.email]\nkind = \"ses\"\nendpoint_url = \"{moto}\"\nregion = \"us-east-1\"\n\
                 access_key_id = \"test\"\nsecret_access_key = \"test\"\nfrom = \"{from}\"\n\
                 configuration_set = \"{set}\"\n\n\
                 [storage]\nurl = \"sqlite://{}/fairlane.db\"\n",
                dir.path().display()
            ),
        )
        .unwrap();
        config
    };
    let write_config = |set: &str| write_config_from(set, "noreply@example.com");
    let config = write_config(&format!("{prefix}-set"));
    let (code, text) = check_aws(&config);
    assert_eq!(code, 0, "the intact stack matches: {text}");
    assert!(text.contains("match the configuration"), "{text}");

    // Break it: remove the fast lane's DLQ, give a slow class queue another
    // maxReceiveCount.
    let sdk = aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .endpoint_url(&moto)
        .credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "test", "test", None, None, "tests",
        ))
        .build();
    let sqs = aws_sdk_sqs::Client::from_conf(sdk);
    let url = |name: String| {
        let sqs = sqs.clone();
        async move {
            sqs.get_queue_url()
                .queue_name(name)
                .send()
                .await
                .unwrap()
                .queue_url()
                .unwrap()
                .to_owned()
        }
    };
    let dlq = url(format!("{prefix}-fast-dlq")).await;
    sqs.delete_queue().queue_url(&dlq).send().await.unwrap();
    let slow_dlq_arn = format!("arn:aws:sqs:us-east-1:123456789012:{prefix}-slow-dlq");
    let slow_high = url(format!("{prefix}-slow-high")).await;
    sqs.set_queue_attributes()
        .queue_url(&slow_high)
        .attributes(
            aws_sdk_sqs::types::QueueAttributeName::RedrivePolicy,
            serde_json::json!({"deadLetterTargetArn": slow_dlq_arn, "maxReceiveCount": 7})
                .to_string(),
        )
        .send()
        .await
        .unwrap();
    let (code, text) = check_aws(&write_config(&format!("{prefix}-absent")));
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains(&format!("SES configuration set {prefix}-absent is missing")),
        "{text}"
    );
    assert!(
        !text.contains("no SES identity"),
        "the identity exists: {text}"
    );
    // A sender no identity verifies (neither the address nor its domain).
    let (code, text) = check_aws(&write_config_from(
        &format!("{prefix}-set"),
        "someone@unverified.example",
    ));
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("no SES identity for someone@unverified.example"),
        "{text}"
    );
    assert!(
        text.contains(&format!("missing queue {prefix}-fast-dlq")),
        "{text}"
    );
    assert!(
        text.contains(&format!("queue {prefix}-slow-high has maxReceiveCount 7")),
        "{text}"
    );
    assert!(
        !text.contains(&format!("{prefix}-slow-low")),
        "only what was changed is reported: {text}"
    );
}

/// Every queue of the template outlives its stack: deleting or replacing
/// the stack must not delete queues that may hold messages (cfn-lint
/// I3011).
#[test]
fn every_queue_is_retained_when_its_stack_goes() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/aws/fairlane.json");
    let template: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read the template"))
            .expect("the template is JSON");
    let mut queues = 0;
    for (name, resource) in template["Resources"].as_object().expect("resources") {
        if resource["Type"] != "AWS::SQS::Queue" {
            continue;
        }
        queues += 1;
        for policy in ["DeletionPolicy", "UpdateReplacePolicy"] {
            assert_eq!(resource[policy], "Retain", "{name}: {policy}");
        }
    }
    assert!(queues >= 17, "only {queues} queues in the template");
}
