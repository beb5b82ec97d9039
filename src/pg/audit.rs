//! The operators' audit trail (`admin_audit`): one row per action on the admin listener or the
//! matching CLI, never purged (docs/architecture/security.md#admin-surface).

use tokio_postgres::GenericClient;

/// The actor of a CLI command: `cli:$USER`.
pub fn cli_actor() -> String {
    format!(
        "cli:{}",
        std::env::var("USER").unwrap_or_else(|_| "unknown".into())
    )
}

/// Records that `actor` did `action` on `target`, with what it came to.
pub async fn record(
    client: &impl GenericClient,
    actor: &str,
    action: &str,
    target: &str,
    detail: &serde_json::Value,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO admin_audit (actor, action, target, detail) VALUES ($1, $2, $3, $4)",
            &[&actor, &action, &target, detail],
        )
        .await
        .map(|_| ())
}
