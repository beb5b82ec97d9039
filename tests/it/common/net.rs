//! Loopback plumbing: free ports, a connection's end, and a proxy that stops forwarding.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reads until the server closes the connection (or resets it); what it sent, or `None` if the
/// connection is still open after `secs`.
pub async fn closed_within(mut s: tokio::net::TcpStream, secs: u64) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    // The kernel may hand the same free port to two tests whose processes have not bound it
    // yet; one of them then fails to start while the other answers its readiness probe. A
    // port handed out once in this run is never handed out again.
    static GIVEN: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
}

/// A loopback TCP proxy to `upstream` that can stop forwarding: from the client's side, a
/// dependency that hangs (the connection stays open, nothing comes back).
pub struct StallProxy {
    pub addr: std::net::SocketAddr,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    accept: tokio::task::JoinHandle<()>,
}

impl StallProxy {
    pub async fn start(upstream: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let upstream = upstream.to_string();
        let flag = stalled.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(Self::pump(cr, sw, flag.clone()));
                tokio::spawn(Self::pump(sr, cw, flag.clone()));
            }
        });
        Self {
            addr,
            stalled,
            accept,
        }
    }

    /// Holds every byte (`true`) or forwards again, the held ones first (`false`).
    pub fn stall(&self, on: bool) {
        self.stalled.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        stalled: Arc<std::sync::atomic::AtomicBool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while stalled.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
