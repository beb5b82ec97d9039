//! The order transaction (docs/architecture/order-creation.md#order-creation): for a batch of
//! ORDER_CREATE_REQUESTED messages, one PostgreSQL transaction writes the inbox, the reservation
//! decision, the orders, one conditional final-stock update per SKU, the ledger, the outbox,
//! compensation tasks for rejections and quarantine rows for poison. It commits or it leaves no
//! trace; the caller ACKs only after a commit.
//!
//! Every per-message guarantee holds inside a batch: a duplicate message or reservation is a
//! no-op, a buyer gets at most one valid order, stock never goes below zero (partial stock
//! gives as many orders as units left and rejects the rest), and a poison body is quarantined
//! without failing the others. Set-based statements (`unnest`) keep the round trips per batch
//! constant, and the hot stock row is locked as late as possible.
//!
//! `process_batch` is the list of steps: quarantine poison → claim the inbox → record the
//! reservations → insert the orders → take the stock (optimistically, else locked) → write
//! the outcomes → stamp the commit → commit.

use crate::domain::status::InboxStatus;
use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};
use deadpool_postgres::Client;
use tokio_postgres::types::Type;

use super::errors::TxError;
use super::statements::{exec_unless_empty, Sql};
use crate::domain::order_create::PoisonReason;
use crate::domain::{Decision, OrderCreateRequested, RejectReason};

mod docs;
mod rows;
mod stock;
use super::rows::{
    InboxClaims, LedgerMove, LedgerRows, OutboxRows, Poison, QuarantineRows, Returned,
};
use rows::{
    home_bucket, inbox_corrections, push_release, OrderRows, RejectionRows, ReservationRows,
};
use stock::group_by_sku;

/// One message handed to the transaction.
#[derive(Debug, Clone)]
pub struct Inbound {
    /// The decoded event, or why it can never be processed.
    pub event: Result<OrderCreateRequested, PoisonReason>,
    /// The body exactly as received, kept in quarantine when it is poison (a decoded event
    /// needs no copy: it may be left empty).
    pub raw_body: Vec<u8>,
    /// Message properties (message_id, traceparent, ...), kept in quarantine with poison
    /// (`Null` when the event decoded).
    pub properties: serde_json::Value,
    /// `message_id` property, when the body cannot be parsed (`None` when it was).
    pub property_message_id: Option<String>,
    /// The broker's id of the message, kept in quarantine with poison (empty otherwise).
    pub broker_msg_id: String,
    /// Broker delivery attempt (0 = first delivery).
    pub delivery_attempt: i32,
}

impl Inbound {
    /// The message's id: its event's, or for poison its `message_id` property.
    pub fn message_id(&self) -> Option<&str> {
        match &self.event {
            Ok(e) => Some(&e.message_id),
            Err(_) => self.property_message_id.as_deref(),
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
    /// How long before its deadline an order's timer is sent (`scan.timer_lead_secs`).
    pub timer_lead: Duration,
}

impl TxNames {
    /// The order-create group's names: its inbox, its source topic and where its outcomes go.
    pub fn order_create(settings: &crate::config::Settings) -> Self {
        let n = settings.names();
        Self {
            consumer_group: n.order_create_group.clone(),
            source_topic: n.order_create_topic.clone(),
            order_event_topic: n.order_event_topic.clone(),
            order_timeout_topic: n.order_timeout_topic.clone(),
            compensate_topic: n.compensate_topic.clone(),
            timer_lead: Duration::seconds(settings.scan.timer_lead_secs as i64),
        }
    }
}

/// One batch on its way through the transaction: the decoded events and what each came to.
struct Batch<'a> {
    names: &'a TxNames,
    items: &'a [Inbound],
    /// The decoded event of each item (`None`: poison).
    events: Vec<Option<&'a OrderCreateRequested>>,
    /// What each item came to, once known; the rest are duplicates of an earlier message.
    decisions: Vec<Option<Decision>>,
    now: DateTime<Utc>,
    /// The payment deadline of every order this batch creates.
    expires_at: DateTime<Utc>,
    /// `now` and `expires_at` as the created orders' event documents write them.
    doc_times: docs::DocTimes,
    /// Reject every message this batch owns, whatever it holds ([`withdraw`]).
    withdraw: bool,
    /// Reject every message this batch owns as expired or expiring ([`shed`]).
    shed: bool,
}

impl<'a> Batch<'a> {
    fn new(names: &'a TxNames, items: &'a [Inbound], now: DateTime<Utc>, pay: Duration) -> Self {
        Self {
            names,
            items,
            events: items.iter().map(|item| item.event.as_ref().ok()).collect(),
            decisions: vec![None; items.len()],
            now,
            expires_at: now + pay,
            doc_times: docs::DocTimes::new(now, now + pay),
            withdraw: false,
            shed: false,
        }
    }

