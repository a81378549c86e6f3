//! Test support: starts a real [`Application`] on a random port with its own
//! temporary SQLite file, and wraps the requests the tests make (admin calls,
//! sends, status reads) so each test reads as the behaviour it checks.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fairlane::api::AppState;
use fairlane::app::Application;
use fairlane::config::{DEFAULT_TOML, Settings};
use reqwest::header::{CONTENT_TYPE, HeaderMap};
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde_json::{Value, json};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection};
use tempfile::TempDir;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Which store a test app keeps its state in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// A SQLite file in the test's temporary directory (the default).
    Sqlite,
    /// A database of the test's own on the test PostgreSQL server, with the
    /// lanes in SQS on moto.
    Postgres,
    /// A database of the test's own on the test PostgreSQL server, with the
    /// lanes in it (`queue.backend = "postgres"`).
    PostgresLanes,
}

tokio::task_local! {
    /// The store of the apps a test starts; see [`on_both_stores!`].
    pub static STORE: Store;
}

/// Defines a test module `NAME` with one test per `ARM => STORE` pair:
/// `NAME::ARM`, in which every [`TestApp`] the test starts keeps its state
/// in that [`Store`]. The macros below name the usual sets.
macro_rules! on_stores {
    ([$($arm:ident => $store:ident),+] $(#[doc = $doc:literal])* async fn $name:ident() $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $arm() {
                    $crate::support::STORE
                        .scope($crate::support::Store::$store, async $body)
                        .await
                }
            )+
        }
    };
}
pub(crate) use on_stores;

/// Defines a test that runs three times, as `NAME::on_sqlite`,
/// `NAME::on_postgres` (SQS lanes) and `NAME::on_postgres_lanes` (the lanes
/// in PostgreSQL): for behaviour that must not depend on the store.
macro_rules! on_both_stores {
    ($($test:tt)*) => {
        $crate::support::on_stores! {
            [on_sqlite => Sqlite, on_postgres => Postgres, on_postgres_lanes => PostgresLanes]
            $($test)*
        }
    };
}
pub(crate) use on_both_stores;

/// [`on_both_stores!`] without the lanes in PostgreSQL: for tests of the
/// SQS lanes on either store.
macro_rules! on_sqlite_and_postgres {
    ($($test:tt)*) => {
        $crate::support::on_stores! {
            [on_sqlite => Sqlite, on_postgres => Postgres]
            $($test)*
        }
    };
}
pub(crate) use on_sqlite_and_postgres;

/// Defines a test that runs twice, as `NAME::embedded` (a SQLite file and
/// its embedded queue) and `NAME::lanes_in_postgres` (a PostgreSQL store
/// with its lanes in it): for the queue's behaviour end to end.
macro_rules! on_embedded_and_postgres_lanes {
    ($($test:tt)*) => {
        $crate::support::on_stores! {
            [embedded => Sqlite, lanes_in_postgres => PostgresLanes]
            $($test)*
        }
    };
}
pub(crate) use on_embedded_and_postgres_lanes;

/// Tests whose figures are timings on this machine's two shared cores take
/// this to read (they still run beside each other); the browser tests,
/// whose headless Chromium takes a core to itself while it renders, take it
/// to write: the two kinds never run at once. Taken once, at a test's
/// start, and held to its end.
pub static TIMED: std::sync::LazyLock<tokio::sync::RwLock<()>> =
    std::sync::LazyLock::new(|| tokio::sync::RwLock::new(()));

/// The admin token every test app is configured with.
pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// SQLite's write lock, held by a test.
pub struct WriteLock(rusqlite::Connection);

impl WriteLock {
    pub async fn release(self) {
        self.0
            .execute_batch("ROLLBACK")
            .expect("release the write lock");
    }
}

/// A connection of the test's own to the SQLite file at `path`, for
/// reading (or arranging) from outside the app.
pub fn sqlite_file(path: &Path) -> rusqlite::Connection {
    let conn = rusqlite::Connection::open(path).expect("open the SQLite file");
    conn.busy_timeout(Duration::from_secs(10))
        .expect("busy timeout");
    conn
}

/// The number the first column of `sql`'s first row holds, read from the
/// SQLite file at `path`.
pub fn sqlite_count(path: &Path, sql: &str, params: impl rusqlite::Params) -> i64 {
    sqlite_file(path)
        .query_row(sql, params, |row| row.get(0))
        .unwrap_or_else(|err| panic!("{sql}: {err}"))
}

