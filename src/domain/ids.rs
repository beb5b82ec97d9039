//! Business identifiers. The API mints all of them before it touches Redis, so every retry,
//! re-send and replay of the same reservation carries the same ids (docs/ARCHITECTURE.md#identifiers).

use ulid::Ulid;

/// The ids of one reservation, fixed for its whole life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    /// Inbox key of the ORDER_CREATE_REQUESTED event (`evt_<ulid>`).
    pub message_id: String,
    /// The Redis reservation and the message key (`rsv_<ulid>`).
    pub reservation_id: String,
    /// The order the consumer will create (`ord_<ulid>`).
    pub order_id: String,
}

impl Ids {
    pub fn generate() -> Self {
        Self {
            message_id: format!("evt_{}", Ulid::new()),
            reservation_id: format!("rsv_{}", Ulid::new()),
            order_id: format!("ord_{}", Ulid::new()),
        }
    }
}

/// True for ids this system mints: a known prefix and a 26-character ULID.
pub fn is_valid_id(prefix: &str, id: &str) -> bool {
    id.strip_prefix(prefix)
        .and_then(|rest| rest.strip_prefix('_'))
        .is_some_and(|ulid| ulid.len() == 26 && Ulid::from_string(ulid).is_ok())
}

/// A random W3C `traceparent` for a request that arrived without one.
pub fn new_traceparent() -> (String, String, String) {
    let trace_id = format!("{:032x}", rand::random::<u128>());
    let span_id = format!("{:016x}", rand::random::<u64>());
    let tp = format!("00-{trace_id}-{span_id}-01");
    (trace_id, span_id, tp)
}

/// Parses a W3C `traceparent` header (`00-<32 hex>-<16 hex>-<2 hex>`).
pub fn parse_traceparent(tp: &str) -> Option<(String, String)> {
    let parts: Vec<&str> = tp.trim().split('-').collect();
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if parts.len() == 4
        && hex(parts[0], 2)
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && parts[1].bytes().any(|b| b != b'0')
    {
        Some((parts[1].to_ascii_lowercase(), parts[2].to_ascii_lowercase()))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_distinct_and_valid() {
        let a = Ids::generate();
        let b = Ids::generate();
        assert_ne!(a, b);
        assert!(is_valid_id("evt", &a.message_id));
        assert!(is_valid_id("rsv", &a.reservation_id));
        assert!(is_valid_id("ord", &a.order_id));
        assert!(!is_valid_id("ord", &a.reservation_id));
        assert!(!is_valid_id("rsv", "rsv_"));
        assert!(!is_valid_id("rsv", "rsv_../../etc/passwd"));
    }

    #[test]
    fn traceparent_round_trip() {
        let (trace, span, tp) = new_traceparent();
        assert_eq!(parse_traceparent(&tp), Some((trace, span)));
        assert_eq!(
            parse_traceparent("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            None
        );
        assert_eq!(parse_traceparent("garbage"), None);
    }
}
