//! Every JSON body the buyers' API answers with, as a type. `docs/openapi.yaml` is the
//! contract; the test below serializes each type and checks it against its schema there, so
//! a field added, renamed or dropped on one side fails until the other follows.

use chrono::{DateTime, Utc};
use serde::Serialize;

/// 202 to a reservation (`#/components/schemas/Queued`).
#[derive(Debug, Serialize)]
pub struct Queued<'a> {
    pub status: &'static str,
    pub reservation_id: &'a str,
    pub order_id: &'a str,
    pub valid_until: Option<DateTime<Utc>>,
    pub duplicate: bool,
}

/// A reservation answered from the order projection (`ReservationProjected`).
#[derive(Debug, Serialize)]
pub struct ReservationProjected<'a> {
    pub reservation_id: &'a str,
    pub order_id: &'a str,
    pub status: &'a str,
    pub version: Option<i64>,
}

/// A reservation answered from its order in PostgreSQL (`ReservationOrdered`).
#[derive(Debug, Serialize)]
pub struct ReservationOrdered<'a> {
    pub reservation_id: &'a str,
    pub order_id: &'a str,
    pub status: &'a str,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
}

/// A reservation the order consumer rejected (`ReservationRejected`).
#[derive(Debug, Serialize)]
pub struct ReservationRejected<'a> {
    pub reservation_id: &'a str,
    pub order_id: &'a str,
    pub status: &'static str,
    pub reason: Option<&'a str>,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
}

/// A reservation still waiting for its order, from Redis (`ReservationInRedis`).
#[derive(Debug, Serialize)]
pub struct ReservationInRedis<'a> {
    pub reservation_id: &'a str,
    pub order_id: &'a str,
    pub status: &'static str,
    pub mq_status: &'a str,
    pub activity_id: Option<i64>,
    pub sku_id: Option<i64>,
    pub user_id: Option<i64>,
    pub valid_until: Option<DateTime<Utc>>,
}

/// 200 to a payment notification (`Paid`).
#[derive(Debug, Serialize)]
pub struct Paid<'a> {
    pub order_id: &'a str,
    pub status: &'static str,
    pub payment_id: &'a str,
    pub repeat: bool,
}

/// 201 (issued) or 200 (held already) to a pass registration (`SalePass`).
#[derive(Debug, Serialize)]
pub struct SalePass<'a> {
    pub pass: &'a str,
    pub pass_id: &'a str,
    pub activity_id: i64,
    pub user_id: i64,
    pub issued_at: DateTime<Utc>,
}

/// 200 to a proof-of-work challenge request (`PassChallenge`): the ALTCHA challenge as made.
#[derive(Debug, Serialize)]
pub struct PassChallenge<'a> {
    pub challenge: &'a altcha::Challenge,
    pub difficulty: u32,
}

