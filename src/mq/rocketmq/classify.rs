//! Send errors sorted into the three outcomes: UNKNOWN (the broker may have stored the
//! message: retry with the same id) or DEFINITE_FAILURE (retrying cannot help).

use rocketmq_client_rust::{ClientError, MQClientException};

use crate::mq::SendOutcome;

// Error classification

/// The parts of a client error the classification looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorFacts<'a> {
    /// Canonical descriptor code, e.g. `transport.response.timeout`.
    pub code: &'a str,
    /// Canonical condition, e.g. `invalid_argument`, `permission_denied`.
    pub condition: &'a str,
    /// Response code the broker (or name server) answered with, when the error carries one.
    pub broker_code: Option<i32>,
    /// Response code of a wrapped `MQClientException` (`-1` when the client set none).
    pub client_code: Option<i32>,
}

/// Whether a failed send may have stored the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendErrorClass {
    /// The message may or may not be stored: retry with the same message id.
    Unknown,
    /// Certainly not stored, and the same message would fail again.
    DefiniteFailure,
}

/// Broker response codes after which resending the same message cannot succeed:
/// MESSAGE_ILLEGAL, NO_PERMISSION, TOPIC_NOT_EXIST, INVALID_PARAMETER.
const DEFINITE_BROKER_CODES: [i32; 4] = [13, 16, 17, 29];

/// `MQClientException` codes with the same meaning, plus the client's own
/// NOT_FOUND_TOPIC_EXCEPTION (10005). Client code 17 is the name server's "no route".
const DEFINITE_CLIENT_CODES: [i32; 5] = [13, 16, 17, 29, 10005];

/// Descriptor codes that always mean "this message cannot be sent as is".
const DEFINITE_DESCRIPTOR_CODES: [&str; 6] = [
    "route.topic.not_found",
    "broker.topic.not_found",
    "broker.message.invalid",
    "broker.message.too_large",
    "broker.queue.id_out_of_range",
    "protocol.message.property.invalid",
];

/// Classifies a send error. Only failures that certainly left nothing on the broker *and*
/// would repeat are definite; everything else (timeouts, lost connections, busy broker,
/// unclear client states) is UNKNOWN, which the caller resolves by retrying with the same id.
pub fn classify_send_error(facts: &ErrorFacts<'_>) -> SendErrorClass {
    use SendErrorClass::{DefiniteFailure, Unknown};
    if let Some(code) = facts.broker_code {
        // SYSTEM_ERROR, SYSTEM_BUSY, SERVICE_NOT_AVAILABLE, flow control, ...: transient.
        return if DEFINITE_BROKER_CODES.contains(&code) {
            DefiniteFailure
        } else {
            Unknown
        };
    }
    if let Some(code) = facts.client_code.filter(|c| *c != -1) {
        // 10001 connect, 10002/10006 timeout, 10003 "no route available" (broker down), ...
        return if DEFINITE_CLIENT_CODES.contains(&code) {
            DefiniteFailure
        } else {
            Unknown
        };
    }
    if DEFINITE_DESCRIPTOR_CODES.contains(&facts.code) {
        return DefiniteFailure;
    }
    if matches!(facts.condition, "permission_denied" | "unauthenticated") {
        return DefiniteFailure;
    }
    if facts.code == "core.argument.invalid" {
        // The client wraps *every* MQClientException in core.argument.invalid; without a
        // code it is a generic state ("send failed N times", "producer not running"), so
        // only a typed argument error (no wrapped exception) is a real bad message/batch.
        return if facts.client_code.is_some() {
            Unknown
        } else {
            DefiniteFailure
        };
    }
    Unknown
}

/// The response code a client error carries: the broker's, else the wrapped
/// `MQClientException`'s (`None` when neither says).
pub(super) fn response_code(err: &ClientError) -> Option<i32> {
    err.broker_response_code().or_else(|| {
        err.source_ref::<MQClientException>()
            .map(MQClientException::response_code)
            .filter(|c| *c != -1)
    })
}

