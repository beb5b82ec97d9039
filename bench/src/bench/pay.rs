//! Payments after the drain: signed notifications to the API, then the settle wait.

use std::time::{Duration, Instant};

use futures::StreamExt;

use super::load::api_bases;
use super::BenchArgs;
use crate::report::BenchReport;
use seckill::config::Settings;

/// Pays `--pay-share` of the created orders through signed payment notifications, newest
/// first: those have the most of their pay window left, so on a slow machine the payments do
/// not reach orders the timeout already cancelled (a late payment is refused with 409, which
/// the report counts as a refusal).
pub(super) async fn pay_orders(
    settings: &Settings,
    args: &BenchArgs,
    client: &reqwest::Client,
    pg: &deadpool_postgres::Object,
    report: &mut BenchReport,
    last_sku: i64,
) -> anyhow::Result<()> {
    let orders: Vec<(String, i64)> = pg
        .query(
            "SELECT order_id, amount_cents FROM orders
             WHERE activity_id = ANY($1::int8[]) AND sku_id BETWEEN $2 AND $3
               AND status = 'CREATED'
             ORDER BY created_at DESC",
            &[&args.activity_id, &args.sku_id, &last_sku],
        )
        .await?
        .into_iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let secret = settings
        .payments
        .webhook_secrets
        .first()
        .ok_or_else(|| anyhow::anyhow!("payments.webhook_secrets is empty: cannot pay"))?
        .clone();
    let to_pay = ((orders.len() as f64) * args.pay_share.clamp(0.0, 1.0)).round() as usize;
    let bases = api_bases(&args.api);
    let results: Vec<PayAnswer> =
        futures::stream::iter(orders.into_iter().take(to_pay).enumerate())
            .map(|(k, (order_id, amount_cents))| {
                let base = bases[k % bases.len()].clone();
                let (client, secret) = (client.clone(), secret.clone());
                async move { pay_one(&client, &base, &secret, &order_id, amount_cents).await }
            })
            .buffer_unordered(args.concurrency.max(1))
            .collect()
            .await;
    report.paid = results.iter().filter(|a| **a == PayAnswer::Paid).count();
    report.pay_errors = results.len() - report.paid;
    Ok(())
}

/// What the API answered a signed payment notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PayAnswer {
    Paid,
    /// 409 `ORDER_CANCELED` / `ORDER_EXPIRED`: the order's pay window had closed when the
    /// notification landed. Refused as it should be; a slow payer, not a fault.
    Late,
    /// Any other refusal, or no answer after every retry.
    Refused,
}

/// Pays one order through a signed notification, as the provider would: `payment_id` =
/// `pay-<order_id>`. A notification that got no answer or a 5xx is sent again (signed afresh)
/// until it is answered, up to 20 times over ~10 s.
pub(crate) async fn pay_one(
    client: &reqwest::Client,
    base: &str,
    secret: &secrecy::SecretString,
    order_id: &str,
    amount_cents: i64,
) -> PayAnswer {
    let body = serde_json::json!({
        "order_id": order_id,
        "payment_id": format!("pay-{order_id}"),
        "amount_cents": amount_cents,
    })
    .to_string();
    for attempt in 0..20 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let t = chrono::Utc::now().timestamp();
        let sig = seckill::auth::signature::sign(secret, t, body.as_bytes());
        let sent = client
            .post(format!("{base}/v1/payments/notifications"))
            .header("content-type", "application/json")
            .header("seckill-signature", sig)
            .body(body.clone())
            .send()
            .await;
        match sent {
            Ok(r) if r.status().is_server_error() => continue,
            Ok(r) if r.status().is_success() => return PayAnswer::Paid,
            Ok(r) if r.status() == reqwest::StatusCode::CONFLICT => {
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                let code = body["error"]["code"].as_str().unwrap_or_default();
                return if matches!(code, "ORDER_CANCELED" | "ORDER_EXPIRED") {
                    PayAnswer::Late
                } else {
                    PayAnswer::Refused
                };
            }
            Ok(_) => return PayAnswer::Refused,
            Err(_) => continue,
        }
    }
    PayAnswer::Refused
}

/// Waits until every unpaid order is cancelled and every compensation done.
pub(super) async fn wait_settled(
    args: &BenchArgs,
    pg: &deadpool_postgres::Object,
    report: &mut BenchReport,
    last_sku: i64,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.settle_timeout_secs);
    loop {
        let row = pg
            .query_one(
                "SELECT (SELECT count(*) FROM orders WHERE activity_id = ANY($1::int8[])
                           AND sku_id BETWEEN $2 AND $3 AND status IN ('CREATED', 'PAYING')),
                        (SELECT count(*) FROM compensation_tasks WHERE activity_id = ANY($1::int8[])
                           AND sku_id BETWEEN $2 AND $3 AND status = 'PENDING'),
                        (SELECT count(*) FROM orders WHERE activity_id = ANY($1::int8[])
                           AND sku_id BETWEEN $2 AND $3 AND status = 'CANCELED')",
                &[&args.activity_id, &args.sku_id, &last_sku],
            )
            .await?;
        let (unpaid, pending, canceled): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        report.canceled = canceled;
        if unpaid == 0 && pending == 0 {
            report.settled = true;
            break;
        }
        if Instant::now() >= deadline {
            eprintln!("settle timeout: {unpaid} unpaid orders, {pending} pending compensations");
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    report.settle_secs = started.elapsed().as_secs_f64();
    Ok(())
}