    /// The event at `idx`; only indexes of decoded events are ever looked up.
    fn ev(&self, idx: usize) -> &'a OrderCreateRequested {
        self.events[idx].expect("index of a decoded event")
    }

    /// Why the message at `idx` is rejected before any order is tried, if it is.
    fn early_rejection(&self, idx: usize) -> Option<RejectReason> {
        if self.withdraw {
            Some(RejectReason::Withdrawn)
        } else if self.ev(idx).reservation_valid_until <= self.now {
            Some(RejectReason::Expired)
        } else if self.shed {
            Some(RejectReason::Expiring)
        } else {
            None
        }
    }

    /// The inbox outcome the claim writes for the message at `idx`: its early rejection, else
    /// a created order (what nearly every message comes to); [`rows::inbox_corrections`]
    /// rewrites the rows that came to something else.
    fn expected_outcome(&self, idx: usize) -> (&'static str, &'static str) {
        match self.early_rejection(idx) {
            Some(reason) => (InboxStatus::Rejected.as_str(), reason.code()),
            None => (InboxStatus::Succeeded.as_str(), "CREATED"),
        }
    }

    /// The decisions in input order, once the transaction has committed.
    fn finish(mut self, created: &[usize], rejected: &[(usize, RejectReason)]) -> Vec<Decision> {
        for &i in created {
            self.decisions[i] = Some(Decision::Created {
                order_id: self.ev(i).order_id.clone(),
            });
        }
        for &(i, reason) in rejected {
            self.decisions[i] = Some(Decision::Rejected(reason));
        }
        self.decisions
            .into_iter()
            .map(|d| d.unwrap_or(Decision::DuplicateMessage))
            .collect()
    }
}

/// The transaction the steps run in.
pub type Tx<'t> = deadpool_postgres::Transaction<'t>;

/// Withdraws messages no copy of which may become an order any more: the same transaction
/// as [`process_batch`], except that every message it owns is rejected (`WITHDRAWN`) with its
/// compensation, so the reservation's unit goes back through the compensation path, once. A
/// message the inbox already holds is a duplicate: what its earlier copy came to stands. The
/// inbox row it writes fences any copy still in the broker (a later delivery is a duplicate).
pub async fn withdraw(
    client: &mut Client,
    names: &TxNames,
    items: &[Inbound],
    now: DateTime<Utc>,
) -> Result<Vec<Decision>, TxError> {
    let tx = client.transaction().await?;
    let decisions = withdraw_in(&tx, names, items, now).await?;
    tx.commit().await?;
    Ok(decisions)
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
    run(client, Batch::new(names, items, now, pay_window)).await
}

/// The fast lane's transaction (docs/architecture/roles.md#the-fast-lane): the steps of
/// [`process_batch`], except that every message it owns is rejected, `EXPIRED` when its
/// validity has passed, else `EXPIRING`, with its compensation; no order and no stock row is
/// touched. Duplicates stay duplicates: what an earlier copy came to stands.
pub async fn shed(
    client: &mut Client,
    names: &TxNames,
    items: &[Inbound],
    now: DateTime<Utc>,
) -> Result<Vec<Decision>, TxError> {
    let mut b = Batch::new(names, items, now, Duration::zero());
    b.shed = true;
    run(client, b).await
}

