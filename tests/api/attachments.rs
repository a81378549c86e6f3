//! Email attachments end to end: uploaded over HTTP, stored in the store
//! (never in a queue message), claimed by one send, read back at delivery
//! and sent to SES inside the raw MIME message, which is parsed back here
//! with a MIME parser and the file compared by its hash.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::delivery::{delivery_settings, status_is, wait_for};
use crate::senders::{mail_of, ses_calls, ses_ok};
use crate::support::{
    TestApp, email, expect_field_error, expect_json, expect_problem, on_both_stores, sms, with,
};
use crate::test_keys::issue;

/// A PDF of `size` bytes: the header a PDF starts with, then bytes of
/// every value (so a text transfer encoding would spoil them), then the
/// trailer.
pub(crate) fn pdf_of(size: usize) -> Vec<u8> {
    let mut bytes = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n".to_vec();
    let mut state: u32 = 0x2545_4f46;
    while bytes.len() < size - 6 {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        bytes.push((state >> 24) as u8);
    }
    bytes.extend_from_slice(b"\n%%EOF");
    bytes
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Uploads `bytes` as `filename` of `content_type` with `key`.
pub(crate) async fn upload(
    app: &TestApp,
    key: &str,
    filename: &str,
    content_type: &str,
    bytes: Vec<u8>,
) -> reqwest::Response {
    let query: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("filename", filename)
        .finish();
    app.tenant(key, Method::POST, &format!("/v1/attachments?{query}"))
        .header("content-type", content_type)
        .body(bytes)
        .send()
        .await
        .unwrap()
}

/// Uploads and returns the stored file's view.
pub(crate) async fn uploaded(
    app: &TestApp,
    key: &str,
    filename: &str,
    content_type: &str,
    bytes: Vec<u8>,
) -> Value {
    expect_json(
        upload(app, key, filename, content_type, bytes).await,
        StatusCode::CREATED,
    )
    .await
}

/// How many attachment rows and chunk rows the store holds.
async fn stored_files(app: &TestApp) -> (i64, i64) {
    use fairlane::store::Db;
    const FILES: &str =
        "SELECT (SELECT COUNT(*) FROM attachments), (SELECT COUNT(*) FROM attachment_chunks)";
    match &app.state.db {
        Db::Sqlite(db) => crate::support::sqlite_file(&db.path)
            .query_row(FILES, [], |row| Ok((row.get(0)?, row.get(1)?)))
            .unwrap(),
        Db::Postgres(db) => sqlx::query_as(FILES).fetch_one(&db.pool).await.unwrap(),
    }
}

on_both_stores! {
    /// A 2 MB PDF uploaded, named in a send with an HTML body, reaches SES
    /// whole inside a `multipart/mixed` message: the same bytes (hash), the
    /// cleaned name, the type. The queue message carried only its id; the
    /// file is counted in usage in bytes, and goes out whole with a second
    /// send too, its view counting the two messages.
    async fn a_two_megabyte_pdf_arrives_intact_with_its_email() {
        let ses = ses_ok().await;
        let app = TestApp::start(&delivery_settings("http://127.0.0.1:9", &ses.uri(), "")).await;
        let key = app.tenant_with_key("acme", "pro").await;
        let pdf = pdf_of(2 * 1024 * 1024);
        let file = uploaded(&app, &key, "../reports/Invoice \"17\".pdf", "application/pdf", pdf.clone()).await;
        assert_eq!(file["filename"], "Invoice 17.pdf", "{file}");
        assert_eq!(file["content_type"], "application/pdf");
        assert_eq!(file["size"], pdf.len());
        assert_eq!(file["sha256"], sha256_hex(&pdf));
        assert!(file["expires_at"].is_string(), "{file}");
        let file_id = file["id"].as_str().unwrap().to_owned();

        let send = json!({
            "channel": "email", "to": "a@example.com", "subject": "Invoice 17",
            "html": "<p>Your invoice is attached.</p>", "attachments": [file_id],
        });
        let id = app.send_accepted(&key, &send).await;
        let view = wait_for(&app, &key, &id, status_is("sent")).await;
        assert_eq!(view["attachment_bytes"], pdf.len(), "{view}");

        let calls = ses_calls(&ses).await;
        assert_eq!(calls.len(), 1);
        let mail = mail_of(&calls[0]);
        assert_eq!(mail.content_type, "multipart/mixed");
        assert_eq!(mail.html.as_deref(), Some("<p>Your invoice is attached.</p>"));
        let parsed = mail_parser::MessageParser::default().parse(&mail.raw).unwrap();
        assert_eq!(parsed.attachment_count(), 1);
        let part = parsed.attachment(0).unwrap();
        use mail_parser::MimeHeaders;
        assert_eq!(part.attachment_name(), Some("Invoice 17.pdf"));
        assert_eq!(
            part.content_type().map(|c| format!("{}/{}", c.ctype(), c.subtype().unwrap_or(""))),
            Some("application/pdf".to_owned())
        );
        assert_eq!(sha256_hex(part.contents()), sha256_hex(&pdf), "the file arrives intact");

        let usage = expect_json(app.tenant(&key, Method::GET, "/v1/usage").send().await.unwrap(), StatusCode::OK).await;
        let email_total = usage["totals"].as_array().unwrap().iter().find(|t| t["channel"] == "email").cloned().unwrap();
        assert_eq!(email_total["attachment_bytes"], pdf.len(), "{usage}");

        let again = app.send_accepted(&key, &send).await;
        wait_for(&app, &key, &again, status_is("sent")).await;
        let calls = ses_calls(&ses).await;
        assert_eq!(calls.len(), 2);
        assert_eq!(attached_hashes(&calls[1]), [sha256_hex(&pdf)], "the second send carries the file too");
        let shown = viewed(&app, &key, &file_id).await;
        assert_eq!(shown["messages"], 2, "{shown}");
        assert!(shown.get("message_id").is_none(), "{shown}");
        assert_eq!(shown["expires_at"], file["expires_at"], "{shown}");
    }
}

/// The SHA-256 of each file attached to the email of an SES call.
fn attached_hashes(call: &Value) -> Vec<String> {
    let mail = mail_of(call);
    let parsed = mail_parser::MessageParser::default()
        .parse(&mail.raw)
        .unwrap();
    (0..parsed.attachment_count())
        .map(|i| sha256_hex(parsed.attachment(i as u32).unwrap().contents()))
        .collect()
}

/// The view of file `id`, which must be there.
async fn viewed(app: &TestApp, key: &str, id: &str) -> Value {
    expect_json(
        app.tenant(key, Method::GET, &format!("/v1/attachments/{id}"))
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await
}

/// Runs `sql` on the app's own database (`$1` binds `id`).
async fn execute(app: &TestApp, sql: &str, id: &str) {
    use fairlane::store::Db;
    match &app.state.db {
        Db::Sqlite(db) => {
            crate::support::sqlite_file(&db.path)
                .execute(&sql.replace('$', "?"), rusqlite::params![id])
                .unwrap();
        }
        Db::Postgres(db) => {
            sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                .bind(id)
                .execute(&db.pool)
                .await
                .unwrap();
        }
    }
}

fn delete(app: &TestApp, key: &str, id: &str) -> reqwest::RequestBuilder {
    app.tenant(key, Method::DELETE, &format!("/v1/attachments/{id}"))
}

on_both_stores! {
    /// A file deleted while a held send uses it: the DELETE is 204, a new
    /// send naming it is 422 on `attachments[0]` and the file is 404, yet
    /// the earlier send goes out with its bytes once the tenant resumes;
    /// when retention erases that message, the file's bytes go. A file no
    /// message uses goes at once, and another world's key cannot delete.
    async fn a_deleted_file_still_goes_out_with_the_sends_before_and_goes_with_the_last() {
        let ses = ses_ok().await;
        let app = TestApp::start(&delivery_settings("http://127.0.0.1:9", &ses.uri(), "")).await;
        let key = app.tenant_with_key("acme", "pro").await;
        let test_key = issue(&app, "acme", Some("test")).await["key"].as_str().unwrap().to_owned();
        let pdf = pdf_of(300 * 1024);
        let file = uploaded(&app, &key, "a.pdf", "application/pdf", pdf.clone()).await;
        let file_id = file["id"].as_str().unwrap().to_owned();
        app.patch_tenant("acme", json!({"status": "paused"})).await;
        let send = with(email(), "attachments", json!([file_id]));
        let held = app.send_accepted(&key, &send).await;

        let response = delete(&app, &test_key, &file_id).send().await.unwrap();
        expect_problem(response, StatusCode::NOT_FOUND).await;
        let response = delete(&app, &key, &file_id).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        expect_field_error(app.send(&key, &send).await, "attachments[0]").await;
        let response = app.tenant(&key, Method::GET, &format!("/v1/attachments/{file_id}")).send().await.unwrap();
        expect_problem(response, StatusCode::NOT_FOUND).await;
        let response = delete(&app, &key, &file_id).send().await.unwrap();
        expect_problem(response, StatusCode::NOT_FOUND).await;
        assert_eq!(stored_files(&app).await.0, 1, "kept while a message uses it");

        app.patch_tenant("acme", json!({"status": "active"})).await;
        wait_for(&app, &key, &held, status_is("sent")).await;
        let calls = ses_calls(&ses).await;
        assert_eq!(calls.len(), 1);
        assert_eq!(attached_hashes(&calls[0]), [sha256_hex(&pdf)]);

        app.patch_tenant("acme", json!({"retention_days": 1})).await;
        crate::retention::age_messages(&app, "acme", 2).await;
        let run = crate::retention::run_retention(&app).await;
        assert_eq!(run.erased, 1, "{run:?}");
        assert_eq!(stored_files(&app).await, (0, 0), "the bytes went with the last message");

        // A file nothing uses goes at once.
        let unused = uploaded(&app, &key, "b.pdf", "application/pdf", pdf_of(1000)).await;
        let response = delete(&app, &key, unused["id"].as_str().unwrap()).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        assert_eq!(stored_files(&app).await, (0, 0));
    }
}

on_both_stores! {
    /// A file past its `expires_at` is refused by a send (422 on
    /// `attachments[0]`), and the sweep erases it since nothing uses it.
    async fn an_expired_file_is_refused_and_swept() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let file = uploaded(&app, &key, "a.csv", "text/csv", b"a,b\n1,2\n".to_vec()).await;
        let file_id = file["id"].as_str().unwrap().to_owned();
        execute(&app, "UPDATE attachments SET expires_at = created_at WHERE id = $1", &file_id).await;
        let body = expect_field_error(app.send(&key, &with(email(), "attachments", json!([file_id]))).await, "attachments[0]").await;
        assert!(body["errors"]["attachments[0]"].as_str().unwrap().contains("expired"), "{body}");
        let run = crate::retention::run_retention(&app).await;
        assert_eq!(run.unclaimed_files, 1, "{run:?}");
        assert_eq!(stored_files(&app).await, (0, 0));
    }
}

on_both_stores! {
    /// Nothing of a refused upload stays in the store: a type not on the
    /// list (415), bytes that are not the claimed type or a name whose
    /// extension is not (422 naming the field), a file over 10 MiB told by
    /// its `Content-Length` or by its bytes streamed without one (413).
    async fn uploads_are_checked_by_type_name_bytes_and_size() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let exe = b"MZ\x90\x00\x03\x00\x00\x00 this is not a pdf".to_vec();
        expect_problem(upload(&app, &key, "setup.exe", "application/x-msdownload", exe.clone()).await, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
        expect_field_error(upload(&app, &key, "invoice.pdf", "application/pdf", exe).await, "body").await;
        expect_field_error(upload(&app, &key, "invoice.png", "application/pdf", pdf_of(1000)).await, "filename").await;
        expect_field_error(upload(&app, &key, "/", "application/pdf", pdf_of(1000)).await, "filename").await;
        expect_field_error(upload(&app, &key, "notes.txt", "text/plain", b"a\x00b".to_vec()).await, "body").await;
        expect_field_error(upload(&app, &key, "empty.pdf", "application/pdf", Vec::new()).await, "body").await;
        let too_large = fairlane::attachments::MAX_FILE_BYTES as usize + 1;
        let (status, answer) = declared_upload(&app, &key, too_large).await;
        assert_eq!(status, 413, "answered before any byte of the body: {answer}");
        let (status, answer) = chunked_upload(&app, &key, "big.pdf", too_large).await;
        assert_eq!(status, 413, "{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert_eq!(stored_files(&app).await, (0, 0), "no refused upload leaves a row");

        // Within the limit, the same streaming upload is stored whole.
        let (status, answer) = chunked_upload(&app, &key, "fits.pdf", 3 * 1024 * 1024).await;
        assert_eq!(status, 201, "{answer}");
        let (files, chunks) = stored_files(&app).await;
        assert_eq!((files, chunks), (1, 12), "3 MiB in chunks of 256 KiB");
    }
}

/// Sends the head of an upload declaring `length` bytes and none of
/// them; the status and the answer's text.
async fn declared_upload(app: &TestApp, key: &str, length: usize) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let head = format!(
        "POST /v1/attachments?filename=big.pdf HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/pdf\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n",
        app.addr
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    answer_of(stream).await
}

/// The status and text of the answer on `stream`, read until it closes.
async fn answer_of(mut stream: tokio::net::TcpStream) -> (u16, String) {
    let mut answer = Vec::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        stream.read_to_end(&mut answer),
    )
    .await;
    assert!(
        read.is_ok(),
        "no answer within 30 s: {:?}",
        String::from_utf8_lossy(&answer)
    );
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer: {text:?}"));
    (status, text)
}

/// Sends `size` bytes of a PDF to `/v1/attachments` with chunked transfer
/// encoding (no `Content-Length`), a megabyte a chunk, stopping when the
/// server answers or closes; the status and the answer's text.
async fn chunked_upload(app: &TestApp, key: &str, filename: &str, size: usize) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let head = format!(
        "POST /v1/attachments?filename={filename} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/pdf\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        app.addr
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let pdf = pdf_of(size);
    for piece in pdf.chunks(1024 * 1024) {
        let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
        chunk.extend_from_slice(piece);
        chunk.extend_from_slice(b"\r\n");
        if stream.write_all(&chunk).await.is_err() {
            break;
        }
    }
    let _ = stream.write_all(b"0\r\n\r\n").await;
    answer_of(stream).await
}

on_both_stores! {
    /// A send's `attachments` are checked naming the field: an id that is
    /// not the tenant's, a live upload named by a test send (the worlds
    /// are apart), a repeated id, an SMS, more than ten.
    async fn a_send_names_only_its_own_worlds_free_files() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let other = app.tenant_with_key("globex", "pro").await;
        let test_key = issue(&app, "acme", Some("test")).await["key"].as_str().unwrap().to_owned();
        let file = uploaded(&app, &key, "a.csv", "text/csv", b"name,city\nAda,London\n".to_vec()).await;
        let id = file["id"].clone();
        for (caller, body, field) in [
            (&other, with(email(), "attachments", json!([id])), "attachments[0]"),
            (&test_key, with(email(), "attachments", json!([id])), "attachments[0]"),
            (&key, with(email(), "attachments", json!([id, id])), "attachments[1]"),
            (&key, with(email(), "attachments", json!(["x"])), "attachments[0]"),
            (&key, with(email(), "attachments", json!(id)), "attachments"),
            (&key, with(sms(), "attachments", json!([id])), "attachments"),
            (&key, with(email(), "attachments", json!(vec![id.clone(); 11])), "attachments"),
        ] {
            expect_field_error(app.send(caller, &body).await, field).await;
        }
        let seen_by_test = app.tenant(&test_key, Method::GET, &format!("/v1/attachments/{}", id.as_str().unwrap())).send().await.unwrap();
        expect_problem(seen_by_test, StatusCode::NOT_FOUND).await;
        // The file is still free: a live send takes it.
        app.send_accepted(&key, &with(email(), "attachments", json!([id]))).await;
    }
}

