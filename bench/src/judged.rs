//! Which scenario lines of a whole `make bench` are judged, and how: the verdict count
//! (`crate::ratios::violations`) and the human summary's pipeline section (`crate::summary`)
//! read the same list.

/// How a scenario's line is judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// By its verdict alone.
    Verdict,
    /// Through the pipeline: its verdict, and the invariant violations it counted (a line
    /// without the count counts as one).
    Violations,
}

/// Every judged scenario line of `make bench` outside the ceilings and the crowd: how it is
/// judged, and whether the summary's pipeline section shows it (`crate::summary`, in this
/// order): one list for both.
pub const SCENARIOS: [(&str, Judged, bool); 26] = [
    ("B_BATCH", Judged::Violations, true),
    ("ORDER_ROUNDS", Judged::Violations, false),
    ("B_WIDE", Judged::Violations, true),
    ("B_SINGLE", Judged::Violations, true),
    ("RELAY", Judged::Verdict, true),
    ("I_BATCHED", Judged::Verdict, true),
    ("I_SINGLE", Judged::Verdict, true),
    ("T_OFF", Judged::Verdict, true),
    ("T_ON", Judged::Verdict, true),
    ("T_OFF2", Judged::Verdict, true),
    ("T_ON2", Judged::Verdict, true),
    ("A_BATCHED", Judged::Violations, true),
    ("A_SINGLE", Judged::Violations, true),
    ("SOLDOUT_REDIS", Judged::Violations, true),
    ("SOLDOUT", Judged::Violations, true),
    ("SALE", Judged::Violations, true),
    ("SALE_FRONT", Judged::Verdict, true),
    ("MANY", Judged::Violations, true),
    ("DUPS", Judged::Violations, true),
    ("OPEN", Judged::Violations, true),
    ("BASE_SOLDOUT", Judged::Verdict, false),
    ("BASE_BUY", Judged::Verdict, false),
    ("BASE_SALE", Judged::Verdict, false),
    ("CROWD_FCFS", Judged::Verdict, false),
    ("CROWD_DRAW", Judged::Verdict, false),
    ("CROWD_PASSES", Judged::Verdict, false),
];
