//! The command line: one binary, one subcommand per role or admin tool.

use std::future::Future;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Settings, TelemetrySettings};
use crate::roles;
use crate::roles::ops::activity::CreateArgs;
use crate::roles::ops::dev_credentials::{self, PaymentCommand, TokenCommand};
use crate::roles::ops::resync::ResyncArgs;

#[derive(Debug, Parser)]
#[command(
    name = "seckill",
    version,
    about = "Flash-sale order pipeline: Redis → RocketMQ → PostgreSQL"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// HTTP API: reserve, query; /metrics, /healthz, /readyz.
    Api,
    /// Order-create consumer group (the broker's batches gathered into PostgreSQL transactions).
    Consume {
        /// Batches taken from the broker at once (default: `consumer.listener_calls`).
        /// Transactions at once never exceed the worker budget, whatever this says.
        #[arg(long)]
        workers: Option<usize>,
    },
    /// Consumer of the delay topic: conditional cancel of unpaid expired orders.
    TimeoutCancel,
    /// Reservation re-send scanner and outbox relay (several instances are safe).
    Scan,
    /// Apply the database migrations in `sql/`.
    Migrate(crate::roles::ops::migrate::MigrateArgs),
    /// Broker topics.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// One-shot drift check (cron / systemd timer): emits missing events, changes no business state.
    Reconcile(crate::roles::ops::reconcile::ReconcileArgs),
    /// Dead letters: list, show, replay, discard.
    Dlq {
        #[command(subcommand)]
        command: crate::roles::ops::dlq::DlqCommand,
    },
    /// The archive retention writes before it deletes: list, verify, restore.
    Archive {
        #[command(subcommand)]
        command: crate::roles::ops::archive::ArchiveCommand,
    },
    /// The event outbox: requeue DEAD rows.
    Outbox {
        #[command(subcommand)]
        command: crate::roles::ops::outbox::OutboxCommand,
    },
    /// Refunds owed for payments no order could take: list, mark refunded.
    Refunds {
        #[command(subcommand)]
        command: crate::roles::ops::refunds::RefundsCommand,
    },
    /// Development buyer tokens (refused in PROD).
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Development payment notifications (refused in PROD).
    Payment {
        #[command(subcommand)]
        command: PaymentCommand,
    },
    /// The PostgreSQL connections the fleet opens, role by role, against pg.max_connections
    /// (exit 1 when over).
    Budget {
        #[arg(long)]
        json: bool,
    },
    /// A fleet for a target (peak requests/s, units, SKUs, activities), from the per-core
    /// costs `make bench` measured (docs/SCALING.md).
    Plan(crate::plan::Target),
    /// Flash-sale activities.
    Activity {
        #[command(subcommand)]
        command: ActivityCommand,
    },
}

impl Command {
    /// A long-running role (its log is its output, to stdout for journald or a file), as
    /// opposed to a one-shot operator tool (stdout is its report; its log goes to stderr).
    pub fn is_role(&self) -> bool {
        self.role_name().is_some()
    }

