//! The ticket hook (docs/RUNBOOK.md#dead-letter-tickets): each new group of failures is posted
//! once to `dlq.ticket_webhook`, signed, with its owner and the runbook link, and posted again
//! (backed off) until the hook answers 2xx. The consume role runs it with its DLQ gauges.

use std::time::Duration;

use tracing::{info, warn};

use crate::config::DlqSettings;
use crate::pg::dlq_tickets::{self, Ticket};
use crate::services::failure_groups::FailureGroup;

/// Where a ticket sends its reader.
pub const RUNBOOK: &str = "docs/RUNBOOK.md#alert-seckilldlqfailuregroup";

/// Tickets posted per pass at most.
const PER_PASS: i64 = 10;

pub struct Tickets {
    settings: DlqSettings,
    client: reqwest::Client,
}

impl Tickets {
    /// `None` when `dlq.ticket_webhook` is empty.
    pub fn new(settings: &DlqSettings) -> anyhow::Result<Option<Self>> {
        if settings.ticket_webhook.is_empty() {
            return Ok(None);
        }
        crate::tls::install_crypto_provider();
        let mut client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("seckill/", env!("CARGO_PKG_VERSION")));
        if settings.ticket_webhook.starts_with("https://") {
            client =
                client.use_preconfigured_tls(crate::tls::client_config("", "dlq.ticket_webhook")?);
        }
        Ok(Some(Self {
            settings: settings.clone(),
            client: client.build()?,
        }))
    }

    /// Opens a ticket for each group never ticketed, then posts what is due.
    pub async fn pass(
        &self,
        client: &tokio_postgres::Client,
        groups: &[FailureGroup],
    ) -> anyhow::Result<()> {
        for g in groups {
            let t = Ticket {
                fingerprint: g.fingerprint.clone(),
                consumer_group: g.consumer_group.clone(),
                source: g.source.to_string(),
                owner: self.settings.owner_of(&g.consumer_group),
                message: g.message.clone(),
                failures: i32::try_from(g.count).unwrap_or(i32::MAX),
                opened_at: chrono::Utc::now(),
                attempts: 0,
            };
            if dlq_tickets::open(client, &t).await? {
                info!(fingerprint = %t.fingerprint, consumer_group = %t.consumer_group,
                      owner = %t.owner, "ticket opened for a new group of failures");
            }
        }
        for t in dlq_tickets::claim_due(client, PER_PASS).await? {
            let error = self.post(&t).await.err();
            let result = if error.is_none() { "opened" } else { "failed" };
            metrics::counter!("dlq_ticket_open_total", "result" => result).increment(1);
            if let Some(e) = &error {
                warn!(fingerprint = %t.fingerprint, attempt = t.attempts, error = %e,
                      "ticket hook did not take the ticket; posted again later");
            }
            dlq_tickets::record(client, &t.fingerprint, error.as_deref()).await?;
        }
        Ok(())
    }

    /// One POST of `t`: `Ok` on a 2xx.
    async fn post(&self, t: &Ticket) -> Result<(), String> {
        let body = serde_json::json!({
            "ticket_id": t.fingerprint,
            "fingerprint": t.fingerprint,
            "consumer_group": t.consumer_group,
            "source": t.source,
            "owner": t.owner,
            "message": t.message,
            "failures": t.failures,
            "opened_at": t.opened_at,
            "attempt": t.attempts,
            "runbook": RUNBOOK,
        })
        .to_string();
        let signature = crate::auth::signature::sign(
            &self.settings.ticket_secret,
            chrono::Utc::now().timestamp(),
            body.as_bytes(),
        );
        let answer = self
            .client
            .post(&self.settings.ticket_webhook)
            .header("content-type", "application/json")
            .header("seckill-signature", signature)
            .header("idempotency-key", &t.fingerprint)
            .body(body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if answer.status().is_success() {
            Ok(())
        } else {
            Err(format!("answered {}", answer.status()))
        }
    }
}
