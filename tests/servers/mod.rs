//! The servers the tests need, found or started once per test process:
//! moto (SQS and SES), a Python with the Standard Webhooks library, Redis
//! and PostgreSQL. Shared by the integration tests (`tests/api/main.rs`)
//! and the library's unit tests (`src/lib.rs`, through `#[path]`).
//!
//! - moto: `FAIRLANE_TEST_SQS_URL` when set; otherwise `moto_server` from the
//!   pinned venv below, on a free 127.0.0.1 port.
//! - The webhook verifier's Python: `FAIRLANE_TEST_PYTHON` when set;
//!   otherwise the venv's.
//! - Redis: `FAIRLANE_TEST_REDIS_URL` when set; otherwise the one on
//!   `redis://127.0.0.1:6379` if it answers, else a `redis-server` of our
//!   own on a free port, without persistence.
//! - PostgreSQL: `FAIRLANE_TEST_PG_URL` when set; otherwise
//!   `postgres://root@127.0.0.1:5432/postgres` if it answers, else a cluster
//!   of our own (`initdb` in a temporary directory, trust authentication,
//!   `pg_ctl start` on a free port; as the `postgres` user when we are root).
//!
//! The venv (`moto[server]` and `standardwebhooks`, pinned) lives in
//! `$XDG_CACHE_HOME/fairlane-test-venv` (or `$HOME/.cache/…`) and is made,
//! under a file lock, when missing or at other versions.
//!
//! - ChromeDriver, for the console's browser tests: `FAIRLANE_TEST_WEBDRIVER_URL`
//!   when set; otherwise Debian's `chromedriver` (package `chromium-driver`,
//!   driving the `chromium` package headless) on a free 127.0.0.1 port.
//!
//! `FAIRLANE_TEST_START_OWN` (a comma-separated list of `moto`, `redis`,
//! `postgres`, or `all`) starts our own server even where a variable or
//! the default names one that answers: a way to exercise the start-up paths.
//!
//! Everything started here is watched by a guardian, a small `sh` whose
//! stdin is a pipe only this process holds: when the process ends, however
//! it ends, the pipe closes and the guardian stops the servers by their PIDs
//! (PostgreSQL with `pg_ctl stop -m immediate` first) and removes their
//! temporary directory.

#![allow(dead_code)] // each test binary uses its own part of this

use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub const MOTO_VERSION: &str = "5.2.5";
pub const STANDARDWEBHOOKS_VERSION: &str = "1.1.0";
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
pub const DEFAULT_PG_URL: &str = "postgres://root@127.0.0.1:5432/postgres";
/// The superuser of a PostgreSQL cluster started here.
const OWN_PG_USER: &str = "fairlane";

/// moto's base URL (SQS and SES).
pub fn sqs_url() -> String {
    static URL: OnceLock<Result<String, String>> = OnceLock::new();
    shared(&URL, || match configured("FAIRLANE_TEST_SQS_URL", "moto") {
        Some(url) => Ok(url),
        None => start_moto(),
    })
}

/// The base URL of a moto server of the caller's own, started now (and
/// stopped when the test process ends): for a test whose figures depend
/// on moto's pace, which other tests on the shared server would slow
/// (moto's ReceiveMessage costs about 1.7 ms per message in the queue).
pub fn own_sqs_url() -> String {
    start_moto().unwrap_or_else(|err| panic!("could not start a moto server of its own: {err}"))
}

/// A Python with the `standardwebhooks` package, for the webhook verifier.
pub fn python() -> String {
    static PYTHON: OnceLock<Result<String, String>> = OnceLock::new();
    shared(&PYTHON, || match nonempty_var("FAIRLANE_TEST_PYTHON") {
        Some(python) => Ok(python),
        None => Ok(venv()?.join("bin/python").to_string_lossy().into_owned()),
    })
}

