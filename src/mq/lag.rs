//! Consumer groups' backlog, read from the broker through a [`LagProbe`]: the order-create
//! lag the API's fail-closed admission reads, and every group's backlog the roles export as
//! metrics (docs/architecture/observability.md#metrics).

use std::sync::Arc;
use std::time::Duration;

use crate::mq::rocketmq::{Lag, LagProbe};

/// The order-create group's lag on its topic (admission).
#[derive(Clone)]
pub struct LagSource {
    pub probe: Arc<LagProbe>,
    pub group: String,
    pub topic: String,
}

/// Reads the order-create lag; `None` when there is no reading.
pub async fn read_lag(source: &LagSource) -> Option<Lag> {
    match source.probe.lag(&source.group, &source.topic).await {
        Ok(lag) => Some(lag),
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

/// The broker's retry topic of a consumer group: failed deliveries come back through it.
pub fn retry_topic(group: &str) -> String {
    format!("%RETRY%{group}")
}

/// One consumer group's whole backlog: its topic, and its retry topic (deliveries that failed
/// and are due again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backlog {
    /// Unconsumed messages on the topic and the retry topic together.
    pub messages: i64,
    /// Of those, on the retry topic.
    pub retry_messages: i64,
    /// Age of the oldest unconsumed message of either; 0 when there is none.
    pub oldest_age: Duration,
}

/// Combines the topic's and the retry topic's lag (pure). A retry topic that cannot be read
/// counts as empty: the broker creates it at a group's first failed delivery, and the topic's
/// own reading decides whether there is a reading at all.
pub fn combine_backlog(main: &Lag, retry: Option<&Lag>) -> Backlog {
    let age = |l: &Lag| l.oldest_unconsumed_age_ms.unwrap_or(0).max(0) as u64;
    let retry_messages = retry.map_or(0, |r| r.messages);
    Backlog {
        messages: main.messages + retry_messages,
        retry_messages,
        oldest_age: Duration::from_millis(age(main).max(retry.map_or(0, age))),
    }
}

/// Reads `group`'s backlog on `topic` (and its retry topic) and exports it under the topic's
/// short name: `mq_consumer_lag_messages`, `mq_consumer_lag_seconds` (both counting the retry
/// topic) and `mq_consumer_retry_lag_messages`. `None` when the topic's lag cannot be read: the
/// gauges keep their last value and `mq_consumer_lag_read_errors_total` counts the miss.
pub async fn export_backlog(probe: &LagProbe, group: &str, topic: &str) -> Option<Backlog> {
    export_backlog_as(probe, group, topic, crate::mq::topic_label(topic)).await
}

/// [`export_backlog`] under `label`: a second group of a topic (the audit stream beside the
/// projection) is told apart from the first.
pub async fn export_backlog_as(
    probe: &LagProbe,
    group: &str,
    topic: &str,
    label: &'static str,
) -> Option<Backlog> {
    let main = match probe.lag(group, topic).await {
        Ok(lag) => lag,
        Err(e) => {
            metrics::counter!("mq_consumer_lag_read_errors_total", "topic" => label).increment(1);
            tracing::debug!(group, topic, error = %e, "consumer lag unavailable");
            return None;
        }
    };
    let retry = probe.lag(group, &retry_topic(group)).await.ok();
    let b = combine_backlog(&main, retry.as_ref());
    metrics::gauge!("mq_consumer_lag_messages", "topic" => label).set(b.messages as f64);
    metrics::gauge!("mq_consumer_lag_seconds", "topic" => label).set(b.oldest_age.as_secs_f64());
    metrics::gauge!("mq_consumer_retry_lag_messages", "topic" => label)
        .set(b.retry_messages as f64);
    Some(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lag(messages: i64, age_ms: Option<i64>) -> Lag {
        Lag {
            messages,
            oldest_unconsumed_age_ms: age_ms,
        }
    }

    #[test]
    fn the_retry_topic_counts_in_the_backlog_and_its_age() {
        let b = combine_backlog(&lag(10, Some(500)), Some(&lag(2, Some(40_000))));
        assert_eq!(b.messages, 12);
        assert_eq!(b.retry_messages, 2);
        assert_eq!(b.oldest_age, Duration::from_secs(40));
    }

    #[test]
    fn an_unreadable_or_empty_retry_topic_counts_as_empty() {
        let b = combine_backlog(&lag(3, Some(1_500)), None);
        assert_eq!((b.messages, b.retry_messages), (3, 0));
        assert_eq!(b.oldest_age, Duration::from_millis(1_500));
        let caught_up = combine_backlog(&lag(0, None), Some(&lag(0, None)));
        assert_eq!(caught_up.oldest_age, Duration::ZERO);
    }

    #[test]
    fn retry_topics_are_named_like_the_broker_names_them() {
        assert_eq!(retry_topic("CG_X"), "%RETRY%CG_X");
    }
}
