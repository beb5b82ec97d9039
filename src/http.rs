//! Every HTTP listener of the project (the buyers' API, the admin listener, each role's ops
//! endpoints) is served here, with limits a slow or hostile client cannot get around
//! (docs/architecture/hot-path.md#slow-clients):
//!
//! - HTTP/1.1 only: a load balancer, a scraper and an operator's `curl` all speak it, and one
//!   protocol means one set of bounds (an HTTP/2 preface is refused and the connection closed);
//! - the request head must arrive within `header_read_timeout`, counted from the connection's
//!   first byte or the end of its previous answer, so a silent connection and an idle
//!   kept-alive one close alike;
//! - a request head is at most `max_head_bytes`; a longer one is answered 431 and closed, so a
//!   half-sent head holds at most that much of the heap;
//! - a whole request, body included, is answered within `request_timeout` (`408
//!   REQUEST_TIMEOUT` otherwise);
//! - an answer whose write makes no progress for `write_timeout` (a client that never reads)
//!   closes the connection;
//! - at most `max_connections` connections are served at once; past it the listener stops
//!   accepting until one closes, so the kernel's backlog absorbs a burst instead of the heap.
//!
//! On `stop`, the listener closes and open connections finish their current request; the
//! caller bounds that drain.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Sleep;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;
use tracing::{debug, warn};

/// The peer of a connection (the client, or a proxy in front of it), put on every request.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub std::net::SocketAddr);

/// The smallest head cap the HTTP/1 parser takes (hyper's read buffer floor).
pub const MIN_HEAD_BYTES: usize = 8192;

/// The limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The `listener` label of the connection metrics (`buyers`, `admin`, `ops`).
    pub name: &'static str,
    pub header_read_timeout: Duration,
    pub request_timeout: Duration,
    /// An answer's write that makes no progress this long closes the connection.
    pub write_timeout: Duration,
    /// Largest request head (request line and headers), at least [`MIN_HEAD_BYTES`].
    pub max_head_bytes: usize,
    pub max_connections: usize,
}

impl Limits {
    /// For the ops endpoints (`/metrics`, `/healthz`, `/readyz`): scrapers and probes only.
    pub const OPS: Limits = Limits {
        name: "ops",
        header_read_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(10),
        write_timeout: Duration::from_secs(5),
        max_head_bytes: MIN_HEAD_BYTES,
        max_connections: 256,
    };

    /// For the admin listener: operators only, the ops bounds.
    pub const ADMIN: Limits = Limits {
        name: "admin",
        ..Limits::OPS
    };
}

/// Serves `app` on `listener` until `stop`, then waits for the open connections to finish
/// their current request (the caller bounds this with its grace period).
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, stop: CancellationToken) {
    let app = app.layer(axum::middleware::from_fn_with_state(
        limits.request_timeout,
        request_timeout,
    ));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_head_bytes.max(MIN_HEAD_BYTES))
        .keep_alive(true);
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let open = metrics::gauge!("http_connections_open", "listener" => limits.name);
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
        let io = TokioIo::new(WriteStall::new(stream, limits.write_timeout));
        let conn = graceful.watch(builder.serve_connection(io, service));
        let open = open.clone();
        open.increment(1.0);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                let reason = close_reason(&e);
                metrics::counter!("http_connection_errors_total",
                    "listener" => limits.name, "reason" => reason)
                .increment(1);
                debug!(error = %e, reason, "connection closed with an error");
            }
            open.decrement(1.0);
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Why a connection ended in an error, for `http_connection_errors_total{reason}`.
fn close_reason(e: &hyper::Error) -> &'static str {
    use std::error::Error as _;
    if e.is_parse_too_large() {
        "head_too_large"
    } else if e.is_timeout() {
        "head_timeout"
    } else if e.is_parse() || e.is_parse_status() {
        "bad_request"
    } else if e
        .source()
        .and_then(|s| s.downcast_ref::<io::Error>())
        .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut)
    {
        "write_stalled"
    } else {
        "io"
    }
}

/// A connection whose writes fail with `TimedOut` once one has waited `limit` for the client
/// to make room (it stopped reading): the connection then closes and frees its slot.
struct WriteStall<T> {
    io: T,
    limit: Duration,
    /// Armed when a write finds the socket full; dropped as soon as one goes through.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteStall<T> {
    fn new(io: T, limit: Duration) -> Self {
        Self {
            io,
            limit,
            stalled: None,
        }
    }

    /// What a write that could not proceed returns: still pending, or the stall's error.
    fn pending<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing of its answer in time",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progress<R>(
        &mut self,
        cx: &mut Context<'_>,
        done: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        match done {
            Poll::Pending => self.pending(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteStall<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteStall<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let done = Pin::new(&mut self.io).poll_write(cx, buf);
        self.progress(cx, done)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let done = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.progress(cx, done)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let done = Pin::new(&mut self.io).poll_flush(cx);
        self.progress(cx, done)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let done = Pin::new(&mut self.io).poll_shutdown(cx);
        self.progress(cx, done)
    }
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
