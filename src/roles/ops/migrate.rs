//! `seckill migrate`: applies `sql/` to the configured schema (a separate release step, never
//! done by the replicas themselves).

use tracing::info;

use crate::config::Settings;

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let applied = crate::pg::migrate(&settings.pg).await?;
    if applied.is_empty() {
        info!(schema = %settings.pg.schema, "schema is up to date");
    } else {
        info!(schema = %settings.pg.schema, versions = ?applied, "migrations applied");
    }
    println!(
        "migrate: schema {} up to date (applied now: {:?})",
        settings.pg.schema, applied
    );
    Ok(())
}
