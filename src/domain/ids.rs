//! Business identifiers. The API mints all of them before it touches Redis, so every retry,
//! re-send and replay of the same reservation carries the same ids (docs/ARCHITECTURE.md#identifiers).

use ulid::Ulid;

/// The ids of one reservation, fixed for its whole life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    /// Inbox key of the ORDER_CREATE_REQUESTED event (`evt_<ulid>`).
    pub message_id: String,
    /// The Redis reservation and the message key (`rsv_<activity>_<ulid>`): it names its
    /// activity, so a lookup by id alone finds the reservation's keys (their hash tag) without
    /// a second key to write and read.
    pub reservation_id: String,
    /// The order the consumer will create (`ord_<ulid>`).
    pub order_id: String,
}

impl Ids {
    /// Fresh ids for a reservation in `activity_id`.
    pub fn generate(activity_id: i64) -> Self {
        Self {
            message_id: format!("evt_{}", Ulid::new()),
            reservation_id: format!("rsv_{activity_id}_{}", Ulid::new()),
            order_id: format!("ord_{}", Ulid::new()),
        }
    }
}

/// True for ids this system mints: a known prefix and a 26-character ULID; a reservation id
/// also names its activity (`rsv_<activity>_<ulid>`), or is one of the older `rsv_<ulid>`.
pub fn is_valid_id(prefix: &str, id: &str) -> bool {
    let Some(rest) = id.strip_prefix(prefix).and_then(|r| r.strip_prefix('_')) else {
        return false;
    };
    let ulid = match rest.split_once('_') {
        Some((activity, ulid)) if prefix == "rsv" && activity_number(activity).is_some() => ulid,
        _ => rest,
    };
    ulid.len() == 26 && Ulid::from_string(ulid).is_ok()
}

/// The activity a reservation id names (`rsv_<activity>_<ulid>`); `None` for an older
/// `rsv_<ulid>` or anything that is not a reservation id.
pub fn reservation_activity(reservation_id: &str) -> Option<i64> {
    if !is_valid_id("rsv", reservation_id) {
        return None;
    }
    let (activity, _) = reservation_id.strip_prefix("rsv_")?.split_once('_')?;
    activity_number(activity)
}

/// A positive decimal number with no sign or leading zero, as the ids spell an activity.
fn activity_number(s: &str) -> Option<i64> {
    let plain = !s.is_empty() && !s.starts_with('0') && s.bytes().all(|b| b.is_ascii_digit());
    plain.then(|| s.parse().ok()).flatten()
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
        let a = Ids::generate(7);
        let b = Ids::generate(7);
        assert_ne!(a, b);
        assert!(is_valid_id("evt", &a.message_id));
        assert!(is_valid_id("rsv", &a.reservation_id));
        assert!(is_valid_id("ord", &a.order_id));
        assert!(!is_valid_id("ord", &a.reservation_id));
        assert!(!is_valid_id("rsv", "rsv_"));
        assert!(!is_valid_id("rsv", "rsv_../../etc/passwd"));
    }

    #[test]
    fn a_reservation_id_names_its_activity() {
        let id = Ids::generate(982).reservation_id;
        assert_eq!(reservation_activity(&id), Some(982));
        // The older form stays valid and names none: its location is looked up instead.
        let ulid = Ulid::new();
        assert!(is_valid_id("rsv", &format!("rsv_{ulid}")));
        assert_eq!(reservation_activity(&format!("rsv_{ulid}")), None);
        // Only a plain positive number is an activity, and only reservation ids carry one.
        for bad in [
            "rsv_-1_",
            "rsv_01_",
            "rsv__",
            "rsv_1x_",
            "rsv_99999999999999999999_",
        ] {
            assert!(!is_valid_id("rsv", &format!("{bad}{ulid}")), "{bad}");
            assert_eq!(reservation_activity(&format!("{bad}{ulid}")), None, "{bad}");
        }
        assert!(!is_valid_id("ord", &format!("ord_7_{ulid}")));
        assert!(!is_valid_id("rsv", &format!("rsv_7_{ulid}_x")));
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
