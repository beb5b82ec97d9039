//! The trust boundary against hostile callers (docs/architecture/security.md#security-model):
//! buyers are who a verified token says, they read only what is theirs, and only the payment
//! provider's signed notification pays an order, once, for its amount.

use std::path::Path;

use crate::common::{
    bearer, created_orders, error_code as code, notify_payment, post_notification, start_api,
    TestEnv,
};
use base64::Engine;
use chrono::Utc;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::StatusCode;
use seckill::auth::buyer::{mint_with_key, TokenSpec};
use seckill::auth::signature::sign;
use secrecy::SecretString;
use serde_json::{json, Value};

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name),
    )
    .unwrap()
}

/// A token for `user` signed by the fixture key `signer` under `kid`.
fn signed(alg: Algorithm, signer: &str, kid: &str, user: i64) -> String {
    let spec = TokenSpec {
        user_id: user,
        ttl: std::time::Duration::from_secs(600),
        audience: "seckill",
        issuer: "",
    };
    mint_with_key(alg, &fixture(signer), kid, &spec).unwrap()
}

/// A token with hand-made claims, signed by the shop's real Ed25519 key.
fn with_claims(claims: Value) -> String {
    let mut header = Header::new(Algorithm::EdDSA);
    header.kid = Some("test-a".into());
    let key = EncodingKey::from_ed_pem(&fixture("buyer-signer-a.pem")).unwrap();
    seckill::auth::install_crypto();
    jsonwebtoken::encode(&header, &claims, &key).unwrap()
}

/// `alg: none`: claims without a signature.
fn unsigned(user: i64) -> String {
    let b64 = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    let now = Utc::now().timestamp();
    format!(
        "{}.{}.",
        b64(json!({"alg": "none", "typ": "JWT"})),
        b64(json!({"sub": user.to_string(), "aud": "seckill", "exp": now + 600, "nbf": now - 1}))
    )
}