/// Every error (`Error`): `{"error": {"code", "message"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub code: &'a str,
    pub message: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::status::{OrderStatus, ReservationStatus, SendStatus};
    use serde_json::{json, Value};

    fn spec() -> Value {
        let text = include_str!("../../../docs/openapi.yaml");
        let docs = yaml_rust2::YamlLoader::load_from_str(text).expect("docs/openapi.yaml parses");
        to_json(&docs[0])
    }

    fn to_json(y: &yaml_rust2::Yaml) -> Value {
        use yaml_rust2::Yaml;
        match y {
            Yaml::Integer(i) => json!(i),
            Yaml::Real(r) => r.parse::<f64>().map(|f| json!(f)).unwrap_or(Value::Null),
            Yaml::String(s) => json!(s),
            Yaml::Boolean(b) => json!(b),
            Yaml::Array(a) => Value::Array(a.iter().map(to_json).collect()),
            Yaml::Hash(h) => Value::Object(
                h.iter()
                    .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), to_json(v))))
                    .collect(),
            ),
            Yaml::Null | Yaml::Alias(_) | Yaml::BadValue => Value::Null,
        }
    }

    fn resolve<'a>(spec: &'a Value, schema: &'a Value) -> &'a Value {
        match schema.get("$ref").and_then(Value::as_str) {
            Some(r) => {
                let path = r.trim_start_matches("#/").split('/');
                let target = path.fold(spec, |v, k| &v[k]);
                resolve(spec, target)
            }
            None => schema,
        }
    }

    /// The shape checks an OpenAPI 3.0 schema makes of a value: type (with `nullable`),
    /// enum, required, no property it does not declare when `additionalProperties: false`,
    /// and the same of each property.
    fn check(spec: &Value, schema: &Value, value: &Value, at: &str) -> Vec<String> {
        let schema = resolve(spec, schema);
        let mut errs = Vec::new();
        if value.is_null() {
            if schema["nullable"] != json!(true) {
                errs.push(format!("{at}: null, not nullable"));
            }
            return errs;
        }
        let ok = match schema["type"].as_str() {
            Some("string") => value.is_string(),
            Some("integer") => value.is_i64() || value.is_u64(),
            Some("boolean") => value.is_boolean(),
            Some("object") => value.is_object(),
            Some("array") => value.is_array(),
            _ => true,
        };
        if !ok {
            errs.push(format!("{at}: {value} is not a {}", schema["type"]));
        }
        if let Some(allowed) = schema["enum"].as_array() {
            if !allowed.contains(value) {
                errs.push(format!("{at}: {value} not in {allowed:?}"));
            }
        }
        if let (Some(obj), Some(props)) = (value.as_object(), schema["properties"].as_object()) {
            for req in schema["required"].as_array().into_iter().flatten() {
                let req = req.as_str().unwrap_or_default();
                if !obj.contains_key(req) {
                    errs.push(format!("{at}: required `{req}` missing"));
                }
            }
            for (k, v) in obj {
                match props.get(k) {
                    Some(p) => errs.extend(check(spec, p, v, &format!("{at}.{k}"))),
                    None if schema["additionalProperties"] == json!(false) => {
                        errs.push(format!("{at}: `{k}` is not in the schema"))
                    }
                    None => {}
                }
            }
        }
        errs
    }

    fn assert_matches(name: &str, body: impl Serialize) {
        let spec = spec();
        let schema = &spec["components"]["schemas"][name];
        assert!(schema.is_object(), "docs/openapi.yaml has no schema {name}");
        let value = serde_json::to_value(body).expect("serializes");
        let errs = check(&spec, schema, &value, name);
        assert!(
            errs.is_empty(),
            "{name} does not match docs/openapi.yaml: {errs:#?}"
        );
    }

    const RSV: &str = "rsv_42_01JQ3Z8V6W2M4N7P9R1S3T5V7X";
    const ORD: &str = "ord_01JQ3Z8V6W2M4N7P9R1S3T5V7Y";

    #[test]
    fn every_body_matches_its_schema_in_openapi_yaml() {
        let now = Some(Utc::now());
        for (valid_until, duplicate) in [(now, false), (None, true)] {
            let queued = Queued {
                status: "QUEUED",
                reservation_id: RSV,
                order_id: ORD,
                valid_until,
                duplicate,
            };
            assert_matches("Queued", queued);
        }
        for version in [Some(3), None] {
            let projected = ReservationProjected {
                reservation_id: RSV,
                order_id: ORD,
                status: OrderStatus::Paid.as_str(),
                version,
            };
            assert_matches("ReservationProjected", projected);
        }
        let ordered = ReservationOrdered {
            reservation_id: RSV,
            order_id: ORD,
            status: OrderStatus::Created.as_str(),
            activity_id: 10001,
            sku_id: 1,
            user_id: 42,
        };
        assert_matches("ReservationOrdered", ordered);
        let rejected = ReservationRejected {
            reservation_id: RSV,
            order_id: ORD,
            status: ReservationStatus::Rejected.as_str(),
            reason: Some("NO_STOCK"),
            activity_id: 10001,
            sku_id: 1,
            user_id: 42,
        };
        assert_matches("ReservationRejected", rejected);
        let waiting = ReservationInRedis {
            reservation_id: RSV,
            order_id: ORD,
            status: "QUEUED",
            mq_status: SendStatus::MqPending.as_str(),
            activity_id: Some(10001),
            sku_id: None,
            user_id: Some(42),
            valid_until: now,
        };
        assert_matches("ReservationInRedis", waiting);
        let paid = Paid {
            order_id: ORD,
            status: OrderStatus::Paid.as_str(),
            payment_id: "pay-1",
            repeat: false,
        };
        assert_matches("Paid", paid);
        let error = ErrorBody {
            error: ErrorDetail {
                code: "SOLD_OUT",
                message: "sold out",
            },
        };
        assert_matches("Error", error);
    }

    #[test]
    fn the_pass_bodies_match_their_schemas_in_openapi_yaml() {
        let pass = SalePass {
            pass: "sp1.10001.42.sp_01JQ3Z8V6W2M4N7P9R1S3T5V7Z.c2ln",
            pass_id: "sp_01JQ3Z8V6W2M4N7P9R1S3T5V7Z",
            activity_id: 10001,
            user_id: 42,
            issued_at: Utc::now(),
        };
        assert_matches("SalePass", pass);
        let pow = crate::auth::pow::Pow::new(
            &[secrecy::SecretString::from("x".repeat(32))],
            (&crate::config::PassSettings::default()).into(),
        );
        let (challenge, difficulty) = pow.challenge(10001, 42, 100).expect("a secret is set");
        assert_matches(
            "PassChallenge",
            PassChallenge {
                challenge: &challenge,
                difficulty,
            },
        );
    }

    #[test]
    fn the_order_matches_its_schema_in_openapi_yaml() {
        let now = Some(Utc::now());
        for (paid_at, channel) in [(None, None), (now, Some("mini_program".to_string()))] {
            let order = crate::pg::queries::OrderView {
                order: crate::domain::events::OrderRef {
                    order_id: ORD.into(),
                    reservation_id: RSV.into(),
                    activity_id: 10001,
                    sku_id: 1,
                    user_id: 42,
                },
                status: OrderStatus::Paid.to_string(),
                amount_cents: 9_900,
                version: 2,
                expires_at: Utc::now(),
                created_at: Utc::now(),
                paid_at,
                canceled_at: None,
                channel,
            };
            assert_matches("Order", order);
        }
    }

    #[test]
    fn the_check_finds_a_body_that_drifted() {
        let spec = spec();
        let schema = &spec["components"]["schemas"]["Queued"];
        let drifted = json!({"status": "QUEUED", "reservation_id": RSV, "order_id": ORD,
                             "valid_until": null, "dup": false});
        let errs = check(&spec, schema, &drifted, "Queued");
        assert!(
            errs.iter().any(|e| e.contains("`duplicate` missing")),
            "{errs:?}"
        );
        assert!(
            errs.iter()
                .any(|e| e.contains("`dup` is not in the schema")),
            "{errs:?}"
        );
        let wrong = json!({"error": {"code": "NOPE", "message": 7}});
        let errs = check(
            &spec,
            &spec["components"]["schemas"]["Error"],
            &wrong,
            "Error",
        );
        assert_eq!(errs.len(), 2, "{errs:?}");
    }
}
