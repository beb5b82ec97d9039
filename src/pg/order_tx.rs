//! The order transaction (§14–16; 002 §8.9–8.10): for a batch of ORDER_CREATE_REQUESTED
//! messages, one PostgreSQL transaction writes the inbox, the reservation decision, the
//! orders, one conditional final-stock update per SKU, the ledger, the outbox, compensation
//! tasks for rejections and quarantine rows for poison. It commits or it leaves no trace;
//! the caller ACKs only after a commit.
//!
//! Every per-message guarantee holds inside a batch: a duplicate message or reservation is a
//! no-op, a buyer gets at most one valid order, stock never goes below zero (partial stock
//! gives as many orders as units left and rejects the rest), and a poison body is quarantined
//! without failing the others. Set-based statements (`unnest`) keep the round trips per batch
//! constant, and the hot stock row is locked as late as possible.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};
use deadpool_postgres::Client;
use serde_json::json;
use tokio_postgres::types::ToSql;

use super::errors::TxError;
use crate::domain::event::PoisonReason;
use crate::domain::OrderCreateRequested;

/// One message handed to the transaction.
#[derive(Debug, Clone)]
pub struct Inbound {
    /// The decoded event, or why it can never be processed.
    pub event: Result<OrderCreateRequested, PoisonReason>,
    /// The body exactly as received (kept in quarantine for poison).
    pub raw_body: Vec<u8>,
    /// Message properties (message_id, traceparent, ...), kept in quarantine.
    pub properties: serde_json::Value,
    /// `message_id` property, when the body cannot be parsed.
    pub property_message_id: Option<String>,
    pub broker_msg_id: String,
    /// Broker delivery attempt (0 = first delivery).
    pub delivery_attempt: i32,
}

/// Why a reservation did not become an order. Each one is recorded and compensated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// `reservation_valid_until` passed before the consumer got to it (§21).
    Expired,
    /// PostgreSQL final stock is exhausted.
    NoStock,
    /// The buyer already has a valid order for this activity SKU.
    DuplicateBuyer,
    /// The activity SKU does not exist in PostgreSQL.
    UnknownSku,
}

impl RejectReason {
    pub fn code(&self) -> &'static str {
        match self {
            RejectReason::Expired => "EXPIRED",
            RejectReason::NoStock => "NO_STOCK",
            RejectReason::DuplicateBuyer => "DUPLICATE_BUYER",
            RejectReason::UnknownSku => "UNKNOWN_SKU",
        }
    }
}

/// What one message came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Created {
        order_id: String,
    },
    /// Its message_id was already processed by this group (inbox hit).
    DuplicateMessage,
    /// Another message already decided this reservation.
    DuplicateReservation,
    Rejected(RejectReason),
    Quarantined(&'static str),
}

impl Decision {
    /// Stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Decision::Created { .. } => "created",
            Decision::DuplicateMessage => "duplicate_message",
            Decision::DuplicateReservation => "duplicate_reservation",
            Decision::Rejected(_) => "rejected",
            Decision::Quarantined(_) => "quarantined",
        }
    }
}

/// Names the transaction writes (consumer group and the topics of the outbox rows).
#[derive(Debug, Clone)]
pub struct TxNames {
    pub consumer_group: String,
    pub source_topic: String,
    pub order_event_topic: String,
    pub order_timeout_topic: String,
    pub compensate_topic: String,
}

/// Deterministic outbox event ids: re-running a step (or reconcile) never mints a second event.
pub fn order_created_event_id(order_id: &str) -> String {
    format!("{order_id}.v1.ORDER_CREATED")
}
pub fn cancel_if_unpaid_event_id(order_id: &str) -> String {
    format!("{order_id}.CANCEL_IF_UNPAID")
}
pub fn compensation_event_id(reservation_id: &str) -> String {
    format!("{reservation_id}.RELEASE_RESERVATION")
}

/// Column arrays for `unnest`-based multi-row statements.
#[derive(Default)]
struct Cols {
    a: Vec<String>,
    b: Vec<String>,
    c: Vec<String>,
    d: Vec<String>,
    e: Vec<i64>,
    f: Vec<i64>,
    g: Vec<i64>,
    h: Vec<DateTime<Utc>>,
    i: Vec<DateTime<Utc>>,
    j: Vec<Option<String>>,
}