on_both_stores! {
    /// A refusal of the bytes is one whole sentence that names the type
    /// with its article: a PNG sent as a PDF, a text file with a NUL.
    async fn a_refused_files_bytes_are_named_in_a_whole_sentence() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01".to_vec();
        let body = expect_field_error(upload(&app, &key, "a.pdf", "application/pdf", png).await, "body").await;
        assert_eq!(body["errors"]["body"], "is not an application/pdf file: its bytes are image/png", "{body}");
        let body = expect_field_error(upload(&app, &key, "a.txt", "text/plain", b"a\x00b".to_vec()).await, "body").await;
        assert_eq!(
            body["errors"]["body"],
            "is not a text/plain file: its bytes are not UTF-8 text without NUL bytes",
            "{body}"
        );
    }
}

/// Puts plan `name` with these upload limits (a slow lane, the send
/// figures of no interest here).
async fn upload_plan(app: &TestApp, name: &str, per_minute: u32, bytes_held: u64) {
    let body = json!({
        "lane": "fast", "rate_per_second": 10, "burst": 10, "daily_quota": 1000,
        "max_in_flight": 1, "uploads_per_minute": per_minute, "upload_bytes_held": bytes_held,
    });
    let put = app
        .admin(Method::PUT, &format!("/v1/admin/plans/{name}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success(), "{}", put.text().await.unwrap());
}

/// The `type` of a problem answer and its `Retry-After`, if any.
async fn refusal(response: reqwest::Response) -> (String, Option<String>, String) {
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let body: Value = response.json().await.unwrap();
    (
        body["type"].as_str().unwrap().to_owned(),
        retry_after,
        body["detail"].as_str().unwrap().to_owned(),
    )
}

on_both_stores! {
    /// A plan's upload limits hold per world: past `upload_bytes_held` a
    /// file is refused (429 upload-bytes-held, no Retry-After) whether its
    /// length is declared or streamed, leaving nothing behind; a test key's
    /// uploads have a budget of their own; a DELETE of an unused file gives
    /// its room back; past `uploads_per_minute`, 429 too-many-uploads with
    /// the Retry-After of the next one. Uploads are not changes: a bucket
    /// of one change does not stop them.
    async fn a_plans_upload_limits_hold_in_each_world() {
        let app = TestApp::start("[limits]\ntenant_writes_burst = 1\ntenant_writes_per_second = 0.01\n").await;
        upload_plan(&app, "tiny", 5, 3000).await;
        let key = app.tenant_with_key("acme", "tiny").await;
        let test_key = issue(&app, "acme", Some("test")).await["key"].as_str().unwrap().to_owned();
        let first = uploaded(&app, &key, "a.pdf", "application/pdf", pdf_of(1000)).await;
        uploaded(&app, &key, "b.pdf", "application/pdf", pdf_of(1000)).await;
        let (kind, retry_after, detail) = refusal(upload(&app, &key, "c.pdf", "application/pdf", pdf_of(1500)).await).await;
        assert_eq!(kind, "urn:fairlane:problem:upload-bytes-held", "{detail}");
        assert_eq!(retry_after, None, "waiting alone gives no room back");
        assert!(detail.contains("3000") && detail.contains("2000"), "{detail}");
        // Streamed without a Content-Length, it is refused as its bytes pass the room.
        let (status, answer) = chunked_upload(&app, &key, "d.pdf", 1500).await;
        assert_eq!(status, 429, "{answer}");
        assert!(answer.contains("upload-bytes-held"), "{answer}");
        assert_eq!(stored_files(&app).await.0, 2, "nothing of the refused uploads stays");
        // The test world's budget is its own.
        uploaded(&app, &test_key, "c.pdf", "application/pdf", pdf_of(1500)).await;
        // Deleting an unused file gives its room back (the one change of the bucket).
        let deleted = delete(&app, &key, first["id"].as_str().unwrap()).send().await.unwrap();
        assert_eq!(deleted.status(), StatusCode::NO_CONTENT);
        uploaded(&app, &key, "c.pdf", "application/pdf", pdf_of(1500)).await;
        // That was the world's fifth upload of the minute: the sixth waits.
        let (kind, retry_after, detail) = refusal(upload(&app, &key, "e.txt", "text/plain", b"e".to_vec()).await).await;
        assert_eq!(kind, "urn:fairlane:problem:too-many-uploads", "{detail}");
        let wait: u64 = retry_after.expect("a Retry-After").parse().unwrap();
        assert!((1..=12).contains(&wait), "one upload comes back every 12 s: {wait}");
        assert!(detail.contains("5 uploads per minute"), "{detail}");
        // The test world's bucket is its own too.
        uploaded(&app, &test_key, "e.txt", "text/plain", b"e".to_vec()).await;
    }
}

/// Sends the head of an upload of `size` bytes and its first `first`
/// bytes, and returns the stream and the rest to send.
async fn begun_upload(
    app: &TestApp,
    key: &str,
    filename: &str,
    size: usize,
    first: usize,
) -> (tokio::net::TcpStream, Vec<u8>) {
    let mut stream = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let head = format!(
        "POST /v1/attachments?filename={filename} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/pdf\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n",
        app.addr
    );
    let pdf = pdf_of(size);
    let mut sent = head.into_bytes();
    sent.extend_from_slice(&pdf[..first]);
    stream.write_all(&sent).await.unwrap();
    (stream, pdf[first..].to_vec())
}

on_both_stores! {
    /// Two uploads under way at once that each fit the world's room alone
    /// but not together: both pass the checks of their start and of their
    /// bytes, and the finish, one step per world, lets only one of them
    /// in; the world never holds more than its plan's bytes.
    async fn two_uploads_that_fit_alone_do_not_both_finish_past_the_limit() {
        let app = TestApp::start("").await;
        upload_plan(&app, "tiny", 60, 300_000).await;
        let key = app.tenant_with_key("acme", "tiny").await;
        // 200 KB each, of which the first 100 KB now: each has begun its
        // row and is streaming when the other finishes.
        let (mut a, rest_a) = begun_upload(&app, &key, "a.pdf", 200_000, 100_000).await;
        let (mut b, rest_b) = begun_upload(&app, &key, "b.pdf", 200_000, 100_000).await;
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        assert_eq!(stored_files(&app).await.0, 2, "both uploads have begun");
        a.write_all(&rest_a).await.unwrap();
        b.write_all(&rest_b).await.unwrap();
        let (first, second) = tokio::join!(answer_of(a), answer_of(b));
        let mut statuses = [first.0, second.0];
        statuses.sort();
        assert_eq!(statuses, [201, 429], "{first:?} {second:?}");
        let refused = if first.0 == 429 { &first.1 } else { &second.1 };
        assert!(refused.contains("upload-bytes-held"), "{refused}");
        assert_eq!(stored_files(&app).await.0, 1, "the refused one left nothing");
    }
}
