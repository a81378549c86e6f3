//! The `fairlane` command: parses arguments and calls the library.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use utoipa::OpenApi;

/// The accept path allocates and frees many small buffers per request
/// across threads; mimalloc does that with less contention than glibc's
/// allocator (see bench/README.md for the measured difference).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The environment `serve` and `admin-token` read, shown under `--help`.
/// The book's "Configuration" (docs/src/configuration.md, "Environment
/// variables") lists the same names; a test keeps the two in step.
const ENVIRONMENT: &str = "\
Environment:
  FAIRLANE_CONFIG          the configuration file, when --config is not given
  FAIRLANE__SECTION__KEY   overrides one setting over the file and the built-in
                           defaults: double underscores between levels, e.g.
                           FAIRLANE__SERVER__LISTEN=0.0.0.0:8080 sets
                           server.listen (docs/src/reference/configuration.md)
  RUST_LOG                 serve: log filter, default \"info\" (e.g. \"fairlane=debug\")
  FAIRLANE_LOG_FORMAT      serve: \"json\" writes the log as JSON lines
  OTEL_RESOURCE_ATTRIBUTES serve, with telemetry.otlp_endpoint: attributes of
                           the spans' resource (service.instance.id=api-1)
  AWS_REGION, AWS_PROFILE, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
  AWS_SESSION_TOKEN        the standard AWS chain, for SQS and SES only";

#[derive(Parser)]
#[command(
    name = "fairlane",
    version,
    about = "Multi-tenant notification gateway",
    after_help = ENVIRONMENT
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the API and the lane consumers.
    #[command(after_help = ENVIRONMENT)]
    Serve {
        /// TOML file layered over the built-in defaults (see
        /// config/default.toml); environment variables override both.
        #[arg(long, env = "FAIRLANE_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Print the OpenAPI document (JSON) to stdout.
    Openapi,
    /// Read the AWS account's queues (never change them) and report each
    /// way they differ from the configuration; exit status 1 when any does.
    #[command(after_help = ENVIRONMENT)]
    CheckAws {
        /// The configuration file `serve` runs with.
        #[arg(long, env = "FAIRLANE_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Generate a new admin token, store its hash and print it.
    #[command(after_help = ENVIRONMENT)]
    AdminToken {
        /// The configuration file `serve` runs with, so the token's hash goes
        /// to the same store (`storage.url`); environment variables override
        /// it as for `serve`.
        #[arg(long, env = "FAIRLANE_CONFIG")]
        config: Option<PathBuf>,
        /// Required: replaces the current generated token.
        #[arg(long)]
        rotate: bool,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Openapi => {
            println!("{}", fairlane::api::ApiDoc::openapi().to_pretty_json()?);
            Ok(())
        }
        Command::CheckAws { config } => {
            let settings = fairlane::config::Settings::load(config.as_deref())?;
            let problems = tokio::runtime::Runtime::new()?
                .block_on(fairlane::queue::sqs::check::check(&settings))?;
            for problem in &problems {
                println!("{problem}");
            }
            if problems.is_empty() {
                println!("The queues match the configuration.");
                Ok(())
            } else {
                eprintln!("{} mismatch(es) with the configuration.", problems.len());
                std::process::exit(1);
            }
        }
        Command::Serve { config } => {
            let settings = fairlane::config::Settings::load(config.as_deref())?;
            let telemetry = fairlane::telemetry::init(&settings.telemetry)?;
            let runtime = tokio::runtime::Runtime::new()?;
            let served = runtime.block_on(fairlane::app::serve(settings));
            // The runtime's tasks end first; the last spans are exported then.
            drop(runtime);
            drop(telemetry);
            served
        }
        Command::AdminToken { config, rotate } => {
            anyhow::ensure!(rotate, "pass --rotate to replace the generated admin token");
            let settings = fairlane::config::Settings::load(config.as_deref())?;
            tokio::runtime::Runtime::new()?.block_on(async {
                let db =
                    fairlane::store::Db::connect(&settings.storage.url, settings.storage.fsync)
                        .await?;
                let token = fairlane::api::auth::AdminAuth::rotate(&db).await?;
                db.close().await;
                if settings.server.admin_token.is_some() {
                    eprintln!(
                        "note: server.admin_token is set, and it takes precedence over this token"
                    );
                }
                println!("{token}");
                anyhow::Ok(())
            })
        }
    }
}