async fn reserve_with(
    base: &str,
    activity: i64,
    auth: Option<&str>,
    body: Value,
) -> (StatusCode, Value) {
    let mut req = reqwest::Client::new()
        .post(format!(
            "{base}/v1/activities/{activity}/skus/1/reservations"
        ))
        .json(&body);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let r = req.send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn get_with(url: String, auth: &str) -> (StatusCode, Value) {
    let r = reqwest::Client::new()
        .get(url)
        .header("authorization", auth)
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Forged, expired, wrong-audience and unsigned buyer tokens get 401, another buyer's token gets
/// 403, and none writes anything. The shop's real keys reserve, and a buyer reads only their own
/// reservation.
///
/// One story: the refusals leave the stock whole, the real tokens then take from that stock, and
/// the owner-only reads ask about the reservation those tokens made.
#[tokio::test]
async fn forged_expired_wrong_audience_and_unsigned_tokens_are_refused_and_write_nothing() {
    let env = TestEnv::with_topics().await;
    env.activity(1100, 1, 10).await;
    let mut settings = env.settings.clone();
    settings.auth.jwks_file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/buyer-jwks.json")
        .display()
        .to_string();
    let api = start_api(settings).await;
    let now = Utc::now().timestamp();
    let b = |t: String| format!("Bearer {t}");
    // The JWKS's public key used as an HMAC secret: the classic algorithm confusion.
    let jwks: Value = serde_json::from_slice(&fixture("buyer-jwks.json")).unwrap();
    let public_x = jwks["keys"][0]["x"].as_str().unwrap().to_string();
    let confused = seckill::auth::buyer::mint_dev(
        &SecretString::from(public_x),
        &TokenSpec {
            user_id: 5,
            ttl: std::time::Duration::from_secs(600),
            audience: "seckill",
            issuer: "",
        },
    )
    .unwrap();
    let attacks: Vec<(&str, Option<String>)> = vec![
        ("no token", None),
        ("not a JWT", Some(b("garbage".into()))),
        ("basic auth", Some("Basic dXNlcjpwYXNz".into())),
        ("unsigned (alg none)", Some(b(unsigned(5)))),
        (
            "forged: the attacker's key under the shop's kid",
            Some(b(signed(
                Algorithm::EdDSA,
                "buyer-signer-b.pem",
                "test-a",
                5,
            ))),
        ),
        (
            "unknown kid",
            Some(b(signed(Algorithm::EdDSA, "buyer-signer-a.pem", "nope", 5))),
        ),
        ("HS256 keyed with the public key", Some(b(confused))),
        (
            "expired",
            Some(b(with_claims(
                json!({"sub": "5", "aud": "seckill", "exp": now - 120, "nbf": now - 900, "iat": now - 900}),
            ))),
        ),
        (
            "not yet valid",
            Some(b(with_claims(
                json!({"sub": "5", "aud": "seckill", "exp": now + 900, "nbf": now + 600, "iat": now}),
            ))),
        ),
        (
            "wrong audience",
            Some(b(with_claims(
                json!({"sub": "5", "aud": "another-shop", "exp": now + 600, "nbf": now, "iat": now}),
            ))),
        ),
        (
            "no audience",
            Some(b(with_claims(
                json!({"sub": "5", "exp": now + 600, "nbf": now, "iat": now}),
            ))),
        ),
        (
            "sub is not a buyer id",
            Some(b(with_claims(
                json!({"sub": "admin", "aud": "seckill", "exp": now + 600, "nbf": now, "iat": now}),
            ))),
        ),
    ];
    for (what, auth) in &attacks {
        let (s, body) = reserve_with(
            &api.base,
            1100,
            auth.as_deref(),
            json!({"user_id": 5, "request_id": "steal", "quantity": 1}),
        )
        .await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{what}: {body}");
        assert_eq!(code(&body), Some("UNAUTHENTICATED"), "{what}");
        // No detail of why: the same message for every refusal.
        assert_eq!(
            body["error"]["message"],
            "a valid buyer token is required (Authorization: Bearer <token>)",
            "{what}"
        );
    }
    // A real token of buyer 6 cannot reserve for buyer 5.
    let six = b(signed(Algorithm::EdDSA, "buyer-signer-a.pem", "test-a", 6));
    let (s, body) = reserve_with(
        &api.base,
        1100,
        Some(&six),
        json!({"user_id": 5, "request_id": "steal", "quantity": 1}),
    )
    .await;
    assert_eq!((s, code(&body)), (StatusCode::FORBIDDEN, Some("FORBIDDEN")));
    // Nothing was written: the stock is whole, no reservation, no buyer, no request id.
    let redis = env.redis().await;
    assert_eq!(
        redis.stock().sku_stock(1100, 1).await.unwrap(),
        Some((10, 10))
    );
    assert_eq!(redis.recovery().pending_count(1100).await.unwrap(), 0);
    let pg_rows = env.count("SELECT count(*) FROM reservations").await
        + env.count("SELECT count(*) FROM orders").await;
    assert_eq!(pg_rows, 0);

    // The shop's real keys, EdDSA and ES256, are accepted; the buyer is the token's `sub`, the
    // body's user_id may be left out.
    let (s, a) = reserve_with(
        &api.base,
        1100,
        Some(&six),
        json!({"request_id": "mine", "quantity": 1}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{a}");
    let seven = b(signed(Algorithm::ES256, "buyer-signer-c.pem", "test-c", 7));
    let (s, body) = reserve_with(
        &api.base,
        1100,
        Some(&seven),
        json!({"user_id": 7, "request_id": "mine", "quantity": 1}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{body}");
    assert_eq!(
        redis.stock().sku_stock(1100, 1).await.unwrap(),
        Some((10, 8))
    );
    let rid = a["reservation_id"].as_str().unwrap();
    let fields = redis.reservation(1100, rid).await.unwrap();
    assert_eq!(fields["user_id"], "6");

    // Reads are owner-only: buyer 7 asking for 6's reservation gets what an unknown id gets.
    let url = format!("{}/v1/reservations/{rid}", api.base);
    let (s, mine) = get_with(url.clone(), &six).await;
    assert_eq!(s, StatusCode::OK, "{mine}");
    assert_eq!(mine["user_id"], 6);
    let (s, theirs) = get_with(url, &seven).await;
    let unknown = format!(
        "{}/v1/reservations/{}",
        api.base,
        seckill::domain::Ids::generate(1, 0).reservation_id
    );
    let (s_unknown, nobody) = get_with(unknown, &seven).await;
    assert_eq!((s, &theirs), (s_unknown, &nobody));
    assert_eq!(
        (s, code(&theirs)),
        (StatusCode::NOT_FOUND, Some("RESERVATION_NOT_FOUND"))
    );
    // An id naming a stock bucket the activity does not have is unknown too, not an error.
    let no_such_bucket = seckill::domain::Ids::generate(1100, 11).reservation_id;
    let (s, body) = get_with(
        format!("{}/v1/reservations/{no_such_bucket}", api.base),
        &seven,
    )
    .await;
    assert_eq!((s, &body), (s_unknown, &nobody), "{no_such_bucket}");
    let (s, _) = get_with(format!("{}/v1/reservations/{rid}", api.base), "Bearer x").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    api.stop.cancel();
    env.cleanup().await;
}

#[tokio::test]
async fn another_buyers_order_reads_as_not_found() {
    let env = TestEnv::without_topics().await;
    env.activity(1110, 1, 10).await;
    let ids = created_orders(&env, 1110, &[21]).await.remove(0);
    let api = start_api(env.settings.clone()).await;
    for (path, not_found) in [
        (format!("/v1/orders/{}", ids.order_id), "ORDER_NOT_FOUND"),
        (
            format!("/v1/reservations/{}", ids.reservation_id),
            "RESERVATION_NOT_FOUND",
        ),
    ] {
        let url = format!("{}{path}", api.base);
        let (s, mine) = get_with(url.clone(), &bearer(21)).await;
        assert_eq!(s, StatusCode::OK, "{path}: {mine}");
        assert_eq!(mine["user_id"], 21, "{path}");
        let (s, theirs) = get_with(url, &bearer(22)).await;
        assert_eq!(
            (s, code(&theirs)),
            (StatusCode::NOT_FOUND, Some(not_found)),
            "{path}"
        );
    }
    api.stop.cancel();
    env.cleanup().await;
}

#[tokio::test]
async fn only_a_fresh_signed_notification_for_the_exact_amount_pays_an_order_once() {
    let env = TestEnv::without_topics().await;
    env.activity(1120, 1, 10).await;
    let orders = created_orders(&env, 1120, &[31, 32]).await;
    let (first, second) = (&orders[0].order_id, &orders[1].order_id);
    let api = start_api(env.settings.clone()).await;
    let base = &api.base;
    let body = |order: &str, payment: &str, amount: i64| {
        json!({"order_id": order, "payment_id": payment, "amount_cents": amount}).to_string()
    };
    let good = body(first, "pay-A", 100);
    let secret = env.settings.payments.webhook_secrets[0].clone();
    let now = Utc::now().timestamp();
    let wrong_secret = SecretString::from("whsec-an-attacker-guessed-this".to_string());
    let refused: Vec<(&str, String, Option<String>)> = vec![
        ("unsigned", good.clone(), None),
        ("garbage signature", good.clone(), Some("t=1,v1=zz".into())),
        (
            "stale (301 s old)",
            good.clone(),
            Some(sign(&secret, now - 301, good.as_bytes())),
        ),
        (
            "from the future",
            good.clone(),
            Some(sign(&secret, now + 301, good.as_bytes())),
        ),
        (
            "mis-signed",
            good.clone(),
            Some(sign(&wrong_secret, now, good.as_bytes())),
        ),
        (
            "tampered body (signed for 1 cent, sent as 100)",
            good.clone(),
            Some(sign(&secret, now, body(first, "pay-A", 1).as_bytes())),
        ),
    ];
    for (what, body, sig) in &refused {
        let (s, b) = post_notification(base, body, sig.as_deref()).await;
        assert_eq!(
            (s, code(&b)),
            (StatusCode::UNAUTHORIZED, Some("BAD_SIGNATURE")),
            "{what}"
        );
    }
    // Signed, but for the wrong amount: the order is unchanged, the cent paid is owed back
    // (tests/it/refunds.rs).
    let (s, b) = notify_payment(base, first, "pay-short", 1).await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("AMOUNT_MISMATCH"))
    );
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'PAID'")
            .await,
        0
    );
    assert_eq!(
        env.count("SELECT count(*) FROM refund_obligations WHERE payment_id = 'pay-short'")
            .await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID'")
            .await,
        0
    );

    // The good one pays; its replay gets the same answer and changes nothing.
    let (s, b) = notify_payment(base, first, "pay-A", 100).await;
    assert_eq!(
        (s, b["status"].as_str(), b["repeat"].as_bool()),
        (StatusCode::OK, Some("PAID"), Some(false))
    );
    let version_sql = format!("SELECT version::int8 FROM orders WHERE order_id = '{first}'");
    let version = || env.count(&version_sql);
    let v1 = version().await;
    let (s, b) = notify_payment(base, first, "pay-A", 100).await;
    assert_eq!((s, b["repeat"].as_bool()), (StatusCode::OK, Some(true)));
    assert_eq!(version().await, v1);
    // One payment id settles one order: reused on a second order it is refused.
    let (s, b) = notify_payment(base, second, "pay-A", 100).await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::CONFLICT, Some("PAYMENT_ID_REUSED"))
    );
    assert_eq!(
        env.count(&format!("SELECT count(*) FROM orders WHERE order_id = '{second}' AND status = 'CREATED' AND payment_id IS NULL")).await,
        1
    );
    one_order_paid(&env).await;
    api.stop.cancel();
    env.cleanup().await;
}

/// Exactly one order is PAID, with exactly one ORDER_PAID in the outbox.
async fn one_order_paid(env: &TestEnv) {
    let paid = env.count("SELECT count(*) FROM orders WHERE status = 'PAID'");
    let events = env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID'");
    assert_eq!((paid.await, events.await), (1, 1));
}

/// Two signed notifications racing with one new payment id for two orders: exactly one pays,
/// the other is PAYMENT_ID_REUSED, and one ORDER_PAID is written.
#[tokio::test]
async fn one_payment_id_racing_for_two_orders_pays_exactly_one() {
    let env = TestEnv::without_topics().await;
    env.activity(1121, 1, 10).await;
    let orders = created_orders(&env, 1121, &[35, 36]).await;
    let api = start_api(env.settings.clone()).await;
    let base = &api.base;
    let (third, fourth) = (&orders[0].order_id, &orders[1].order_id);
    let (a, b) = tokio::join!(
        notify_payment(base, third, "pay-race", 100),
        notify_payment(base, fourth, "pay-race", 100)
    );
    let mut answers = [code(&a.1).unwrap_or("PAID"), code(&b.1).unwrap_or("PAID")];
    answers.sort();
    assert_eq!(answers, ["PAID", "PAYMENT_ID_REUSED"]);
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE payment_id = 'pay-race'")
            .await,
        1
    );
    one_order_paid(&env).await;
    api.stop.cancel();
    env.cleanup().await;
}

