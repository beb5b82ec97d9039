//! Abuse limits on the reservation route (docs/ARCHITECTURE.md#abuse-limits): a token bucket
//! per client address (checked before the body is read) and one per buyer (once the body says
//! who), both in Redis so every API instance shares them. An empty bucket is `429
//! RATE_LIMITED` with `Retry-After`.

use std::net::{IpAddr, SocketAddr};

use axum::http::{HeaderMap, StatusCode};
use chrono::Utc;
use tracing::warn;

use super::{ApiError, ApiState};

/// The client's address: the peer's own, or, when the peer is a trusted proxy, the last
/// address of `X-Forwarded-For` that is not itself a trusted proxy (the one the trusted chain
/// received the request from). A peer that is not trusted cannot choose its address.
pub fn client_addr(
    peer: Option<SocketAddr>,
    headers: &HeaderMap,
    trusted: &[IpAddr],
) -> Option<IpAddr> {
    let peer = peer?.ip();
    if !trusted.contains(&peer) {
        return Some(peer);
    }
    let forwarded: Vec<IpAddr> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|a| a.trim().parse::<IpAddr>().ok())
        .collect();
    Some(
        forwarded
            .into_iter()
            .rev()
            .find(|a| !trusted.contains(a))
            .unwrap_or(peer),
    )
}

/// Takes a token from the bucket of `caller` (`kind` "ip" or "u"), or refuses with 429.
pub async fn take(
    s: &ApiState,
    kind: &'static str,
    caller: &str,
    rate_per_sec: f64,
    burst: u32,
) -> Result<(), ApiError> {
    if rate_per_sec <= 0.0 {
        return Ok(());
    }
    let bucket = s.redis.keys.rate_bucket(kind, caller);
    let now = Utc::now().timestamp_millis();
    match s.redis.take_token(&bucket, rate_per_sec, burst, now).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(retry_ms)) => {
            metrics::counter!("rate_limited_total", "by" => kind).increment(1);
            Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "RATE_LIMITED",
                "too many requests; retry after the indicated delay",
            )
            .retry_after(retry_ms.div_ceil(1000).max(1)))
        }
        Err(e) => {
            warn!(error = %e, "rate limit check failed");
            Err(ApiError::unavailable("the reservation store"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(xff: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in xff {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    #[test]
    fn forwarded_addresses_are_believed_only_from_trusted_proxies() {
        let lb: IpAddr = "10.0.0.1".parse().unwrap();
        let peer = |ip: &str| Some(SocketAddr::new(ip.parse().unwrap(), 5000));
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        // An untrusted peer is its own address, whatever it claims.
        assert_eq!(
            client_addr(peer("203.0.113.9"), &headers(&["1.2.3.4"]), &[lb]),
            ip("203.0.113.9")
        );
        // Through the trusted balancer: the address it received the request from.
        assert_eq!(
            client_addr(peer("10.0.0.1"), &headers(&["1.2.3.4"]), &[lb]),
            ip("1.2.3.4")
        );
        // A client forging a chain only adds entries before the real one.
        assert_eq!(
            client_addr(peer("10.0.0.1"), &headers(&["6.6.6.6, 1.2.3.4"]), &[lb]),
            ip("1.2.3.4")
        );
        assert_eq!(
            client_addr(peer("10.0.0.1"), &headers(&["6.6.6.6", "1.2.3.4"]), &[lb]),
            ip("1.2.3.4")
        );
        // Nothing usable forwarded: the proxy itself.
        assert_eq!(
            client_addr(peer("10.0.0.1"), &headers(&["garbage"]), &[lb]),
            ip("10.0.0.1")
        );
        assert_eq!(client_addr(None, &headers(&[]), &[lb]), None);
    }
}
