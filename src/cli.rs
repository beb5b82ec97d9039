//! The command line: one binary, one subcommand per role or admin tool.

use std::future::Future;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::{Settings, TelemetrySettings};
use crate::roles::ops::activity::CreateArgs;
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
    Migrate,
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
    /// The event outbox: requeue DEAD rows.
    Outbox {
        #[command(subcommand)]
        command: crate::roles::ops::outbox::OutboxCommand,
    },
    /// Development buyer tokens (refused in PROD).
    Token {
        #[command(subcommand)]
        command: crate::roles::ops::dev_credentials::TokenCommand,
    },
    /// Development payment notifications (refused in PROD).
    Payment {
        #[command(subcommand)]
        command: crate::roles::ops::dev_credentials::PaymentCommand,
    },
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
        matches!(
            self,
            Command::Api | Command::Consume { .. } | Command::TimeoutCancel | Command::Scan
        )
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

/// What a binary of this project does around its command: load the configuration (exit 2
/// naming the bad key), start the logs with `logs` and the metrics recorder, run `command` on
/// a multi-threaded runtime, and turn its result into the exit code (`Ok(false)`: failure
/// already reported; `Err`: printed with its causes).
pub fn run_process<F, Fut>(name: &str, logs: fn(&TelemetrySettings), command: F) -> ExitCode
where
    F: FnOnce(Settings) -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let settings = match Settings::load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{name}: invalid configuration: {e}");
            return ExitCode::from(2);
        }
    };
    logs(&settings.telemetry);
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
