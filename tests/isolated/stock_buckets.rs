//! Hot-SKU stock buckets (docs/architecture/redis.md#stock-buckets): a SKU's stock split into K
//! buckets, each its own Redis hash tag and PostgreSQL stock row. Buyers each reserve in
//! their home bucket only, so one reservation per buyer and a repeated request id stay exact;
//! leftovers move to a bucket that refuses buyers (docs/architecture/redis.md#moving-leftovers), so
//! a sale sells out completely however unevenly its buyers map, and a move cut between its
//! debit and its credit is finished by the next pass, never lost or credited twice.

use crate::common;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::Duration;

use crate::common::{eventually, TestEnv};
use chrono::Utc;
use futures::StreamExt;
use seckill::domain::ids::{home_bucket, reservation_bucket};
use seckill::redis::{RedisStore, ReserveResult, Shard};
use seckill::roles::scan::rebalance::rebalance;

/// One reservation attempt in the buyer's home bucket, as the API makes it.
async fn reserve(
    redis: &RedisStore,
    activity_id: i64,
    user_id: i64,
    request_id: &str,
) -> ReserveResult {
    common::try_reserve(redis, activity_id, user_id, request_id, 600_000)
        .await
        .1
}

/// Buyer ids whose home bucket (of `buckets`) is `bucket`.
fn buyers_of(bucket: u16, buckets: u16, from: i64, n: usize) -> Vec<i64> {
    (from..)
        .filter(|&u| home_bucket(u, buckets) == bucket)
        .take(n)
        .collect()
}