/// A running app, its database directory and an HTTP client for it.
/// What a stopped app leaves for a restart.
pub struct Kept {
    pub dir: TempDir,
    /// Its PostgreSQL database, on a PostgreSQL store.
    pub database: Option<TestDatabase>,
}

impl Kept {
    fn dir(dir: TempDir) -> Kept {
        Kept {
            dir,
            database: None,
        }
    }
}

pub struct TestApp {
    pub addr: SocketAddr,
    /// Shared state of the running app, for looking at queue depths.
    pub state: AppState,
    pub client: reqwest::Client,
    /// Holds the SQLite file; removed when the test ends.
    dir: Option<TempDir>,
    /// The PostgreSQL database of an app on [`Store::Postgres`]; dropped
    /// when the test ends.
    #[allow(dead_code)] // held for its Drop, which drops the database
    database: Option<TestDatabase>,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

impl TestApp {
    /// Starts an app with the default settings plus `extra` (TOML text that
    /// must not repeat the `[server]` or `[storage]` tables).
    pub async fn start(extra: &str) -> TestApp {
        Self::start_custom(extra, |_| {}).await
    }

    /// Like [`TestApp::start`], then lets the test change the parsed settings.
    pub async fn start_custom(extra: &str, tweak: impl FnOnce(&mut Settings)) -> TestApp {
        let dir = tempfile::tempdir().expect("temporary directory");
        Self::start_on(Kept::dir(dir), extra, tweak).await
    }

    /// Starts an app whose database lives in `dir` (a restart keeps it).
    pub async fn start_in(dir: TempDir, extra: &str, tweak: impl FnOnce(&mut Settings)) -> TestApp {
        Self::start_on(
            Kept {
                dir,
                database: None,
            },
            extra,
            tweak,
        )
        .await
    }

