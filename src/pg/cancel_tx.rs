//! The timeout-cancel transaction (docs/architecture/recovery.md#timeout-cancel-and-payment): a
//! batch of CANCEL_ORDER_IF_UNPAID messages becomes one PostgreSQL transaction, set-based like
//! order creation, so the way back costs a few round trips per batch, not per order.
//!
//! Per message the guarantees of a single cancel hold: the message is claimed in the inbox
//! (a duplicate is a no-op); only an order still unpaid (`CREATED`/`PAYING`) and expired by the
//! database's clock is cancelled, by one conditional update of its row, so a payment and a
//! cancel can never both win; a paid or already-cancelled order is a counted no-op; a message
//! that came before its order expired leaves no trace (its inbox row is removed in the same
//! transaction) and is redelivered later. Every order that was cancelled gives its unit back to
//! the final stock (one conditional increment per SKU, in key order, like creation's
//! decrement), with its ledger credit, its compensation task (the Redis release) and its
//! ORDER_CANCELED and RELEASE_RESERVATION outbox rows, all in the same commit.

use crate::domain::status::{InboxStatus, OrderStatus};
use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};
use deadpool_postgres::Client;
use tokio_postgres::types::ToSql;

use super::errors::TxError;
use super::order_state::StateNames;
use super::rows::{
    CompensationRows, InboxClaims, InboxOutcomes, JsonDoc, LedgerMove, LedgerRows, OutboxEvent,
    OutboxRows, OutboxStart,
};
use super::statements::exec_unless_empty;
use crate::domain::events::{
    payload, OrderCanceled, OrderRef, ReleaseReservation, TAG_ORDER_CANCELED,
};
use crate::domain::CancelOutcome;

/// One cancel message handed to the transaction.
#[derive(Debug, Clone)]
pub struct CancelRequest {
    /// The message's `event_id`: its inbox key.
    pub message_id: String,
    pub order_id: String,
}

/// Who runs the transaction: the inbox's consumer group and the source topic, and the topics
/// the outbox rows go to.
#[derive(Debug, Clone)]
pub struct CancelNames {
    pub consumer_group: String,
    pub source_topic: String,
    pub state: StateNames,
}

/// An order the conditional update cancelled.
struct Canceled {
    version: i32,
    facts: OrderRef,
    /// Seconds from its deadline to its cancel.
    late_secs: f64,
    /// The stock row its unit came from, where it goes back
    /// (docs/architecture/redis.md#stock-buckets).
    stock_bucket: i16,
}

/// An ORDER_CANCELED drafted before its cancel commits, for a transaction message
/// (docs/architecture/messages.md#delivering-events): the half carries exactly this event, and the
/// cancel writes exactly it, or nothing.
#[derive(Debug, Clone)]
pub struct CanceledDraft {
    pub event: OrderCanceled,
    /// The order's version once cancelled (its version now + 1).
    pub version: i32,
}

impl CanceledDraft {
    /// The event as the outbox row the relay would send: the same message in either mode.
    pub fn row(&self, names: &StateNames) -> super::outbox::OutboxRow {
        let order_id = &self.event.base.order.order_id;
        super::outbox::OutboxRow {
            activity_id: self.event.base.order.activity_id,
            event_id: self.event.base.event_id.clone(),
            topic: names.order_event_topic.clone(),
            tag: TAG_ORDER_CANCELED.to_string(),
            message_key: order_id.clone(),
            aggregate_id: Some(order_id.clone()),
            aggregate_version: Some(self.version),
            payload: payload(&self.event),
            deliver_at: None,
            attempts: 1,
        }
    }
}

/// The drafts a cancel writes as its transaction messages' rows, and the deadline its commit
/// must meet (on PostgreSQL's clock, as the check-back reads it).
#[derive(Debug, Clone)]
pub struct CancelDrafts {
    pub by_order: HashMap<String, CanceledDraft>,
    pub deadline: DateTime<Utc>,
}

/// The ORDER_CANCELED each of `order_ids` would get if cancelled now: those still unpaid and
/// expired by the database's clock.
pub async fn draft_canceled(
    client: &Client,
    order_ids: &[&str],
) -> Result<Vec<CanceledDraft>, TxError> {
    let rows = client
        .query(
            "SELECT order_id, version, reservation_id, activity_id, sku_id, user_id FROM orders
             WHERE order_id = ANY($1::text[]) AND status IN ('CREATED', 'PAYING')
               AND expires_at <= now()",
            &[&order_ids],
        )
        .await?;
    let now = Utc::now();
    Ok(rows
        .into_iter()
        .map(|r| {
            let facts = super::order_ref(r.get(0), &r, 2);
            let version = r.get::<_, i32>(1) + 1;
            CanceledDraft {
                event: canceled_event(&facts, version, now),
                version,
            }
        })
        .collect())
}

