//! Every HTTP listener of the project (the buyers' API, the ops endpoints) is served here, with
//! limits a slow or hostile client cannot get around (docs/ARCHITECTURE.md#slow-clients):
//!
//! - the request head must arrive within `header_read_timeout`, which also closes a keep-alive
//!   connection idle for that long (the timer runs while the connection waits for a head);
//! - a whole request, body included, is answered within `request_timeout` (`408
//!   REQUEST_TIMEOUT` otherwise);
//! - at most `max_connections` connections are served at once; past it the listener stops
//!   accepting until one closes, so the kernel's backlog absorbs a burst instead of the heap.
//!
//! On `stop`, the listener closes and open connections finish their current request; the
//! caller bounds that drain.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;
use tracing::{debug, warn};

/// The peer of a connection (the client, or a proxy in front of it), put on every request.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub std::net::SocketAddr);

/// The limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub request_timeout: Duration,
    pub max_connections: usize,
}

impl Limits {
    /// For the ops endpoints (`/metrics`, `/healthz`, `/readyz`): scrapers and probes only.
    pub const OPS: Limits = Limits {
        header_read_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(10),
        max_connections: 256,
    };
}

/// Serves `app` on `listener` until `stop`, then waits for the open connections to finish
/// their current request (the caller bounds this with its grace period).
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, stop: CancellationToken) {
    let app = app.layer(axum::middleware::from_fn_with_state(
        limits.request_timeout,
        request_timeout,
    ));
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            _ = stop.cancelled() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pause instead of spinning.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        // The peer goes on each request as it arrives: no per-connection copy of the router.
        let service = TowerToHyperService::new(app.clone().map_request(
            move |mut req: axum::http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(PeerAddr(peer));
                req
            },
        ));
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                debug!(error = %e, "connection closed with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Answers `408 REQUEST_TIMEOUT` when the request (reading its body included) takes longer
/// than the listener's bound. Dropping the handler there is safe: every handler's writes are
/// single atomic steps whose later retries are idempotent.
async fn request_timeout(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            Json(json!({"error": {
                "code": "REQUEST_TIMEOUT",
                "message": "the request took too long to arrive or to answer; retry it"
            }})),
        )
            .into_response(),
    }
}
