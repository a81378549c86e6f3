//! The OpenAPI document: structural rules an OpenAPI 3.1 validator or a
//! client generator would enforce, checked by walking the generated
//! document as JSON, and a check that the refusals it documents for every
//! secured operation are what the server really answers.
//!
//! `.ci/run` also runs `openapi-spec-validator` on `openapi/openapi.json`;
//! these tests catch the common mistakes without Python.

use std::collections::BTreeSet;

use fairlane::api::ApiDoc;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use utoipa::OpenApi;

use crate::support::*;

const METHODS: &[&str] = &[
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// The document `fairlane openapi` prints and `/openapi.json` serves.
fn document() -> Value {
    serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document serializes")
}

/// One operation of the document.
struct Operation<'a> {
    path: &'a str,
    method: &'a str,
    op: &'a Value,
    /// Parameters declared on the path item, shared by its operations.
    shared_params: &'a [Value],
}

impl Operation<'_> {
    fn name(&self) -> String {
        format!("{} {}", self.method.to_ascii_uppercase(), self.path)
    }

    fn parameters(&self) -> impl Iterator<Item = &Value> {
        let own = self.op["parameters"]
            .as_array()
            .map_or(&[][..], Vec::as_slice);
        self.shared_params.iter().chain(own)
    }

    /// Names of the security schemes the operation accepts.
    fn schemes(&self) -> BTreeSet<&str> {
        self.op["security"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_object)
            .flat_map(|requirement| requirement.keys().map(String::as_str))
            .collect()
    }

    fn responses(&self) -> &serde_json::Map<String, Value> {
        self.op["responses"]
            .as_object()
            .unwrap_or_else(|| panic!("{} has no responses object", self.name()))
    }

    /// The path with every `{parameter}` filled in with `x`.
    fn concrete_path(&self) -> String {
        let mut path = String::new();
        let mut rest = self.path;
        while let Some(open) = rest.find('{') {
            let close = rest[open..].find('}').expect("closed template") + open;
            path.push_str(&rest[..open]);
            path.push('x');
            rest = &rest[close + 1..];
        }
        path.push_str(rest);
        path
    }
}

fn operations(doc: &Value) -> Vec<Operation<'_>> {
    let paths = doc["paths"].as_object().expect("paths object");
    let mut found = Vec::new();
    for (path, item) in paths {
        let shared_params = item["parameters"].as_array().map_or(&[][..], Vec::as_slice);
        for method in METHODS {
            if let Some(op) = item.get(*method) {
                found.push(Operation {
                    path,
                    method,
                    op,
                    shared_params,
                });
            }
        }
    }
    assert!(!found.is_empty(), "the document has no operations");
    found
}

/// A response object, following a `$ref` into `components/responses`.
fn resolve<'a>(doc: &'a Value, response: &'a Value) -> &'a Value {
    match response["$ref"].as_str() {
        None => response,
        Some(reference) => {
            let name = reference
                .strip_prefix("#/components/responses/")
                .unwrap_or_else(|| panic!("response $ref outside components: {reference}"));
            let target = &doc["components"]["responses"][name];
            assert!(target.is_object(), "dangling response $ref {reference}");
            target
        }
    }
}

/// `{name}` segments of a path template.
fn template_names(path: &str) -> BTreeSet<&str> {
    path.split('{')
        .skip(1)
        .map(|rest| rest.split('}').next().expect("closed template"))
        .collect()
}

#[test]
fn every_response_in_the_openapi_document_has_a_description() {
    let doc = document();
    let mut missing = Vec::new();
    for op in operations(&doc) {
        for (status, response) in op.responses() {
            if resolve(&doc, response)["description"].as_str().is_none() {
                missing.push(format!("{} {status}", op.name()));
            }
        }
    }
    for (name, response) in doc["components"]["responses"]
        .as_object()
        .into_iter()
        .flatten()
    {
        if response["description"].as_str().is_none() {
            missing.push(format!("components/responses/{name}"));
        }
    }
    assert!(
        missing.is_empty(),
        "responses without a description: {missing:#?}"
    );
}

#[test]
fn the_dlq_listing_takes_lane_and_limit_from_the_query() {
    let doc = document();
    let list = &doc["paths"]["/v1/admin/dlq"]["get"];
    let params = list["parameters"]
        .as_array()
        .expect("DLQ listing parameters");
    for name in ["lane", "limit"] {
        let param = params
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} is not documented: {params:#?}"));
        assert_eq!(param["in"], "query", "{name}: {param}");
        assert_ne!(param["required"], true, "{name} is optional: {param}");
    }
    let limit = params.iter().find(|p| p["name"] == "limit").unwrap();
    assert_eq!(limit["schema"]["minimum"], 1, "{limit}");
    assert_eq!(limit["schema"]["maximum"], 1000, "{limit}");
}

