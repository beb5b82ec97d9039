//! The ticket hook: each new group of failures is posted once to `dlq.ticket_webhook`, signed,
//! with its owner and the runbook link, and posted again until the hook answers 2xx.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use secrecy::SecretString;
use serde_json::Value;

use crate::common::{self, eventually, TestEnv};

const SECRET: &str = "ticket-secret-for-the-hook-test";

/// What the hook was sent: (signature, idempotency key, body, answered 2xx).
type Received = Arc<Mutex<Vec<(String, String, Vec<u8>, bool)>>>;

/// A ticket system that refuses the first ticket it is sent, then takes every one.
async fn hook(
    State(got): State<Received>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    let mut got = got.lock().unwrap();
    let ok = !got.is_empty();
    let header = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    got.push((
        header("seckill-signature"),
        header("idempotency-key"),
        body.to_vec(),
        ok,
    ));
    if ok {
        StatusCode::CREATED
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    }
}

/// Two groups of failures, of two consumer groups (one with an owner named, one without): each
/// is ticketed once, the first after the hook refused it once; every post is signed.
#[tokio::test]
async fn each_new_group_of_failures_is_ticketed_once_signed_and_posted_again_until_taken() {
    let env = TestEnv::with_topics().await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    c.batch_execute(
        "INSERT INTO dlq_messages (consumer_group, topic, dlq_queue_id, dlq_queue_offset, attempts,
                                  error_class, last_error, payload, status, first_seen)
         SELECT 'CG_T', 't', 0, i, 17, 'PERMANENT', 'order ord_' || i || ' not found', '{}', 'OPEN',
                now() - interval '1 hour' FROM generate_series(1, 3) i;
         INSERT INTO dlq_messages (consumer_group, topic, dlq_queue_id, dlq_queue_offset, attempts,
                                  error_class, last_error, payload, status, first_seen)
         VALUES ('CG_U', 't', 0, 9, 17, 'TRANSIENT', 'lock timeout', '{}', 'OPEN', now());",
    )
    .await
    .unwrap();
    let got: Received = Arc::default();
    let app = axum::Router::new()
        .route("/tickets", axum::routing::post(hook))
        .with_state(got.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/tickets", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    let consume = common::Role::consume(1)
        .var("SECKILL__DLQ__TICKET_WEBHOOK", &url)
        .var("SECKILL__DLQ__TICKET_SECRET", SECRET)
        .var("SECKILL__DLQ__OWNERS", "CG_T=team-orders")
        .spawn(&env);
    common::ready([&consume]).await;
    eventually(40, "both groups ticketed", || async {
        env.count("SELECT count(*) FROM dlq_tickets WHERE delivered_at IS NOT NULL")
            .await
            == 2
    })
    .await;
    let posts = got.lock().unwrap().clone();
    assert_eq!(posts.len(), 3, "one refused, then one each");
    let secrets = [SecretString::from(SECRET.to_string())];
    let now = chrono::Utc::now().timestamp();
    for (sig, _, body, _) in &posts {
        seckill::auth::signature::verify(&secrets, Some(sig), body, now, 300).unwrap();
    }
    let taken: Vec<Value> = posts
        .iter()
        .filter(|p| p.3)
        .map(|p| serde_json::from_slice(&p.2).unwrap())
        .collect();
    let of = |group: &str| taken.iter().find(|t| t["consumer_group"] == group).unwrap();
    assert_eq!(of("CG_T")["owner"], "team-orders");
    assert_eq!(of("CG_T")["failures"], 3);
    assert_eq!(of("CG_U")["owner"], "seckill-oncall");
    assert_eq!(
        of("CG_T")["runbook"],
        "docs/RUNBOOK.md#alert-seckilldlqfailuregroup"
    );
    for (_, key, body, _) in &posts {
        let t: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(
            (&t["ticket_id"], &t["fingerprint"]),
            (&t["fingerprint"], &Value::from(key.as_str()))
        );
    }
    // The refused one was the same ticket posted again, with the same idempotency key.
    let refused = &posts[0];
    assert!(posts[1..].iter().any(|p| p.1 == refused.1));
    assert_eq!(
        env.count("SELECT max(attempts)::int8 FROM dlq_tickets")
            .await,
        2
    );
    let port = consume.ops;
    assert_eq!(
        common::metric(port, "dlq_ticket_open_total", "result=\"opened\"").await,
        2.0
    );
    assert_eq!(
        common::metric(port, "dlq_ticket_open_total", "result=\"failed\"").await,
        1.0
    );
    let mut consume = consume.proc;
    assert!(consume.terminate(40).await.success());
    drop(c);
    env.cleanup().await;
}
