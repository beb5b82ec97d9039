//! Abuse limits on the reservation route (docs/architecture/hot-path.md#abuse-limits): a token
//! bucket per client address and one per buyer in each activity, in Redis so every API instance
//! shares them, taken by the reserve script itself (`src/redis/lua/reserve.lua`) in the same call.
//! An empty bucket is `429 RATE_LIMITED` with `Retry-After`. This file says who the client is.

use std::net::{IpAddr, SocketAddr};

use axum::http::HeaderMap;

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