/// What the transaction already knows when it writes the outcomes.
struct Ctx<'a> {
    names: &'a TxNames,
    events: &'a [Option<&'a OrderCreateRequested>],
    decisions: &'a [Option<Decision>],
    now: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

impl Ctx<'_> {
    fn ev(&self, idx: usize) -> &OrderCreateRequested {
        self.events[idx].expect("index of a decoded event")
    }
}

/// Step 6: ledger, outbox, rejections with their compensation, inbox status of every owned
/// message. Independent statements, sent pipelined on the one connection.
async fn write_outcomes(
    tx: &deadpool_postgres::Transaction<'_>,
    cx: &Ctx<'_>,
    owned: &[usize],
    created: &[usize],
    rejected: &[(usize, RejectReason)],
) -> Result<(), tokio_postgres::Error> {
    let mut led = Cols::default();
    let mut ob_ids: Vec<String> = Vec::new();
    let mut ob_topics: Vec<String> = Vec::new();
    let mut ob_tags: Vec<String> = Vec::new();
    let mut ob_keys: Vec<String> = Vec::new();
    let mut ob_agg: Vec<Option<String>> = Vec::new();
    let mut ob_ver: Vec<Option<i32>> = Vec::new();
    let mut ob_payload: Vec<serde_json::Value> = Vec::new();
    let mut ob_deliver: Vec<Option<DateTime<Utc>>> = Vec::new();
    for &i in created {
        let e = cx.ev(i);
        led.a.push(e.order_id.clone());
        led.e.push(e.activity_id);
        led.f.push(e.sku_id);
        let trace = &e.trace.traceparent;
        ob_ids.push(order_created_event_id(&e.order_id));
        ob_topics.push(cx.names.order_event_topic.clone());
        ob_tags.push("ORDER_CREATED".into());
        ob_keys.push(e.order_id.clone());
        ob_agg.push(Some(e.order_id.clone()));
        ob_ver.push(Some(1));
        ob_payload.push(json!({
            "schema_version": 1, "event_type": "ORDER_CREATED",
            "event_id": order_created_event_id(&e.order_id),
            "order_id": e.order_id, "reservation_id": e.reservation_id,
            "activity_id": e.activity_id, "sku_id": e.sku_id, "user_id": e.user_id,
            "status": "CREATED", "aggregate_version": 1, "expires_at": cx.expires_at,
            "occurred_at": cx.now, "traceparent": trace,
        }));
        ob_deliver.push(None);
        ob_ids.push(cancel_if_unpaid_event_id(&e.order_id));
        ob_topics.push(cx.names.order_timeout_topic.clone());
        ob_tags.push("CANCEL_IF_UNPAID".into());
        ob_keys.push(e.order_id.clone());
        ob_agg.push(Some(e.order_id.clone()));
        ob_ver.push(None);
        ob_payload.push(json!({
            "schema_version": 1, "event_type": "CANCEL_ORDER_IF_UNPAID",
            "event_id": cancel_if_unpaid_event_id(&e.order_id),
            "order_id": e.order_id, "activity_id": e.activity_id, "sku_id": e.sku_id,
            "expires_at": cx.expires_at, "traceparent": trace,
        }));
        ob_deliver.push(Some(cx.expires_at));
    }
    let mut rj = Cols::default();
    for &(i, reason) in rejected {
        let e = cx.ev(i);
        rj.a.push(e.reservation_id.clone());
        rj.b.push(reason.code().to_string());
        rj.e.push(e.activity_id);
        rj.f.push(e.sku_id);
        rj.g.push(e.user_id);
        rj.c.push(format!("cmp_{}", e.reservation_id));
        ob_ids.push(compensation_event_id(&e.reservation_id));
        ob_topics.push(cx.names.compensate_topic.clone());
        ob_tags.push("RELEASE_RESERVATION".into());
        ob_keys.push(e.reservation_id.clone());
        ob_agg.push(None);
        ob_ver.push(None);
        ob_payload.push(json!({
            "schema_version": 1, "event_type": "RELEASE_RESERVATION",
            "event_id": compensation_event_id(&e.reservation_id),
            "reservation_id": e.reservation_id, "message_id": e.message_id,
            "order_id": e.order_id, "activity_id": e.activity_id, "sku_id": e.sku_id,
            "user_id": e.user_id, "reason": reason.code(), "occurred_at": cx.now,
            "traceparent": e.trace.traceparent,
        }));
        ob_deliver.push(None);
    }
    // Inbox outcome of every message this batch owns.
    let rejected_map: HashMap<usize, RejectReason> = rejected.iter().copied().collect();
    let mut ib_mid: Vec<String> = Vec::new();
    let mut ib_status: Vec<&str> = Vec::new();
    let mut ib_decision: Vec<String> = Vec::new();
    for &i in owned {
        let e = cx.ev(i);
        let (status, decision) = if let Some(r) = rejected_map.get(&i) {
            ("REJECTED", r.code().to_string())
        } else if cx.decisions[i] == Some(Decision::DuplicateReservation) {
            ("SUCCEEDED", "DUPLICATE_RESERVATION".to_string())
        } else {
            ("SUCCEEDED", "CREATED".to_string())
        };
        ib_mid.push(e.message_id.clone());
        ib_status.push(status);
        ib_decision.push(decision);
    }

    let ledger = exec_unless_empty(
        tx,
        led.a.is_empty(),
        "INSERT INTO stock_ledger (activity_id, sku_id, order_id, delta, reason)
         SELECT t.a, t.s, t.o, -1, 'ORDER_CREATED'
         FROM unnest($1::int8[], $2::int8[], $3::text[]) AS t(a, s, o)",
        [&led.e, &led.f, &led.a],
    );
    let outbox = exec_unless_empty(
        tx,
        ob_ids.is_empty(),
        "INSERT INTO event_outbox
           (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload, deliver_at)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                              $6::int[], $7::jsonb[], $8::timestamptz[])
         ON CONFLICT (event_id) DO NOTHING",
        [
            &ob_ids,
            &ob_topics,
            &ob_tags,
            &ob_keys,
            &ob_agg,
            &ob_ver,
            &ob_payload,
            &ob_deliver,
        ],
    );
    let reject = exec_unless_empty(
        tx,
        rj.a.is_empty(),
        "UPDATE reservations r SET status = 'REJECTED', reject_reason = t.x
         FROM unnest($1::text[], $2::text[]) AS t(id, x)
         WHERE r.reservation_id = t.id",
        [&rj.a, &rj.b],
    );
    let compensate = exec_unless_empty(
        tx,
        rj.a.is_empty(),
        "INSERT INTO compensation_tasks (task_id, reservation_id, activity_id, sku_id, user_id, reason)
         SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], $6::text[])
         ON CONFLICT DO NOTHING",
        [&rj.c, &rj.a, &rj.e, &rj.f, &rj.g, &rj.b],
    );
    let inbox = exec_unless_empty(
        tx,
        ib_mid.is_empty(),
        "UPDATE consumer_inbox i SET status = t.st, decision = t.d, updated_at = now()
         FROM unnest($2::text[], $3::text[], $4::text[]) AS t(m, st, d)
         WHERE i.consumer_group = $1 AND i.message_id = t.m",
        [&cx.names.consumer_group, &ib_mid, &ib_status, &ib_decision],
    );
    // Wakes the outbox relays on commit (a NOTIFY is delivered only if the transaction commits).
    let notify = async {
        if ob_ids.is_empty() {
            return Ok::<_, tokio_postgres::Error>(());
        }
        tx.batch_execute(&format!("NOTIFY {}", super::outbox::OUTBOX_CHANNEL))
            .await
    };
    // Every statement runs to its answer; the first error (in statement order) is returned.
    let (r1, r2, r3, r4, r5, r6) =
        futures::join!(ledger, outbox, reject, compensate, inbox, notify);
    r1?;
    r2?;
    r3?;
    r4?;
    r5?;
    r6?;
    Ok(())
}

