//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default `info`),
//! as text or, with `FAIRLANE_LOG_FORMAT=json`, as JSON lines. Levels and
//! the lines an operator follows are described in README.md ("Logging").

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; a second call is a no-op.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("FAIRLANE_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    // Colours only on a terminal: in `docker logs`, a file or a log shipper
    // the escape codes would sit inside field names and values (the
    // generated admin token among them).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
