//! Business identifiers. The API mints all of them before it touches Redis, so every retry,
//! re-send and replay of the same reservation carries the same ids
//! (docs/architecture/messages.md#identifiers).

use ulid::Ulid;

/// The ids of one reservation, fixed for its whole life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    /// Inbox key of the ORDER_CREATE_REQUESTED event (`evt_<ulid>`).
    pub message_id: String,
    /// The Redis reservation and the message key (`rsv_<activity>_<ulid>`, or
    /// `rsv_<activity>.<bucket>_<ulid>` in a stock bucket other than the first): it names its
    /// activity and bucket, so a lookup by id alone finds the reservation's keys (their hash
    /// tag) without a second key to write and read.
    pub reservation_id: String,
    /// The order the consumer will create (`ord_<ulid>`).
    pub order_id: String,
}

impl Ids {
    /// Fresh ids for a reservation in `activity_id`, in its stock bucket `bucket`
    /// (docs/architecture/redis.md#stock-buckets; 0 when the stock is not split).
    pub fn generate(activity_id: i64, bucket: u16) -> Self {
        let reservation_id = if bucket == 0 {
            format!("rsv_{activity_id}_{}", Ulid::new())
        } else {
            format!("rsv_{activity_id}.{bucket}_{}", Ulid::new())
        };
        Self {
            message_id: format!("evt_{}", Ulid::new()),
            reservation_id,
            order_id: format!("ord_{}", Ulid::new()),
        }
    }
}

/// Crockford's base 32, ULID's alphabet.
const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";

/// The time minted in `id`'s first ULID (the leftmost 26 characters of Crockford's alphabet whose
/// first is 0-7: the 48-bit milliseconds in its first 10), or the epoch when it has none: the
/// partition key `id_at` of the inbox and the outbox
/// (docs/architecture/postgresql.md#tables-by-day). It must be SQL's `seckill_id_at` (V25), which
/// the triggers use for rows an older release writes: one message, one key, whoever writes it.
pub fn id_at(id: &str) -> chrono::DateTime<chrono::Utc> {
    let digit = |b: u8| CROCKFORD.iter().position(|&c| c == b).map(|d| d as i64);
    let bytes = id.as_bytes();
    let found = (0..bytes.len().saturating_sub(25)).find(|&i| {
        matches!(bytes[i], b'0'..=b'7') && bytes[i..i + 26].iter().all(|&b| digit(b).is_some())
    });
    let ms = found.map_or(0, |i| {
        bytes[i..i + 10]
            .iter()
            .fold(0i64, |ms, &b| ms * 32 + digit(b).unwrap_or(0))
    });
    chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default()
}

/// Most stock buckets one activity's SKUs can be split into.
pub const MAX_STOCK_BUCKETS: u16 = 64;

/// The stock bucket a buyer reserves in, among `buckets`
/// (docs/architecture/redis.md#stock-buckets): always the same one for the same buyer, so one
/// reservation per buyer and a repeated request id stay exact within one bucket. The user id is
/// mixed first (SplitMix64), so consecutive ids spread over the buckets.
pub fn home_bucket(user_id: i64, buckets: u16) -> u16 {
    if buckets <= 1 {
        return 0;
    }
    let mut z = (user_id as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % u64::from(buckets)) as u16
}

/// Units of `total` that bucket `bucket` of `buckets` starts with: an even split, the first
/// `total % buckets` buckets one more. Redis and PostgreSQL split the same way.
pub fn bucket_share(total: i64, bucket: u16, buckets: u16) -> i64 {
    let k = i64::from(buckets.max(1));
    total / k + i64::from(i64::from(bucket) < total % k)
}

/// True for ids this system mints: a known prefix and a 26-character ULID; a reservation id
/// also names its activity and bucket (`rsv_<activity>[.<bucket>]_<ulid>`), or is one of the
/// older `rsv_<ulid>`.
pub fn is_valid_id(prefix: &str, id: &str) -> bool {
    let Some(rest) = id.strip_prefix(prefix).and_then(|r| r.strip_prefix('_')) else {
        return false;
    };
    let ulid = match rest.split_once('_') {
        Some((place, ulid)) if prefix == "rsv" && reservation_place(place).is_some() => ulid,
        _ => rest,
    };
    ulid.len() == 26 && Ulid::from_string(ulid).is_ok()
}

