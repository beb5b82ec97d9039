//! The schema is ready for a distributed PostgreSQL
//! (docs/architecture/postgresql.md#a-distributed-postgresql): every primary and unique key of the
//! sale's tables carries the distribution column (`activity_id`), `orders` is partitioned by it,
//! and a payment id still settles one order across activities.

use crate::common;

use crate::common::TestEnv;

/// The sale's tables: the order transaction's rows and the inbox and outbox that guard them.
const SALE_TABLES: [&str; 9] = [
    "activities",
    "activity_skus",
    "stock_buckets",
    "reservations",
    "orders",
    "stock_ledger",
    "compensation_tasks",
    "consumer_inbox",
    "event_outbox",
];

#[tokio::test]
async fn every_key_of_the_sale_tables_carries_the_activity_and_orders_are_partitioned_by_it() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let schema = env.settings.pg.schema.clone();
    // Every primary key, unique constraint and unique index of each table, with its columns.
    let rows = client
        .query(
            "SELECT c.relname, i.relname,
                    array_agg(a.attname::text ORDER BY a.attnum)
             FROM pg_index x
             JOIN pg_class c ON c.oid = x.indrelid
             JOIN pg_class i ON i.oid = x.indexrelid
             JOIN pg_namespace n ON n.oid = c.relnamespace
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(x.indkey)
             WHERE n.nspname = $1 AND c.relname = ANY($2) AND x.indisunique
             GROUP BY c.relname, i.relname",
            &[&schema, &SALE_TABLES.to_vec()],
        )
        .await
        .unwrap();
    let mut seen: Vec<String> = Vec::new();
    for r in &rows {
        let (table, index, cols): (String, String, Vec<String>) = (r.get(0), r.get(1), r.get(2));
        assert!(
            cols.iter().any(|c| c == "activity_id"),
            "{table}: unique key {index} ({cols:?}) does not carry activity_id"
        );
        seen.push(table);
    }
    for t in SALE_TABLES {
        assert!(seen.iter().any(|s| s == t), "{t} has no unique key at all");
    }
    // orders: partitioned by hash of activity_id.
    let partitioned: Option<String> = client
        .query_one(
            "SELECT pg_get_partkeydef(c.oid) FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = 'orders'",
            &[&schema],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(partitioned.as_deref(), Some("HASH (activity_id)"));
    drop(client);
    env.cleanup().await;
}

/// Two unpaid orders of 100 cents for `user`, `ord_<a>` in activity 1601 and `ord_<b>` in 1602.
async fn unpaid_orders(client: &tokio_postgres::Client, a: &str, b: &str, user: i64) {
    client
        .execute(
            "INSERT INTO orders (order_id, reservation_id, activity_id, sku_id, user_id, status,
                                 amount_cents, expires_at, reserved_at)
             SELECT 'ord_' || x, 'rsv_' || x, act, 1, $3, 'CREATED', 100,
                    now() + interval '1 hour', now()
             FROM (VALUES ($1::text, 1601::int8), ($2::text, 1602::int8)) AS t(x, act)",
            &[&a, &b, &user],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_payment_id_settles_one_order_across_activities() {
    let env = TestEnv::without_topics().await;
    env.activity(1601, 1, 5).await;
    env.activity(1602, 1, 5).await;
    let pool = env.pool(1).await;
    let mut client = pool.get().await.unwrap();
    unpaid_orders(&client, "a", "b", 7).await;
    let names = seckill::pg::order_state::StateNames {
        order_event_topic: "t-event".into(),
        compensate_topic: "t-compensate".into(),
    };
    let pay = |order_id: &'static str| seckill::pg::order_state::Payment {
        order_id,
        payment_id: "pay_1",
        amount_cents: 100,
    };
    let first = seckill::pg::order_state::pay(&mut client, &pay("ord_a"), &names)
        .await
        .unwrap();
    assert!(
        matches!(first, seckill::domain::PayOutcome::Paid { .. }),
        "{first:?}"
    );
    // The same payment id for an order of another activity: refused, nothing written.
    let second = seckill::pg::order_state::pay(&mut client, &pay("ord_b"), &names)
        .await
        .unwrap();
    assert_eq!(second, seckill::domain::PayOutcome::PaymentIdReused);
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'PAID'")
            .await,
        1
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM order_payments WHERE payment_id = 'pay_1' AND order_id = 'ord_a'"
        )
        .await,
        1
    );
    // The first notification again: the same answer, no second row.
    let again = seckill::pg::order_state::pay(&mut client, &pay("ord_a"), &names)
        .await
        .unwrap();
    assert_eq!(again, seckill::domain::PayOutcome::AlreadyPaidSame);
    drop(client);
    env.cleanup().await;
}

