//! `seckill-bench`: the load generators and the direct-PostgreSQL baseline that `make bench`,
//! `make demo` and `make chaos` drive against a running pipeline. Not part of the product: the
//! production `seckill` binary carries none of it. It reads the same configuration as
//! `seckill` (`config/`, `SECKILL_ENV`, `SECKILL__SECTION__KEY`).

// The RocketMQ client's futures are deeply nested; proving them Send needs a deeper limit.
#![recursion_limit = "256"]

mod backlog;
mod baseline;
mod bench;
mod broker;
mod burst;
mod cpu;
mod crowd;
mod intake;
mod judged;
mod lines;
mod payments;
mod plot;
mod ratios;
mod report;
mod reserve;
mod run;
mod scrape;
mod soak;
mod summary;
mod timers;
mod tokens;
mod verify;
mod wait;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "seckill-bench",
    version,
    about = "Load generators and baselines for seckill's benchmarks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Load generator against a running API, drain wait and invariant check.
    Load(bench::BenchArgs),
    /// Order-consumer throughput: fill a backlog (Redis reservations + broker batches) and
    /// time how fast a running `seckill consume` turns it into orders.
    Backlog(backlog::BacklogArgs),
    /// The broker's raw send rate, one message per call or in batches.
    Broker(broker::BrokerArgs),
    /// The same route served straight from PostgreSQL (UPDATE stock + INSERT order per
    /// request), the design this project is compared with.
    BaselineApi(baseline::BaselineArgs),
    /// A long sale at a steady rate with payments and timeouts, sampled every few seconds
    /// (memory, table sizes, lags, order and cancel ages); last line SOAK OK|FAILED.
    Soak(soak::SoakArgs),
    /// How fast and how late the broker delivers timer messages that fall due together.
    Timers(timers::TimersArgs),
    /// The reservation script's rate for one hot SKU split into stock buckets, and each Redis
    /// primary's share of the calls.
    Reserve(reserve::ReserveRunArgs),
    /// The payment path's ORDER_PAID through the outbox and as a transaction message, side by
    /// side: events/s, notification-to-delivery latency, PostgreSQL work per event.
    Payments(payments::PaymentsArgs),
    /// The arithmetic of `make bench`: reads each scenario's summary line from a directory,
    /// prints the summary and the RATIOS line; non-zero exit when a scenario failed.
    Ratios(ratios::RatiosArgs),
    /// Who gets the units of a contested start: scripted buyers and people against one SKU,
    /// first come or drawn, with or without sale passes; last line CROWD ... people_share=…
    Crowd(crowd::CrowdArgs),
    /// The scenarios of `make bench` in order (after scripts/bench.sh measured the limits),
    /// each a line under the run directory, then the ratios; non-zero exit when one failed.
    Run(run::RunArgs),
    /// What the RocketMQ client's intake costs per message with a handler that does nothing:
    /// the push consumer as `seckill consume` runs it against the client's lite pull consumer;
    /// last lines INTAKE push|pull ... consumer_us_per_msg=…
    Intake(intake::IntakeArgs),
    /// What one buyer-token check costs per algorithm on one core: the signature alone through
    /// each jsonwebtoken backend, and the API's whole check with the token cache off and on.
    Verify(verify::VerifyArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Logs go to stderr: stdout is the report that the scripts read.
    let logs = seckill::telemetry::init_logs_to_stderr;
    seckill::cli::run_process("seckill-bench", logs, |settings| async move {
        match cli.command {
            Command::Load(args) => bench::run(settings, args).await,
            Command::Backlog(args) => backlog::run(settings, args).await,
            Command::Crowd(args) => crowd::run(settings, args).await,
            Command::Intake(args) => intake::run(settings, args).await,
            Command::Broker(args) => broker::run(settings, args).await,
            Command::BaselineApi(args) => baseline::run(settings, args).await.map(|_| true),
            Command::Soak(args) => soak::run(settings, args).await,
            Command::Timers(args) => timers::run(settings, args).await,
            Command::Reserve(args) => reserve::run(settings, args).await,
            Command::Payments(args) => payments::run(settings, args).await,
            Command::Ratios(args) => ratios::run(args),
            Command::Run(args) => run::run(settings, args).await,
            Command::Verify(args) => verify::run(settings, args).await,
        }
    })
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