/// The activity and stock bucket a reservation id names (`rsv_<activity>_<ulid>`: bucket 0,
/// `rsv_<activity>.<bucket>_<ulid>`); `None` for an older `rsv_<ulid>` or anything that is
/// not a reservation id.
pub fn reservation_activity_bucket(reservation_id: &str) -> Option<(i64, u16)> {
    let (place, ulid) = reservation_id.strip_prefix("rsv_")?.split_once('_')?;
    let found = reservation_place(place)?;
    (ulid.len() == 26 && Ulid::from_string(ulid).is_ok()).then_some(found)
}

/// The activity a reservation id names; `None` for an older `rsv_<ulid>` or anything that
/// is not a reservation id.
pub fn reservation_activity(reservation_id: &str) -> Option<i64> {
    reservation_activity_bucket(reservation_id).map(|(activity, _)| activity)
}

/// The stock bucket a reservation id names (0 for ids that name none).
pub fn reservation_bucket(reservation_id: &str) -> u16 {
    reservation_activity_bucket(reservation_id).map_or(0, |(_, bucket)| bucket)
}

/// `<activity>` or `<activity>.<bucket>` with a bucket from 1 to [`MAX_STOCK_BUCKETS`] - 1.
fn reservation_place(s: &str) -> Option<(i64, u16)> {
    match s.split_once('.') {
        None => Some((plain_number(s)?, 0)),
        Some((activity, bucket)) => {
            let bucket = u16::try_from(plain_number(bucket)?).ok()?;
            (bucket < MAX_STOCK_BUCKETS).then_some((plain_number(activity)?, bucket))
        }
    }
}

/// A positive decimal number with no sign or leading zero, as the ids spell an activity.
fn plain_number(s: &str) -> Option<i64> {
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
        let a = Ids::generate(7, 0);
        let b = Ids::generate(7, 0);
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
        let id = Ids::generate(982, 0).reservation_id;
        assert_eq!(reservation_activity(&id), Some(982));
        assert_eq!(reservation_bucket(&id), 0);
        let id = Ids::generate(982, 5).reservation_id;
        assert!(id.starts_with("rsv_982.5_"), "{id}");
        assert!(is_valid_id("rsv", &id));
        assert_eq!(reservation_activity_bucket(&id), Some((982, 5)));
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
            "rsv_7.0_",
            "rsv_7.64_",
            "rsv_7._",
            "rsv_.3_",
            "rsv_7.3.1_",
        ] {
            assert!(!is_valid_id("rsv", &format!("{bad}{ulid}")), "{bad}");
            assert_eq!(reservation_activity(&format!("{bad}{ulid}")), None, "{bad}");
        }
        assert!(!is_valid_id("ord", &format!("ord_7_{ulid}")));
        assert!(!is_valid_id("rsv", &format!("rsv_7_{ulid}_x")));
    }

    #[test]
    fn buyers_keep_one_home_bucket_and_shares_add_up() {
        for user in [1_i64, 2, 77, 1_000_003, -5] {
            assert_eq!(home_bucket(user, 1), 0);
            let b = home_bucket(user, 6);
            assert!(b < 6);
            assert_eq!(home_bucket(user, 6), b);
        }
        // Consecutive ids spread: each of 4 buckets gets some of 1..=400.
        let mut seen = [0; 4];
        for user in 1..=400 {
            seen[home_bucket(user, 4) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
        for (total, k) in [(10_i64, 3_u16), (2, 4), (0, 2), (7, 1)] {
            let sum: i64 = (0..k).map(|b| bucket_share(total, b, k)).sum();
            assert_eq!(sum, total, "{total} over {k}");
        }
        assert_eq!(bucket_share(10, 0, 3), 4);
        assert_eq!(bucket_share(10, 2, 3), 3);
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

    #[test]
    fn id_at_is_the_time_minted_in_the_first_ulid() {
        let ms = 1_765_000_123_456u64;
        let u = Ulid::from_parts(ms, 7);
        for id in [
            format!("evt_{u}"),
            format!("rsv_17_{u}"),
            format!("rsv_17.3_{u}"),
            format!("cmp_rsv_17_{u}"),
            format!("ord_{u}.pay-1.REFUND_REQUIRED"),
            format!("ord_{u}.CANCEL_IF_UNPAID"),
        ] {
            assert_eq!(id_at(&id).timestamp_millis() as u64, ms, "{id}");
        }
        assert_eq!(id_at("no ulid here").timestamp_millis(), 0);
        assert_eq!(id_at("").timestamp_millis(), 0);
        // The first of two; a run that starts above 7 is not one.
        let later = Ulid::from_parts(ms + 1, 1);
        assert_eq!(
            id_at(&format!("x_{u}_{later}")).timestamp_millis() as u64,
            ms
        );
        assert_eq!(
            id_at(&format!("Z{}", &u.to_string()[1..])).timestamp_millis(),
            0
        );
    }
}
