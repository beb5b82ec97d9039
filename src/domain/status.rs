//! The words that carry state, one type per state machine: what PostgreSQL's `status` columns
//! allow (their `CHECK` constraints; `tests/it/schema.rs` compares them) and what the Lua scripts
//! write into a reservation's hash (the tests below read the scripts). Each word has one
//! spelling, here: Rust code names the variant, SQL and Lua keep the word, and the two are
//! checked to agree.

use std::fmt;
use std::str::FromStr;

/// A word no variant of the named type spells.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{word:?} is not a {kind}")]
pub struct UnknownWord {
    pub kind: &'static str,
    pub word: String,
}

macro_rules! words {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal,)+ }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        pub enum $name {
            $($(#[$vm])* #[serde(rename = $s)] $v,)+
        }

        impl $name {
            /// Every word, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$v,)+];

            /// The word as PostgreSQL, Redis and the wire spell it.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$v => $s,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownWord;

            fn from_str(s: &str) -> Result<Self, UnknownWord> {
                match s {
                    $($s => Ok($name::$v),)+
                    _ => Err(UnknownWord { kind: stringify!($name), word: s.to_string() }),
                }
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.as_str() == *other
            }
        }
    };
}

words! {
    /// `orders.status`.
    OrderStatus {
        Created = "CREATED",
        /// A payment is being settled in a RocketMQ transaction message.
        Paying = "PAYING",
        Paid = "PAID",
        Canceled = "CANCELED",
    }
}

words! {
    /// `reservations.status`: what the order-create consumer made of a reservation.
    ReservationStatus {
        Ordered = "ORDERED",
        Rejected = "REJECTED",
    }
}

words! {
    /// A reservation hash's `status` in Redis: whether it holds its unit.
    HoldStatus {
        Reserved = "RESERVED",
        Released = "RELEASED",
        /// Entered in a fair start's draw, not drawn yet (docs/architecture/hot-path.md#a-fair-start).
        DrawPending = "DRAW_PENDING",
        DrawLost = "DRAW_LOST",
    }
}

words! {
    /// A reservation hash's `mq_status` in Redis: where its message stands.
    SendStatus {
        MqPending = "MQ_PENDING",
        MqSent = "MQ_SENT",
        MqFailed = "MQ_FAILED",
        /// Settled from PostgreSQL: the inbox fenced every copy still in the broker.
        MqFenced = "MQ_FENCED",
        DrawPending = "DRAW_PENDING",
        DrawLost = "DRAW_LOST",
    }
}

words! {
    /// `consumer_inbox.status`.
    InboxStatus {
        Processing = "PROCESSING",
        Succeeded = "SUCCEEDED",
        Rejected = "REJECTED",
    }
}

words! {
    /// `event_outbox.status`.
    OutboxStatus {
        Pending = "PENDING",
        Sent = "SENT",
        Dead = "DEAD",
        /// Written by a transaction message's local transaction; the relay never claims it.
        Transaction = "TRANSACTION",
    }
}

words! {
    /// `compensation_tasks.status`.
    CompensationStatus {
        Pending = "PENDING",
        Done = "DONE",
    }
}

words! {
    /// `refund_obligations.status`.
    RefundStatus {
        Pending = "PENDING",
        Refunded = "REFUNDED",
    }
}

words! {
    /// `dlq_messages.status`.
    DeadLetterStatus {
        Open = "OPEN",
        Replayed = "REPLAYED",
        Discarded = "DISCARDED",
    }
}

words! {
    /// `replay_batches.status`: whether an operator's replay may go on.
    ReplayBatchStatus {
        Running = "RUNNING",
        Paused = "PAUSED",
        Done = "DONE",
    }
}

