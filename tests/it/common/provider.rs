//! A payment provider of the tests' own: it pays orders as a real one does, sending again what
//! was not answered, and keeps every answer to judge the books by.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;

use super::TestEnv;

/// The payment provider: pays every CREATED order it sees (of those its filter picks), once
/// the notification is answered (a 5xx or no answer is sent again later, as providers do);
/// keeps what each answer was.
#[derive(Default)]
pub struct Provider {
    /// An SQL condition on `orders`: which orders its buyers pay (`true`: all).
    pub only: &'static str,
    /// Orders whose notification was answered 2xx with status PAID.
    pub paid_2xx: Mutex<BTreeSet<String>>,
    /// Every answer, by status and code.
    pub answers: Mutex<BTreeMap<String, usize>>,
    pub stop: AtomicBool,
}

impl Provider {
    /// A provider paying the orders `only` picks.
    pub fn paying(only: &'static str) -> Self {
        Self {
            only,
            ..Default::default()
        }
    }

    pub async fn run(self: Arc<Self>, env: Arc<TestEnv>, api_port: u16) {
        while !self.stop.load(Ordering::SeqCst) {
            self.pay_round(&env, api_port, self.only).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One round: every CREATED order `only` picks (at most 64) paid once; how many were
    /// answered 2xx PAID.
    pub async fn pay_round(&self, env: &TestEnv, api_port: u16, only: &str) -> usize {
        let base = format!("http://127.0.0.1:{api_port}");
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let secret = &env.settings.payments.webhook_secrets[0];
        let mut paid_now = 0;
        for (order_id, cents) in created_orders(env, only).await {
            let body = serde_json::json!({
                "order_id": order_id, "payment_id": format!("pay-{order_id}"),
                "amount_cents": cents,
            })
            .to_string();
            let sig =
                seckill::auth::signature::sign(secret, Utc::now().timestamp(), body.as_bytes());
            let sent = client
                .post(format!("{base}/v1/payments/notifications"))
                .header("content-type", "application/json")
                .header("seckill-signature", sig)
                .body(body)
                .send()
                .await;
            // No answer is an answer too: the provider sends it again on its next round.
            let (key, paid) = match sent {
                Err(e) => (
                    format!(
                        "no answer ({})",
                        if e.is_timeout() { "timeout" } else { "error" }
                    ),
                    false,
                ),
                Ok(r) => {
                    let status = r.status();
                    let v: serde_json::Value = r.json().await.unwrap_or_default();
                    let code = v["error"]["code"].as_str().unwrap_or_default().to_owned();
                    (
                        format!("{} {code}", status.as_u16()),
                        status.is_success() && v["status"] == "PAID",
                    )
                }
            };
            *self.answers.lock().unwrap().entry(key).or_default() += 1;
            if paid {
                self.paid_2xx.lock().unwrap().insert(order_id);
                paid_now += 1;
            }
        }
        paid_now
    }
}

/// CREATED orders (id, amount) `only` picks, as the primary of the moment has them.
async fn created_orders(env: &TestEnv, only: &str) -> Vec<(String, i64)> {
    let Ok(pool) = seckill::pg::connect_pool(&env.settings.pg, 1).await else {
        return Vec::new();
    };
    let Ok(client) = pool.get().await else {
        return Vec::new();
    };
    client
        .query(
            &format!(
                "SELECT order_id, amount_cents FROM orders WHERE status = 'CREATED' AND ({only}) \
                 LIMIT 64"
            ),
            &[],
        )
        .await
        .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        .unwrap_or_default()
}

/// Every payment answered 2xx is PAID (after a failover: on the new primary): those that are not.
pub async fn paid_2xx_not_paid(env: &TestEnv, provider: &Provider) -> Vec<String> {
    let ids: Vec<String> = provider.paid_2xx.lock().unwrap().iter().cloned().collect();
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let paid: BTreeSet<String> = client
        .query(
            "SELECT order_id FROM orders WHERE order_id = ANY($1) AND status = 'PAID'",
            &[&ids],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    ids.into_iter().filter(|id| !paid.contains(id)).collect()
}
