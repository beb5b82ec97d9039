//! The command line: one binary, one subcommand per role or admin tool.

use clap::{Parser, Subcommand};

use crate::roles::activity::CreateArgs;
use crate::roles::bench::BenchArgs;

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
    /// Order-create consumer group (one PostgreSQL transaction per batch).
    Consume {
        /// Batches taken from the broker at once (default: the worker budget from `pg.*`).
        /// Transactions at once never exceed the budget, whatever this says.
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
    Reconcile(crate::roles::reconcile::ReconcileArgs),
    /// Dead letters: list, show, replay, discard.
    Dlq {
        #[command(subcommand)]
        command: crate::roles::dlq::DlqCommand,
    },
    /// Flash-sale activities.
    Activity {
        #[command(subcommand)]
        command: ActivityCommand,
    },
    /// Load generator against a running API, drain wait and invariant check.
    Bench(BenchArgs),
    /// Order-consumer throughput: fill a backlog (Redis reservations + broker batches) and
    /// time how fast a running `seckill consume` turns it into orders.
    BenchBacklog(crate::roles::bench_backlog::BacklogArgs),
    /// The broker's raw send rate, one message per call or in batches.
    BenchBroker(crate::roles::bench_broker::BrokerArgs),
    /// For benchmarks only: the same route served straight from PostgreSQL (UPDATE stock +
    /// INSERT order per request), the design this project is compared with.
    BaselineApi(crate::roles::baseline::BaselineArgs),
}

#[derive(Debug, Subcommand)]
pub enum TopicsCommand {
    /// Create every topic of the pipeline with its queue count (idempotent).
    Create,
}

#[derive(Debug, Subcommand)]
pub enum ActivityCommand {
    /// Create an activity and its SKU stock, and warm Redis (idempotent).
    Create(CreateArgs),
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