/// The steps, in one transaction.
async fn run(client: &mut Client, mut b: Batch<'_>) -> Result<Vec<Decision>, TxError> {
    let tx = client.transaction().await?;
    let (created, rejected) = steps(&tx, &mut b).await?;
    // Fault-injection point: the process dies inside the transaction, before the commit
    // (`consume-inside-transaction=return` aborts like a SIGKILL; PostgreSQL rolls back).
    fail::fail_point!("consume-inside-transaction", |_| std::process::abort());
    tx.commit().await?;
    Ok(b.finish(&created, &rejected))
}

/// [`withdraw`] inside the caller's transaction (an operator's discard commits it with its
/// audit row). Nothing is decided until the caller commits.
pub async fn withdraw_in(
    tx: &Tx<'_>,
    names: &TxNames,
    items: &[Inbound],
    now: DateTime<Utc>,
) -> Result<Vec<Decision>, tokio_postgres::Error> {
    let mut b = Batch::new(names, items, now, Duration::zero());
    b.withdraw = true;
    let (created, rejected) = steps(tx, &mut b).await?;
    Ok(b.finish(&created, &rejected))
}

/// The steps of [`process_batch`]: the created and the rejected messages, by index.
async fn steps(
    tx: &Tx<'_>,
    b: &mut Batch<'_>,
) -> Result<(Vec<usize>, Vec<(usize, RejectReason)>), tokio_postgres::Error> {
    quarantine_poison(tx, b).await?;
    let owned = claim_inbox(tx, b).await?;
    let (eligible, mut rejected) = record_reservations(tx, b, &owned).await?;
    let inserted = insert_orders(tx, b, &eligible, &mut rejected).await?;
    let per_row = group_by_sku(b, &eligible, &inserted);
    // Optimistic: step 6 before step 5's decrements, so the hot row is locked last.
    if let Some(all) = stock::enough_unlocked(tx, &per_row).await? {
        write_outcomes(tx, b, &owned, &all, &HashMap::new(), &rejected).await?;
        if stock::take_and_stamp(tx, &per_row, all.len()).await? {
            return Ok((all, rejected));
        }
    }
    // Locked: step 5 decides who gets a unit, then step 6 writes it, then step 7.
    let (created, moved) = stock::take_stock_locked(tx, b, &per_row, &mut rejected).await?;
    write_outcomes(tx, b, &owned, &created, &moved, &rejected).await?;
    if !created.is_empty() {
        stock::stamp_commit(tx, created.len()).await?;
    }
    Ok((created, rejected))
}

/// Step 1, poison: quarantined with the raw body; it never fails the others.
async fn quarantine_poison(tx: &Tx<'_>, b: &mut Batch<'_>) -> Result<(), tokio_postgres::Error> {
    let mut rows = QuarantineRows::default();
    for (idx, item) in b.items.iter().enumerate() {
        if let Err(reason) = &item.event {
            rows.push(Poison {
                message_id: item.property_message_id.clone(),
                broker_msg_id: item.broker_msg_id.clone(),
                reason: reason.code().to_string(),
                error: reason.to_string(),
                body: item.raw_body.clone(),
                properties: item.properties.clone(),
                delivery_attempt: item.delivery_attempt,
            });
            b.decisions[idx] = Some(Decision::Quarantined(reason.code()));
        }
    }
    rows.insert(tx, &b.names.consumer_group, &b.names.source_topic)
        .await
}