/// Runs one set-based statement of the transaction (prepared once per connection), unless it
/// has no rows to write.
async fn exec_unless_empty<const N: usize>(
    tx: &deadpool_postgres::Transaction<'_>,
    empty: bool,
    sql: &str,
    params: [&(dyn ToSql + Sync); N],
) -> Result<(), tokio_postgres::Error> {
    if empty {
        return Ok(());
    }
    let stmt = tx.prepare_cached(sql).await?;
    tx.execute(&stmt, &params).await?;
    Ok(())
}

/// Processes a batch in one transaction. Returns one decision per input, in order.
/// On `Err` nothing was committed (or the commit's result is unknown: redelivery resolves it).
pub async fn process_batch(
    client: &mut Client,
    names: &TxNames,
    items: &[Inbound],
    now: DateTime<Utc>,
    pay_window: Duration,
) -> Result<Vec<Decision>, TxError> {
    let mut decisions: Vec<Option<Decision>> = vec![None; items.len()];
    let tx = client.transaction().await?;

    // 1. Poison: quarantine with the raw body; it never fails the others.
    let mut q = Cols::default();
    let mut q_bodies: Vec<Vec<u8>> = Vec::new();
    let mut q_props: Vec<serde_json::Value> = Vec::new();
    let mut q_attempts: Vec<i32> = Vec::new();
    for (idx, item) in items.iter().enumerate() {
        if let Err(reason) = &item.event {
            q.j.push(item.property_message_id.clone());
            q.a.push(item.broker_msg_id.clone());
            q.b.push(reason.code().to_string());
            q.c.push(reason.to_string());
            q_bodies.push(item.raw_body.clone());
            q_props.push(item.properties.clone());
            q_attempts.push(item.delivery_attempt);
            decisions[idx] = Some(Decision::Quarantined(reason.code()));
        }
    }
    if !q.a.is_empty() {
        let stmt = tx
            .prepare_cached(
                "INSERT INTO quarantined_messages
                   (consumer_group, topic, message_id, broker_msg_id, reason, error, raw_body,
                    properties, delivery_attempt)
                 SELECT $1, $2, t.m, t.b, t.r, t.e, t.body, t.p, t.a
                 FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::bytea[],
                             $8::jsonb[], $9::int[]) AS t(m, b, r, e, body, p, a)",
            )
            .await?;
        tx.execute(
            &stmt,
            &[
                &names.consumer_group,
                &names.source_topic,
                &q.j,
                &q.a,
                &q.b,
                &q.c,
                &q_bodies,
                &q_props,
                &q_attempts,
            ],
        )
        .await?;
    }

    // 2. Inbox: the first writer of (group, message_id) owns the message's effect.
    let mut seen_msg: HashSet<&str> = HashSet::new();
    let mut candidates: Vec<usize> = Vec::new();
    for (idx, item) in items.iter().enumerate() {
        if let Ok(ev) = &item.event {
            if seen_msg.insert(ev.message_id.as_str()) {
                candidates.push(idx);
            } else {
                decisions[idx] = Some(Decision::DuplicateMessage);
            }
        }
    }
    let events: Vec<Option<&OrderCreateRequested>> =
        items.iter().map(|item| item.event.as_ref().ok()).collect();
    // Only indexes of decoded events are ever looked up here.
    let ev = |idx: usize| events[idx].expect("index of a decoded event");
    let fresh: HashSet<String> = if candidates.is_empty() {
        HashSet::new()
    } else {
        let stmt = tx
            .prepare_cached(
                "INSERT INTO consumer_inbox
                   (consumer_group, message_id, topic, reservation_id, order_id, status, delivery_attempt)
                 SELECT $1, t.m, $2, t.r, t.o, 'PROCESSING', t.a
                 FROM unnest($3::text[], $4::text[], $5::text[], $6::int[]) AS t(m, r, o, a)
                 ON CONFLICT DO NOTHING
                 RETURNING message_id",
            )
            .await?;
        let m: Vec<&str> = candidates
            .iter()
            .map(|&i| ev(i).message_id.as_str())
            .collect();
        let r: Vec<&str> = candidates
            .iter()
            .map(|&i| ev(i).reservation_id.as_str())
            .collect();
        let o: Vec<&str> = candidates
            .iter()
            .map(|&i| ev(i).order_id.as_str())
            .collect();
        let a: Vec<i32> = candidates
            .iter()
            .map(|&i| items[i].delivery_attempt)
            .collect();
        tx.query(
            &stmt,
            &[&names.consumer_group, &names.source_topic, &m, &r, &o, &a],
        )
        .await?
        .into_iter()
        .map(|row| row.get::<_, String>(0))
        .collect()
    };
    let mut owned: Vec<usize> = Vec::new();
    for &idx in &candidates {
        if fresh.contains(&ev(idx).message_id) {
            owned.push(idx);
        } else {
            decisions[idx] = Some(Decision::DuplicateMessage);
        }
    }

    // 3. Reservation decision row: the first message to record a reservation decides it.
    //    Expired ones are recorded as rejected right away (deadline from the message itself).
    let mut seen_rsv: HashSet<&str> = HashSet::new();
    let mut rsv_idx: Vec<usize> = Vec::new();
    for &idx in &owned {
        if seen_rsv.insert(ev(idx).reservation_id.as_str()) {
            rsv_idx.push(idx);
        } else {
            decisions[idx] = Some(Decision::DuplicateReservation);
        }
    }
    let expired = |idx: usize| ev(idx).reservation_valid_until <= now;
    let new_rsv: HashSet<String> = if rsv_idx.is_empty() {
        HashSet::new()
    } else {
        let stmt = tx
            .prepare_cached(
                "INSERT INTO reservations
                   (reservation_id, message_id, request_id, order_id, activity_id, sku_id, user_id,
                    status, reject_reason, reserved_at, valid_until)
                 SELECT t.r, t.m, t.q, t.o, t.a, t.s, t.u,
                        CASE WHEN t.x IS NULL THEN 'ORDERED' ELSE 'REJECTED' END, t.x, t.ra, t.vu
                 FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::int8[],
                             $7::int8[], $8::text[], $9::timestamptz[], $10::timestamptz[])
                      AS t(r, m, q, o, a, s, u, x, ra, vu)
                 ON CONFLICT (reservation_id) DO NOTHING
                 RETURNING reservation_id",
            )
            .await?;
        let mut c = Cols::default();
        for &i in &rsv_idx {
            let e = ev(i);
            c.a.push(e.reservation_id.clone());
            c.b.push(e.message_id.clone());
            c.c.push(e.request_id.clone());
            c.d.push(e.order_id.clone());
            c.e.push(e.activity_id);
            c.f.push(e.sku_id);
            c.g.push(e.user_id);
            c.j.push(expired(i).then(|| RejectReason::Expired.code().to_string()));
            c.h.push(e.reservation_created_at);
            c.i.push(e.reservation_valid_until);
        }
        tx.query(
            &stmt,
            &[&c.a, &c.b, &c.c, &c.d, &c.e, &c.f, &c.g, &c.j, &c.h, &c.i],
        )
        .await?
        .into_iter()
        .map(|row| row.get::<_, String>(0))
        .collect()
    };
    // (index, reason) of every rejection; compensation follows for each.
    let mut rejected: Vec<(usize, RejectReason)> = Vec::new();
    let mut eligible: Vec<usize> = Vec::new();
    for &idx in &rsv_idx {
        if !new_rsv.contains(&ev(idx).reservation_id) {
            decisions[idx] = Some(Decision::DuplicateReservation);
        } else if expired(idx) {
            rejected.push((idx, RejectReason::Expired));
        } else {
            eligible.push(idx);
        }
    }

    // 4. Orders: the partial unique index refuses a second valid order per buyer.
    let expires_at = now + pay_window;
    let mut inserted: HashSet<String> = HashSet::new();
    if !eligible.is_empty() {
        let stmt = tx
            .prepare_cached(
                "INSERT INTO orders
                   (order_id, reservation_id, activity_id, sku_id, user_id, status, amount_cents,
                    expires_at, reserved_at)
                 SELECT t.o, t.r, t.a, t.s, t.u, 'CREATED', k.price_cents, $6, t.ra
                 FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[],
                             $7::timestamptz[]) AS t(o, r, a, s, u, ra)
                 JOIN activity_skus k ON k.activity_id = t.a AND k.sku_id = t.s
                 ON CONFLICT DO NOTHING
                 RETURNING order_id",
            )
            .await?;
        let mut c = Cols::default();
        for &i in &eligible {
            let e = ev(i);
            c.a.push(e.order_id.clone());
            c.b.push(e.reservation_id.clone());
            c.e.push(e.activity_id);
            c.f.push(e.sku_id);
            c.g.push(e.user_id);
            c.h.push(e.reservation_created_at);
        }
        inserted = tx
            .query(&stmt, &[&c.a, &c.b, &c.e, &c.f, &c.g, &expires_at, &c.h])
            .await?
            .into_iter()
            .map(|row| row.get::<_, String>(0))
            .collect();
    }
    // Not inserted: either the buyer already holds a valid order, or the SKU is unknown.
    let missing: Vec<usize> = eligible
        .iter()
        .copied()
        .filter(|&i| !inserted.contains(&ev(i).order_id))
        .collect();
    if !missing.is_empty() {
        let stmt = tx
            .prepare_cached(
                "SELECT t.a, t.s FROM unnest($1::int8[], $2::int8[]) AS t(a, s)
                 WHERE EXISTS (SELECT 1 FROM activity_skus k WHERE k.activity_id = t.a AND k.sku_id = t.s)",
            )
            .await?;
        let a: Vec<i64> = missing.iter().map(|&i| ev(i).activity_id).collect();
        let s: Vec<i64> = missing.iter().map(|&i| ev(i).sku_id).collect();
        let known: HashSet<(i64, i64)> = tx
            .query(&stmt, &[&a, &s])
            .await?
            .into_iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        for &i in &missing {
            let reason = if known.contains(&(ev(i).activity_id, ev(i).sku_id)) {
                RejectReason::DuplicateBuyer
            } else {
                RejectReason::UnknownSku
            };
            rejected.push((i, reason));
        }
    }

    // 5. Final stock, taken as late as possible: the hot row's lock is what serialises the
    //    sale, so it should be held for the final UPDATE and the commit only.
    let mut per_sku: BTreeMap<(i64, i64), Vec<usize>> = BTreeMap::new();
    for &i in &eligible {
        if inserted.contains(&ev(i).order_id) {
            per_sku
                .entry((ev(i).activity_id, ev(i).sku_id))
                .or_default()
                .push(i);
        }
    }
    let cx = Ctx {
        names,
        events: &events,
        decisions: &decisions,
        now,
        expires_at,
    };
    let mut created: Vec<usize> = Vec::new();
    // Optimistic path, when an unlocked read shows enough stock for every SKU of the batch:
    // write every outcome as if all were granted, then decrement each SKU conditionally
    // (`remaining_stock >= wanted`, re-checked by PostgreSQL on the latest row version), in
    // key order. If one falls short (the sale ran out meanwhile), roll back to the savepoint
    // and take the locked path below.
    let mut settled = false;
    if !per_sku.is_empty() {
        let a: Vec<i64> = per_sku.keys().map(|k| k.0).collect();
        let s: Vec<i64> = per_sku.keys().map(|k| k.1).collect();
        let peek = tx
            .prepare_cached(
                "SELECT k.activity_id, k.sku_id, k.remaining_stock::int8
                 FROM unnest($1::int8[], $2::int8[]) AS t(a, s)
                 JOIN activity_skus k ON k.activity_id = t.a AND k.sku_id = t.s",
            )
            .await?;
        let peek_params: [&(dyn ToSql + Sync); 2] = [&a, &s];
        let (sp, rows) = futures::join!(
            tx.batch_execute("SAVEPOINT stock"),
            tx.query(&peek, &peek_params)
        );
        sp?;
        let left: HashMap<(i64, i64), i64> = rows?
            .into_iter()
            .map(|r| ((r.get(0), r.get(1)), r.get(2)))
            .collect();
        let enough = per_sku
            .iter()
            .all(|(k, idxs)| left.get(k).copied().unwrap_or(0) >= idxs.len() as i64);
        if enough {
            let all: Vec<usize> = per_sku.values().flatten().copied().collect();
            write_outcomes(&tx, &cx, &owned, &all, &rejected).await?;
            let take = tx
                .prepare_cached(
                    "UPDATE activity_skus SET remaining_stock = remaining_stock - $3, updated_at = now()
                     WHERE activity_id = $1 AND sku_id = $2 AND remaining_stock >= $3
                     RETURNING remaining_stock",
                )
                .await?;
            // One statement per SKU, pipelined: PostgreSQL runs them in key order (so two
            // batches never lock the same rows in opposite orders), in one round trip.
            let wants: Vec<i32> = per_sku.values().map(|idxs| idxs.len() as i32).collect();
            let params: Vec<[&(dyn ToSql + Sync); 3]> = per_sku
                .keys()
                .zip(&wants)
                .map(|((activity_id, sku_id), want)| {
                    [activity_id as &(dyn ToSql + Sync), sku_id, want]
                })
                .collect();
            let takes = params.iter().map(|p| tx.query_opt(&take, p));
            let mut granted_all = true;
            for taken in futures::future::join_all(takes).await {
                granted_all &= taken?.is_some();
            }
            if granted_all {
                created = all;
                settled = true;
            } else {
                metrics::counter!("order_tx_stock_fallback_total").increment(1);
                tx.batch_execute("ROLLBACK TO SAVEPOINT stock").await?;
            }
        }
    }
    if !settled {
        // Locked path: one conditional decrement per SKU, in key order (no deadlocks between
        // batches), granting at most what is left. Surplus orders are removed and rejected.
        // The row lock is FOR NO KEY UPDATE: the orders' foreign-key checks hold FOR KEY
        // SHARE on the same row, and FOR UPDATE would deadlock two transactions.
        let mut surplus: Vec<String> = Vec::new();
        for ((activity_id, sku_id), idxs) in &per_sku {
            let stmt = tx
                .prepare_cached(
                    "WITH cur AS (
                        SELECT activity_id, sku_id, remaining_stock FROM activity_skus
                        WHERE activity_id = $1 AND sku_id = $2 FOR NO KEY UPDATE)
                     UPDATE activity_skus s
                        SET remaining_stock = cur.remaining_stock - LEAST(cur.remaining_stock, $3),
                            updated_at = now()
                     FROM cur WHERE s.activity_id = cur.activity_id AND s.sku_id = cur.sku_id
                     RETURNING LEAST(cur.remaining_stock, $3)",
                )
                .await?;
            let want = idxs.len() as i32;
            let granted: i32 = tx
                .query_opt(&stmt, &[activity_id, sku_id, &want])
                .await?
                .map(|row| row.get(0))
                .unwrap_or(0);
            let granted = granted.clamp(0, want) as usize;
            if granted < idxs.len() {
                metrics::counter!("inventory_condition_update_miss_total")
                    .increment((idxs.len() - granted) as u64);
            }
            for (n, &i) in idxs.iter().enumerate() {
                if n < granted {
                    created.push(i);
                } else {
                    surplus.push(ev(i).order_id.clone());
                    rejected.push((i, RejectReason::NoStock));
                }
            }
        }
        if !surplus.is_empty() {
            let stmt = tx
                .prepare_cached("DELETE FROM orders WHERE order_id = ANY($1::text[])")
                .await?;
            tx.execute(&stmt, &[&surplus]).await?;
        }
        write_outcomes(&tx, &cx, &owned, &created, &rejected).await?;
    }

    // Injection point of §29.3: the process dies inside the transaction, before the commit
    // (`consume-inside-transaction=return` aborts like a SIGKILL; PostgreSQL rolls back).
    fail::fail_point!("consume-inside-transaction", |_| std::process::abort());
    tx.commit().await?;

    for &i in &created {
        decisions[i] = Some(Decision::Created {
            order_id: ev(i).order_id.clone(),
        });
    }
    for &(i, reason) in &rejected {
        decisions[i] = Some(Decision::Rejected(reason));
    }
    Ok(decisions
        .into_iter()
        .map(|d| d.unwrap_or(Decision::DuplicateMessage))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_ids_are_deterministic() {
        assert_eq!(order_created_event_id("ord_1"), "ord_1.v1.ORDER_CREATED");
        assert_eq!(cancel_if_unpaid_event_id("ord_1"), "ord_1.CANCEL_IF_UNPAID");
        assert_eq!(compensation_event_id("rsv_1"), "rsv_1.RELEASE_RESERVATION");
    }
}