/// A SKU split over three buckets sells out to the buyers of one bucket as the leftovers move to
/// it. A move cut between its debit and its credit leaves its units in transit, and the next pass
/// finishes it once.
///
/// One story: the move is cut when bucket 0 has sold its share, and the sell-out that follows buys
/// the units that move and the later ones bring.
#[tokio::test]
async fn a_split_sku_sells_out_to_the_buyers_of_one_bucket_and_a_move_cut_midway_is_finished() {
    let env = TestEnv::without_topics().await;
    env.activity_in_buckets(1500, &[(1, 12)], 3).await;
    let redis = env.redis().await;
    assert_eq!(redis.buckets(1500).await.unwrap(), 3);
    let stock = redis.moves().bucket_stock(1500, 1).await.unwrap();
    let shares: Vec<i64> = stock.buckets.iter().map(|b| b.total).collect();
    assert_eq!(shares, [4, 4, 4]);
    // PostgreSQL splits the same way.
    assert_eq!(
        env.count(
            "SELECT count(*) FROM stock_buckets WHERE activity_id = 1500 AND total_stock = 4"
        )
        .await,
        3
    );

    // Every buyer maps to bucket 0: its 4 units go, the 5th buyer is refused.
    let buyers = buyers_of(0, 3, 1, 40);
    let mut winners: Vec<(i64, String)> = Vec::new();
    for &u in &buyers[..4] {
        match reserve(&redis, 1500, u, "r1").await {
            ReserveResult::Reserved(v) => winners.push((u, v.reservation_id)),
            other => panic!("buyer {u}: {other:?}"),
        }
    }
    assert!(winners.iter().all(|(_, id)| reservation_bucket(id) == 0));
    assert_eq!(
        reserve(&redis, 1500, buyers[4], "r1").await,
        ReserveResult::SoldOut
    );

    // A move cut between its debit and its credit: the units are in transit, not lost.
    let _only_failpoints = common::process_failpoints().await;
    fail::cfg("rebalance-after-debit", "return").unwrap();
    assert!(rebalance(&redis, 1500, "test").await.is_err());
    fail::remove("rebalance-after-debit");
    let open = redis.moves().open_transfers(1500, 1).await.unwrap();
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!((open[0].to, open[0].units), (0, 2), "{open:?}");
    let cut = redis.moves().bucket_stock(1500, 1).await.unwrap();
    assert_eq!(cut.in_transit, 2);
    assert_eq!(cut.remaining(), 6, "{cut:?}");
    // Conservation holds with the units in transit (the invariant check counts them).
    let report = env.invariants(1500, 1).await;
    assert_eq!(report.figures.redis_remaining, 8, "{:?}", report.figures);
    assert!(
        !report.violations.iter().any(|v| v.starts_with("Redis")),
        "{:?}",
        report.violations
    );

    // The next pass finishes it first (credited once), then moves again only on new refusals.
    let moved = rebalance(&redis, 1500, "test").await.unwrap();
    assert_eq!((moved.resumed, moved.moves), (1, 0), "{moved:?}");
    assert!(redis
        .moves()
        .open_transfers(1500, 1)
        .await
        .unwrap()
        .is_empty());
    // Finishing it again credits nothing: the target's trail knows the transfer.
    assert!(!redis
        .moves()
        .transfer_in(1500, 1, &open[0], Utc::now().timestamp_millis())
        .await
        .unwrap());
    let after = redis.moves().bucket_stock(1500, 1).await.unwrap();
    assert_eq!((after.in_transit, after.remaining()), (0, 8), "{after:?}");

    // Bucket 0's buyers keep coming; each refusal brings leftovers, until all 12 are sold.
    let mut next = 5;
    for _ in 0..100 {
        if winners.len() == 12 {
            break;
        }
        let u = buyers[next];
        match reserve(&redis, 1500, u, "r1").await {
            ReserveResult::Reserved(v) => {
                winners.push((u, v.reservation_id));
                next += 1;
            }
            ReserveResult::SoldOut => {
                rebalance(&redis, 1500, "test").await.unwrap();
            }
            other => panic!("buyer {u}: {other:?}"),
        }
    }
    assert_eq!(winners.len(), 12, "every unit sold to bucket 0's buyers");
    let stock = redis.moves().bucket_stock(1500, 1).await.unwrap();
    assert_eq!(stock.remaining(), 0, "{stock:?}");
    assert_eq!(stock.in_transit, 0);
    assert_eq!(
        stock.buckets.iter().map(|b| b.moved_out).sum::<i64>(),
        8,
        "{stock:?}"
    );
    // Nothing more to sell: the next buyer is refused, and no move finds units.
    assert_eq!(
        reserve(&redis, 1500, buyers[next], "r1").await,
        ReserveResult::SoldOut
    );
    assert_eq!(rebalance(&redis, 1500, "test").await.unwrap().moves, 0);
    // One per buyer and the same request id stay exact: both answered in the home bucket.
    let (u, id) = &winners[0];
    assert!(matches!(
        reserve(&redis, 1500, *u, "r2").await,
        ReserveResult::AlreadyPurchased { reservation_id } if &reservation_id == id
    ));
    assert!(matches!(
        reserve(&redis, 1500, *u, "r1").await,
        ReserveResult::Duplicate(v) if &v.reservation_id == id
    ));
    let distinct: HashSet<i64> = winners.iter().map(|(u, _)| *u).collect();
    assert_eq!(distinct.len(), 12);
    // The trail: every move on both sides, under one transfer id.
    let mut conn = redis.pool.get().await.unwrap();
    let mut outs = 0;
    let mut ins = 0;
    for b in 0..3 {
        let shard = Shard::new(1500, b, 3);
        let o: HashMap<String, String> = deadpool_redis::redis::cmd("HGETALL")
            .arg(redis.keys.transfers_out(shard, 1))
            .query_async(&mut *conn)
            .await
            .unwrap();
        let i: HashMap<String, String> = deadpool_redis::redis::cmd("HGETALL")
            .arg(redis.keys.transfers_in(shard, 1))
            .query_async(&mut *conn)
            .await
            .unwrap();
        outs += o.len();
        ins += i.len();
    }
    assert!(outs >= 2 && outs == ins, "{outs} out, {ins} in");
    env.cleanup().await;
}

