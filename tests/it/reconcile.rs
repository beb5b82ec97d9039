//! Reconcile on seeded drift: it emits exactly the missing events, a second run emits none,
//! and no order row changes.

use crate::common;

use crate::common::TestEnv;
use chrono::Utc;
use seckill::pg::order_state::{pay, Payment, StateNames};
use seckill::roles::ops::reconcile::reconcile;

async fn snapshot(
    c: &deadpool_postgres::Object,
) -> Vec<(String, String, i32, chrono::DateTime<Utc>)> {
    c.query(
        "SELECT order_id, status, version, updated_at FROM orders ORDER BY order_id",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// Reconcile finds a lost ORDER_PAID event and an expired unpaid order, emits each missing event
/// once under its canonical id, and changes no order. With a grace period it judges nothing; the
/// binary writes its figures and fails on drift.
///
/// One story: the runs after the first read the drift it left, so the second run, the run with
/// grace and the binary's figures follow from what the first one emitted.
#[tokio::test]
async fn reconcile_emits_exactly_the_missing_events_once_and_changes_no_order() {
    let env = TestEnv::without_topics().await;
    env.activity(960, 1, 10).await;
    let redis = env.redis().await;
    let names = env.names();
    let orders = three_orders(&env).await;
    let pool = env.pool(2).await;
    let mut c = pool.get().await.unwrap();
    let state = StateNames {
        order_event_topic: names.order_event_topic.clone(),
        compensate_topic: names.compensate_topic.clone(),
    };
    // Drift 1: a PAID order whose ORDER_PAID event row was lost.
    let paid = Payment {
        order_id: &orders[0],
        payment_id: "pay-0",
        amount_cents: 100,
    };
    pay(&mut c, &paid, &state).await.unwrap();
    c.execute("DELETE FROM event_outbox WHERE tag = 'ORDER_PAID'", &[])
        .await
        .unwrap();
    // Drift 2: an expired unpaid order that was never cancelled.
    c.execute(
        "UPDATE orders SET expires_at = now() - interval '10 minutes' WHERE order_id = $1",
        &[&orders[1]],
    )
    .await
    .unwrap();
    let before = snapshot(&c).await;
    let outbox_before = env.count("SELECT count(*) FROM event_outbox").await;

    let args = common::reconcile_now();
    let report = reconcile(&env.settings, &**c, &redis, &args).await.unwrap();
    let found = |k: &str| {
        report
            .findings
            .iter()
            .find(|f| f.kind == k)
            .map(|f| (f.found, f.emitted))
            .unwrap()
    };
    assert_eq!(found("missing_order_paid"), (1, 1));
    assert_eq!(found("expired_unpaid_not_canceled"), (1, 1));
    assert_eq!(found("missing_order_created"), (0, 0));
    assert_eq!(found("missing_order_canceled"), (0, 0));
    assert_eq!(found("reservation_neither_ordered_nor_released"), (0, 0));
    assert_eq!(found("stock_drift"), (0, 0), "{:?}", report.findings);
    // What each check looked at: the three orders changed in the window, the one paid, the
    // one whose pay window ended (the others' end later), no cancelled order, no transaction
    // row, the one SKU; nothing left as too fresh with no grace period.
    let looked = |k: &str| {
        let f = report.findings.iter().find(|f| f.kind == k).unwrap();
        (f.scanned, f.skipped_fresh)
    };
    assert_eq!(looked("missing_order_created"), (3, 0));
    assert_eq!(looked("missing_order_paid"), (1, 0));
    assert_eq!(looked("missing_order_canceled"), (0, 0));
    assert_eq!(looked("expired_unpaid_not_canceled"), (1, 0));
    assert_eq!(looked("transaction_past_horizon"), (0, 0));
    assert_eq!(looked("stock_drift"), (1, 0));
    let stuck = looked("reservation_neither_ordered_nor_released");
    assert_eq!(stuck.1, 0, "{:?}", report.findings);
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox").await,
        outbox_before + 2
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM event_outbox WHERE event_id = '{}.v2.ORDER_PAID'",
            orders[0]
        ))
        .await,
        1,
        "the canonical event id, so consumers recognise it"
    );

    // A second run emits nothing new, and no order changed.
    let again = reconcile(&env.settings, &**c, &redis, &args).await.unwrap();
    assert_eq!(again.emitted(), 0);

    // With half an hour of grace every order changed too recently to judge: each check says so
    // and finds nothing, the expired order included (its window ended ten minutes ago).
    let patient = seckill::roles::ops::reconcile::ReconcileArgs {
        window_hours: 2,
        grace_secs: 1800,
        ..common::reconcile_now()
    };
    let fresh = reconcile(&env.settings, &**c, &redis, &patient)
        .await
        .unwrap();
    let looked = |k: &str| {
        let f = fresh.findings.iter().find(|f| f.kind == k).unwrap();
        (f.scanned, f.skipped_fresh, f.found)
    };
    assert_eq!(looked("missing_order_created"), (0, 3, 0));
    assert_eq!(looked("missing_order_paid"), (0, 1, 0));
    assert_eq!(looked("expired_unpaid_not_canceled"), (0, 1, 0));
    assert_eq!(fresh.drift(), 0, "{:?}", fresh.findings);
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox").await,
        outbox_before + 2
    );
    assert_eq!(
        snapshot(&c).await,
        before,
        "reconcile never changes business state"
    );

    // The binary: textfile for node_exporter, and a non-zero exit on drift.
    let file = std::env::temp_dir().join(format!("seckill-reconcile-{}.prom", env.id));
    let out = common::command(
        &env,
        &[
            "reconcile",
            "--grace-secs",
            "0",
            "--fail-on-drift",
            "--metrics-file",
        ],
    )
    .arg(&file)
    .output()
    .unwrap();
    assert!(!out.status.success(), "the expired order is still drift");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.contains("seckill_reconcile_drift{kind=\"expired_unpaid_not_canceled\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("seckill_reconcile_emitted{kind=\"missing_order_paid\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("seckill_reconcile_scanned{kind=\"missing_order_created\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("seckill_reconcile_skipped_fresh{kind=\"missing_order_created\"} 0"),
        "{text}"
    );
    let _ = std::fs::remove_file(&file);
    drop(c);
    env.cleanup().await;
}

/// Three orders of activity 960, reserved in Redis exactly as the API does, then created by
/// the consumer.
async fn three_orders(env: &TestEnv) -> Vec<String> {
    common::created_orders(env, 960, &[1, 2, 3])
        .await
        .into_iter()
        .map(|ids| ids.order_id)
        .collect()
}
