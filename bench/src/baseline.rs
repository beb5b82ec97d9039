//! `seckill-bench baseline-api`: the design a team would otherwise build, for comparison only
//! (`make bench`). Same HTTP route, same request validation, same server stack as `seckill
//! api`, but every request goes straight to PostgreSQL, in the best naive form: ONE autocommit
//! statement, `UPDATE stock SET remaining = remaining - 1 WHERE ... AND remaining > 0` feeding
//! the `INSERT` of the order (the row lock held for that statement and its commit only; a sold-out
//! answer is the UPDATE finding no row: no lock, no write). No Redis, no broker. It keeps its
//! own tables in schema `seckill_baseline`. It checks the buyer's token exactly as `seckill api`
//! does (the same [`BuyerAuth`], the same configuration: `auth.jwks_file`, the token cache), so
//! the comparison is of two servers that both know who is buying.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::{to_bytes, Body};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use clap::Args;
use serde_json::json;

use seckill::auth::buyer::{AuthFailure, BuyerAuth};
use seckill::config::{BuyerIdentity, Settings};
use seckill::domain::request::{parse_path_id, ReserveRequest};

#[derive(Debug, Clone, Args)]
pub struct BaselineArgs {
    #[arg(long, default_value = "127.0.0.1:28090")]
    pub listen: SocketAddr,
    /// PostgreSQL connections (the requests served at once).
    #[arg(long, default_value_t = 16)]
    pub pool: usize,
    /// `activity_id:sku_id:stock`, repeatable: (re)sets the stock of a SKU at start.
    #[arg(long = "stock", value_parser = parse_stock)]
    pub stock: Vec<(i64, i64, i32)>,
}

fn parse_stock(s: &str) -> Result<(i64, i64, i32), String> {
    let bad = || format!("`{s}`: expected activity_id:sku_id:stock");
    let p: Vec<&str> = s.split(':').collect();
    if p.len() != 3 {
        return Err(bad());
    }
    Ok((
        p[0].parse().map_err(|_| bad())?,
        p[1].parse().map_err(|_| bad())?,
        p[2].parse().map_err(|_| bad())?,
    ))
}

const SCHEMA: &str = "seckill_baseline";

struct Baseline {
    pool: deadpool_postgres::Pool,
    max_body: usize,
    /// `None` when the deployment believes the body's `user_id` (`auth.buyers = "body"`).
    auth: Option<BuyerAuth>,
}

fn error(status: StatusCode, code: &str) -> Response {
    (
        status,
        Json(json!({"error": {"code": code, "message": code}})),
    )
        .into_response()
}