/// An activity id whose three bucket tags land on three different primaries.
fn activity_over_three_primaries(redis: &RedisStore, from: i64) -> i64 {
    let primary = |slot: u16| match slot {
        0..=5460 => 0,
        5461..=10922 => 1,
        _ => 2,
    };
    (from..)
        .find(|&a| {
            let p: BTreeSet<u8> = (0..3)
                .map(|b| primary(redis.keys.slot(Shard::new(a, b, 3))))
                .collect();
            p.len() == 3
        })
        .unwrap()
}

/// A sale split over three buckets on Redis Cluster sells out through the real roles, however
/// unevenly its buyers map to the buckets, and every reservation becomes an order.
///
/// One story: refused buyers come back until the sale is sold out, and the end checks count the
/// orders those reservations became.
#[tokio::test]
async fn a_split_sale_on_the_cluster_sells_out_through_the_roles_however_its_buyers_map() {
    const STOCK: i32 = 30;
    let env = TestEnv::with_topics().await.on_redis_cluster();
    let redis = env.redis().await;
    let activity = activity_over_three_primaries(&redis, 7600);
    env.activity_in_buckets(activity, &[(1, STOCK)], 3).await;
    // Uneven: 45 buyers of bucket 0 (share 10), 10 of bucket 1 (10), 5 of bucket 2 (10).
    let mut buyers = buyers_of(0, 3, 1, 45);
    buyers.extend(buyers_of(1, 3, 1, 10));
    buyers.extend(buyers_of(2, 3, 1, 5));
    let roles = common::SaleRoles::start(&env).await;
    let api_port = roles.api_port;
    // Refused buyers come back, as buyers of a flash sale do, until every unit is sold (or a
    // bounded number of rounds).
    let base = format!("http://127.0.0.1:{api_port}");
    let mut winners: HashMap<i64, String> = HashMap::new();
    for _round in 0..120 {
        let waiting: Vec<i64> = buyers
            .iter()
            .copied()
            .filter(|u| !winners.contains_key(u))
            .collect();
        let answers: Vec<(i64, u16, serde_json::Value)> = futures::stream::iter(waiting)
            .map(|u| {
                let base = base.clone();
                async move {
                    let (status, body) = common::reserve_as(&base, activity, 1, u, "r1").await;
                    (u, status.as_u16(), body)
                }
            })
            .buffer_unordered(16)
            .collect()
            .await;
        for (u, status, body) in answers {
            match status {
                202 => {
                    let id = body["reservation_id"].as_str().unwrap().to_string();
                    assert_eq!(reservation_bucket(&id), home_bucket(u, 3), "{id}");
                    assert!(winners.insert(u, id).is_none(), "buyer {u} won twice");
                }
                410 => {}
                other => panic!("buyer {u}: {other} {body}"),
            }
        }
        if winners.len() == STOCK as usize {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        winners.len(),
        STOCK as usize,
        "the sale sold out completely"
    );
    let won_in: Vec<usize> = (0..3)
        .map(|b| {
            winners
                .values()
                .filter(|id| reservation_bucket(id) == b)
                .count()
        })
        .collect();
    assert_eq!(won_in.iter().sum::<usize>(), 30);
    assert!(won_in[0] > 10, "bucket 0 sold leftovers: {won_in:?}");
    eventually(
        120,
        "every reservation an order, every bucket row drained",
        || async {
            let r = env.invariants(activity, 1).await;
            r.ok() && r.figures.unrecorded == 0 && r.figures.valid_orders == i64::from(STOCK)
        },
    )
    .await;
    let r = env.invariants(activity, 1).await;
    assert!(r.ok(), "{:?}", r.violations);
    assert_eq!(
        env.count(&format!(
            "SELECT sum(remaining_stock)::int8 FROM stock_buckets WHERE activity_id = {activity}"
        ))
        .await,
        0
    );
    roles.stop().await;
    env.cleanup().await;
}
