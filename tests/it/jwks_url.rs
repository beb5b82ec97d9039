//! Buyer keys from the identity provider's JWKS URL (`auth.jwks_url`;
//! docs/architecture/security.md#buyer-tokens), against a JWKS server on loopback whose answer the
//! test changes: rotation, a withdrawn key, a flood of unknown kids, the provider down (error,
//! garbage, an empty set, a hang) mid-sale, and down at start.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use jsonwebtoken::Algorithm;
use seckill::auth::buyer::{mint_with_key, AuthFailure, BuyerAuth, TokenSpec};
use seckill::auth::keygen::{generate, jwks, SigningKey};
use seckill::config::{AuthSettings, BuyerIdentity};
use secrecy::SecretString;
use tokio_util::sync::CancellationToken;

use crate::common::{wait_ready, TestEnv};

/// What the provider answers.
#[derive(Clone)]
enum Answer {
    Jwks(String),
    Status(u16),
    Body(&'static str),
    /// Holds the request open far past the API's fetch timeout.
    Hang,
}

/// A JWKS server on loopback: its URL, its answer (changed by the test), the requests it saw.
struct Provider {
    url: String,
    answer: Arc<Mutex<Answer>>,
    hits: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Provider {
    async fn start(answer: Answer) -> Self {
        let answer = Arc::new(Mutex::new(answer));
        let hits = Arc::new(AtomicU64::new(0));
        let (a, h) = (answer.clone(), hits.clone());
        let app = axum::Router::new().route(
            "/.well-known/jwks.json",
            axum::routing::get(move || {
                let (a, h) = (a.clone(), h.clone());
                async move {
                    h.fetch_add(1, Ordering::SeqCst);
                    let now = a.lock().unwrap().clone();
                    match now {
                        Answer::Jwks(text) => (StatusCode::OK, text),
                        Answer::Status(code) => {
                            (StatusCode::from_u16(code).unwrap(), String::new())
                        }
                        Answer::Body(text) => (StatusCode::OK, text.to_string()),
                        Answer::Hang => {
                            tokio::time::sleep(Duration::from_secs(30)).await;
                            (StatusCode::OK, String::new())
                        }
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/.well-known/jwks.json",
            listener.local_addr().unwrap()
        );
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            answer,
            hits,
            task,
        }
    }

    fn answer(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }

    fn publish(&self, keys: &[&SigningKey]) {
        self.answer(Answer::Jwks(jwks(keys.iter().copied())));
    }

    fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn auth_settings(url: &str, min_refresh_secs: u64) -> AuthSettings {
    AuthSettings {
        buyers: BuyerIdentity::Token,
        jwks_file: String::new(),
        jwks_url: url.to_string(),
        jwks_ca_file: String::new(),
        jwks_refresh_secs: 3600,
        jwks_min_refresh_secs: min_refresh_secs,
        jwks_timeout_ms: 300,
        token_cache_entries: 1000,
        audience: "seckill".into(),
        issuer: String::new(),
        leeway_secs: 5,
        dev_hs256_secret: SecretString::from(String::new()),
    }
}

fn token(key: &SigningKey, kid: &str, user: i64) -> String {
    let spec = TokenSpec {
        user_id: user,
        ttl: Duration::from_secs(600),
        audience: "seckill",
        issuer: "",
    };
    mint_with_key(key.alg, key.pem.as_bytes(), kid, &spec).unwrap()
}

/// Starts verifying with `settings` and waits (bounded) until the first set is in.
async fn started(settings: &AuthSettings, stop: &CancellationToken) -> Arc<BuyerAuth> {
    let auth = Arc::new(BuyerAuth::from_settings(settings).unwrap());
    auth.start(stop.clone());
    for _ in 0..100 {
        if auth.has_keys() {
            return auth;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the provider's keys never loaded");
}

/// A provider publishing one new `alg` key `k1`, and an API verifier loaded from it.
async fn provider_with(
    alg: Algorithm,
    min_refresh_secs: u64,
    stop: &CancellationToken,
) -> (SigningKey, Provider, Arc<BuyerAuth>) {
    let k1 = generate(alg, "k1").unwrap();
    let provider = Provider::start(Answer::Jwks(jwks([&k1]))).await;
    let auth = started(&auth_settings(&provider.url, min_refresh_secs), stop).await;
    (k1, provider, auth)
}

/// Sends tokens naming an unknown kid until the provider has been asked once more (the
/// on-demand refresh waits out `auth.jwks_min_refresh_secs`); bounded.
async fn force_refresh(auth: &BuyerAuth, provider: &Provider, key: &SigningKey) {
    let before = provider.hits();
    for i in 0..60 {
        let probe = token(key, &format!("probe-{i}"), 9);
        assert_eq!(auth.verify(&probe).await, Err(AuthFailure::Invalid));
        if provider.hits() > before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no refresh reached the provider");
}

#[tokio::test]
async fn keys_rotate_through_the_url_and_a_withdrawn_key_verifies_nothing() {
    let stop = CancellationToken::new();
    let (k1, provider, auth) = provider_with(Algorithm::RS256, 1, &stop).await;
    let k2 = generate(Algorithm::ES256, "k2").unwrap();
    let old = token(&k1, "k1", 1);
    assert_eq!(auth.verify(&old).await, Ok(1));
    assert_eq!(provider.hits(), 1);

    // The provider publishes k2 and signs with it: the first k2 token fetches the new set
    // itself, without waiting for the periodic refresh.
    provider.publish(&[&k1, &k2]);
    assert_eq!(auth.verify(&token(&k2, "k2", 2)).await, Ok(2));
    assert_eq!(provider.hits(), 2);
    assert_eq!(auth.verify(&old).await, Ok(1), "k1 is still published");

    // k1 withdrawn (its tokens have expired, or it leaked): once a refresh has seen the new
    // set, neither the cached k1 token nor a fresh one signed by k1 verifies.
    provider.publish(&[&k2]);
    force_refresh(&auth, &provider, &k2).await;
    assert_eq!(auth.verify(&old).await, Err(AuthFailure::Invalid));
    assert_eq!(
        auth.verify(&token(&k1, "k1", 1)).await,
        Err(AuthFailure::Invalid)
    );
    assert_eq!(auth.verify(&token(&k2, "k2", 2)).await, Ok(2));
    stop.cancel();
}

#[tokio::test]
async fn a_flood_of_unknown_kids_costs_the_provider_one_fetch_per_interval() {
    let stop = CancellationToken::new();
    let (k1, provider, auth) = provider_with(Algorithm::EdDSA, 60, &stop).await;
    assert_eq!(provider.hits(), 1);
    // 400 callers at once, each with a kid nobody published (signed with the real key, to
    // look as real as a token can without the kid).
    let flood = |round: u32| {
        let auth = auth.clone();
        let forged: Vec<String> = (0..400)
            .map(|i| token(&k1, &format!("spray-{round}-{i}"), 5))
            .collect();
        async move {
            let verdicts = futures::future::join_all(forged.iter().map(|t| auth.verify(t))).await;
            assert!(verdicts.iter().all(|v| *v == Err(AuthFailure::Invalid)));
        }
    };
    flood(0).await;
    assert_eq!(provider.hits(), 2, "one refresh for the whole first flood");
    flood(1).await;
    assert_eq!(provider.hits(), 2, "none within the minimum interval");
    assert_eq!(auth.verify(&token(&k1, "k1", 5)).await, Ok(5));
    stop.cancel();
}

#[tokio::test]
async fn the_last_good_set_is_kept_while_the_provider_fails_mid_sale() {
    let stop = CancellationToken::new();
    let (k1, provider, auth) = provider_with(Algorithm::PS256, 1, &stop).await;
    let mut user = 10;
    for failure in [
        Answer::Status(503),
        Answer::Status(404),
        Answer::Body("<html>maintenance</html>"),
        Answer::Body(r#"{"keys": []}"#),
        Answer::Hang,
    ] {
        provider.answer(failure);
        force_refresh(&auth, &provider, &k1).await;
        user += 1;
        // A new token (not served from the cache) still verifies with the kept set.
        assert_eq!(auth.verify(&token(&k1, "k1", user)).await, Ok(user));
    }
    stop.cancel();
}

#[tokio::test]
async fn the_api_is_not_ready_and_answers_503_until_the_provider_first_answers() {
    let env = TestEnv::with_topics().await;
    env.activity(3600, 1, 10).await;
    let k1 = generate(Algorithm::RS256, "k1").unwrap();
    let provider = Provider::start(Answer::Status(503)).await;
    let mut settings = env.settings.clone();
    settings.auth.jwks_url = provider.url.clone();
    settings.auth.jwks_min_refresh_secs = 1;
    settings.auth.jwks_timeout_ms = 300;
    let publisher = seckill::mq::connect_publisher(&settings).await.unwrap();
    let state = seckill::roles::api::build_state(Arc::new(settings), publisher)
        .await
        .expect("the API starts while the provider is down");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(seckill::roles::api::serve(listener, state, stop.clone()));
    let client = reqwest::Client::new();
    let reserve = |user: i64, request: &'static str| {
        client
            .post(format!("{base}/v1/activities/3600/skus/1/reservations"))
            .header(
                "authorization",
                format!("Bearer {}", token(&k1, "k1", user)),
            )
            .json(&serde_json::json!({"request_id": request, "quantity": 1}))
            .send()
    };
    // Down at start: serving, not ready, and a buyer is told to retry (not that their token
    // is bad) once the provider has been asked at least twice.
    for _ in 0..100 {
        if provider.hits() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(provider.hits() >= 2, "the API retries the provider");
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
    let r = reserve(21, "before-keys").await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().contains_key("retry-after"));
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "UNAVAILABLE", "{body}");

    // The provider comes up: ready within its retry interval, and the same buyer reserves.
    provider.publish(&[&k1]);
    wait_ready(format!("{base}/readyz")).await;
    let r = reserve(21, "after-keys").await.unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        0,
        "no consumer runs here: only the 202 went on"
    );
    stop.cancel();
    env.cleanup().await;
}