async fn reserve(
    State(b): State<Arc<Baseline>>,
    Path((activity, sku)): Path<(String, String)>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Response {
    let token_buyer = match &b.auth {
        None => None,
        Some(auth) => match auth.buyer(&headers).await {
            Ok(buyer) => Some(buyer),
            Err(AuthFailure::KeysUnavailable) => {
                return error(StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE")
            }
            Err(_) => return error(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED"),
        },
    };
    let (Ok(activity_id), Ok(sku_id)) = (
        parse_path_id(&activity, "activity_id"),
        parse_path_id(&sku, "sku_id"),
    ) else {
        return error(StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    };
    let Ok(bytes) = to_bytes(body, b.max_body).await else {
        return error(StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    };
    let Ok(req) = ReserveRequest::parse(&bytes) else {
        return error(StatusCode::BAD_REQUEST, "INVALID_REQUEST");
    };
    let user_id = match (token_buyer, req.user_id) {
        (Some(token), Some(body)) if token != body => {
            return error(StatusCode::FORBIDDEN, "FORBIDDEN")
        }
        (Some(buyer), _) | (None, Some(buyer)) => buyer,
        (None, None) => return error(StatusCode::BAD_REQUEST, "INVALID_REQUEST"),
    };
    match buy(&b.pool, (activity_id, sku_id, user_id), &req.request_id).await {
        Ok(Some(order_id)) => (
            StatusCode::ACCEPTED,
            Json(json!({"status": "ORDERED", "reservation_id": format!("base_{order_id}")})),
        )
            .into_response(),
        Ok(None) => error(StatusCode::GONE, "SOLD_OUT"),
        Err(Failed::AlreadyPurchased) => error(StatusCode::CONFLICT, "ALREADY_PURCHASED"),
        Err(Failed::Unavailable) => error(StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE"),
    }
}

enum Failed {
    AlreadyPurchased,
    Unavailable,
}

impl From<tokio_postgres::Error> for Failed {
    fn from(e: tokio_postgres::Error) -> Self {
        if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
            Failed::AlreadyPurchased
        } else {
            Failed::Unavailable
        }
    }
}

/// One purchase, one statement: decrement if any is left and insert the order from the row
/// that came back; `None` when sold out. A buyer's second order fails the unique key, which
/// rolls the decrement back with it.
async fn buy(
    pool: &deadpool_postgres::Pool,
    (activity_id, sku_id, user_id): (i64, i64, i64),
    request_id: &str,
) -> Result<Option<i64>, Failed> {
    let client = pool.get().await.map_err(|_| Failed::Unavailable)?;
    let buy = client
        .prepare_cached(
            "WITH take AS (
                 UPDATE stock SET remaining = remaining - 1
                 WHERE activity_id = $1 AND sku_id = $2 AND remaining > 0
                 RETURNING activity_id, sku_id)
             INSERT INTO orders (activity_id, sku_id, user_id, request_id)
             SELECT activity_id, sku_id, $3, $4 FROM take
             RETURNING order_id",
        )
        .await?;
    Ok(client
        .query_opt(&buy, &[&activity_id, &sku_id, &user_id, &request_id])
        .await?
        .map(|row| row.get(0)))
}

pub async fn run(settings: Settings, args: BaselineArgs) -> anyhow::Result<()> {
    let mut pg = settings.pg.clone();
    pg.schema = SCHEMA.to_owned();
    let pool = seckill::pg::connect_pool(&pg, args.pool.max(1)).await?;
    {
        let c = pool.get().await?;
        c.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS {SCHEMA};
             CREATE TABLE IF NOT EXISTS {SCHEMA}.stock (
               activity_id BIGINT NOT NULL, sku_id BIGINT NOT NULL,
               remaining INTEGER NOT NULL CHECK (remaining >= 0),
               PRIMARY KEY (activity_id, sku_id));
             CREATE TABLE IF NOT EXISTS {SCHEMA}.orders (
               order_id BIGSERIAL PRIMARY KEY, activity_id BIGINT NOT NULL, sku_id BIGINT NOT NULL,
               user_id BIGINT NOT NULL, request_id TEXT NOT NULL,
               created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
               UNIQUE (activity_id, sku_id, user_id),
               FOREIGN KEY (activity_id, sku_id) REFERENCES {SCHEMA}.stock);"
        ))
        .await?;
        for (a, s, n) in &args.stock {
            c.execute(
                "INSERT INTO stock VALUES ($1, $2, $3)
                 ON CONFLICT (activity_id, sku_id) DO UPDATE SET remaining = EXCLUDED.remaining",
                &[a, s, n],
            )
            .await?;
        }
    }
    let auth = match settings.auth.buyers {
        BuyerIdentity::Token => Some(BuyerAuth::from_settings(&settings.auth)?),
        BuyerIdentity::Body => None,
    };
    let state = Arc::new(Baseline {
        pool,
        max_body: settings.api.max_body_bytes,
        auth,
    });
    let app = Router::new()
        .route(
            "/v1/activities/{activity_id}/skus/{sku_id}/reservations",
            post(reserve),
        )
        .route("/readyz", axum::routing::get(|| async { "ready" }))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    tracing::info!(listen = %args.listen, pool = args.pool, "baseline api (direct PostgreSQL) started");
    axum::serve(listener, app)
        .with_graceful_shutdown(seckill::shutdown::shutdown_signal())
        .await?;
    Ok(())
}