    /// Starts an app on what a stopped one [`Kept`]: its directory and, on
    /// PostgreSQL, its database (a new one when there is none).
    pub async fn start_on(kept: Kept, extra: &str, tweak: impl FnOnce(&mut Settings)) -> TestApp {
        let Kept { dir, database } = kept;
        let store = STORE.try_with(|store| *store).unwrap_or(Store::Sqlite);
        let database = match (store, database) {
            (Store::Sqlite, _) => None,
            (_, Some(database)) => Some(database),
            (_, None) => Some(TestDatabase::create().await),
        };
        let (mut settings, database) = match (store, database) {
            (Store::Sqlite, _) | (_, None) => (settings_for(dir.path(), extra), None),
            (Store::Postgres, Some(database)) => {
                let moto = crate::backends::moto_url();
                let queue = crate::backends::sqs_settings(&moto, "pg", "");
                let mut settings = settings_for(dir.path(), &format!("{queue}\n{extra}"));
                settings.storage.url = database.url.clone();
                (settings, Some(database))
            }
            (Store::PostgresLanes, Some(database)) => {
                let mut settings = settings_for(dir.path(), extra);
                settings.storage.url = database.url.clone();
                // A test that asks for SQS lanes keeps them.
                if settings.queue.backend == fairlane::config::QueueBackend::Embedded {
                    settings.queue.backend = fairlane::config::QueueBackend::Postgres;
                }
                (settings, Some(database))
            }
        };
        tweak(&mut settings);
        let app = Application::build(settings)
            .await
            .expect("application builds");
        let addr = app.local_addr();
        let state = app.state();
        let (shutdown, signal) = oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let stopped = app
                .run_until(async move {
                    let _ = signal.await;
                })
                .await;
            if let Err(err) = stopped {
                panic!("server failed: {err:#}");
            }
        });
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("HTTP client");
        TestApp {
            addr,
            state,
            client,
            dir: Some(dir),
            database,
            shutdown: Some(shutdown),
            server: Some(server),
        }
    }

    /// Signals shutdown without waiting: the app stops taking connections
    /// and finishes the requests it has.
    pub fn begin_shutdown(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }

    /// Shuts the app down gracefully, waits for it to finish and hands back
    /// the directory holding its database.
    pub async fn stop(self) -> TempDir {
        self.stop_keeping().await.dir
    }

    /// Like [`TestApp::stop`], keeping the PostgreSQL database too, for
    /// [`TestApp::start_on`].
    pub async fn stop_keeping(mut self) -> Kept {
        // Idle keep-alive connections must not hold up the graceful shutdown.
        self.client = reqwest::Client::new();
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(server) = self.server.take() {
            tokio::time::timeout(Duration::from_secs(20), server)
                .await
                .expect("server stops within 20 s")
                .expect("server task ends without panicking");
        }
        Kept {
            dir: self.dir.take().expect("database directory"),
            database: self.database.take(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A request carrying the admin token.
    pub fn admin(&self, method: Method, path: &str) -> RequestBuilder {
        self.client
            .request(method, self.url(path))
            .bearer_auth(ADMIN_TOKEN)
    }

    /// A request carrying a tenant API key.
    pub fn tenant(&self, key: &str, method: Method, path: &str) -> RequestBuilder {
        self.client.request(method, self.url(path)).bearer_auth(key)
    }

    /// Creates a tenant on `plan`; panics unless the answer is 201.
    pub async fn create_tenant(&self, id: &str, plan: &str) -> Value {
        let response = self
            .admin(Method::POST, "/v1/admin/tenants")
            .json(&json!({"id": id, "name": format!("Tenant {id}"), "plan": plan}))
            .send()
            .await
            .expect("create tenant");
        expect_json(response, StatusCode::CREATED).await
    }

    /// Issues a key for `tenant`; returns `(key id, key)`.
    pub async fn issue_key(&self, tenant: &str) -> (String, String) {
        let response = self
            .admin(Method::POST, &format!("/v1/admin/tenants/{tenant}/keys"))
            .send()
            .await
            .expect("issue key");
        let body = expect_json(response, StatusCode::CREATED).await;
        (
            body["id"].as_str().expect("key id").to_owned(),
            body["key"].as_str().expect("key").to_owned(),
        )
    }

    /// Creates a tenant on `plan` and returns a fresh key for it.
    pub async fn tenant_with_key(&self, id: &str, plan: &str) -> String {
        self.create_tenant(id, plan).await;
        self.issue_key(id).await.1
    }

    /// Changes a tenant with `PATCH`; panics unless the answer is 200.
    pub async fn patch_tenant(&self, id: &str, patch: Value) -> Value {
        let response = self
            .admin(Method::PATCH, &format!("/v1/admin/tenants/{id}"))
            .json(&patch)
            .send()
            .await
            .expect("patch tenant");
        expect_json(response, StatusCode::OK).await
    }

    /// `POST /v1/messages` with a JSON body.
    pub async fn send(&self, key: &str, body: &Value) -> Response {
        self.tenant(key, Method::POST, "/v1/messages")
            .json(body)
            .send()
            .await
            .expect("send message")
    }

    /// `POST /v1/messages` with an `Idempotency-Key` header.
    pub async fn send_idempotent(
        &self,
        key: &str,
        idempotency_key: &str,
        body: &Value,
    ) -> Response {
        self.tenant(key, Method::POST, "/v1/messages")
            .header("idempotency-key", idempotency_key)
            .json(body)
            .send()
            .await
            .expect("send message")
    }

    /// Takes SQLite's write lock (an open `BEGIN IMMEDIATE` on the store's
    /// write connection): the accept writer's next commit waits until
    /// [`WriteLock::release`].
    pub async fn hold_write_lock(&self) -> WriteLock {
        let path = self.state.db.sqlite().expect("a SQLite store").path.clone();
        tokio::task::spawn_blocking(move || {
            let conn = sqlite_file(&path);
            conn.execute_batch("BEGIN IMMEDIATE").expect("write lock");
            WriteLock(conn)
        })
        .await
        .expect("write lock taken")
    }

    /// The `/metrics` page (process-wide counters: other tests add to them).
    pub async fn metrics_text(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// Starts `POST /v1/messages` in a task of its own, for tests that hold
    /// the store and look at the request while it waits.
    pub fn send_in_background(&self, key: &str, body: Value) -> JoinHandle<Response> {
        let request = self.tenant(key, Method::POST, "/v1/messages").json(&body);
        tokio::spawn(async move { request.send().await.expect("send message") })
    }

    /// Sends `body` and returns the id of the 202 answer.
    pub async fn send_accepted(&self, key: &str, body: &Value) -> String {
        let response = self.send(key, body).await;
        let accepted = expect_json(response, StatusCode::ACCEPTED).await;
        accepted["id"].as_str().expect("message id").to_owned()
    }

    /// `GET /v1/messages/{id}`.
    pub async fn get_message(&self, key: &str, id: &str) -> Response {
        self.tenant(key, Method::GET, &format!("/v1/messages/{id}"))
            .send()
            .await
            .expect("get message")
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// Default settings with a random port, a fixed admin token, the database
/// in `dir`, no lane consumers, and `extra` on top.
pub fn settings_for(dir: &Path, extra: &str) -> Settings {
    // These tests look at the accept path, so messages must stay queued:
    // lane consumers (where this build has them) are turned off.
    let consumers = if DEFAULT_TOML.contains("[consumers]") && !extra.contains("[consumers]") {
        "[consumers]\nenabled = false\n"
    } else {
        ""
    };
    let overlay = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN_TOKEN}\"\n\n\
         [storage]\nurl = \"sqlite://{}/fairlane.db\"\n\n{consumers}\n{extra}\n",
        dir.display()
    );
    Settings::from_toml_overlay(&overlay).expect("test settings are valid")
}

/// A valid email send request.
pub fn email() -> Value {
    json!({"channel": "email", "to": "a@example.com", "subject": "Hi", "text": "Hello"})
}

/// A valid SMS send request.
pub fn sms() -> Value {
    json!({"channel": "sms", "to": "+15551234567", "text": "Hello"})
}

/// `body` with `field` set to `value` (or removed when `value` is null).
pub fn with(mut body: Value, field: &str, value: Value) -> Value {
    let object = body.as_object_mut().expect("an object");
    if value.is_null() {
        object.remove(field);
    } else {
        object.insert(field.to_owned(), value);
    }
    body
}

/// The value of a header as text, if present.
pub fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// A header parsed as a whole number; panics when absent or not a number.
pub fn header_u64(headers: &HeaderMap, name: &str) -> u64 {
    let text = header(headers, name).unwrap_or_else(|| panic!("header {name} is missing"));
    text.parse()
        .unwrap_or_else(|_| panic!("header {name} is not a number: {text:?}"))
}

/// Asserts the status and a JSON body; returns the body.
pub async fn expect_json(response: Response, status: StatusCode) -> Value {
    let actual = response.status();
    let text = response.text().await.expect("response body");
    assert_eq!(actual, status, "unexpected status; body: {text}");
    serde_json::from_str(&text).unwrap_or_else(|err| panic!("body is not JSON ({err}): {text}"))
}

/// Asserts an RFC 9457 problem answer with `status`; returns its headers and
/// body.
pub async fn expect_problem(response: Response, status: StatusCode) -> (HeaderMap, Value) {
    let headers = response.headers().clone();
    let body = expect_json(response, status).await;
    assert_eq!(
        header(&headers, CONTENT_TYPE.as_str()),
        Some("application/problem+json"),
        "content type of a {status} problem; body: {body}"
    );
    assert!(
        body["type"].as_str().is_some_and(|t| !t.is_empty()),
        "problem type: {body}"
    );
    assert!(
        body["title"].as_str().is_some_and(|t| !t.is_empty()),
        "problem title: {body}"
    );
    assert!(
        body["detail"].as_str().is_some_and(|t| !t.is_empty()),
        "problem detail: {body}"
    );
    assert_eq!(
        body["status"],
        json!(status.as_u16()),
        "problem status: {body}"
    );
    (headers, body)
}

/// Asserts a 422 problem whose `errors` names `field`; returns the body.
pub async fn expect_field_error(response: Response, field: &str) -> Value {
    let (_, body) = expect_problem(response, StatusCode::UNPROCESSABLE_ENTITY).await;
    assert!(
        body["errors"].get(field).and_then(Value::as_str).is_some(),
        "errors should name {field:?}: {body}"
    );
    body
}

/// Asserts a problem whose `type` contains `kind`; returns headers and body.
pub async fn expect_problem_kind(
    response: Response,
    status: StatusCode,
    kind: &str,
) -> (HeaderMap, Value) {
    let (headers, body) = expect_problem(response, status).await;
    let actual = body["type"].as_str().unwrap_or_default();
    assert!(
        actual.contains(kind),
        "problem type should contain {kind:?}: {body}"
    );
    (headers, body)
}

/// Messages waiting in the fast lane: the embedded queue's depth, or on the
/// PostgreSQL store (SQS lanes, whose depth SQS reports only now and then)
/// the lane's `queued` status rows.
pub async fn fast_lane_depth(app: &TestApp) -> u64 {
    match app.state.db.postgres() {
        Some(pg) => {
            let queued: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM messages WHERE lane = 'fast' AND status = 'queued'",
            )
            .fetch_one(&pg.pool)
            .await
            .unwrap();
            queued as u64
        }
        None => {
            app.state
                .queue
                .stats(fairlane::model::Lane::Fast)
                .await
                .unwrap()
                .depth
        }
    }
}

/// Waits up to 20 s until nothing waits or is in flight in the fast lane
/// (embedded queue): every copy has been sent or deleted.
pub async fn wait_until_the_fast_lane_is_empty(app: &TestApp) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stats = app
            .state
            .queue
            .stats(fairlane::model::Lane::Fast)
            .await
            .unwrap();
        if stats.depth == 0 && stats.in_flight == 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the lane never emptied: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ----- PostgreSQL -----

/// The test PostgreSQL server (see `tests/servers`).
pub fn pg_server_url() -> String {
    crate::servers::pg_url()
}

/// `server` (a PostgreSQL URL naming any database) with the database
/// replaced by `name`, query parameters kept.
fn with_database(server: &str, name: &str) -> String {
    let (base, query) = match server.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (server, None),
    };
    let authority = base.find("://").map_or(0, |at| at + 3);
    let base = match base[authority..].find('/') {
        Some(slash) => &base[..authority + slash],
        None => base,
    };
    match query {
        Some(query) => format!("{base}/{name}?{query}"),
        None => format!("{base}/{name}"),
    }
}

/// A database of this test's own on the test PostgreSQL server; dropped
/// (`WITH (FORCE)`, whoever is still connected) when the guard is.
pub struct TestDatabase {
    server: String,
    name: String,
    /// What the app or the instances are configured with.
    pub url: String,
}

impl TestDatabase {
    pub async fn create() -> TestDatabase {
        let server = pg_server_url();
        let mut conn = connect_pg(&server).await;
        let name = format!(
            "fairlane_test_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..16]
        );
        // The name is ours (letters, digits and underscores), quoted.
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|err| panic!("CREATE DATABASE {name} on {server}: {err}"));
        let _ = conn.close().await;
        let url = with_database(&server, &name);
        TestDatabase { server, name, url }
    }
}

