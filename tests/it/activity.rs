//! `activity create`: idempotent, warms Redis, and refuses to change the stock of an
//! activity that has started.

use crate::common::TestEnv;
use chrono::{Duration, Utc};
use seckill::roles::ops::activity::{create, CreateArgs};

fn args(activity_id: i64, stock: i32, starts_in_secs: i64) -> CreateArgs {
    CreateArgs {
        activity_id,
        name: "sale".into(),
        skus: vec![(1, stock, 500)],
        starts_at: Some(Utc::now() + Duration::seconds(starts_in_secs)),
        duration_secs: 600,
        reservation_valid_secs: Some(120),
        stock_buckets: 1,
    }
}

#[tokio::test]
async fn create_is_idempotent_and_refuses_to_change_a_started_activity() {
    let env = TestEnv::without_topics().await;
    let redis = env.redis().await;

    // Not started yet: creating twice is fine, and the stock may still change.
    let future = args(10, 100, 3600);
    create(&env.settings, &future).await.unwrap();
    create(&env.settings, &future).await.unwrap();
    assert_eq!(redis.sku_stock(10, 1).await.unwrap(), Some((100, 100)));
    create(&env.settings, &args(10, 120, 3600)).await.unwrap();
    assert_eq!(redis.sku_stock(10, 1).await.unwrap(), Some((120, 120)));
    assert_eq!(
        env.count("SELECT total_stock::int8 FROM activity_skus WHERE activity_id = 10")
            .await,
        120
    );

    // Started: the same stock is accepted again, another stock is refused everywhere.
    let started = args(11, 50, -5);
    create(&env.settings, &started).await.unwrap();
    create(&env.settings, &started).await.unwrap();
    let err = create(&env.settings, &args(11, 60, -5)).await.unwrap_err();
    assert!(err.to_string().contains("has started"), "{err:#}");
    assert_eq!(
        env.count("SELECT total_stock::int8 FROM activity_skus WHERE activity_id = 11")
            .await,
        50
    );
    assert_eq!(redis.sku_stock(11, 1).await.unwrap(), Some((50, 50)));

    // Split into stock buckets: the same split in PostgreSQL and Redis, fixed once created,
    // and a stock change before the start re-splits both.
    let mut split = args(12, 10, 3600);
    split.stock_buckets = 3;
    create(&env.settings, &split).await.unwrap();
    assert_eq!(redis.buckets(12).await.unwrap(), 3);
    let shares = |rows: &seckill::redis::SkuBuckets| -> Vec<i64> {
        rows.buckets.iter().map(|b| b.total).collect()
    };
    assert_eq!(shares(&redis.bucket_stock(12, 1).await.unwrap()), [4, 3, 3]);
    assert_eq!(
        env.count("SELECT count(*) FROM stock_buckets WHERE activity_id = 12")
            .await,
        3
    );
    split.skus = vec![(1, 20, 500)];
    create(&env.settings, &split).await.unwrap();
    assert_eq!(shares(&redis.bucket_stock(12, 1).await.unwrap()), [7, 7, 6]);
    assert_eq!(
        env.count(
            "SELECT total_stock::int8 FROM stock_buckets WHERE activity_id = 12 AND bucket = 2"
        )
        .await,
        6
    );
    split.stock_buckets = 2;
    let err = create(&env.settings, &split).await.unwrap_err();
    assert!(err.to_string().contains("stock bucket"), "{err:#}");
    env.cleanup().await;
}
