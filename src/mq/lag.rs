//! The order-create group's lag, read through a [`LagSource`] by two roles: the API's
//! fail-closed admission and the consumer's own lag metrics.

use std::sync::Arc;
use std::time::Duration;

use crate::mq::rocketmq::{Lag, LagProbe};

#[derive(Clone)]
pub struct LagSource {
    pub probe: Arc<LagProbe>,
    pub group: String,
    pub topic: String,
}

/// Reads the order-create lag and exports it (`mq_consumer_lag_messages`,
/// `mq_consumer_lag_seconds`); `None` when there is no reading.
pub async fn read_lag(source: &LagSource) -> Option<Lag> {
    match source.probe.lag(&source.group, &source.topic).await {
        Ok(lag) => {
            let ms = lag.oldest_unconsumed_age_ms.unwrap_or(0).max(0);
            metrics::gauge!("mq_consumer_lag_messages", "topic" => "order_create")
                .set(lag.messages as f64);
            metrics::gauge!("mq_consumer_lag_seconds", "topic" => "order_create")
                .set(ms as f64 / 1000.0);
            Some(lag)
        }
        Err(e) => {
            // No reading (e.g. the group has not consumed yet): the pending age still guards.
            tracing::debug!(error = %e, "consumer lag unavailable");
            None
        }
    }
}

/// Age of the oldest unconsumed order-create message (0 when caught up); `None` when the lag
/// cannot be read, which is never the same as "caught up".
pub async fn lag_age(source: &LagSource) -> Option<Duration> {
    read_lag(source).await.map(|lag| {
        lag.oldest_unconsumed_age_ms
            .map(|ms| Duration::from_millis(ms.max(0) as u64))
            .unwrap_or(Duration::ZERO)
    })
}