/// A connection to `url`; fails the test, saying why, when PostgreSQL does
/// not answer.
pub async fn connect_pg(url: &str) -> PgConnection {
    match tokio::time::timeout(Duration::from_secs(10), PgConnection::connect(url)).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(err)) => panic!(
            "cannot connect to PostgreSQL at {url} (FAIRLANE_TEST_PG_URL): the several-instances \
             tests need a PostgreSQL server where they may create databases: {err}"
        ),
        Err(_) => panic!(
            "PostgreSQL at {url} (FAIRLANE_TEST_PG_URL) did not answer within 10 s: the \
             several-instances tests need a PostgreSQL server where they may create databases"
        ),
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        if std::thread::panicking() && std::env::var_os("FAIRLANE_TEST_KEEP_DB").is_some() {
            eprintln!(
                "----- database kept for inspection (FAIRLANE_TEST_KEEP_DB): {} -----",
                self.url
            );
            return;
        }
        let (server, name) = (self.server.clone(), self.name.clone());
        // Drop runs inside the test's runtime, which must not be blocked
        // on; the drop gets a thread and a small runtime of its own.
        let dropped = std::thread::spawn(move || -> anyhow::Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let mut conn = PgConnection::connect(&server).await?;
                sqlx::query(AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                )))
                .execute(&mut conn)
                .await?;
                conn.close().await?;
                Ok(())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(err)) => eprintln!("could not drop test database {}: {err:#}", self.name),
            Err(_) => eprintln!("dropping test database {} panicked", self.name),
        }
    }
}

