//! Refund obligations on the real services (docs/architecture/recovery.md#refund-obligations): a
//! payment the provider confirmed that no order could take is owed back, once per payment id, with
//! its REFUND_REQUIRED event; its id can settle nothing else; the admin route and the CLI mark it
//! refunded, audited and idempotent.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::{
    self, admin_call as admin, caught_up, cli, collect_events, created_orders, error_code as code,
    eventually, notify_payment, Role, TestEnv,
};

const ADMIN_TOKEN: &str = "admin-token-for-refund-tests";

/// A payment no order can take (past its window, a second one, a wrong amount) is owed back once,
/// with one REFUND_REQUIRED event, and its payment id settles no other order. The refund worker and
/// the operator then mark each obligation refunded, once.
///
/// One story: the obligations come from the payments made against the sale's orders, the scanner
/// sends their events, and the admin route and the CLI mark those same rows, so each step reads
/// what the one before it left.
#[tokio::test]
async fn payments_no_order_can_take_are_owed_back_once_and_their_ids_settle_nothing_else() {
    let env = TestEnv::with_topics().await;
    env.activity(1700, 1, 10).await;
    let orders = created_orders(&env, 1700, &[71, 72, 73, 74]).await;
    let [expired, paid, cheap, other] = [0, 1, 2, 3].map(|i| orders[i].order_id.clone());
    let o = Orders {
        expired,
        paid,
        cheap,
        other,
    };
    let api = common::start_with_admin(&env, ADMIN_TOKEN).await;
    env.count(&format!(
        "WITH e AS (UPDATE orders SET expires_at = now() - interval '1 second' \
         WHERE order_id = '{}' RETURNING 1) SELECT count(*) FROM e",
        o.expired
    ))
    .await;
    pay_what_no_order_can_take(&env, &api.base, &o).await;
    owed_with_their_events(&env, &o).await;
    // The scanner's relay sends each event once to the order's stream, and exports what is
    // owed.
    let (collector, consumer, group) = collect_events(&env).await;
    let scan = Role::scan().spawn(&env);
    common::ready([&scan]).await;
    for (order, payment) in [
        (&o.expired, "pay-late"),
        (&o.paid, "pay-second"),
        (&o.cheap, "pay-short"),
    ] {
        eventually(30, "REFUND_REQUIRED delivered", || async {
            !collector.tagged("REFUND_REQUIRED", order).is_empty()
        })
        .await;
        let got = collector.tagged("REFUND_REQUIRED", order);
        let body: Value = serde_json::from_slice(&got[0].body).unwrap();
        assert_eq!(body["payment_id"], payment);
        assert_eq!(
            got[0].properties["message_id"],
            format!("{order}.{payment}.REFUND_REQUIRED")
        );
    }
    caught_up(&env, &group, &env.names().order_event_topic).await;
    // One event per obligation. Delivery is at least once (a send whose answer timed out is
    // sent again under the same message_id, which its readers deduplicate on), so copies are
    // allowed; a second event is not.
    for order in [&o.expired, &o.paid, &o.cheap] {
        let copies = collector.tagged("REFUND_REQUIRED", order);
        let ids: std::collections::BTreeSet<&str> =
            copies.iter().map(|d| &d.properties["message_id"]).collect();
        assert_eq!(ids.len(), 1, "{order}: {} copies of {ids:?}", copies.len());
    }
    let metrics = format!("http://127.0.0.1:{}/metrics", scan.ops);
    eventually(20, "the scanner exports what is owed", || {
        exports(
            &metrics,
            &[
                "refund_obligations_pending 3",
                "refund_obligations_pending_cents 201",
            ],
        )
    })
    .await;
    the_refund_worker_marks(&api.admin).await;
    the_operator_marks(&env, &api.admin).await;
    eventually(20, "the scanner exports what is still owed", || {
        exports(
            &metrics,
            &[
                "refund_obligations_pending 1",
                "refund_obligations_pending_cents 1",
            ],
        )
    })
    .await;
    let mut scan = scan.proc;
    assert!(scan.terminate(20).await.success());
    assert!(consumer.shutdown().await);
    api.stop.cancel();
    env.cleanup().await;
}

/// The sale's four orders: one past its pay window, one paid, one paid the wrong amount, one
/// another payment's id is tried on.
struct Orders {
    expired: String,
    paid: String,
    cheap: String,
    other: String,
}

/// Whether the metrics at `url` hold every one of `lines`.
async fn exports(url: &str, lines: &[&str]) -> bool {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    lines.iter().all(|l| text.lines().any(|t| t == *l))
}

