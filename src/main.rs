//! Thin entry point: parse the command line, load config, start telemetry, run the role.

// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

use clap::Parser;

use seckill::cli::{ActivityCommand, Cli, Command, TopicsCommand};
use seckill::config::Settings;
use seckill::roles;

fn main() -> std::process::ExitCode {
    // Failpoints from the FAILPOINTS variable, only in builds for the fault tests.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    let settings = match Settings::load() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("seckill: invalid configuration: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    seckill::telemetry::init_logs(&settings.telemetry);
    // The recorder goes in before any role records its first metric.
    let _ = seckill::telemetry::metrics_handle();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("seckill: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Api => roles::api::run(settings).await.map(|_| true),
            Command::Consume { workers } => {
                roles::consume::run(settings, workers).await.map(|_| true)
            }
            Command::TimeoutCancel => roles::timeout_cancel::run(settings).await.map(|_| true),
            Command::Scan => roles::scan::run(settings).await.map(|_| true),
            Command::Migrate => roles::migrate::run(settings).await.map(|_| true),
            Command::Topics {
                command: TopicsCommand::Create,
            } => roles::topics::run(settings).await.map(|_| true),
            Command::Activity {
                command: ActivityCommand::Create(args),
            } => roles::activity::create(&settings, &args)
                .await
                .map(|_| true),
            Command::Reconcile(args) => roles::reconcile::run(settings, args).await,
            Command::Dlq { command } => roles::dlq::run(settings, command).await,
            Command::Bench(args) => roles::bench::run(settings, args).await,
            Command::BenchBacklog(args) => roles::bench_backlog::run(settings, args).await,
            Command::BenchBroker(args) => roles::bench_broker::run(settings, args).await,
            Command::BaselineApi(args) => roles::baseline::run(settings, args).await.map(|_| true),
        }
    });
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("seckill: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