/// Step 2, inbox: the first writer of (group, message_id) owns the message's effect. Returns
/// the indexes this batch owns.
async fn claim_inbox(tx: &Tx<'_>, b: &mut Batch<'_>) -> Result<Vec<usize>, tokio_postgres::Error> {
    let mut seen_msg: HashSet<&str> = HashSet::new();
    let mut candidates: Vec<usize> = Vec::new();
    for (idx, ev) in b.events.iter().enumerate() {
        if let Some(ev) = ev {
            if seen_msg.insert(ev.message_id.as_str()) {
                candidates.push(idx);
            } else {
                b.decisions[idx] = Some(Decision::DuplicateMessage);
            }
        }
    }
    let mut claims = InboxClaims::default();
    for &i in &candidates {
        let e = b.ev(i);
        let attempt = b.items[i].delivery_attempt;
        let r = Some(e.reservation_id.as_str());
        let expected = Some(b.expected_outcome(i));
        claims.push(
            &e.message_id,
            r,
            &e.order_id,
            attempt,
            Some(e.activity_id),
            expected,
        );
    }
    let fresh = claims
        .claim(tx, &b.names.consumer_group, &b.names.source_topic)
        .await?;
    let mut owned: Vec<usize> = Vec::new();
    for idx in candidates {
        if fresh.contains(&b.ev(idx).message_id) {
            owned.push(idx);
        } else {
            b.decisions[idx] = Some(Decision::DuplicateMessage);
        }
    }
    Ok(owned)
}

/// Step 3, the reservation decision row: the first message to record a reservation decides
/// it. Expired ones are recorded as rejected right away (deadline from the message itself).
/// Returns the indexes still eligible for an order, and the rejections so far.
async fn record_reservations(
    tx: &Tx<'_>,
    b: &mut Batch<'_>,
    owned: &[usize],
) -> Result<(Vec<usize>, Vec<(usize, RejectReason)>), tokio_postgres::Error> {
    let mut seen_rsv: HashSet<&str> = HashSet::new();
    let mut rsv_idx: Vec<usize> = Vec::new();
    for &idx in owned {
        if seen_rsv.insert(b.ev(idx).reservation_id.as_str()) {
            rsv_idx.push(idx);
        } else {
            b.decisions[idx] = Some(Decision::DuplicateReservation);
        }
    }
    let new_rsv = if rsv_idx.is_empty() {
        Returned::All
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
                 ON CONFLICT (activity_id, reservation_id) DO NOTHING
                 RETURNING reservation_id",
            )
            .await?;
        let mut rows = ReservationRows::default();
        for &i in &rsv_idx {
            rows.push(b.ev(i), b.early_rejection(i));
        }
        Returned::of(tx.query(&stmt, &rows.params()).await?, rsv_idx.len())
    };
    let mut rejected: Vec<(usize, RejectReason)> = Vec::new();
    let mut eligible: Vec<usize> = Vec::new();
    for idx in rsv_idx {
        if !new_rsv.contains(&b.ev(idx).reservation_id) {
            b.decisions[idx] = Some(Decision::DuplicateReservation);
        } else if let Some(reason) = b.early_rejection(idx) {
            rejected.push((idx, reason));
        } else {
            eligible.push(idx);
        }
    }
    Ok((eligible, rejected))
}