/// A TCP proxy in front of a server (PostgreSQL, SQS) that the test can
/// cut (every connection closed, new ones closed at once) and restore.
pub struct TcpProxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    /// Connections closed at once because the proxy was cut.
    refused: Arc<AtomicUsize>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl TcpProxy {
    pub async fn start(upstream: String) -> TcpProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicUsize::new(0));
        let connections: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (is_cut, held, counted) = (cut.clone(), connections.clone(), refused.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if is_cut.load(Ordering::SeqCst) {
                    counted.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                }
                let upstream = upstream.clone();
                held.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                }));
            }
        });
        TcpProxy {
            port,
            cut,
            refused,
            connections,
            accept,
        }
    }

    /// The server "goes away": every connection through the proxy closes
    /// and new ones are closed as soon as they open.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }

    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// How many connections were closed at once while the proxy was cut:
    /// the calls a client tried while the server was away.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

/// What a [`FaultProxy`] does with the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    /// Forwarded at once.
    Pass,
    /// Every chunk, either way, waits this long before it is forwarded;
    /// connections stay open.
    Stall(Duration),
    /// Every connection closed; new ones closed as soon as they open.
    Cut,
}

/// What a [`FaultProxy`] has done, for a test to show that a fault it
/// injected really took effect.
#[derive(Debug, Default)]
struct FaultCounts {
    /// Connections closed because the proxy was cut, open ones and new ones.
    closed: AtomicUsize,
    /// Chunks forwarded late because the proxy was stalled.
    delayed: AtomicUsize,
}