    /// The role's name as `seckill budget` prints it (`None`: a one-shot command).
    pub fn role_name(&self) -> Option<&'static str> {
        match self {
            Command::Api => Some("api"),
            Command::Consume { .. } => Some("consume"),
            Command::TimeoutCancel => Some("timeout-cancel"),
            Command::Scan => Some("scan"),
            _ => None,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum TopicsCommand {
    /// Create every topic of the pipeline with its queue count (idempotent).
    Create,
    /// Delete every topic of this environment (its retry and dead-letter topics too) and the
    /// messages in them: for a scratch environment a test, bench or soak run left behind.
    Delete {
        /// The environment's name again (`env`), to confirm.
        #[arg(long)]
        confirm: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ActivityCommand {
    /// Create an activity and its SKU stock, and warm Redis (idempotent).
    Create(CreateArgs),
    /// Rebuild the activity's Redis state from PostgreSQL (stock, buyers, request ids):
    /// fence, wait for the backlog, rebuild, resume; `--dry-run` first (audited).
    Resync(ResyncArgs),
}

/// The `seckill` binary's whole body: parse the command line, then run the command under
/// [`run_process`]. It lives here, not in `main.rs`, so the roles' futures are compiled once
/// in this crate instead of again in the binary that polls them (a release build spends
/// minutes on that copy).
pub fn main() -> ExitCode {
    // Failpoints from the FAILPOINTS variable, only in builds for the fault tests.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    // A role's log is its output (stdout: a file or journald); a tool's stdout is its report,
    // so its log goes to stderr.
    let logs = if cli.command.is_role() {
        crate::telemetry::init_logs
    } else {
        crate::telemetry::init_logs_to_stderr
    };
    let role = cli.command.is_role();
    // PostgreSQL sees which part of the fleet holds each connection (`application_name`): a
    // role's name, or `ops` for every one-shot command (`seckill budget`'s operators).
    let connections_of = cli.command.role_name().unwrap_or("ops");
    // A role refuses to start when the fleet's pools do not fit the database (exit 2, naming
    // pg.max_connections): `seckill budget` prints the figures.
    let check = if role {
        |s: &Settings| s.connection_budget().check()
    } else {
        |_: &Settings| Ok(())
    };
    run_process_checked("seckill", logs, check, |settings| async move {
        crate::pg::name_connections(connections_of, &settings.env);
        if role {
            crate::mq::check_name_servers(&settings.mq).await?;
            crate::mq::watch_name_servers(&settings.mq);
        }
        match cli.command {
            Command::Api => roles::api::run(settings).await.map(|_| true),
            Command::Consume { workers } => {
                roles::consume::run(settings, workers).await.map(|_| true)
            }
            Command::TimeoutCancel => roles::timeout_cancel::run(settings).await.map(|_| true),
            Command::Scan => roles::scan::run(settings).await.map(|_| true),
            Command::Migrate(args) => roles::ops::migrate::run(settings, args).await.map(|_| true),
            Command::Topics {
                command: TopicsCommand::Create,
            } => roles::ops::topics::run(settings).await.map(|_| true),
            Command::Topics {
                command: TopicsCommand::Delete { confirm },
            } => roles::ops::topics::delete(settings, &confirm).await,
            Command::Activity {
                command: ActivityCommand::Create(args),
            } => roles::ops::activity::create(&settings, &args)
                .await
                .map(|_| true),
            Command::Activity {
                command: ActivityCommand::Resync(args),
            } => roles::ops::resync::run(settings, args).await,
            Command::Reconcile(args) => roles::ops::reconcile::run(settings, args).await,
            Command::Dlq { command } => roles::ops::dlq::run(settings, command).await,
            Command::Archive { command } => roles::ops::archive::run(settings, command).await,
            Command::Outbox { command } => roles::ops::outbox::run(settings, command).await,
            Command::Refunds { command } => roles::ops::refunds::run(settings, command).await,
            Command::Token {
                command: TokenCommand::Mint(args),
            } => dev_credentials::mint(&settings, &args).map(|_| true),
            Command::Token {
                command: TokenCommand::Keygen(args),
            } => dev_credentials::keygen(&args).map(|_| true),
            Command::Payment {
                command: PaymentCommand::Sign(args),
            } => dev_credentials::sign_notification(&settings, &args).map(|_| true),
            Command::Budget { json } => print_budget(&settings, json),
            Command::Plan(target) => crate::plan::run(&settings, &target),
        }
    })
}

/// `seckill budget`: the connection budget as a table (or JSON); false when over.
fn print_budget(settings: &Settings, json: bool) -> anyhow::Result<bool> {
    let budget = settings.connection_budget();
    if json {
        println!("{}", serde_json::to_string_pretty(&budget)?);
    } else {
        print!("{}", budget.table());
    }
    if let Err(e) = budget.check() {
        eprintln!("seckill: {e}");
        return Ok(false);
    }
    Ok(true)
}

/// [`run_process_checked`] with no check past the configuration's own.
pub fn run_process<F, Fut>(name: &str, logs: fn(&TelemetrySettings), command: F) -> ExitCode
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    run_process_checked(name, logs, |_| Ok(()), command)
}

/// What a binary of this project does around its command: load the configuration (exit 2
/// naming the bad key), start the logs with `logs` and the metrics recorder, run `command` on
/// a multi-threaded runtime, and turn its result into the exit code (`Ok(false)`: failure
/// already reported; `Err`: printed with its causes). `check` is what the command needs of
/// the configuration beyond its own validity (exit 2 as well).
pub fn run_process_checked<F, Fut>(
    name: &str,
    logs: fn(&TelemetrySettings),
    check: fn(&Settings) -> Result<(), crate::config::ConfigError>,
    command: F,
) -> ExitCode
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let settings = match Settings::load().and_then(|s| check(&s).map(|_| s)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{name}: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    logs(&settings.telemetry);
    for deprecated in settings.pg.deprecations() {
        tracing::warn!("{deprecated}");
    }
    // One TLS and one token-signature backend for the whole process, before any client asks
    // (an HTTP client built before a provider is installed panics).
    crate::tls::install_crypto_provider();
    crate::auth::install_crypto();
    // The recorder goes in before the command records its first metric.
    let _ = crate::telemetry::metrics_handle();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{name}: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(command(settings)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn verify_cli() {
        Cli::command().debug_assert();
    }
}