/// Two notifications with one payment id racing for orders of two activities: the second
/// cannot see the first's uncommitted payment, and the orders' unique key (per activity) does
/// not stop it; order_payments does, once the first commits.
#[tokio::test]
async fn one_payment_id_racing_for_two_activities_orders_pays_one() {
    let env = TestEnv::without_topics().await;
    env.activity(1601, 1, 5).await;
    env.activity(1602, 1, 5).await;
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    unpaid_orders(&client, "c", "d", 8).await;
    let first_pool = env.pool(1).await;
    let mut first = first_pool.get().await.unwrap();
    let tx = first.transaction().await.unwrap();
    tx.batch_execute(
        "UPDATE orders SET status = 'PAID', payment_id = 'pay_2', paid_at = now() WHERE order_id = 'ord_c';
         INSERT INTO order_payments (payment_id, activity_id, order_id) VALUES ('pay_2', 1601, 'ord_c')",
    )
    .await
    .unwrap();
    let race_pool = env.pool(1).await;
    let racing = tokio::spawn(async move {
        let mut c = race_pool.get().await.unwrap();
        let names = seckill::pg::order_state::StateNames {
            order_event_topic: "t-event".into(),
            compensate_topic: "t-compensate".into(),
        };
        let p = seckill::pg::order_state::Payment {
            order_id: "ord_d",
            payment_id: "pay_2",
            amount_cents: 100,
        };
        seckill::pg::order_state::pay(&mut c, &p, &names)
            .await
            .unwrap()
    });
    // The racing payment waits on the first's order_payments row (a lock, not a sleep).
    common::eventually(
        30,
        "the second payment waits on the first's row",
        || async {
            env.count(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
               AND query LIKE '%order_payments%'",
            )
            .await
                == 1
        },
    )
    .await;
    tx.commit().await.unwrap();
    assert_eq!(
        racing.await.unwrap(),
        seckill::domain::PayOutcome::PaymentIdReused
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE order_id = 'ord_d' AND status = 'CREATED'")
            .await,
        1
    );
    drop(client);
    drop(first);
    env.cleanup().await;
}

/// The words a `status` column's CHECK constraint allows, as the migrated schema has them.
async fn allowed(client: &tokio_postgres::Client, schema: &str, table: &str) -> Vec<String> {
    // This schema's constraints first (materialized): other tests drop their schemas
    // meanwhile, and a definition read of a constraint being dropped fails.
    let defs: Vec<String> = client
        .query(
            "WITH mine AS MATERIALIZED (
               SELECT c.oid FROM pg_constraint c
                 JOIN pg_class t ON t.oid = c.conrelid
                 JOIN pg_namespace n ON n.oid = t.relnamespace
               WHERE n.nspname = $1 AND t.relname = $2 AND c.contype = 'c')
             SELECT pg_get_constraintdef(oid) FROM mine",
            &[&schema, &table],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|d| d.contains("(status = ANY"))
        .collect();
    assert_eq!(defs.len(), 1, "{table}: one status CHECK: {defs:?}");
    let mut words: Vec<String> = defs[0]
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    words.sort();
    words
}

fn sorted<T: Copy>(all: &[T], as_str: fn(T) -> &'static str) -> Vec<String> {
    let mut v: Vec<String> = all.iter().map(|w| as_str(*w).to_string()).collect();
    v.sort();
    v
}

#[tokio::test]
async fn every_status_type_spells_exactly_what_its_column_allows() {
    use seckill::domain::status::*;
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let schema = env.settings.pg.schema.clone();
    let types: [(&str, Vec<String>); 9] = [
        ("orders", sorted(OrderStatus::ALL, OrderStatus::as_str)),
        (
            "reservations",
            sorted(ReservationStatus::ALL, ReservationStatus::as_str),
        ),
        (
            "consumer_inbox",
            sorted(InboxStatus::ALL, InboxStatus::as_str),
        ),
        (
            "event_outbox",
            sorted(OutboxStatus::ALL, OutboxStatus::as_str),
        ),
        (
            "compensation_tasks",
            sorted(CompensationStatus::ALL, CompensationStatus::as_str),
        ),
        (
            "refund_obligations",
            sorted(RefundStatus::ALL, RefundStatus::as_str),
        ),
        (
            "dlq_messages",
            sorted(DeadLetterStatus::ALL, DeadLetterStatus::as_str),
        ),
        (
            "quarantined_messages",
            sorted(QuarantineStatus::ALL, QuarantineStatus::as_str),
        ),
        (
            "replay_batches",
            sorted(ReplayBatchStatus::ALL, ReplayBatchStatus::as_str),
        ),
    ];
    for (table, words) in types {
        assert_eq!(allowed(&client, &schema, table).await, words, "{table}");
    }
    env.cleanup().await;
}