struct FaultState {
    upstream: String,
    flow: Mutex<Flow>,
    counts: FaultCounts,
    connections: Mutex<Vec<JoinHandle<()>>>,
}

impl FaultState {
    fn flow(&self) -> Flow {
        *self.flow.lock().unwrap()
    }
}

/// A TCP proxy on 127.0.0.1 in front of a server on 127.0.0.1 (PostgreSQL,
/// Redis, moto) that can be cut, stalled (each chunk held for a while, the
/// connections kept open: a server or network that answers slowly) and
/// restored, for the fault-injection scenarios (`tests/api/faults.rs`).
pub struct FaultProxy {
    pub port: u16,
    state: Arc<FaultState>,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy forwarding to `upstream` (`127.0.0.1:PORT` or
    /// `localhost:PORT`: these proxies never reach past loopback).
    pub async fn start(upstream: &str) -> FaultProxy {
        assert!(
            upstream.starts_with("127.0.0.1:") || upstream.starts_with("localhost:"),
            "a fault proxy forwards to loopback only, not to {upstream:?}"
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(FaultState {
            upstream: upstream.to_owned(),
            flow: Mutex::new(Flow::Pass),
            counts: FaultCounts::default(),
            connections: Mutex::default(),
        });
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if shared.flow() == Flow::Cut {
                    shared.counts.closed.fetch_add(1, Ordering::SeqCst);
                    drop(client);
                    continue;
                }
                let connection = tokio::spawn(relay(client, shared.clone()));
                let mut held = shared.connections.lock().unwrap();
                held.retain(|task| !task.is_finished());
                held.push(connection);
            }
        });
        FaultProxy {
            port,
            state,
            accept,
        }
    }

    /// `127.0.0.1:PORT`, to put in a URL in place of the upstream's.
    pub fn authority(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The server "goes away": every connection through the proxy closes
    /// and new ones are closed as soon as they open, until
    /// [`FaultProxy::restore`].
    pub fn cut(&self) {
        *self.state.flow.lock().unwrap() = Flow::Cut;
        for connection in self.state.connections.lock().unwrap().drain(..) {
            if !connection.is_finished() {
                self.state.counts.closed.fetch_add(1, Ordering::SeqCst);
            }
            connection.abort();
        }
    }

    /// The server answers slowly: until [`FaultProxy::restore`], every chunk
    /// read from either side waits `per_chunk` before it is passed on (the
    /// next one is read after that). Connections stay open, new ones are
    /// taken.
    pub fn stall(&self, per_chunk: Duration) {
        *self.state.flow.lock().unwrap() = Flow::Stall(per_chunk);
    }

    /// Back to forwarding at once.
    pub fn restore(&self) {
        *self.state.flow.lock().unwrap() = Flow::Pass;
    }

    /// Connections closed because the proxy was cut, so far.
    pub fn closed(&self) -> usize {
        self.state.counts.closed.load(Ordering::SeqCst)
    }

    /// Chunks held back because the proxy was stalled, so far.
    pub fn delayed(&self) -> usize {
        self.state.counts.delayed.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for connection in self.state.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

/// Carries one connection both ways until either side closes (or the task
/// is aborted by a cut).
async fn relay(client: tokio::net::TcpStream, state: Arc<FaultState>) {
    let Ok(server) = tokio::net::TcpStream::connect(&state.upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::join!(
        pump(client_read, server_write, &state),
        pump(server_read, client_write, &state),
    );
}

/// Copies `from` to `to` chunk by chunk, each held for the stall when the
/// proxy is stalled; shuts `to` down when `from` ends.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: &FaultState,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        match state.flow() {
            Flow::Pass => {}
            Flow::Stall(per_chunk) => {
                state.counts.delayed.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(per_chunk).await;
            }
            // A connection that opened as the cut began (and so escaped
            // it) ends at its next chunk.
            Flow::Cut => break,
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