/// Payments no order can take, each answered why and sent again by the provider; the ids
/// owed back settle nothing else. One order is paid.
async fn pay_what_no_order_can_take(env: &TestEnv, base: &str, o: &Orders) {
    let Orders {
        expired,
        paid,
        cheap,
        other,
    } = o;
    // Past its payment window (the cancel has not run yet): 409, owed back.
    let (s, b) = notify_payment(base, expired, "pay-late", 100).await;
    assert_eq!((s, code(&b)), (StatusCode::CONFLICT, Some("ORDER_EXPIRED")));
    // Paid, then paid again with another payment: the second is owed back.
    let (s, _) = notify_payment(base, paid, "pay-first", 100).await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = notify_payment(base, paid, "pay-second", 100).await;
    assert_eq!((s, code(&b)), (StatusCode::CONFLICT, Some("ALREADY_PAID")));
    // Another amount: the order is unchanged, the 1 cent paid is owed back.
    let (s, b) = notify_payment(base, cheap, "pay-short", 1).await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("AMOUNT_MISMATCH"))
    );
    // The provider re-sends each until it gets a 2xx: the same answers, nothing more written.
    for _ in 0..3 {
        let (s, b) = notify_payment(base, expired, "pay-late", 100).await;
        assert_eq!((s, code(&b)), (StatusCode::CONFLICT, Some("ORDER_EXPIRED")));
        let (s, b) = notify_payment(base, paid, "pay-second", 100).await;
        assert_eq!((s, code(&b)), (StatusCode::CONFLICT, Some("ALREADY_PAID")));
    }
    // A payment owed back belongs to its order: it cannot settle another one, nor its own
    // with a different amount.
    let (s, b) = notify_payment(base, other, "pay-late", 100).await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::CONFLICT, Some("PAYMENT_ID_REUSED"))
    );
    let (s, b) = notify_payment(base, cheap, "pay-short", 100).await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::CONFLICT, Some("PAYMENT_ID_REUSED"))
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'PAID'")
            .await,
        1,
        "only the first payment paid an order"
    );
}

/// Three obligations, each naming its order and buyer, each with one REFUND_REQUIRED event on
/// the order's stream at the order's version.
async fn owed_with_their_events(env: &TestEnv, o: &Orders) {
    let Orders {
        expired,
        paid,
        cheap,
        ..
    } = o;
    let owed = env
        .count(
            "SELECT count(*) FROM refund_obligations WHERE status = 'PENDING' AND (
               (payment_id, reason, amount_cents) IN
                 (('pay-late', 'ORDER_EXPIRED', 100), ('pay-second', 'ALREADY_PAID', 100),
                  ('pay-short', 'AMOUNT_MISMATCH', 1)))",
        )
        .await;
    assert_eq!(owed, 3);
    assert_eq!(
        env.count("SELECT count(*) FROM refund_obligations").await,
        3
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM refund_obligations r JOIN orders o USING (order_id) \
             WHERE r.user_id = o.user_id AND r.activity_id = 1700 \
               AND r.order_id IN ('{expired}', '{paid}', '{cheap}')"
        ))
        .await,
        3,
        "each obligation names its order and buyer"
    );
    // One REFUND_REQUIRED event per obligation, on the order's stream at the order's version.
    let events = env
        .pool(1)
        .await
        .get()
        .await
        .unwrap()
        .query(
            "SELECT e.event_id, e.payload, e.aggregate_version, o.version, e.message_key
             FROM event_outbox e JOIN orders o ON o.order_id = e.aggregate_id
             WHERE e.tag = 'REFUND_REQUIRED' ORDER BY e.event_id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(events.len(), 3);
    for e in &events {
        let payload: Value = e.get(1);
        let (event_v, order_v): (Option<i32>, i32) = (e.get(2), e.get(3));
        assert_eq!(event_v, Some(order_v), "the refund does not move the order");
        assert_eq!(payload["event_type"], "REFUND_REQUIRED");
        assert_eq!(payload["aggregate_version"], json!(order_v));
        assert_eq!(e.get::<_, String>(4), payload["order_id"].as_str().unwrap());
        let id: String = e.get(0);
        assert_eq!(
            id,
            format!(
                "{}.{}.REFUND_REQUIRED",
                payload["order_id"].as_str().unwrap(),
                payload["payment_id"].as_str().unwrap()
            )
        );
    }
    let late = events
        .iter()
        .map(|e| e.get::<_, Value>(1))
        .find(|p| p["payment_id"] == "pay-late")
        .unwrap();
    assert_eq!(
        (&late["reason"], &late["amount_cents"], &late["status"]),
        (&json!("ORDER_EXPIRED"), &json!(100), &json!("CREATED"))
    );
}

