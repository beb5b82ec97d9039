//! Thin entry point: parse the command line, load config, start telemetry, run the role.

// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

use clap::Parser;

use seckill::cli::{ActivityCommand, Cli, Command, TopicsCommand};
use seckill::roles;
use seckill::roles::ops::dev_credentials::{self, PaymentCommand, TokenCommand};

fn main() -> std::process::ExitCode {
    // Failpoints from the FAILPOINTS variable, only in builds for the fault tests.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    // A role's log is its output (stdout: a file or journald); a tool's stdout is its report,
    // so its log goes to stderr.
    let logs = if cli.command.is_role() {
        seckill::telemetry::init_logs
    } else {
        seckill::telemetry::init_logs_to_stderr
    };
    let role = cli.command.is_role();
    seckill::cli::run_process("seckill", logs, |settings| async move {
        if role {
            seckill::mq::check_name_servers(&settings.mq).await?;
            seckill::mq::watch_name_servers(&settings.mq);
        }
        match cli.command {
            Command::Api => roles::api::run(settings).await.map(|_| true),
            Command::Consume { workers } => {
                roles::consume::run(settings, workers).await.map(|_| true)
            }
            Command::TimeoutCancel => roles::timeout_cancel::run(settings).await.map(|_| true),
            Command::Scan => roles::scan::run(settings).await.map(|_| true),
            Command::Migrate => roles::ops::migrate::run(settings).await.map(|_| true),
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
            Command::Outbox { command } => roles::ops::outbox::run(settings, command).await,
            Command::Token {
                command: TokenCommand::Mint(args),
            } => dev_credentials::mint(&settings, &args).map(|_| true),
            Command::Token {
                command: TokenCommand::Keygen(args),
            } => dev_credentials::keygen(&args).map(|_| true),
            Command::Payment {
                command: PaymentCommand::Sign(args),
            } => dev_credentials::sign_notification(&settings, &args).map(|_| true),
        }
    })
}
