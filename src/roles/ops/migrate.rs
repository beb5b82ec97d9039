//! `seckill migrate`: applies `sql/` to the configured schema (a separate release step, never
//! done by the replicas themselves); a schema it creates is contracted at once, and with
//! `--contract` an existing one once every instance runs this release
//! (docs/architecture/postgresql.md#tables-by-day).

use clap::Args;
use tracing::info;

use crate::config::Settings;
use crate::pg::contract::{self, Contracted};

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Then drop what this release no longer uses (the unpartitioned inbox and outbox and their
    /// mirrors): once every instance runs this release. Refused while a session of an older
    /// release is connected.
    #[arg(long)]
    pub contract: bool,
    /// With --contract: drop them even though an older release is connected (its writes to
    /// them then fail).
    #[arg(long, requires = "contract")]
    pub force: bool,
}

pub async fn run(settings: Settings, args: MigrateArgs) -> anyhow::Result<()> {
    let applied = crate::pg::migrate_contracting_new(&settings.pg).await?;
    if applied.is_empty() {
        info!(schema = %settings.pg.schema, "schema is up to date");
    } else {
        info!(schema = %settings.pg.schema, versions = ?applied, "migrations applied");
    }
    println!(
        "migrate: schema {} up to date (applied now: {:?})",
        settings.pg.schema, applied
    );
    if args.contract {
        let (mut client, conn) = crate::pg::connect_one(&settings.pg).await?;
        let conn = tokio::spawn(conn);
        let actor = crate::pg::audit::cli_actor();
        let done = contract::run(&mut client, &actor, args.force).await;
        drop(client);
        let _ = conn.await;
        match done? {
            Contracted::Dropped { differed } => {
                info!(schema = %settings.pg.schema, differed, "contract: old inbox and outbox dropped");
                println!(
                    "contract: dropped consumer_inbox, event_outbox and their mirrors \
                     (rows that differed: {differed})"
                );
            }
            Contracted::AlreadyDone => println!("contract: nothing left to drop"),
        }
    }
    Ok(())
}