/// The refund worker's side: listed oldest first, marked with the provider's refund id, once;
/// without the admin token nothing is listed or marked.
async fn the_refund_worker_marks(admin_base: &str) {
    let get = reqwest::Method::GET;
    let post = reqwest::Method::POST;
    let list = format!("{admin_base}/admin/v1/refunds");
    let mark = |p: &str| format!("{admin_base}/admin/v1/refunds/{p}/refunded");
    let (s, _) = admin(get.clone(), list.clone(), None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = admin(
        post.clone(),
        mark("pay-late"),
        Some("wrong"),
        Some(json!({"reference": "re_1"})),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, b) = admin(get.clone(), list.clone(), Some(ADMIN_TOKEN), None).await;
    assert_eq!(s, StatusCode::OK);
    let listed: Vec<&str> = b["refunds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["payment_id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ["pay-late", "pay-second", "pay-short"]);
    for bad in [
        json!({}),
        json!({"reference": ""}),
        json!({"reference": "a b"}),
    ] {
        let (s, b) = admin(post.clone(), mark("pay-late"), Some(ADMIN_TOKEN), Some(bad)).await;
        assert_eq!(
            (s, code(&b)),
            (StatusCode::BAD_REQUEST, Some("INVALID_REQUEST"))
        );
    }
    let (s, b) = admin(
        post.clone(),
        mark("pay-late"),
        Some(ADMIN_TOKEN),
        Some(json!({"reference": "re_1"})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(
        (
            &b["repeat"],
            &b["refund"]["status"],
            &b["refund"]["refund_reference"]
        ),
        (&json!(false), &json!("REFUNDED"), &json!("re_1"))
    );
    // Marked again (a worker retrying, or with another id): unchanged, and said so.
    let (s, b) = admin(
        post.clone(),
        mark("pay-late"),
        Some(ADMIN_TOKEN),
        Some(json!({"reference": "re_2"})),
    )
    .await;
    assert_eq!(
        (s, &b["repeat"], &b["refund"]["refund_reference"]),
        (StatusCode::OK, &json!(true), &json!("re_1"))
    );
    let (s, b) = admin(
        post.clone(),
        mark("pay-never-seen"),
        Some(ADMIN_TOKEN),
        Some(json!({"reference": "re_3"})),
    )
    .await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::NOT_FOUND, Some("REFUND_NOT_FOUND"))
    );
}

/// The operator's side: the CLI lists and marks the same rows; every mark is audited.
async fn the_operator_marks(env: &TestEnv, admin_base: &str) {
    let list = format!("{admin_base}/admin/v1/refunds");
    // The operator's side: the CLI lists and marks the same rows.
    let out = cli(env, &["refunds", "list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let pending: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let pending: Vec<&str> = pending
        .iter()
        .map(|r| r["payment_id"].as_str().unwrap())
        .collect();
    assert_eq!(pending, ["pay-second", "pay-short"]);
    let out = cli(
        env,
        &[
            "refunds",
            "mark-refunded",
            "--payment-id",
            "pay-second",
            "--reference",
            "re_4",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let out = cli(
        env,
        &[
            "refunds",
            "mark-refunded",
            "--payment-id",
            "pay-nope",
            "--reference",
            "re_5",
        ],
    );
    assert!(!out.status.success(), "no obligation for pay-nope: {out:?}");
    let (_, b) = admin(
        reqwest::Method::GET,
        format!("{list}?all=true"),
        Some(ADMIN_TOKEN),
        None,
    )
    .await;
    let statuses: Vec<(&str, &str)> = b["refunds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["payment_id"].as_str().unwrap(),
                r["status"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        [
            ("pay-late", "REFUNDED"),
            ("pay-second", "REFUNDED"),
            ("pay-short", "PENDING")
        ]
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM admin_audit WHERE action = 'refund_mark' \
             AND detail->>'outcome' IN ('refunded', 'already_refunded', 'not_found')"
        )
        .await,
        5,
        "every mark audited, the repeated and the unknown ones too"
    );
}

#[tokio::test]
async fn without_a_synchronous_standby_a_refund_is_not_marked_where_a_failover_could_lose_it() {
    let mut env = TestEnv::without_topics().await;
    env.settings.payments.require_sync_standby = true;
    env.count(
        "WITH o AS (INSERT INTO refund_obligations \
           (payment_id, activity_id, order_id, user_id, amount_cents, reason) \
         VALUES ('pay-owed', 1, 'ord-x', 7, 100, 'ALREADY_PAID') RETURNING 1) \
         SELECT count(*) FROM o",
    )
    .await;
    // The shared PostgreSQL has no standby at all: both ways of marking refuse, record nothing.
    let api = common::start_with_admin(&env, ADMIN_TOKEN).await;
    let (s, b) = admin(
        reqwest::Method::POST,
        format!("{}/admin/v1/refunds/pay-owed/refunded", api.admin),
        Some(ADMIN_TOKEN),
        Some(json!({"reference": "re_1"})),
    )
    .await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::SERVICE_UNAVAILABLE, Some("REFUND_NOT_DURABLE"))
    );
    let out = common::command(
        &env,
        &[
            "refunds",
            "mark-refunded",
            "--payment-id",
            "pay-owed",
            "--reference",
            "re_1",
        ],
    )
    .env("SECKILL__PAYMENTS__REQUIRE_SYNC_STANDBY", "true")
    .output()
    .unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("synchronous standby"),
        "{out:?}"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM refund_obligations WHERE status = 'PENDING'")
            .await,
        1,
        "still owed"
    );
    api.stop.cancel();
    env.cleanup().await;
}