/// The Redis the tests count limits in.
pub fn redis_url() -> String {
    static URL: OnceLock<Result<String, String>> = OnceLock::new();
    shared(&URL, || {
        if let Some(url) = configured("FAIRLANE_TEST_REDIS_URL", "redis") {
            return Ok(url);
        }
        if !start_own("redis") && redis_answers(DEFAULT_REDIS_URL) {
            return Ok(DEFAULT_REDIS_URL.to_owned());
        }
        start_redis()
    })
}

/// A PostgreSQL server (its URL names the `postgres` database) where the
/// tests may create databases.
pub fn pg_url() -> String {
    static URL: OnceLock<Result<String, String>> = OnceLock::new();
    shared(&URL, || {
        if let Some(url) = configured("FAIRLANE_TEST_PG_URL", "postgres") {
            return Ok(url);
        }
        if !start_own("postgres") && pg_answers(DEFAULT_PG_URL) {
            return Ok(DEFAULT_PG_URL.to_owned());
        }
        start_postgres()
    })
}

/// What to run when the browser tests find no Chromium.
pub const CHROMIUM_INSTALL: &str = "apt-get install -y chromium chromium-driver";

/// A WebDriver server driving a headless Chromium.
pub fn webdriver_url() -> String {
    static URL: OnceLock<Result<String, String>> = OnceLock::new();
    shared(&URL, || {
        if let Some(url) = nonempty_var("FAIRLANE_TEST_WEBDRIVER_URL") {
            return Ok(url);
        }
        let missing = |what: &str| {
            format!(
                "the console's browser tests need {what}, which is not on PATH: run `{CHROMIUM_INSTALL}` (Debian's packages; .ci/run does it)"
            )
        };
        find_program("chromium").ok_or_else(|| missing("chromium"))?;
        let driver = find_program("chromedriver").ok_or_else(|| missing("chromedriver"))?;
        let port = start_server(
            "chromedriver",
            &driver,
            |port, _| vec![format!("--port={port}"), "--allowed-ips=127.0.0.1".into()],
            Duration::from_secs(30),
            |port| TcpStream::connect(("127.0.0.1", port)).is_ok(),
        )?;
        Ok(format!("http://127.0.0.1:{port}"))
    })
}

/// axe-core's version, from the npm registry: the accessibility rules the
/// console's browser tests run in each page.
pub const AXE_VERSION: &str = "4.14.1";

/// The source of axe-core (`axe.min.js`) to run in a page: from
/// `FAIRLANE_TEST_AXE_JS`, else installed with npm into the cache when
/// it is not there yet (once per machine).
pub fn axe_source() -> String {
    static SOURCE: OnceLock<Result<String, String>> = OnceLock::new();
    shared(&SOURCE, || {
        let path = match nonempty_var("FAIRLANE_TEST_AXE_JS") {
            Some(path) => PathBuf::from(path),
            None => {
                let root = cache_dir().join(format!("fairlane-axe-{AXE_VERSION}"));
                let path = root.join("node_modules/axe-core/axe.min.js");
                if !path.is_file() {
                    let npm = find_program("npm").ok_or(
                        "the console's accessibility checks need axe-core, installed with npm, which is not on PATH",
                    )?;
                    std::fs::create_dir_all(&root)
                        .map_err(|err| format!("cannot create {}: {err}", root.display()))?;
                    let installed = Command::new(npm)
                        .args(["install", "--no-audit", "--no-fund", "--silent", "--prefix"])
                        .arg(&root)
                        .arg(format!("axe-core@{AXE_VERSION}"))
                        .stdin(Stdio::null())
                        .status()
                        .map_err(|err| format!("npm did not run: {err}"))?;
                    if !installed.success() || !path.is_file() {
                        return Err(format!(
                            "npm install axe-core@{AXE_VERSION} into {} failed ({installed})",
                            root.display()
                        ));
                    }
                }
                path
            }
        };
        std::fs::read_to_string(&path)
            .map_err(|err| format!("cannot read axe-core at {}: {err}", path.display()))
    })
}

