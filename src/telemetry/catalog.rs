//! The catalogue of every metric the roles export: name, kind, unit and its `# HELP` text,
//! described once at start-up (`telemetry::describe`). `tests/it/metrics.rs` checks that every
//! metric recorded in `src/` is here, as the kind it is recorded as.

use metrics::Unit;

/// How a metric is exported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One exported metric and its description (the `# HELP` line).
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: Option<Unit>,
    pub help: &'static str,
}

const fn counter(name: &'static str, help: &'static str) -> Metric {
    Metric {
        name,
        kind: Kind::Counter,
        unit: None,
        help,
    }
}

const fn gauge(name: &'static str, help: &'static str) -> Metric {
    Metric {
        name,
        kind: Kind::Gauge,
        unit: None,
        help,
    }
}

const fn gauge_in(name: &'static str, unit: Unit, help: &'static str) -> Metric {
    Metric {
        name,
        kind: Kind::Gauge,
        unit: Some(unit),
        help,
    }
}

const fn histogram(name: &'static str, help: &'static str) -> Metric {
    Metric {
        name,
        kind: Kind::Histogram,
        unit: None,
        help,
    }
}

const fn histogram_in(name: &'static str, unit: Unit, help: &'static str) -> Metric {
    Metric {
        name,
        kind: Kind::Histogram,
        unit: Some(unit),
        help,
    }
}