/// ORDER_CANCELED of a timeout cancel.
fn canceled_event(facts: &OrderRef, version: i32, now: DateTime<Utc>) -> OrderCanceled {
    let mut ev = OrderCanceled::new(facts, version);
    ev.reason = Some("PAYMENT_TIMEOUT".to_string());
    ev.base.occurred_at = Some(now);
    ev
}

/// Cancels what can be cancelled among `items`, in one transaction. Returns one outcome per
/// item, in order. On `Err` nothing was committed (or the commit's result is unknown: the
/// redelivery finds the inbox rows if it landed).
pub async fn cancel_batch(
    client: &mut Client,
    names: &CancelNames,
    items: &[CancelRequest],
) -> Result<Vec<CancelOutcome>, TxError> {
    Ok(cancel_batch_with(client, names, items, None).await?.0)
}

/// [`cancel_batch`] writing, for an order cancelled at its drafted version, the drafted
/// ORDER_CANCELED as a TRANSACTION row (the others' as PENDING rows, as ever), and committing
/// only before the drafts' deadline. Returns the outcomes and the event ids written
/// TRANSACTION.
pub async fn cancel_batch_with(
    client: &mut Client,
    names: &CancelNames,
    items: &[CancelRequest],
    drafts: Option<&CancelDrafts>,
) -> Result<(Vec<CancelOutcome>, Vec<String>), TxError> {
    let tx = client.transaction().await?;
    let owned = claim_inbox(&tx, names, items).await?;
    let mut outcomes: Vec<CancelOutcome> = vec![CancelOutcome::Duplicate; items.len()];
    if owned.is_empty() {
        tx.commit().await?;
        return Ok((outcomes, Vec::new()));
    }
    let (canceled, current) = cancel_orders(&tx, items, &owned).await?;
    // The first owned message of a cancelled order carries the cancel; any other message for
    // the same order (a reconcile re-send under another id) finds it cancelled.
    let mut reported: HashSet<&str> = HashSet::new();
    let mut early: Vec<&str> = Vec::new();
    for &i in &owned {
        let order_id = items[i].order_id.as_str();
        outcomes[i] = match canceled.get(order_id) {
            Some(c) if reported.insert(order_id) => CancelOutcome::Canceled { version: c.version },
            Some(_) => CancelOutcome::AlreadyCanceled,
            None => match current.get(order_id) {
                None => CancelOutcome::NotFound,
                Some((status, _)) if status == OrderStatus::Paid.as_str() => {
                    CancelOutcome::AlreadyPaid
                }
                Some((status, _)) if status == OrderStatus::Canceled.as_str() => {
                    CancelOutcome::AlreadyCanceled
                }
                // Unpaid but not expired by the database's clock: the message came early.
                Some((_, expires_at)) => {
                    early.push(items[i].message_id.as_str());
                    CancelOutcome::NotYetExpired {
                        expires_at: *expires_at,
                    }
                }
            },
        };
    }
    let mut sorted: Vec<&Canceled> = canceled.values().collect();
    sorted.sort_by(|a, b| a.facts.order_id.cmp(&b.facts.order_id));
    give_stock_back(&tx, &sorted).await?;
    let written = Written {
        items,
        owned: &owned,
        outcomes: &outcomes,
        early: &early,
        canceled: &sorted,
    };
    let in_transaction = write_outcomes(&tx, names, &written, drafts).await?;
    // Last before the commit, with the orders' rows locked since the update: a check-back
    // that finds no row once it holds such a lock, past the deadline, knows this
    // transaction can no longer commit.
    if let (Some(d), false) = (drafts, in_transaction.is_empty()) {
        let in_time: bool = tx
            .query_one("SELECT clock_timestamp() < $1", &[&d.deadline])
            .await?
            .get(0);
        if !in_time {
            return Err(TxError::Transient(
                "the cancel passed its transaction deadline and rolled back".into(),
            ));
        }
    }
    tx.commit().await?;
    for c in &sorted {
        metrics::histogram!("order_cancel_delay_seconds").record(c.late_secs.max(0.0));
    }
    Ok((outcomes, in_transaction))
}

/// What a batch decided, for [`write_outcomes`].
struct Written<'a> {
    items: &'a [CancelRequest],
    owned: &'a [usize],
    outcomes: &'a [CancelOutcome],
    early: &'a [&'a str],
    canceled: &'a [&'a Canceled],
}