#[test]
fn every_path_parameter_is_named_in_its_path_template_and_back() {
    let doc = document();
    for op in operations(&doc) {
        let mut declared = BTreeSet::new();
        for param in op.parameters().filter(|p| p["in"] == "path") {
            let name = param["name"].as_str().expect("parameter name");
            assert_eq!(
                param["required"],
                true,
                "{}: path parameter {name} must be required",
                op.name()
            );
            declared.insert(name);
        }
        assert_eq!(
            declared,
            template_names(op.path),
            "{}: path parameters and template differ",
            op.name()
        );
    }
}

#[test]
fn every_admin_operation_documents_401_and_403_as_problems() {
    let doc = document();
    let admin: Vec<_> = operations(&doc)
        .into_iter()
        .filter(|op| op.path.starts_with("/v1/admin/"))
        .collect();
    assert!(!admin.is_empty(), "no admin operations");
    for op in admin {
        assert_eq!(
            op.schemes(),
            BTreeSet::from(["admin_token"]),
            "{} takes the admin token",
            op.name()
        );
        for status in ["401", "403"] {
            let response = op
                .responses()
                .get(status)
                .unwrap_or_else(|| panic!("{} does not document {status}", op.name()));
            assert!(
                resolve(&doc, response)["content"]["application/problem+json"].is_object(),
                "{} {status} is not problem+json",
                op.name()
            );
        }
    }
}

#[test]
fn every_client_error_is_documented_as_a_problem_document() {
    let doc = document();
    for op in operations(&doc) {
        for (status, response) in op.responses() {
            if !status.starts_with('4') {
                continue;
            }
            let content = resolve(&doc, response)["content"]
                .as_object()
                .unwrap_or_else(|| panic!("{} {status} has no content", op.name()));
            let types: Vec<&String> = content.keys().collect();
            assert_eq!(
                types,
                ["application/problem+json"],
                "{} {status}",
                op.name()
            );
            assert_eq!(
                content["application/problem+json"]["schema"]["$ref"],
                "#/components/schemas/Problem",
                "{} {status}",
                op.name()
            );
        }
    }
}

#[test]
fn the_send_request_tells_email_from_sms_by_a_channel_enum() {
    let doc = document();
    let schemas = &doc["components"]["schemas"];
    // Each channel's request is one of two shapes (its own content, or a
    // template); both name the channel.
    for (schema, channel) in [("SendEmailRequest", "email"), ("SendSmsRequest", "sms")] {
        let shapes = schemas[schema]["oneOf"]
            .as_array()
            .unwrap_or_else(|| panic!("{schema} is oneOf"));
        assert_eq!(shapes.len(), 2, "{schema}: by content and by template");
        for shape in shapes {
            let name = shape["$ref"]
                .as_str()
                .unwrap()
                .trim_start_matches("#/components/schemas/");
            let object = match schemas[name].get("allOf") {
                Some(parts) => &parts[0],
                None => &schemas[name],
            };
            let property = &object["properties"]["channel"];
            assert_eq!(property["type"], "string", "{name}.channel: {property}");
            assert_eq!(property["enum"], json!([channel]), "{name}.channel");
            assert!(
                object["required"]
                    .as_array()
                    .is_some_and(|r| r.contains(&json!("channel"))),
                "{name} requires channel"
            );
        }
    }
    let request = &schemas["SendMessageRequest"];
    assert_eq!(request["discriminator"]["propertyName"], "channel");
    assert_eq!(
        request["discriminator"]["mapping"],
        json!({
            "email": "#/components/schemas/SendEmailRequest",
            "sms": "#/components/schemas/SendSmsRequest",
        })
    );
}

/// What the document promises for authentication and content type, asked
/// of the running server operation by operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secured_operations_refuse_as_documented() {
    let app = TestApp::start("").await;
    let tenant_key = app.tenant_with_key("acme", "basic").await;
    let doc = document();
    let mut refused_bodies = 0;
    for op in operations(&doc) {
        let schemes = op.schemes();
        if schemes.is_empty() {
            continue;
        }
        let name = op.name();
        let method = Method::from_bytes(op.method.to_ascii_uppercase().as_bytes()).unwrap();
        let url = app.url(&op.concrete_path());
        assert!(op.responses().contains_key("401"), "{name} documents 401");

        let anonymous = app.client.request(method.clone(), &url).send().await;
        let (headers, _) = expect_problem(anonymous.unwrap(), StatusCode::UNAUTHORIZED).await;
        assert_eq!(
            header(&headers, "www-authenticate"),
            Some("Bearer"),
            "{name}"
        );

        let as_admin = schemes.contains("admin_token");
        if as_admin {
            let with_tenant_key = app.tenant(&tenant_key, method.clone(), &op.concrete_path());
            expect_problem(with_tenant_key.send().await.unwrap(), StatusCode::FORBIDDEN).await;
        }

        if op.responses().contains_key("415") {
            refused_bodies += 1;
            let request = if as_admin {
                app.admin(method.clone(), &op.concrete_path())
            } else {
                app.tenant(&tenant_key, method.clone(), &op.concrete_path())
            };
            // A form: the wrong type for every body the API takes (plain
            // text is a file an upload may carry).
            let plain = request
                .header("content-type", "application/x-www-form-urlencoded")
                .body("x=1")
                .send()
                .await
                .unwrap();
            expect_problem(plain, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
        }
    }
    assert!(refused_bodies > 0, "no operation documents 415");
}

