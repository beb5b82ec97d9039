//! Sale passes in PostgreSQL (docs/architecture/hot-path.md#sale-passes): an activity's pass
//! policy, and the registrations, one per buyer, at most the activity's limit.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

/// What an activity asks of the buyers who register for a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassPolicy {
    /// Passes issued at most.
    pub limit: i32,
    pub issued: i32,
    pub opens_at: DateTime<Utc>,
    pub closes_at: DateTime<Utc>,
    /// Counters of proof of work asked of each registration (0: none).
    pub pow_difficulty: i32,
}

/// The pass settings `seckill activity create` writes.
#[derive(Debug, Clone, Copy)]
pub struct PassSpec {
    pub limit: i32,
    pub opens_at: Option<DateTime<Utc>>,
    pub closes_at: Option<DateTime<Utc>>,
    pub pow_difficulty: i32,
}

/// Requires passes for an activity that has not started (or sets what it already has).
/// `Ok(false)`: it has started with other settings, which stay.
pub async fn set_policy(
    client: &impl GenericClient,
    activity_id: i64,
    spec: &PassSpec,
    now: DateTime<Utc>,
) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            "UPDATE activities SET pass_limit = $2, pass_registration_opens_at = $3,
                    pass_registration_closes_at = $4, pass_pow_difficulty = $5,
                    updated_at = now()
             WHERE activity_id = $1 AND passes_issued <= $2
               AND (starts_at > $6 OR (pass_limit IS NOT DISTINCT FROM $2
                    AND pass_registration_opens_at IS NOT DISTINCT FROM $3
                    AND pass_registration_closes_at IS NOT DISTINCT FROM $4
                    AND pass_pow_difficulty = $5))",
            &[
                &activity_id,
                &spec.limit,
                &spec.opens_at,
                &spec.closes_at,
                &spec.pow_difficulty,
                &now,
            ],
        )
        .await?;
    Ok(n == 1)
}

/// The activity's pass policy: `Ok(None)` for no such activity, `Ok(Some(None))` for one that
/// sells without passes.
pub async fn policy(
    client: &impl GenericClient,
    activity_id: i64,
) -> Result<Option<Option<PassPolicy>>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT pass_limit, passes_issued, COALESCE(pass_registration_opens_at, created_at),
                    COALESCE(pass_registration_closes_at, starts_at), pass_pow_difficulty
             FROM activities WHERE activity_id = $1",
            &[&activity_id],
        )
        .await?;
    Ok(row.map(|r| {
        r.get::<_, Option<i32>>(0).map(|limit| PassPolicy {
            limit,
            issued: r.get(1),
            opens_at: r.get(2),
            closes_at: r.get(3),
            pow_difficulty: r.get(4),
        })
    }))
}

/// A registration's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registered {
    /// A pass issued now.
    Issued {
        pass_id: String,
        issued_at: DateTime<Utc>,
    },
    /// The buyer held one already: the same pass.
    Held {
        pass_id: String,
        issued_at: DateTime<Utc>,
    },
    /// Every pass of the activity is issued.
    Exhausted,
}

/// Issues `pass_id` to the buyer unless they hold one, within the activity's limit, in one
/// transaction: two registrations of one buyer get one pass, and the count never passes the
/// limit.
pub async fn register(
    client: &mut tokio_postgres::Client,
    activity_id: i64,
    user_id: i64,
    pass_id: &str,
    client_addr: &str,
) -> Result<Registered, tokio_postgres::Error> {
    let held = "SELECT pass_id, issued_at FROM sale_passes WHERE activity_id = $1 AND user_id = $2";
    let tx = client.transaction().await?;
    if let Some(r) = tx.query_opt(held, &[&activity_id, &user_id]).await? {
        return Ok(Registered::Held {
            pass_id: r.get(0),
            issued_at: r.get(1),
        });
    }
    let inserted = tx
        .query_opt(
            "INSERT INTO sale_passes (activity_id, user_id, pass_id, client_addr)
             VALUES ($1, $2, $3, $4) ON CONFLICT (activity_id, user_id) DO NOTHING
             RETURNING issued_at",
            &[&activity_id, &user_id, &pass_id, &client_addr],
        )
        .await?;
    let Some(inserted) = inserted else {
        // Another registration of this buyer committed meanwhile: theirs is the pass.
        drop(tx);
        let r = client.query_one(held, &[&activity_id, &user_id]).await?;
        return Ok(Registered::Held {
            pass_id: r.get(0),
            issued_at: r.get(1),
        });
    };
    let counted = tx
        .execute(
            "UPDATE activities SET passes_issued = passes_issued + 1
             WHERE activity_id = $1 AND passes_issued < pass_limit",
            &[&activity_id],
        )
        .await?;
    if counted == 0 {
        tx.rollback().await?;
        return Ok(Registered::Exhausted);
    }
    tx.commit().await?;
    Ok(Registered::Issued {
        pass_id: pass_id.to_string(),
        issued_at: inserted.get(0),
    })
}