/// Turns a client error into the outcome of the design, with a loggable description.
pub(super) fn outcome_from_error(err: &ClientError) -> SendOutcome {
    let descriptor = err.descriptor();
    let exception = err.source_ref::<MQClientException>();
    let facts = ErrorFacts {
        code: descriptor.code().as_str(),
        condition: descriptor.condition().as_str(),
        broker_code: err.broker_response_code(),
        client_code: exception.map(MQClientException::response_code),
    };
    let detail = exception
        .and_then(MQClientException::error_message)
        .map_or_else(|| err.to_string(), str::to_owned);
    // The error's Display usually starts with its code already.
    let detail = detail
        .strip_prefix(facts.code)
        .map_or(detail.as_str(), |rest| rest.trim_start_matches(": "));
    let error = match (facts.broker_code, facts.client_code) {
        (Some(b), _) => format!("{} (broker code {b}): {detail}", facts.code),
        (None, Some(c)) if c != -1 => format!("{} (client code {c}): {detail}", facts.code),
        _ => format!("{}: {detail}", facts.code),
    };
    match classify_send_error(&facts) {
        SendErrorClass::Unknown => SendOutcome::Unknown { error },
        SendErrorClass::DefiniteFailure => SendOutcome::DefiniteFailure { error },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn facts(
        code: &'static str,
        condition: &'static str,
        broker_code: Option<i32>,
        client_code: Option<i32>,
    ) -> ErrorFacts<'static> {
        ErrorFacts {
            code,
            condition,
            broker_code,
            client_code,
        }
    }

    use SendErrorClass::{DefiniteFailure, Unknown};

    #[test]
    fn hung_or_dead_broker_is_unknown() {
        for code in [
            "transport.response.timeout",
            "transport.write.timeout",
            "transport.connection.failed",
            "transport.dns.failed",
            "core.operation.timed_out",
            "client.lifecycle.not_started",
            "core.internal.failure",
        ] {
            let f = facts(code, "deadline_exceeded", None, None);
            assert_eq!(classify_send_error(&f), Unknown, "{code}");
        }
    }

    #[test]
    fn missing_topic_is_definite_both_ways() {
        // Name server: no route (client code 17); broker: TOPIC_NOT_EXIST (17).
        let ns = facts("core.argument.invalid", "invalid_argument", None, Some(17));
        let br = facts("broker.operation.failed", "internal", Some(17), None);
        assert_eq!(classify_send_error(&ns), DefiniteFailure);
        assert_eq!(classify_send_error(&br), DefiniteFailure);
        let nf = facts(
            "core.argument.invalid",
            "invalid_argument",
            None,
            Some(10005),
        );
        assert_eq!(classify_send_error(&nf), DefiniteFailure);
        let route = facts("route.topic.not_found", "not_found", None, None);
        assert_eq!(classify_send_error(&route), DefiniteFailure);
    }

    #[test]
    fn bad_message_and_permission_are_definite() {
        for code in [13, 16, 29] {
            let b = facts("broker.operation.failed", "internal", Some(code), None);
            assert_eq!(classify_send_error(&b), DefiniteFailure, "broker {code}");
            let c = facts(
                "core.argument.invalid",
                "invalid_argument",
                None,
                Some(code),
            );
            assert_eq!(classify_send_error(&c), DefiniteFailure, "client {code}");
        }
        let prop = facts(
            "protocol.message.property.invalid",
            "invalid_argument",
            None,
            None,
        );
        assert_eq!(classify_send_error(&prop), DefiniteFailure);
        let big = facts("broker.message.too_large", "resource_exhausted", None, None);
        assert_eq!(classify_send_error(&big), DefiniteFailure);
        let denied = facts("auth.operation.failed", "permission_denied", None, None);
        assert_eq!(classify_send_error(&denied), DefiniteFailure);
        // A typed argument error without a wrapped client exception (e.g. a batch the
        // client refuses) is a real bad argument.
        let typed = facts("core.argument.invalid", "invalid_argument", None, None);
        assert_eq!(classify_send_error(&typed), DefiniteFailure);
    }

    #[test]
    fn transient_broker_codes_are_unknown() {
        // SYSTEM_ERROR, SYSTEM_BUSY, SERVICE_NOT_AVAILABLE, FLOW_CONTROL, RPC timeout.
        for code in [1, 2, 14, 215, -1006] {
            let f = facts("broker.operation.failed", "internal", Some(code), None);
            assert_eq!(classify_send_error(&f), Unknown, "broker {code}");
        }
    }

    #[test]
    fn generic_client_exception_is_unknown() {
        // "Send [1] times, still failed", "producer not running": code -1.
        let f = facts("core.argument.invalid", "invalid_argument", None, Some(-1));
        assert_eq!(classify_send_error(&f), Unknown);
        // 10003 "No route available" (broker gone from the route), 10001 connect, 10006 timeout.
        for code in [10001, 10002, 10003, 10006] {
            let f = facts(
                "core.argument.invalid",
                "invalid_argument",
                None,
                Some(code),
            );
            assert_eq!(classify_send_error(&f), Unknown, "client {code}");
        }
    }

    #[test]
    fn broker_code_wins_over_descriptor() {
        let f = facts("broker.topic.not_found", "not_found", Some(2), None);
        assert_eq!(classify_send_error(&f), Unknown);
    }

    #[test]
    fn real_client_errors_classify() {
        let e = ClientError::route_not_found("nope");
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::DefiniteFailure { .. }
        ));
        let e = ClientError::broker_operation_failed("SEND", 17, "topic not exist");
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::DefiniteFailure { .. }
        ));
        let e = ClientError::broker_operation_failed("SEND", 2, "busy");
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::Unknown { .. }
        ));
        let e = ClientError::from(MQClientException::new_with_code(17, "No route info"));
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::DefiniteFailure { .. }
        ));
        let e = ClientError::from(MQClientException::new("Send [1] times, still failed"));
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::Unknown { .. }
        ));
        let e = ClientError::timeout("send", 100);
        assert!(matches!(
            outcome_from_error(&e),
            SendOutcome::Unknown { .. }
        ));
    }
}