/// Step 1, the inbox: one row per new message id (in-batch duplicates removed first). Returns
/// the indexes of the messages this transaction owns.
async fn claim_inbox(
    tx: &Tx<'_>,
    names: &CancelNames,
    items: &[CancelRequest],
) -> Result<Vec<usize>, tokio_postgres::Error> {
    let mut first: HashMap<&str, usize> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        first.entry(item.message_id.as_str()).or_insert(i);
    }
    let candidates: Vec<usize> = (0..items.len())
        .filter(|&i| first.get(items[i].message_id.as_str()) == Some(&i))
        .collect();
    // A cancel message names its order, not its activity: the claim takes the order's.
    let mut claims = InboxClaims::default();
    for &i in &candidates {
        claims.push(
            &items[i].message_id,
            None,
            &items[i].order_id,
            0,
            None,
            None,
        );
    }
    let fresh = claims
        .claim(tx, &names.consumer_group, &names.source_topic)
        .await?;
    Ok(candidates
        .into_iter()
        .filter(|&i| fresh.contains(&items[i].message_id))
        .collect())
}

type Tx<'t> = deadpool_postgres::Transaction<'t>;

/// Step 2, the conditional cancel of every owned order still unpaid and expired, and the
/// current state of them all, pipelined in one round trip (the read sees the update). Returns
/// the cancelled orders by id, and every owned order's status and deadline.
#[allow(clippy::type_complexity)]
async fn cancel_orders(
    tx: &Tx<'_>,
    items: &[CancelRequest],
    owned: &[usize],
) -> Result<
    (
        HashMap<String, Canceled>,
        HashMap<String, (String, DateTime<Utc>)>,
    ),
    tokio_postgres::Error,
> {
    // Sorted: the rows are locked in key order, whatever order the messages came in.
    let mut order_ids: Vec<&str> = owned.iter().map(|&i| items[i].order_id.as_str()).collect();
    order_ids.sort_unstable();
    order_ids.dedup();
    let cancel = tx
        .prepare_cached(
            "UPDATE orders SET status = 'CANCELED', version = version + 1, canceled_at = now(),
                    cancel_reason = 'PAYMENT_TIMEOUT', updated_at = now()
             WHERE order_id = ANY($1::text[]) AND status IN ('CREATED', 'PAYING')
               AND expires_at <= now()
             RETURNING order_id, version, reservation_id, activity_id, sku_id, user_id,
                       extract(epoch FROM now() - expires_at)::float8, stock_bucket",
        )
        .await?;
    let read = tx
        .prepare_cached(
            "SELECT order_id, status, expires_at FROM orders WHERE order_id = ANY($1::text[])",
        )
        .await?;
    let params: [&(dyn ToSql + Sync); 1] = [&order_ids];
    let (updated, current) = futures::join!(tx.query(&cancel, &params), tx.query(&read, &params));
    let canceled = updated?
        .into_iter()
        .map(|r| {
            let facts = super::order_ref(r.get(0), &r, 2);
            (
                facts.order_id.clone(),
                Canceled {
                    version: r.get(1),
                    facts,
                    late_secs: r.get(6),
                    stock_bucket: r.get(7),
                },
            )
        })
        .collect();
    let current = current?
        .into_iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect();
    Ok((canceled, current))
}

/// Step 3, the units back to the final stock: one conditional increment per stock row (the
/// bucket each order took its unit from), in key order (two transactions never lock stock
/// rows in opposite orders), pipelined. An increment that would take a row past its total
/// stock fails the transaction: it would mean a unit returned twice, and nothing of the batch
/// is committed.
async fn give_stock_back(tx: &Tx<'_>, canceled: &[&Canceled]) -> Result<(), TxError> {
    let mut per_row: BTreeMap<(i64, i64, i16), i32> = BTreeMap::new();
    for c in canceled {
        *per_row
            .entry((c.facts.activity_id, c.facts.sku_id, c.stock_bucket))
            .or_default() += 1;
    }
    if per_row.is_empty() {
        return Ok(());
    }
    let stmt = tx
        .prepare_cached(
            "UPDATE stock_buckets SET remaining_stock = remaining_stock + $4, updated_at = now()
             WHERE activity_id = $1 AND sku_id = $2 AND bucket = $3
               AND remaining_stock + $4 <= total_stock
             RETURNING remaining_stock",
        )
        .await?;
    let params: Vec<[&(dyn ToSql + Sync); 4]> = per_row
        .iter()
        .map(|((a, s, k), n)| [a as &(dyn ToSql + Sync), s, k, n])
        .collect();
    let returned = futures::future::join_all(params.iter().map(|p| tx.query_opt(&stmt, p))).await;
    for (((a, s, k), n), r) in per_row.iter().zip(returned) {
        if r?.is_none() {
            return Err(TxError::Unknown(format!(
                "returning {n} unit(s) would take activity {a} SKU {s} bucket {k} past its total stock"
            ).into()));
        }
    }
    Ok(())
}

