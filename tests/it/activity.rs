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
        fair_window_ms: None,
        passes: None,
        pass_registration_opens_at: None,
        pass_registration_closes_at: None,
        pass_pow_difficulty: 0,
    }
}

#[tokio::test]
async fn a_fair_window_is_kept_with_its_seed_and_fixed_once_the_sale_started() {
    let env = TestEnv::without_topics().await;
    let seed_of = |id: i64| {
        let env = &env;
        async move {
            let pool = env.pool(1).await;
            let c = pool.get().await.unwrap();
            let r = c
                .query_one(
                    "SELECT fair_window_ms, fair_seed FROM activities WHERE activity_id = $1",
                    &[&id],
                )
                .await
                .unwrap();
            (r.get::<_, i32>(0), r.get::<_, Option<String>>(1))
        }
    };
    let future = CreateArgs {
        fair_window_ms: Some(2_000),
        ..args(20, 10, 3600)
    };
    create(&env.settings, &future).await.unwrap();
    let (ms, seed) = seed_of(20).await;
    assert_eq!(ms, 2_000);
    let seed = seed.expect("a seed made with the window");
    // Created again (a window changed before the start): the same seed, kept for the audit.
    create(
        &env.settings,
        &CreateArgs {
            fair_window_ms: Some(1_500),
            ..args(20, 10, 3600)
        },
    )
    .await
    .unwrap();
    assert_eq!(seed_of(20).await, (1_500, Some(seed.clone())));
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM admin_audit WHERE action = 'fair_window_set' \
             AND target = 'activity:20' AND detail->>'seed' = '{seed}'"
        ))
        .await,
        2,
        "each window set is in the activity's audit trail with the seed"
    );
    // Past what a held request can wait, or once started with another window: refused.
    let too_long = CreateArgs {
        fair_window_ms: Some(env.settings.draw_hold_ms() as u32 + 1),
        ..args(21, 10, 3600)
    };
    let e = create(&env.settings, &too_long).await.unwrap_err();
    assert!(format!("{e:#}").contains("--fair-window-ms"), "{e:#}");
    create(&env.settings, &args(22, 10, -5)).await.unwrap();
    let late = CreateArgs {
        fair_window_ms: Some(1_000),
        ..args(22, 10, -5)
    };
    let e = create(&env.settings, &late).await.unwrap_err();
    assert!(format!("{e:#}").contains("fair window is fixed"), "{e:#}");
    assert_eq!(seed_of(22).await, (0, None));
    // Re-asserting the window it has is fine.
    let same = CreateArgs {
        fair_window_ms: Some(0),
        ..args(22, 10, -5)
    };
    create(&env.settings, &same).await.unwrap();
    env.cleanup().await;
}

#[tokio::test]
async fn create_is_idempotent_and_refuses_to_change_a_started_activity() {
    let env = TestEnv::without_topics().await;
    let redis = env.redis().await;

    // Not started yet: creating twice is fine, and the stock may still change.
    let future = args(10, 100, 3600);
    create(&env.settings, &future).await.unwrap();
    create(&env.settings, &future).await.unwrap();
    assert_eq!(
        redis.stock().sku_stock(10, 1).await.unwrap(),
        Some((100, 100))
    );
    create(&env.settings, &args(10, 120, 3600)).await.unwrap();
    assert_eq!(
        redis.stock().sku_stock(10, 1).await.unwrap(),
        Some((120, 120))
    );
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
    assert_eq!(
        redis.stock().sku_stock(11, 1).await.unwrap(),
        Some((50, 50))
    );

    // Split into stock buckets: the same split in PostgreSQL and Redis, fixed once created,
    // and a stock change before the start re-splits both.
    let mut split = args(12, 10, 3600);
    split.stock_buckets = 3;
    create(&env.settings, &split).await.unwrap();
    assert_eq!(redis.buckets(12).await.unwrap(), 3);
    let shares = |rows: &seckill::redis::SkuBuckets| -> Vec<i64> {
        rows.buckets.iter().map(|b| b.total).collect()
    };
    assert_eq!(
        shares(&redis.moves().bucket_stock(12, 1).await.unwrap()),
        [4, 3, 3]
    );
    assert_eq!(
        env.count("SELECT count(*) FROM stock_buckets WHERE activity_id = 12")
            .await,
        3
    );
    split.skus = vec![(1, 20, 500)];
    create(&env.settings, &split).await.unwrap();
    assert_eq!(
        shares(&redis.moves().bucket_stock(12, 1).await.unwrap()),
        [7, 7, 6]
    );
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