words! {
    /// `quarantined_messages.status`.
    QuarantineStatus {
        Quarantined = "QUARANTINED",
        Replayed = "REPLAYED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const SCRIPTS: &[(&str, &str)] = &[
        ("claim.lua", include_str!("../redis/lua/claim.lua")),
        (
            "claim_awaiting.lua",
            include_str!("../redis/lua/claim_awaiting.lua"),
        ),
        ("draw.lua", include_str!("../redis/lua/draw.lua")),
        (
            "mark_failed.lua",
            include_str!("../redis/lua/mark_failed.lua"),
        ),
        ("mark_sent.lua", include_str!("../redis/lua/mark_sent.lua")),
        ("project.lua", include_str!("../redis/lua/project.lua")),
        ("release.lua", include_str!("../redis/lua/release.lua")),
        ("reserve.lua", include_str!("../redis/lua/reserve.lua")),
        (
            "schedule_resend.lua",
            include_str!("../redis/lua/schedule_resend.lua"),
        ),
        (
            "set_paused.lua",
            include_str!("../redis/lua/set_paused.lua"),
        ),
        (
            "sold_out_view.lua",
            include_str!("../redis/lua/sold_out_view.lua"),
        ),
        (
            "transfer_in.lua",
            include_str!("../redis/lua/transfer_in.lua"),
        ),
        (
            "transfer_out.lua",
            include_str!("../redis/lua/transfer_out.lua"),
        ),
        ("warm.lua", include_str!("../redis/lua/warm.lua")),
    ];

    /// The words the scripts write to, or compare with, a hash field named `field`:
    /// `'field', 'WORD'` (an HSET pair) and `'field') == 'WORD'` / `~= 'WORD'` (a read); words
    /// are upper case (a field name after `'field', ` is a list of fields read).
    fn script_words(field: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for (_, text) in SCRIPTS {
            for (pattern, skip) in [
                (format!("'{field}', '"), 0),
                (format!("'{field}') == '"), 0),
                (format!("'{field}') ~= '"), 0),
            ] {
                let mut rest = *text;
                while let Some(at) = rest.find(&pattern) {
                    let tail = &rest[at + pattern.len() + skip..];
                    let word: String = tail.chars().take_while(|c| *c != '\'').collect();
                    // `'status', 'user_id'` is a list of fields read, not a word written.
                    if word.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                        out.insert(word);
                    }
                    rest = tail;
                }
            }
        }
        out
    }

    /// Every `'WORD'` (upper case and underscores) in a script: a piece between two quotes made
    /// of nothing else (code and prose between quoted words never is).
    fn upper_quoted(text: &str) -> Vec<String> {
        text.split('\'')
            .filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
            .map(str::to_string)
            .collect()
    }

    fn words<T: Copy>(all: &[T], as_str: fn(T) -> &'static str) -> BTreeSet<String> {
        all.iter().map(|w| as_str(*w).to_string()).collect()
    }

    #[test]
    fn every_word_reads_back_as_itself_and_a_stranger_is_refused() {
        for w in OrderStatus::ALL {
            assert_eq!(w.as_str().parse::<OrderStatus>(), Ok(*w));
            assert_eq!(serde_json::to_value(w).unwrap(), w.as_str());
        }
        for w in SendStatus::ALL {
            assert_eq!(w.as_str().parse::<SendStatus>(), Ok(*w));
        }
        let e = "PAYED".parse::<OrderStatus>().unwrap_err();
        assert_eq!(e.to_string(), "\"PAYED\" is not a OrderStatus");
    }

    #[test]
    fn the_scripts_write_only_the_hold_and_send_words_and_every_one_is_written() {
        let hold = words(HoldStatus::ALL, HoldStatus::as_str);
        let send = words(SendStatus::ALL, SendStatus::as_str);
        let written_hold = script_words("status");
        let written_send = script_words("mq_status");
        assert!(!written_hold.is_empty() && !written_send.is_empty());
        assert!(
            written_hold.is_subset(&hold),
            "a script writes a status HoldStatus lacks: {:?}",
            written_hold.difference(&hold).collect::<Vec<_>>()
        );
        assert!(
            written_send.is_subset(&send),
            "a script writes an mq_status SendStatus lacks: {:?}",
            written_send.difference(&send).collect::<Vec<_>>()
        );
        assert_eq!(
            hold.difference(&written_hold).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "a HoldStatus no script writes"
        );
        // MQ_SENT and MQ_FENCED reach `mark_sent.lua` as its caller's argument; MQ_FENCED alone
        // appears in no script (settled from PostgreSQL, `Sends::settle`).
        let quoted: BTreeSet<String> = SCRIPTS.iter().flat_map(|(_, t)| upper_quoted(t)).collect();
        let by_rust = BTreeSet::from([SendStatus::MqFenced.as_str().to_string()]);
        let nowhere: BTreeSet<_> = send.difference(&quoted).cloned().collect();
        assert_eq!(nowhere, by_rust, "a SendStatus no script knows");
    }
}