/// What the cancelled orders write: a ledger credit and a compensation task each, their
/// ORDER_CANCELED (beside its half message when one was drafted at this version) and
/// RELEASE_RESERVATION; the event ids written as transaction messages.
#[derive(Default)]
struct CanceledRows<'a> {
    ledger: LedgerRows<'a>,
    tasks: CompensationRows,
    outbox: OutboxRows<'a>,
    in_transaction: Vec<String>,
}

fn canceled_rows<'a>(
    names: &'a CancelNames,
    canceled: &[&'a Canceled],
    drafts: Option<&CancelDrafts>,
) -> CanceledRows<'a> {
    let mut out = CanceledRows::default();
    let now = Utc::now();
    for c in canceled {
        let f = &c.facts;
        out.ledger.push(
            f.activity_id,
            f.sku_id,
            &f.order_id,
            c.stock_bucket,
            LedgerMove::OrderCanceled,
        );
        out.tasks.push(
            &f.reservation_id,
            f.activity_id,
            f.sku_id,
            f.user_id,
            "ORDER_CANCELED",
        );
        let drafted = drafts
            .and_then(|d| d.by_order.get(&f.order_id))
            .filter(|d| d.version == c.version);
        let (ev, start) = match drafted {
            Some(d) => {
                out.in_transaction.push(d.event.base.event_id.clone());
                (d.event.clone(), OutboxStart::Transaction)
            }
            None => (canceled_event(f, c.version, now), OutboxStart::Pending),
        };
        out.outbox.push(OutboxEvent {
            event_id: ev.base.event_id.clone(),
            activity_id: f.activity_id,
            topic: &names.state.order_event_topic,
            tag: TAG_ORDER_CANCELED,
            key: &f.order_id,
            aggregate: Some((&f.order_id, Some(c.version))),
            payload: JsonDoc::of(&ev),
            deliver_at: None,
            first_send_at: None,
            start,
        });
        let mut release = ReleaseReservation::new(f, "ORDER_CANCELED");
        release.occurred_at = Some(now);
        let topic = &names.state.compensate_topic;
        out.outbox
            .push(OutboxEvent::release(&release, topic, &f.reservation_id));
    }
    out
}

/// Step 4, the consequences, pipelined: ledger credits, compensation tasks and outbox rows of
/// the cancelled orders, the inbox status of every owned message (an early one's row removed,
/// so its redelivery is not a duplicate), and a NOTIFY for the outbox relays.
async fn write_outcomes(
    tx: &Tx<'_>,
    names: &CancelNames,
    w: &Written<'_>,
    drafts: Option<&CancelDrafts>,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let (items, owned, outcomes, early, canceled) =
        (w.items, w.owned, w.outcomes, w.early, w.canceled);
    let CanceledRows {
        ledger,
        tasks,
        outbox,
        in_transaction,
    } = canceled_rows(names, canceled, drafts);
    let mut settled = InboxOutcomes::default();
    for &i in owned {
        if !matches!(outcomes[i], CancelOutcome::NotYetExpired { .. }) {
            let decision = outcomes[i].label().to_uppercase();
            settled.push(
                items[i].message_id.clone(),
                InboxStatus::Succeeded.as_str(),
                decision,
            );
        }
    }
    let inbox_rows = settled.settle(tx, &names.consumer_group, false);
    let unclaim = exec_unless_empty(
        tx,
        early.is_empty(),
        "DELETE FROM consumer_inbox_by_day WHERE consumer_group = $1 AND message_id = ANY($2::text[])",
        [&names.consumer_group, &early],
    );
    let notify = async {
        if outbox.is_empty() {
            return Ok(());
        }
        super::outbox::notify(&**tx).await
    };
    let (r1, r2, r3, r4, r5, r6) = futures::join!(
        ledger.insert(tx),
        tasks.insert(tx),
        outbox.insert(tx),
        inbox_rows,
        unclaim,
        notify
    );
    // Every statement ran to its end; the first error, if any, is the transaction's.
    [r1, r2, r3, r4, r5, r6]
        .into_iter()
        .collect::<Result<(), _>>()?;
    Ok(in_transaction)
}

/// Orders still unpaid `grace` after their pay deadline, oldest first, at most `limit`: what
/// the timeout sweep cancels when a timer message is late or lost.
pub async fn overdue_orders(
    client: &impl tokio_postgres::GenericClient,
    grace: std::time::Duration,
    limit: i64,
) -> Result<Vec<String>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT order_id FROM orders
             WHERE status IN ('CREATED', 'PAYING')
               AND expires_at <= now() - make_interval(secs => $1)
             ORDER BY expires_at LIMIT $2",
            &[&grace.as_secs_f64(), &limit],
        )
        .await?
        .into_iter()
        .map(|r| r.get(0))
        .collect())
}