/// Every metric the roles export, described once.
pub const METRICS: &[Metric] = &[
    counter("dlq_ticket_open_total", "Tickets of new groups of failures posted to dlq.ticket_webhook, by result (opened: a 2xx, failed: posted again later)"),
    counter("audit_events_recorded_total", "Order events the audit group appended to audit_events (added) or found there already (repeat)"),
    counter("mq_publish_total", "Sends by topic and outcome (confirmed, unknown, definite_failure)"),
    histogram_in("mq_publish_latency_seconds", Unit::Seconds, "Broker send latency"),
    counter("mq_publish_unknown_total", "Sends whose result is unknown (re-sent later, stock kept)"),
    counter("reservation_total", "Reservation attempts by result"),
    counter("reservation_resend_refused_total", "Scanner re-sends the broker refused while the reservation was still valid: retried, not released"),
    counter("reservation_sold_out_from_memory_total", "Requests for a SKU known sold out answered SOLD_OUT without Redis (not from its winners)"),
    gauge("mq_dlq_group_messages", "Open dead letters and quarantined messages per group of failures (seckill dlq groups), the ten largest by fingerprint and the rest as fingerprint=\"other\", by consumer_group and source"),
    gauge("pg_table_bytes", "Bytes on disk of each table that grows with every request (its partitions summed), by table; the scan role reads it every minute"),
    gauge("pg_table_rows_estimate", "The planner's row estimate of each such table (refreshed by ANALYZE), by table"),
    gauge("pg_partition_oldest_age_seconds", "Age of the oldest day partition of a table partitioned by day (audit_events), by table"),
    gauge("sold_out_flags", "SKUs this API instance answers SOLD_OUT from memory"),
    counter("reservation_unconsumed_resend_total", "Confirmed sends the order-create inbox never saw in time (a dead broker may hold them) sent again, same message_id, by outcome"),
    counter("outbox_unconsumed_requeue_total", "Confirmed outbox events the consumers never took in time (a dead broker may hold them) put back to be sent again, by tag"),
    counter("redis_cluster_redirect_retry_total", "Pipelines of Redis scripts sent again because the cluster answered a redirection or cluster-down (a failover moving a slot)"),
    counter("reservation_lost_past_horizon_total", "Reservations answered 202 that PostgreSQL had no order for when the scanner settled them past their validity and grace (a lost commit or message; each named in the scan role's logs)"),
    counter("reservation_awaiting_checked_total", "Watched confirmed sends checked against the order-create inbox, by verdict (consumed, resent, settled)"),
    gauge("reservation_awaiting_consumption", "Confirmed sends not yet seen in the order-create inbox (watched by the scanner)"),
    counter("reservation_settled_total", "Reservations whose re-send was refused after validity + grace, settled from PostgreSQL, by verdict (fenced: released once; consumed: a copy reached the consumer)"),
    gauge("mq_consumer_lag_messages", "Unconsumed messages of a consumer group, its retry topic included, by topic (the audit group under topic=\"audit\")"),
    gauge("mq_consumer_lag_seconds", "Age of the oldest unconsumed message of a consumer group (retry topic included), by topic (the audit group under topic=\"audit\")"),
    gauge("mq_consumer_retry_lag_messages", "Failed deliveries due again and not consumed yet (the group's %RETRY% topic), by topic"),
    counter("mq_consumer_lag_read_errors_total", "Backlog readings the broker did not answer, by topic"),
    counter("mq_consume_repeated_failure_total", "Deliveries that failed for the third time or more in a row, by topic: stuck work, long before the DLQ"),
    histogram_in("order_reservation_to_order_seconds", Unit::Seconds, "From Redis's acceptance of a reservation to its committed order (the 3 s SLO)"),
    counter("role_task_failures_total", "Background tasks of this role that died (the role then stops and exits non-zero)"),
    histogram_in("http_request_duration_seconds", Unit::Seconds, "API latency by route"),
    counter("mq_consume_total", "Consumed messages by topic and result"),
    histogram_in("mq_consume_process_seconds", Unit::Seconds, "Listener call duration per batch"),
    gauge("mq_consumer_inflight", "Batches being processed"),
    gauge("mq_consumer_ready", "Messages of the group on the broker, not pulled yet (lag minus the client's cache)"),
    gauge("mq_consumer_cached_messages", "Messages the consumer has pulled and not ACKed yet (its local cache)"),
    counter("mq_dlq_replay_total", "DLQ replays by result (confirmed, unknown, definite_failure, refused), from the audit table"),
    counter("mq_duplicate_message_total", "Messages already processed (inbox hit)"),
    counter("mq_business_reject_total", "Reservations rejected by the order transaction, by reason"),
    counter("mq_quarantine_total", "Poison messages quarantined, by reason"),
    counter("mq_ack_failure_total", "ACKs the MQ client failed to deliver after commit, by kind (offset_commit, send_back); the redelivery hits the inbox"),
    histogram_in("order_cancel_delay_seconds", Unit::Seconds, "From an order's payment deadline to its timeout cancel (timer or sweep)"),
    counter("order_cancel_sweep_total", "Orders the timeout sweep found unpaid past deadline + grace, by what came of them"),
    histogram_in("order_tx_latency_seconds", Unit::Seconds, "Order transaction latency (begin to commit), by kind: create (order consumer), cancel (timeout cancel)"),
    gauge("order_tx_paced", "1 while pacing holds the order consumer to one transaction (consumer.pace_age_ms)"),
    counter("order_tx_retry_total", "Order transactions rolled back by a transient failure (lost connection, deadlock, timeout) and attempted again in-process, by kind"),
    histogram_in("pg_pool_wait_seconds", Unit::Seconds, "Wait for a pooled PostgreSQL connection"),
    gauge("pg_pool_acquired", "PostgreSQL connections in use"),
    gauge("pg_pool_capacity", "PostgreSQL connections this process may open, its pools together (seckill budget prints the same per role)"),
    gauge("pg_primary", "1 for the PostgreSQL server (address:port, by host) this process writes to, 0 for one it wrote to before a failover"),
    gauge("pg_timeline", "The timeline of the WAL the PostgreSQL primary writes: a promoted standby starts a new one"),
    counter("pg_failovers_seen_total", "Changes of PostgreSQL primary (another server, or a new timeline) this process saw"),
    counter("pg_deadlock_total", "Deadlocks seen"),
    counter("pg_serialization_retry_total", "Serialization failures seen"),
    counter("inventory_condition_update_miss_total", "Units refused by the conditional stock update"),
    gauge("worker_budget", "PostgreSQL transactions this process may run at once"),
    counter("admin_auth_failures_total", "Admin requests refused for their token, by result (refused, busy, tarpit, throttled)"),
    counter("admission_lag_unreadable_total", "Admission checks that could not read the order-create lag (the sale pauses: fail closed)"),
    counter("auth_failures_total", "Buyer requests refused for their token, by reason"),
    counter("auth_token_cache_total", "Buyer tokens looked up in the verified-token cache, by result (hit, miss)"),
    counter("auth_token_cache_evictions_total", "Verified tokens evicted from the cache to keep it within auth.token_cache_entries"),
    gauge("auth_token_cache_entries", "Verified tokens remembered"),
    counter("jwks_refresh_total", "Fetches of auth.jwks_url, by reason (start, periodic, unknown_kid) and result (ok, unchanged, error, throttled)"),
    histogram_in("jwks_refresh_duration_seconds", Unit::Seconds, "One fetch of auth.jwks_url, answered or failed"),
    gauge("jwks_keys", "Keys in the identity provider's current set"),
    gauge_in("jwks_last_success_timestamp_seconds", Unit::Seconds, "When auth.jwks_url last answered with a usable set"),
    counter("compensation_total", "RELEASE_RESERVATION messages handled, by result (released, already_released, missing, quarantined)"),
    counter("event_delivery_total", "ORDER_PAID and ORDER_CANCELED events written, by family and delivery (outbox or transaction message)"),
    counter("http_connection_errors_total", "HTTP connections closed on an error or a limit, by listener and reason (head timeout, head too large, write stalled, ...)"),
    counter("mq_consume_batch_split_total", "Consumer batches that failed whole and were split to find the failing message, by kind"),
    counter("mq_dlq_intake_total", "Dead letters recorded in PostgreSQL by the DLQ intake"),
    counter("mq_name_server_down_total", "Times a name server stopped answering, by name server"),
    counter("mq_transaction_check_total", "Broker check-backs of transaction messages answered, by answer (commit, rollback, unknown)"),
    counter("mq_transaction_end_total", "Transaction messages ended by the producer, by outcome"),
    counter("mq_broker_stats_read_errors_total", "Reads of a broker's runtime stats that failed, by broker (\"route\": the topic's route)"),
    counter("order_cancel_total", "Timeout cancels of unpaid orders, by result (canceled, already paid, not yet expired, ...)"),
    counter("order_pay_total", "Payment notifications handled, by result"),
    counter("order_tx_stock_fallback_total", "Order transactions whose optimistic stock update fell short and took the locked path"),
    counter("order_tx_timeout_total", "Transactions that exceeded consumer.tx_timeout_ms (connection dropped, batch retried), by kind"),
    counter("outbox_auto_requeue_total", "DEAD outbox rows put back to PENDING once the broker answered again"),
    counter("outbox_dead_total", "Outbox rows that exhausted their send attempts and went DEAD"),
    counter("outbox_publish_total", "Outbox relay sends, by tag and outcome"),
    counter("pg_call_timeout_total", "API calls to PostgreSQL abandoned past their bound (answered 503)"),
    counter("projection_apply_total", "Order events applied to the Redis projection, by result (applied, stale, quarantined, held: ahead of its order's earlier event, from_postgres: still ahead on its redelivery, the order's state read from PostgreSQL)"),
    counter("refund_obligations_total", "Payments the provider confirmed that no order could take, recorded as owed back, by reason"),
    counter("rate_limited_total", "Reservations refused by the abuse limits, by bucket (ip: the client address, u: the buyer)"),
    counter("reservation_resend_total", "Scanner re-sends of unconfirmed reservations (same message_id), by outcome"),
    counter("retention_deleted_total", "Rows taken out of PostgreSQL past their retention (each archived first), by table"),
    counter("retention_partitions_dropped_total", "Day partitions archived and dropped whole by retention, by table"),
    counter("retention_failures_total", "Retention passes that stopped, by reason (archive: the archive could not be written, nothing was deleted; postgres)"),
    gauge_in("retention_last_success_timestamp_seconds", Unit::Seconds, "When this scan instance last finished a retention pass"),
    counter("archive_segments_total", "Archive segments written and committed by retention, by table"),
    counter("archive_rows_total", "Rows written to the archive by retention, by table"),
    counter("archive_bytes_total", "Compressed bytes written to the archive by retention, by table"),
    counter("stock_bucket_moved_units_total", "Units of stock moved between stock buckets by the rebalancer"),
    counter("stock_bucket_moves_resumed_total", "Bucket moves cut midway (debited, not credited) that a later pass finished"),
    counter("stock_bucket_moves_total", "Moves of stock between stock buckets"),
    gauge("admission_paused", "1 while this API refuses new reservations of every activity (the order queue is behind, or its lag unreadable)"),
    gauge("projection_deferred", "1 while the projection steps aside because orders are behind (consumer.projection_defer_lag_secs)"),
    counter("projection_deferred_batches_total", "Projection batches held while orders were behind"),
    counter("draw_hold_total", "Requests held through their activity's fair-start draw, by outcome (won, lost, timeout)"),
    histogram_in("draw_hold_seconds", Unit::Seconds, "How long a request waited for its draw"),
    counter("fair_draw_entrants_total", "Buyers who entered a finished fair-start draw (scan, once per SKU and bucket)"),
    counter("fair_draw_won_total", "Entrants of a finished fair-start draw who got a reservation"),
    histogram_in("fair_draw_seconds", Unit::Seconds, "From a fair window's close to its draw finished"),
    gauge("fair_draw_entrants", "Entrants of an activity's finished draws, by activity and SKU (scan)"),
    gauge("fair_draw_won", "Entrants of an activity's finished draws who got a reservation, by activity and SKU"),
    gauge("fair_draw_lost", "Entrants of an activity's finished draws who got none, by activity and SKU"),
    gauge_in("fair_draw_duration_seconds", Unit::Seconds, "From the window's close to the last bucket's draw finished, by activity and SKU"),
    counter("pass_registrations_total", "Sale-pass registrations, by result (issued, held, or the refusal's code)"),
    counter("pass_challenges_total", "Proof-of-work challenges made for pass registrations"),
    gauge("pass_pow_difficulty", "The counters of the last proof-of-work challenge made (the activity's difficulty times the load factor)"),
    counter("pass_pow_refused_total", "Pass registrations whose proof of work was refused, by reason (invalid, not_yours, expired)"),
    counter("pass_refused_total", "Reservations refused before the reserve script for their sale pass, by reason (missing, malformed, not_yours, bad_signature)"),
    gauge("order_fast_lane_active", "1 while the last listener call's oldest message was past consumer.fast_lane_backlog_ms (the fast lane open)"),
    counter("order_fast_lane_total", "Reservations rejected ahead of the queue by the fast lane, by reason (EXPIRED, EXPIRING)"),
    gauge("admission_paused_activities", "Activities this API refuses new reservations of on their own (their reservations wait), the others selling on"),
    gauge("admission_ramp_share", "Share of new reservations admitted while a paused sale ramps back up (1: all)"),
    gauge("http_connections_open", "Open HTTP connections, by listener"),
    gauge("mq_broker_disk_used_ratio", "Used share (0-1) of a master broker's commit-log disk, by broker"),
    gauge("mq_broker_writeable", "1 while a master broker's store accepts writes, by broker"),
    gauge("mq_broker_page_cache_busy", "1 while a master broker reports its OS page cache busy (sends refused or slowed), by broker"),
    gauge("mq_broker_flush_error", "1 when a master broker's last flush failed, by broker"),
    gauge_in("mq_broker_sync_flush_wait_seconds", Unit::Seconds, "How long a master broker's oldest synchronous flush request has waited, by broker"),
    gauge_in("mq_broker_put_lock_seconds", Unit::Seconds, "How long a master broker's put lock has been held by the current write, by broker"),
    gauge("mq_broker_replica_lag_bytes", "Bytes a master broker's furthest replica is behind it, by broker"),
    gauge("mq_broker_in_sync_replicas", "Members of a master broker's in-sync set, itself included, by broker"),
    gauge("mq_dlq_messages", "OPEN dead letters recorded in PostgreSQL"),
    gauge_in("mq_dlq_oldest_age_seconds", Unit::Seconds, "Age of the oldest OPEN dead letter"),
    gauge("mq_name_server_up", "1 while the name server answers, by name server"),
    gauge("order_tx_concurrency_limit", "Order transactions this process runs at once now (the adaptive limit within the worker budget)"),
    gauge("outbox_dead", "DEAD outbox rows (an operator requeues them)"),
    gauge("outbox_in_transaction", "Outbox rows beside a stored half message, waiting for the transaction message's end"),
    gauge("outbox_not_yet_due", "PENDING outbox rows held until shortly before they are due (timers)"),
    gauge("outbox_pending", "PENDING outbox rows due to be sent"),
    gauge_in("outbox_pending_oldest_age_seconds", Unit::Seconds, "Age of the oldest due PENDING outbox row"),
    gauge("refund_obligations_pending", "Refunds owed and not yet marked REFUNDED"),
    gauge("refund_obligations_pending_cents", "Sum of the refunds owed and not yet marked REFUNDED, in cents"),
    gauge_in("refund_obligations_oldest_age_seconds", Unit::Seconds, "Age of the oldest refund owed and not yet marked REFUNDED"),
    gauge("reservation_mq_pending", "Reservations whose message is not known to be stored yet (pending a send or a re-send)"),
    gauge_in("reservation_mq_pending_oldest_age_seconds", Unit::Seconds, "Age of the oldest reservation whose message is not known to be stored"),
    histogram("mq_consume_batch_size", "Messages per batch a consumer handles"),
    histogram("mq_publish_batch_size", "Messages per broker call of the API's batched sends"),
    histogram("order_tx_batch_size", "Messages per order transaction"),
    counter("redis_loss_detected_total", "Activities fenced because Redis was found behind what it had answered, by signal (sequence, meta_missing, compensation_missing, suspect_flag, operator)"),
    counter("redis_restarts_seen_total", "Times this API saw the Redis server's run id change (a restart or another server)"),
    counter("redis_rebuild_total", "Rebuilds of a fenced activity's Redis state from PostgreSQL, by result (ok, failed)"),
    gauge("redis_fenced_activities", "Activities fenced now: refusing reservations until their Redis state is rebuilt"),
    histogram_in("redis_rebuild_duration_seconds", Unit::Seconds, "How long a rebuild of an activity's Redis state from PostgreSQL took"),
    histogram_in("redis_fence_duration_seconds", Unit::Seconds, "How long an activity stayed fenced, detection to resumption"),
    counter("redis_release_held_total", "Releases of a unit asked again because a rebuild held the shard's stock while it read and wrote"),
];