/// Step 4, orders: the partial unique index refuses a second valid order per buyer. Those not
/// inserted are rejected as a duplicate buyer or an unknown SKU. Returns the inserted ids.
async fn insert_orders(
    tx: &Tx<'_>,
    b: &Batch<'_>,
    eligible: &[usize],
    rejected: &mut Vec<(usize, RejectReason)>,
) -> Result<Returned, tokio_postgres::Error> {
    let mut inserted = Returned::All;
    if !eligible.is_empty() {
        let stmt = tx
            .prepare_cached(
                "INSERT INTO orders
                   (order_id, reservation_id, activity_id, sku_id, user_id, status, amount_cents,
                    expires_at, reserved_at, stock_bucket, channel)
                 SELECT t.o, t.r, t.a, t.s, t.u, 'CREATED', k.price_cents, $6, t.ra, t.b, t.c
                 FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[],
                             $7::timestamptz[], $8::int2[], $9::text[])
                      AS t(o, r, a, s, u, ra, b, c)
                 JOIN activity_skus k ON k.activity_id = t.a AND k.sku_id = t.s
                 ON CONFLICT DO NOTHING
                 RETURNING order_id",
            )
            .await?;
        let mut rows = OrderRows::default();
        for &i in eligible {
            rows.push(b.ev(i));
        }
        // One order per reservation, and the reservations are distinct: so are the ids, unless
        // two messages name one order (then fewer rows come back and the set is read).
        let rows = tx.query(&stmt, &rows.params(&b.expires_at)).await?;
        inserted = Returned::of(rows, eligible.len());
    }
    let missing: Vec<usize> = eligible
        .iter()
        .copied()
        .filter(|&i| !inserted.contains(&b.ev(i).order_id))
        .collect();
    if !missing.is_empty() {
        // Not every batch's: planned for these ids (pg::Sql::PerRun).
        let a: Vec<i64> = missing.iter().map(|&i| b.ev(i).activity_id).collect();
        let s: Vec<i64> = missing.iter().map(|&i| b.ev(i).sku_id).collect();
        let known: HashSet<(i64, i64)> = tx
            .query_typed(
                "SELECT t.a, t.s FROM unnest($1::int8[], $2::int8[]) AS t(a, s)
                 WHERE EXISTS (SELECT 1 FROM activity_skus k WHERE k.activity_id = t.a AND k.sku_id = t.s)",
                &[(&a, Type::INT8_ARRAY), (&s, Type::INT8_ARRAY)],
            )
            .await?
            .into_iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        for &i in &missing {
            let reason = if known.contains(&(b.ev(i).activity_id, b.ev(i).sku_id)) {
                RejectReason::DuplicateBuyer
            } else {
                RejectReason::UnknownSku
            };
            rejected.push((i, reason));
        }
    }
    Ok(inserted)
}

/// Step 6: ledger, outbox, rejections with their compensation, inbox status of every owned
/// message. Independent statements, sent pipelined on the one connection.
async fn write_outcomes<'a>(
    tx: &Tx<'_>,
    b: &Batch<'a>,
    owned: &[usize],
    created: &[usize],
    moved: &HashMap<usize, i16>,
    rejected: &[(usize, RejectReason)],
) -> Result<(), tokio_postgres::Error> {
    let mut ledger = LedgerRows::default();
    // Two events per created order, in one statement; one per rejection.
    let mut created_events = docs::CreatedEvents::with_capacity(created.len());
    let mut outbox = OutboxRows::with_capacity(rejected.len());
    for &i in created {
        let e = b.ev(i);
        let bucket = moved.get(&i).copied().unwrap_or_else(|| home_bucket(e));
        ledger.push(
            e.activity_id,
            e.sku_id,
            &e.order_id,
            bucket,
            LedgerMove::OrderCreated,
        );
        created_events.push(e);
    }
    let mut rejections = RejectionRows::default();
    for &(i, reason) in rejected {
        let e = b.ev(i);
        rejections.push(e, reason);
        push_release(&mut outbox, b, e, reason);
    }
    let inbox = inbox_corrections(b, owned, rejected);

    // Rejections are the exception: their reservations and inbox rows are searched with
    // plans made for these ids (pg::Sql::PerRun), whatever this connection has cached.
    let reject = exec_unless_empty(
        tx,
        rejections.reservation_ids.is_empty(),
        Sql::PerRun(rows::MARK_REJECTED, &[Type::TEXT_ARRAY, Type::TEXT_ARRAY]),
        [&rejections.reservation_ids, &rejections.reasons],
    );
    let inbox = inbox.settle(tx, &b.names.consumer_group, true);
    // Wakes the outbox relays on commit (a NOTIFY is delivered only if the transaction commits).
    let notify = async {
        if outbox.is_empty() && created_events.is_empty() {
            return Ok::<_, tokio_postgres::Error>(());
        }
        crate::pg::outbox::notify(&**tx).await
    };
    // Every statement runs to its answer; the first error (in statement order) is returned.
    let (r1, r2, r3, r4, r5, r6, r7) = futures::join!(
        ledger.insert(tx),
        created_events.insert(tx, b),
        outbox.insert(tx),
        reject,
        rejections.tasks.insert(tx),
        inbox,
        notify
    );
    // Every statement ran to its end; the first error, if any, is the transaction's.
    [r1, r2, r3, r4, r5, r6, r7].into_iter().collect()
}