#[tokio::test]
async fn with_an_issuer_configured_a_token_without_iss_is_refused() {
    let env = TestEnv::with_topics().await;
    env.activity(1140, 1, 10).await;
    let mut settings = env.settings.clone();
    settings.auth.jwks_file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/buyer-jwks.json")
        .display()
        .to_string();
    settings.auth.issuer = "https://login.shop.example".into();
    let api = start_api(settings).await;
    let now = Utc::now().timestamp();
    let claims = |user: i64| {
        json!({"sub": user.to_string(), "aud": "seckill", "exp": now + 600, "nbf": now - 1,
               "iat": now})
    };
    // Signed by the shop's own key, every other claim right, no `iss`.
    let mut no_iss = claims(41);
    let (s, b) = reserve_with(
        &api.base,
        1140,
        Some(&format!("Bearer {}", with_claims(no_iss.take()))),
        json!({"request_id": "no-iss", "quantity": 1}),
    )
    .await;
    assert_eq!(
        (s, code(&b)),
        (StatusCode::UNAUTHORIZED, Some("UNAUTHENTICATED"))
    );
    let mut other = claims(41);
    other["iss"] = json!("https://evil.example");
    let (s, _) = reserve_with(
        &api.base,
        1140,
        Some(&format!("Bearer {}", with_claims(other))),
        json!({"request_id": "evil-iss", "quantity": 1}),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let mut right = claims(41);
    right["iss"] = json!("https://login.shop.example");
    let (s, b) = reserve_with(
        &api.base,
        1140,
        Some(&format!("Bearer {}", with_claims(right))),
        json!({"request_id": "right-iss", "quantity": 1}),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        0,
        "nothing but the 202 went on (no consumer runs here)"
    );
    api.stop.cancel();
    env.cleanup().await;
}

#[tokio::test]
async fn another_buyers_reservation_is_looked_up_like_an_unknown_one() {
    let env = TestEnv::without_topics().await;
    env.activity(1150, 1, 10).await;
    let ids = created_orders(&env, 1150, &[51]).await.remove(0);
    // Its projection in Redis names its buyer: the fast answer its owner gets.
    let redis = env.redis().await;
    let header = seckill::domain::events::OrderEventHeader {
        order_id: ids.order_id.clone(),
        reservation_id: ids.reservation_id.clone(),
        status: "CREATED".into(),
        aggregate_version: 1,
        user_id: 51,
    };
    let now = Utc::now().timestamp_millis();
    assert_eq!(
        redis
            .projections()
            .project_many(&[&header], 600, now, false)
            .await
            .unwrap(),
        vec!["APPLIED"]
    );
    let api = start_api(env.settings.clone()).await;
    let theirs = format!("{}/v1/reservations/{}", api.base, ids.reservation_id);
    // The same activity, another ULID: a well-formed id nobody holds.
    let rid = &ids.reservation_id;
    let unknown_id = format!("{}ZZZZZZ", &rid[..rid.len() - 6]);
    let unknown = format!("{}/v1/reservations/{unknown_id}", api.base);
    // PostgreSQL cannot answer (its orders table locked): whoever's path goes through it
    // cannot answer either.
    let pool = env.pool(1).await;
    let mut client = pool.get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE orders IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let (mine, _) = get_with(theirs.clone(), &bearer(51)).await;
    let (other, other_body) = get_with(theirs.clone(), &bearer(52)).await;
    let (nobody, nobody_body) = get_with(unknown.clone(), &bearer(52)).await;
    tx.rollback().await.unwrap();
    assert_eq!(
        mine,
        StatusCode::OK,
        "the owner is answered from the projection"
    );
    // Before, another buyer's id was answered 404 from Redis at once, an unknown one only
    // after PostgreSQL: the difference told which ids exist.
    assert_eq!(
        (other, code(&other_body)),
        (nobody, code(&nobody_body)),
        "another buyer's id and an unknown id take the same path"
    );
    assert_eq!(other, StatusCode::SERVICE_UNAVAILABLE, "{other_body}");
    // With PostgreSQL back, both are the same 404.
    let (other, other_body) = get_with(theirs, &bearer(52)).await;
    let (nobody, nobody_body) = get_with(unknown, &bearer(52)).await;
    assert_eq!(
        (other, code(&other_body)),
        (StatusCode::NOT_FOUND, Some("RESERVATION_NOT_FOUND"))
    );
    assert_eq!((nobody, code(&nobody_body)), (other, code(&other_body)));
    api.stop.cancel();
    env.cleanup().await;
}