/// For a test that reads the standard AWS credential chain (environment
/// variables), which a test must not set in its own process: in the test
/// process, runs test `name` of `module` (`module_path!()`) again in a child
/// process of this test binary with `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`
/// and `AWS_REGION` set (any values work with moto) and the same moto, fails
/// unless it passed there, and returns `false`; in that child, returns `true`:
/// the test runs its body.
pub fn in_child_with_aws_env(module: &str, name: &str) -> bool {
    const MARK: &str = "FAIRLANE_TEST_AWS_CHILD";
    let module = module.split_once("::").map_or("", |(_, rest)| rest);
    let test = if module.is_empty() {
        name.to_owned()
    } else {
        format!("{module}::{name}")
    };
    if std::env::var(MARK).is_ok_and(|marked| marked == test) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = Command::new(exe)
        .args([test.as_str(), "--exact", "--test-threads=1"])
        .env(MARK, &test)
        .env("FAIRLANE_TEST_SQS_URL", sqs_url())
        .env_remove("FAIRLANE_TEST_START_OWN")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .stdin(Stdio::null())
        .output()
        .expect("run the test binary again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test} with the AWS chain's variables set, in a child process: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    false
}

// ----- configuration -----

/// The value every test of this process shares, made once; a failure is
/// kept too, so every test needing it fails with the same message.
fn shared<T: Clone>(
    cell: &OnceLock<Result<T, String>>,
    init: impl FnOnce() -> Result<T, String>,
) -> T {
    match cell.get_or_init(init) {
        Ok(value) => value.clone(),
        Err(err) => panic!("{err}"),
    }
}

fn nonempty_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|value| !value.is_empty())
}

/// `FAIRLANE_TEST_START_OWN` names `what` (or `all`).
fn start_own(what: &str) -> bool {
    nonempty_var("FAIRLANE_TEST_START_OWN").is_some_and(|list| {
        list.split(',')
            .map(str::trim)
            .any(|item| item == what || item == "all")
    })
}

/// The variable `name` unless empty or overridden by `FAIRLANE_TEST_START_OWN`.
fn configured(name: &str, what: &str) -> Option<String> {
    nonempty_var(name).filter(|_| !start_own(what))
}

/// A line on the terminal, not captured by the test harness: what is being
/// started (or installed) and where.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "fairlane tests: {line}");
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|err| format!("no free port on 127.0.0.1: {err}"))
}

/// A temporary directory for one server's files; the guardian removes it.
fn scratch_dir(what: &str) -> Result<PathBuf, String> {
    tempfile::Builder::new()
        .prefix(&format!("fairlane-test-{what}-"))
        .tempdir()
        .map(|dir| dir.keep())
        .map_err(|err| format!("cannot make a temporary directory for {what}: {err}"))
}

