//! ORDER_PAID and ORDER_CANCELED delivered either way
//! (docs/architecture/messages.md#delivering-events): through the outbox and its relay
//! (`"outbox"`), or as a RocketMQ transaction message (`"transaction"`). One file per concern:
//! `modes` (consumers get the same message in both, a half the broker does not store falls back
//! to the outbox, reconcile finds a missing one), `check_back` (the check-back answers from
//! PostgreSQL alone), `faults` (a producer killed between the half message and its end: before
//! its local transaction ROLLBACK, nothing delivered; after its commit COMMIT, delivered once;
//! PostgreSQL unreachable while the broker asks UNKNOWN, asked again). What more than one of
//! them uses is here.

mod check_back;
mod faults;
mod modes;

/// Every order of the test past its deadline a minute ago.
async fn expire_every_order(pool: &deadpool_postgres::Pool) {
    pool.get()
        .await
        .unwrap()
        .execute(
            "UPDATE orders SET expires_at = now() - interval '1 minute'",
            &[],
        )
        .await
        .unwrap();
}
