//! Topic and consumer-group names, derived from the environment name.

/// Topic and consumer-group names, derived from the environment name
/// (docs/architecture/messages.md#topics-and-groups).
#[derive(Debug, Clone)]
pub struct Names {
    pub order_create_topic: String,
    pub order_timeout_topic: String,
    pub order_event_topic: String,
    pub compensate_topic: String,
    pub order_create_group: String,
    pub compensate_group: String,
    pub timeout_group: String,
    pub projection_group: String,
    /// The audit stream's group: every order event appended for the data team.
    pub audit_group: String,
    /// The group that records dead letters of every other group.
    pub dlq_intake_group: String,
    /// The group a replay reads a source topic through (`seckill dlq replay --from-source`):
    /// its own offsets, never the live groups'.
    pub replay_group: String,
    pub producer_group: String,
    /// The transaction producers' group: the broker asks any live member about a half
    /// message, so every API instance joins it.
    pub transaction_producer_group: String,
}

impl Names {
    /// The broker's dead-letter topic of a consumer group.
    pub fn dlq_topic(group: &str) -> String {
        format!("%DLQ%{group}")
    }

    /// The group that records `source_group`'s dead letters: one intake group per source, as
    /// one group over all DLQ topics would mix subscriptions.
    pub fn dlq_intake_group_of(&self, source_group: &str) -> String {
        let short = if source_group.contains("ORDER_CREATE") {
            "ORDER_CREATE"
        } else if source_group.contains("COMPENSATE") {
            "COMPENSATE"
        } else if source_group.contains("TIMEOUT") {
            "TIMEOUT"
        } else if source_group.contains("AUDIT") {
            "AUDIT"
        } else {
            "PROJECTION"
        };
        format!("{}_{short}", self.dlq_intake_group)
    }

    /// `(consumer group, the topic it consumes)` of every group whose dead letters are kept.
    pub fn dead_letter_sources(&self) -> Vec<(String, String)> {
        vec![
            (
                self.order_create_group.clone(),
                self.order_create_topic.clone(),
            ),
            (self.compensate_group.clone(), self.compensate_topic.clone()),
            (self.timeout_group.clone(), self.order_timeout_topic.clone()),
            (
                self.projection_group.clone(),
                self.order_event_topic.clone(),
            ),
            (self.audit_group.clone(), self.order_event_topic.clone()),
        ]
    }

    /// Groups keep their production names in `PROD` (`CG_SECKILL_ORDER_CREATE_PG_V1`); any
    /// other environment inserts its name (`CG_STAGE_SECKILL_...`) so it never joins PROD's group.
    pub fn new(env: &str) -> Self {
        let infix = if env == "PROD" {
            String::new()
        } else {
            format!("{env}_")
        };
        Self {
            order_create_topic: format!("{env}_SECKILL_ORDER_CREATE_V1"),
            order_timeout_topic: format!("{env}_SECKILL_ORDER_TIMEOUT_V1"),
            order_event_topic: format!("{env}_SECKILL_ORDER_EVENT_V1"),
            compensate_topic: format!("{env}_SECKILL_INVENTORY_COMPENSATE_V1"),
            order_create_group: format!("CG_{infix}SECKILL_ORDER_CREATE_PG_V1"),
            compensate_group: format!("CG_{infix}SECKILL_INVENTORY_COMPENSATE_V1"),
            timeout_group: format!("CG_{infix}SECKILL_ORDER_TIMEOUT_V1"),
            projection_group: format!("CG_{infix}SECKILL_ORDER_QUERY_PROJECTION_V1"),
            audit_group: format!("CG_{infix}SECKILL_AUDIT_V1"),
            dlq_intake_group: format!("CG_{infix}SECKILL_DLQ_INTAKE_V1"),
            replay_group: format!("CG_{infix}SECKILL_REPLAY_V1"),
            producer_group: format!("PG_{infix}SECKILL_PRODUCER_V1"),
            transaction_producer_group: format!("PG_{infix}SECKILL_TX_PRODUCER_V1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_environment_prefix() {
        let n = Names::new("PROD");
        assert_eq!(n.order_create_topic, "PROD_SECKILL_ORDER_CREATE_V1");
        assert_eq!(n.order_create_group, "CG_SECKILL_ORDER_CREATE_PG_V1");
        assert_eq!(
            Names::new("T1").order_create_group,
            "CG_T1_SECKILL_ORDER_CREATE_PG_V1"
        );
    }
}