/// The last lines of a log file, for an error message.
fn tail(path: &Path) -> String {
    let text = std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// `program` cannot be run: not installed (or not on PATH).
fn missing(err: &std::io::Error) -> bool {
    err.kind() == std::io::ErrorKind::NotFound
}

// ----- the guardian -----

/// Runs a server (`$2`, `$3`, … with its output in `$1/log`) as its child
/// and stops it when this test process ends: the end closes the guardian's
/// stdin, a pipe only this process holds. The server's PID goes to `$1/pid`
/// and its exit status, once reaped, to `$1/exited`; until then the PID
/// cannot be another process's, so SIGTERM (and SIGKILL 5 s later) reach
/// only the server. Then the directory is removed.
///
/// A background list's stdin is /dev/null in a non-interactive shell, so
/// the watcher reads the pipe through fd 3.
const SERVER_GUARDIAN: &str = r#"
trap '' INT HUP
dir=$1; shift
"$@" </dev/null >"$dir/log" 2>&1 &
pid=$!
echo "$pid" >"$dir/pid"
exec 3<&0
(
  while IFS= read -r _; do :; done
  [ -e "$dir/exited" ] || kill -TERM "$pid" 2>/dev/null
  n=0
  while [ ! -e "$dir/exited" ] && [ "$n" -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
  [ -e "$dir/exited" ] || kill -KILL "$pid" 2>/dev/null
) <&3 &
watcher=$!
wait "$pid"
echo "$?" >"$dir/exited"
wait "$watcher"
rm -rf "$dir"
"#;

/// Guardians' stdin pipes, held open for the life of the process.
static GUARDED: Mutex<Vec<ChildStdin>> = Mutex::new(Vec::new());

/// Starts `sh -c script guardian args…` with its stdin a pipe this process
/// holds until it ends.
fn start_guardian<S: AsRef<OsStr>>(script: &str, args: &[S]) -> Result<(), String> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("fairlane-test-guardian")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Out of the terminal's process group: a Ctrl-C ends the tests,
        // and the guardian cleans up after them.
        .process_group(0)
        .spawn()
        .map_err(|err| format!("cannot start sh for a test server's guardian: {err}"))?;
    let stdin = child.stdin.take().expect("piped stdin");
    GUARDED
        .lock()
        .unwrap_or_else(|err| err.into_inner())
        .push(stdin);
    Ok(())
}

/// `program` as found on PATH (or as given, when it holds a slash).
fn find_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        return Path::new(program).is_file().then(|| PathBuf::from(program));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Starts `program args(port, its directory)` under a guardian, on a free
/// port, until `ready(port)`; returns the port. Three tries: another process
/// may take the port between our look and the server's bind.
fn start_server(
    what: &str,
    program: &Path,
    args: impl Fn(u16, &Path) -> Vec<String>,
    timeout: Duration,
    ready: impl Fn(u16) -> bool,
) -> Result<u16, String> {
    let mut failures = Vec::new();
    for _ in 0..3 {
        let port = free_port()?;
        let dir = scratch_dir(what)?;
        let mut argv = vec![dir.clone().into_os_string(), program.into()];
        argv.extend(args(port, &dir).into_iter().map(Into::into));
        start_guardian(SERVER_GUARDIAN, &argv)?;
        let deadline = Instant::now() + timeout;
        loop {
            if ready(port) {
                let pid = std::fs::read_to_string(dir.join("pid")).unwrap_or_default();
                say(&format!(
                    "started {what} on 127.0.0.1:{port} (pid {}, files in {})",
                    pid.trim(),
                    dir.display()
                ));
                return Ok(port);
            }
            if let Ok(status) = std::fs::read_to_string(dir.join("exited")) {
                failures.push(format!(
                    "{what} on port {port} exited (status {}):\n{}",
                    status.trim(),
                    tail(&dir.join("log"))
                ));
                break;
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{what} on port {port} did not answer within {} s:\n{}",
                    timeout.as_secs(),
                    tail(&dir.join("log"))
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Err(failures.join("\n"))
}

// ----- the venv: moto and standardwebhooks -----

fn cache_dir() -> PathBuf {
    if let Some(dir) = nonempty_var("XDG_CACHE_HOME") {
        return PathBuf::from(dir);
    }
    match nonempty_var("HOME") {
        Some(home) => Path::new(&home).join(".cache"),
        None => std::env::temp_dir(),
    }
}

/// The pinned venv, made (once per machine) when missing or outdated.
fn venv() -> Result<PathBuf, String> {
    static VENV: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    VENV.get_or_init(|| {
        let cache = cache_dir();
        let venv = cache.join("fairlane-test-venv");
        if venv_is_current(&venv) {
            return Ok(venv);
        }
        std::fs::create_dir_all(&cache)
            .map_err(|err| format!("cannot create {}: {err}", cache.display()))?;
        let lock_path = cache.join("fairlane-test-venv.lock");
        let lock = File::create(&lock_path)
            .map_err(|err| format!("cannot create {}: {err}", lock_path.display()))?;
        // Another test binary may be installing at this moment: wait for
        // it, then look again.
        let locked = lock.lock();
        locked.map_err(|err| format!("cannot lock {}: {err}", lock_path.display()))?;
        if venv_is_current(&venv) {
            return Ok(venv);
        }
        install_venv(&venv)?;
        if !venv_is_current(&venv) {
            return Err(format!(
                "{} still lacks moto[server]=={MOTO_VERSION} or \
                 standardwebhooks=={STANDARDWEBHOOKS_VERSION} after pip install",
                venv.display()
            ));
        }
        Ok(venv)
    })
    .clone()
}

fn venv_is_current(venv: &Path) -> bool {
    let check = format!(
        "import importlib.metadata as m, sys; \
         sys.exit(m.version('moto') != '{MOTO_VERSION}' \
         or m.version('standardwebhooks') != '{STANDARDWEBHOOKS_VERSION}')"
    );
    venv.join("bin/moto_server").is_file()
        && Command::new(venv.join("bin/python"))
            .args(["-c", &check])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
}

fn install_venv(venv: &Path) -> Result<(), String> {
    const INSTALL_PYTHON: &str = "install Python 3 with its venv module (Debian/Ubuntu: \
        apt-get install python3 python3-venv), or set FAIRLANE_TEST_SQS_URL to a running moto \
        and FAIRLANE_TEST_PYTHON to a Python with standardwebhooks";
    say(&format!(
        "installing moto[server]=={MOTO_VERSION} and standardwebhooks=={STANDARDWEBHOOKS_VERSION} \
         into {} (once)",
        venv.display()
    ));
    let python_runs = Command::new(venv.join("bin/python"))
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !python_runs {
        let made = Command::new("python3")
            .args(["-m", "venv", "--clear"])
            .arg(venv)
            .stdin(Stdio::null())
            .output()
            .map_err(|err| {
                if missing(&err) {
                    format!(
                        "python3 is not installed: the SQS, SES and webhook tests run moto and \
                         the Standard Webhooks verifier from a venv; {INSTALL_PYTHON}"
                    )
                } else {
                    format!("cannot run python3: {err}")
                }
            })?;
        if !made.status.success() {
            return Err(format!(
                "python3 -m venv {} failed ({}): {}\n{INSTALL_PYTHON}",
                venv.display(),
                made.status,
                String::from_utf8_lossy(&made.stderr).trim()
            ));
        }
    }
    let installed = Command::new(venv.join("bin/python"))
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .arg(format!("moto[server]=={MOTO_VERSION}"))
        .arg(format!("standardwebhooks=={STANDARDWEBHOOKS_VERSION}"))
        .stdin(Stdio::null())
        .output()
        .map_err(|err| format!("cannot run pip in {}: {err}", venv.display()))?;
    if !installed.status.success() {
        return Err(format!(
            "pip install of moto[server]=={MOTO_VERSION} and \
             standardwebhooks=={STANDARDWEBHOOKS_VERSION} into {} failed ({}; it needs PyPI): {}",
            venv.display(),
            installed.status,
            String::from_utf8_lossy(&installed.stderr).trim()
        ));
    }
    Ok(())
}

// ----- moto -----

fn start_moto() -> Result<String, String> {
    let moto_server = venv()?.join("bin/moto_server");
    let port = start_server(
        "moto",
        &moto_server,
        |port, _| {
            vec![
                "-H".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
            ]
        },
        Duration::from_secs(60),
        |port| http_ok(port, "/moto-api/"),
    )?;
    Ok(format!("http://127.0.0.1:{port}"))
}

/// `GET path` on 127.0.0.1:`port` answers 2xx or 3xx.
fn http_ok(port: u16, path: &str) -> bool {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).is_ok()
        && head.starts_with(b"HTTP/1.")
        && matches!(head[9], b'2' | b'3')
}

// ----- Redis -----

fn redis_answers(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    client
        .get_connection_with_timeout(Duration::from_millis(500))
        .and_then(|mut conn| redis::cmd("PING").query::<String>(&mut conn))
        .is_ok()
}

fn start_redis() -> Result<String, String> {
    let redis_server = find_program("redis-server").ok_or_else(|| {
        "redis-server is not installed: the Redis limits tests need it when no Redis answers \
         at redis://127.0.0.1:6379; install Redis (Debian/Ubuntu: apt-get install redis-server; \
         macOS: brew install redis), or set FAIRLANE_TEST_REDIS_URL"
            .to_owned()
    })?;
    let port = start_server(
        "redis-server",
        &redis_server,
        |port, dir| {
            let port = port.to_string();
            let dir = dir.to_string_lossy();
            ["--port", &port, "--bind", "127.0.0.1", "--dir", &dir]
                .into_iter()
                .chain(["--save", "", "--appendonly", "no"])
                .map(str::to_owned)
                .collect()
        },
        Duration::from_secs(10),
        |port| redis_answers(&format!("redis://127.0.0.1:{port}")),
    )?;
    Ok(format!("redis://127.0.0.1:{port}"))
}

// ----- PostgreSQL -----

/// Connecting to `url` works (5 s at most). A thread and a runtime of its
/// own: the caller may be inside a runtime.
fn pg_answers(url: &str) -> bool {
    use sqlx::Connection;
    let url = url.to_owned();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        runtime.block_on(async {
            let connected =
                tokio::time::timeout(Duration::from_secs(5), sqlx::PgConnection::connect(&url));
            let conn = connected.await.ok()?.ok()?;
            conn.close().await.ok()
        })
    })
    .join()
    .ok()
    .flatten()
    .is_some()
}

/// The directory holding `initdb` and `pg_ctl`: on PATH, else the newest
/// `/usr/lib/postgresql/*/bin` (Debian and Ubuntu keep them there).
fn pg_bin_dir() -> Result<PathBuf, String> {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    if let Some(dir) = on_path
        .into_iter()
        .find(|dir| dir.join("initdb").is_file() && dir.join("pg_ctl").is_file())
    {
        return Ok(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            (bin.join("initdb").is_file() && bin.join("pg_ctl").is_file()).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        format!(
            "initdb is not installed (not on PATH nor in /usr/lib/postgresql/*/bin): the \
             PostgreSQL store tests need it when nothing answers at {DEFAULT_PG_URL}; install \
             the PostgreSQL server (Debian/Ubuntu: apt-get install postgresql; macOS: brew \
             install postgresql), or set FAIRLANE_TEST_PG_URL"
        )
    })
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// Runs `command` (already prefixed with `runuser` when needed), its
/// output going to `log`; the error names `what` and carries the log's tail.
fn run_logged(mut command: Command, what: &str, log_path: &Path) -> Result<(), String> {
    let log = File::create(log_path).map_err(|err| format!("{what}'s log: {err}"))?;
    // Not `output()`: the server pg_ctl starts keeps its stdout open.
    let status = command
        .stdin(Stdio::null())
        .stdout(
            log.try_clone()
                .map_err(|err| format!("{what}'s log: {err}"))?,
        )
        .stderr(log)
        .status()
        .map_err(|err| format!("cannot run {what}: {err}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status}):\n{}", tail(log_path)))
    }
}

fn start_postgres() -> Result<String, String> {
    let bin = pg_bin_dir()?;
    let pg_ctl = bin.join("pg_ctl");
    // initdb refuses to run as root: the cluster belongs to `postgres` then.
    let as_user: Vec<&str> = if is_root() {
        if find_program("runuser").is_none() {
            return Err(
                "running as root, the tests start PostgreSQL as the `postgres` user \
                        (initdb refuses root) with runuser, which is missing: install \
                        util-linux, or set FAIRLANE_TEST_PG_URL"
                    .to_owned(),
            );
        }
        vec!["runuser", "-u", "postgres", "--"]
    } else {
        Vec::new()
    };
    let dir = scratch_dir("postgres")?;
    let command = |program: &Path| {
        let mut command = match as_user.split_first() {
            Some((runuser, args)) => {
                let mut command = Command::new(runuser);
                command.args(args).arg(program);
                command
            }
            None => Command::new(program),
        };
        command.env("LC_ALL", "C").current_dir(&dir);
        command
    };
    let data = dir.join("data");
    // When this process ends: an immediate shutdown, SIGKILL to the
    // postmaster's PID should it still run, then the files.
    let mut guardian_args = vec![
        dir.clone().into_os_string(),
        pg_ctl.clone().into_os_string(),
    ];
    guardian_args.extend(as_user.iter().map(std::ffi::OsString::from));
    start_guardian(
        r#"trap '' INT HUP
dir=$1; pg_ctl=$2; shift 2
while IFS= read -r _; do :; done
if [ -f "$dir/data/postmaster.pid" ]; then
  "$@" "$pg_ctl" stop -D "$dir/data" -m immediate -w -t 10 >/dev/null 2>&1
fi
if [ -f "$dir/data/postmaster.pid" ]; then
  { read -r pid && kill -KILL "$pid"; } <"$dir/data/postmaster.pid" 2>/dev/null
fi
rm -rf "$dir""#,
        &guardian_args,
    )?;
    if !as_user.is_empty() {
        let chowned = Command::new("chown")
            .arg("postgres:")
            .arg(&dir)
            .output()
            .map_err(|err| format!("cannot run chown: {err}"))?;
        if !chowned.status.success() {
            return Err(format!(
                "running as root, the tests start PostgreSQL as the `postgres` user (initdb \
                 refuses root), but chown postgres: {} failed: {}",
                dir.display(),
                String::from_utf8_lossy(&chowned.stderr).trim()
            ));
        }
    }
    say(&format!(
        "creating a PostgreSQL cluster in {} ({})",
        data.display(),
        bin.display()
    ));
    let mut initdb = command(&bin.join("initdb"));
    initdb.arg("-D").arg(&data).args([
        "-U",
        OWN_PG_USER,
        "--auth=trust",
        "-E",
        "UTF8",
        "--no-sync",
    ]);
    run_logged(initdb, "initdb", &dir.join("initdb.log"))?;
    let mut last_failure = String::new();
    for _ in 0..3 {
        let port = free_port()?;
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c max_connections=300 \
             -c fsync=off -c synchronous_commit=off -c full_page_writes=off",
            dir.display()
        );
        let mut start = command(&pg_ctl);
        start
            .arg("start")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("postgres.log"))
            .args(["-w", "-t", "60", "-o", &options]);
        // On a failure, the guardian's pg_ctl stop takes care of a server
        // that may have started after all.
        if let Err(err) = run_logged(start, "pg_ctl start", &dir.join("pg_ctl.log")) {
            last_failure = format!("{err}\n{}", tail(&dir.join("postgres.log")));
            continue;
        }
        let pid = std::fs::read_to_string(data.join("postmaster.pid")).unwrap_or_default();
        let url = format!("postgres://{OWN_PG_USER}@127.0.0.1:{port}/postgres");
        if pg_answers(&url) {
            say(&format!(
                "started PostgreSQL on 127.0.0.1:{port} (pid {}, files in {})",
                pid.lines().next().unwrap_or("?"),
                dir.display()
            ));
            return Ok(url);
        }
        return Err(format!(
            "PostgreSQL started on port {port} but does not answer at {url}:\n{}",
            tail(&dir.join("postgres.log"))
        ));
    }
    Err(last_failure)
}
