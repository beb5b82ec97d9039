//! Sold-out answers from memory (docs/architecture/hot-path.md#sold-out-from-memory), against the
//! real Redis and broker: once Redis said SOLD_OUT, the API answers it without Redis, except for
//! the SKU's winners, and a released unit is sold again within a poll.

use crate::common::{eventually, reserve_as as reserve, start_api, TestEnv};
use reqwest::StatusCode;

/// The API's `reservation_sold_out_from_memory_total`, from its ops listener.
async fn from_memory(ops: &str) -> u64 {
    let text = reqwest::get(format!("{ops}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("reservation_sold_out_from_memory_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_sold_out_sku_is_answered_from_memory_except_for_its_winners_until_a_unit_comes_back() {
    let env = TestEnv::with_topics().await;
    env.activity(1300, 1, 2).await;
    let api = start_api(env.settings.clone()).await;
    let (base, ops) = (api.base.clone(), api.ops.clone());
    let (s1, _) = reserve(&base, 1300, 1, 1, "a").await;
    let (s2, won) = reserve(&base, 1300, 1, 2, "b").await;
    assert_eq!((s1, s2), (StatusCode::ACCEPTED, StatusCode::ACCEPTED));
    // Redis says SOLD_OUT; the instance loads the winners and answers by itself from then on.
    assert_eq!(reserve(&base, 1300, 1, 3, "c").await.0, StatusCode::GONE);
    let mut user = 100;
    eventually(5, "sold out answered from memory", || {
        user += 1;
        let (base, ops, u) = (base.clone(), ops.clone(), user);
        async move {
            let (s, b) = reserve(&base, 1300, 1, u, "x").await;
            assert_eq!(s, StatusCode::GONE, "{b}");
            assert_eq!(b["error"]["code"], "SOLD_OUT");
            from_memory(&ops).await > 0
        }
    })
    .await;
    let answered = from_memory(&ops).await;

    // A winner repeating its request still gets its reservation; asking anew, it is told it
    // has one. Both went to Redis.
    let (s, b) = reserve(&base, 1300, 1, 1, "a").await;
    assert_eq!(
        (s, &b["duplicate"]),
        (StatusCode::ACCEPTED, &true.into()),
        "{b}"
    );
    let (s, b) = reserve(&base, 1300, 1, 1, "a2").await;
    assert_eq!(b["error"]["code"], "ALREADY_PURCHASED", "{s} {b}");
    assert_eq!(from_memory(&ops).await, answered);

    // A unit comes back (buyer 2's reservation released): the next buyer gets it within a poll.
    let redis = env.redis().await;
    let rid = won["reservation_id"].as_str().unwrap().to_owned();
    let released = redis
        .sends()
        .release_many(
            &[seckill::redis::Release {
                activity_id: 1300,
                sku_id: 1,
                reservation_id: &rid,
                reason: "TEST",
            }],
            0,
        )
        .await
        .unwrap();
    assert_eq!(released, vec!["RELEASED".to_string()]);
    eventually(3, "the released unit is sold again", || {
        let base = base.clone();
        async move { reserve(&base, 1300, 1, 5, "e").await.0 == StatusCode::ACCEPTED }
    })
    .await;
    // Sold out again, with a new winner: its repeat is not refused from memory.
    eventually(3, "sold out again, from memory", || {
        user += 1;
        let (base, ops, u) = (base.clone(), ops.clone(), user);
        async move {
            reserve(&base, 1300, 1, u, "x").await.0 == StatusCode::GONE
                && from_memory(&ops).await > answered
        }
    })
    .await;
    let (s, b) = reserve(&base, 1300, 1, 5, "e").await;
    assert_eq!(
        (s, &b["duplicate"]),
        (StatusCode::ACCEPTED, &true.into()),
        "{b}"
    );
    api.stop.cancel();
    let _ = api.server.await;
    env.cleanup().await;
}