/// Whether `schema` (an object of the document, `$ref`s not followed)
/// lets `value` through by its length and pattern: enough for the string
/// fields below, whose refusals are those two keywords.
fn string_schema_admits(schema: &Value, value: &str) -> bool {
    let chars = value.chars().count() as u64;
    let min = schema["minLength"].as_u64().unwrap_or(0);
    let max = schema["maxLength"].as_u64().unwrap_or(u64::MAX);
    let pattern = schema["pattern"]
        .as_str()
        .map(|pattern| regex::Regex::new(pattern).unwrap_or_else(|why| panic!("{pattern}: {why}")));
    (min..=max).contains(&chars) && pattern.is_none_or(|pattern| pattern.is_match(value))
}

/// A query parameter's schema.
fn query_parameter<'a>(doc: &'a Value, path: &str, name: &str) -> &'a Value {
    doc["paths"][path]["get"]["parameters"]
        .as_array()
        .and_then(|all| all.iter().find(|p| p["name"] == name))
        .map(|p| &p["schema"])
        .unwrap_or_else(|| panic!("GET {path} has no parameter {name}"))
}

/// What schemathesis's positive-data check found: values the document let
/// through that validation refuses. Each is refused by the server (422
/// naming the field) and now by the document too, so a generated client
/// or a fuzzer reads the same rules as validation does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spec_refuses_what_validation_refuses() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "basic").await;
    let doc = document();
    let schemas = &doc["components"]["schemas"];
    let mut unlike = Vec::new();

    // Query parameters: (path, parameter, value, key).
    let query = [
        ("/v1/messages", "recipient", "+10", key.as_str()),
        ("/v1/admin/audit", "cursor", "", ADMIN_TOKEN),
        ("/v1/admin/audit", "cursor", "abc", ADMIN_TOKEN),
        ("/v1/admin/audit", "since", "", ADMIN_TOKEN),
        ("/v1/usage", "from", "1969-12-31", key.as_str()),
        ("/v1/usage", "to", "0180-06-04", key.as_str()),
    ];
    for (path, name, value, token) in query {
        let url = reqwest::Url::parse_with_params(&app.url(path), &[(name, value)]).unwrap();
        let answer = app.client.get(url).bearer_auth(token).send().await.unwrap();
        let (_, problem) = expect_problem(answer, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert!(
            problem["errors"][name].is_string(),
            "{path}?{name}={value:?}: {problem}"
        );
        let schema = query_parameter(&doc, path, name);
        // A date-time is refused by its format, which a client checks.
        if schema["format"] != "date-time" && string_schema_admits(schema, value) {
            unlike.push(format!("GET {path}?{name}={value:?}"));
        }
    }

    // Body fields: (request, schema of the field, field, body).
    let text = &schemas["SmsTemplateContent"]["properties"]["text"];
    let locale = &schemas["PreviewRequest"]["properties"]["locale"];
    let html_alone =
        &schemas["SendEmailRequestByContent"]["allOf"][1]["anyOf"][1]["properties"]["html"];
    let display_name = &schemas["NewEmailSender"]["properties"]["display_name"];
    let template_name = &schemas["SmsTemplateContent"]["properties"]["name"];
    let named = |name: &str| json!({"name": name, "channel": "sms", "text": "Hi"});
    let email = |html: &str| json!({"channel": "email", "to": "a@example.com", "subject": "s", "html": html});
    let sender =
        |name: &str| json!({"channel": "email", "from": "news@example.com", "display_name": name});
    // (request, the field's schema, the value, the field refused, body, key)
    let bodies = [
        (
            "/v1/templates",
            text,
            "",
            "text",
            json!({"name": "t", "channel": "sms", "text": ""}),
            key.as_str(),
        ),
        (
            "/v1/templates",
            text,
            " \n",
            "text",
            json!({"name": "t", "channel": "sms", "text": " \n"}),
            key.as_str(),
        ),
        (
            "/v1/templates/tpl_none/preview",
            locale,
            "",
            "locale",
            json!({"locale": ""}),
            key.as_str(),
        ),
        // HTML alone, blank: the text derived from it would be empty.
        (
            "/v1/messages",
            html_alone,
            "",
            "text",
            email(""),
            key.as_str(),
        ),
        (
            "/v1/admin/tenants/acme/senders",
            display_name,
            "Acme\u{7}",
            "display_name",
            sender("Acme\u{7}"),
            ADMIN_TOKEN,
        ),
        (
            "/v1/admin/tenants/acme/senders",
            display_name,
            "\u{a0}",
            "display_name",
            sender("\u{a0}"),
            ADMIN_TOKEN,
        ),
        (
            "/v1/templates",
            template_name,
            "a\u{1}b",
            "name",
            named("a\u{1}b"),
            key.as_str(),
        ),
        (
            "/v1/templates",
            template_name,
            "receipt\u{3000}",
            "name",
            named("receipt\u{3000}"),
            key.as_str(),
        ),
    ];
    // Email copies and headers, and a template's locales and variants.
    let email_fields = &schemas["SendEmailRequestByContent"]["allOf"][0]["properties"];
    let headers = &email_fields["headers"];
    let locales = &schemas["SmsTemplateContent"]["properties"]["locales"];
    let with = |field: &str, value: Value| {
        let mut body = email("<p>Hi</p>");
        body[field] = value;
        body
    };
    let sms_template =
        |locales: Value| json!({"name": "t", "channel": "sms", "text": "Hi", "locales": locales});
    let email_template = &schemas["EmailTemplateContent"]["allOf"][0]["properties"];
    let template = json!({"name": "t", "channel": "email", "subject": "a\nb", "text": "Hi"});
    let more = [
        (
            "/v1/messages",
            &email_fields["subject"],
            "a\nb",
            "subject",
            with("subject", json!("a\nb")),
        ),
        (
            "/v1/templates",
            &email_template["subject"],
            "a\nb",
            "subject",
            template,
        ),
        (
            "/v1/messages",
            &email_fields["bcc"]["items"],
            "x",
            "bcc[0]",
            with("bcc", json!(["x"])),
        ),
        (
            "/v1/messages",
            &headers["propertyNames"],
            "X-SES-Tag",
            "headers",
            with("headers", json!({"X-SES-Tag": "v"})),
        ),
        (
            "/v1/messages",
            &headers["propertyNames"],
            "From",
            "headers",
            with("headers", json!({"From": "v"})),
        ),
        (
            "/v1/messages",
            &headers["additionalProperties"],
            "caf\u{e9}",
            "headers",
            with("headers", json!({"X-Tag": "caf\u{e9}"})),
        ),
        (
            "/v1/templates",
            &locales["propertyNames"],
            "",
            "locales.",
            sms_template(json!({"": {"text": "Salut"}})),
        ),
    ];
    for (path, schema, value, field, body, token) in
        bodies
            .into_iter()
            .chain(more.map(|(path, schema, value, field, body)| {
                (path, schema, value, field, body, key.as_str())
            }))
    {
        let answer = app
            .client
            .post(app.url(path))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let (_, problem) = expect_problem(answer, StatusCode::UNPROCESSABLE_ENTITY).await;
        assert!(
            problem["errors"][field].is_string(),
            "POST {path} {body}: {problem}"
        );
        assert!(schema.is_object(), "POST {path}: no schema for {value:?}");
        if string_schema_admits(schema, value) {
            unlike.push(format!("POST {path} {field} {value:?}"));
        }
    }

    // An SMS template's variant has no subject.
    let answer = app
        .client
        .post(app.url("/v1/templates"))
        .bearer_auth(&key)
        .json(&sms_template(
            json!({"fr": {"subject": "Objet", "text": "Salut"}}),
        ))
        .send()
        .await
        .unwrap();
    let (_, problem) = expect_problem(answer, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert!(
        problem["errors"]["locales.fr.subject"].is_string(),
        "{problem}"
    );
    let sms_variant = &schemas[locales["additionalProperties"]["$ref"]
        .as_str()
        .unwrap_or("")
        .trim_start_matches("#/components/schemas/")];
    if sms_variant["properties"].get("subject").is_some()
        || sms_variant["additionalProperties"] != false
    {
        unlike.push(format!("an SMS variant with a subject: {sms_variant}"));
    }

    // An upload needs its bytes and their type: the body is required.
    let answer = app
        .client
        .post(app.url("/v1/attachments?filename=a.pdf"))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    expect_problem(answer, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
    if doc["paths"]["/v1/attachments"]["post"]["requestBody"]["required"] != true {
        unlike.push("POST /v1/attachments without a body".to_owned());
    }

    assert!(
        unlike.is_empty(),
        "the document lets through what validation refuses: {unlike:#?}"
    );
}
