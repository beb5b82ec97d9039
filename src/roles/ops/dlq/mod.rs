//! `seckill dlq groups | list | show | replay | discard`: the operator's side of the dead letters that
//! the intake (in `seckill consume`, `roles::consume::dlq_intake`) recorded in PostgreSQL, and
//! of the quarantined messages a consumer could never read (`--quarantined`): those can be
//! replayed once a consumer that reads them runs (docs/architecture/postgresql.md#upgrades).

use crate::domain::status::{DeadLetterStatus, QuarantineStatus};
use std::time::Duration;

use clap::Subcommand;

use crate::config::Settings;
use crate::pg::order_tx::TxNames;
use crate::pg::{dlq, quarantine, replay as pg_replay};

mod batches;
mod checks;
mod from_archive;
mod groups;
mod replay;
mod source;

pub use checks::{pre_checks, Checks};
pub use groups::{failure_groups, normalise, FailureGroup};
pub use replay::replay_message;

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Open dead letters and quarantined messages grouped by fingerprint (source, consumer
    /// group, error class, normalised error, schema version), the largest group first, each
    /// with its count, first and last arrival and the oldest sample ids.
    Groups {
        /// Only this consumer group.
        #[arg(long)]
        group: Option<String>,
        /// Rows read from each of the two tables at most (the oldest first).
        #[arg(long, default_value_t = 100_000)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Dead letters (or quarantined messages), oldest first.
    List {
        /// OPEN, REPLAYED or DISCARDED (default: OPEN); with --quarantined, QUARANTINED or
        /// REPLAYED (default: QUARANTINED).
        #[arg(long)]
        status: Option<String>,
        /// Only this consumer group.
        #[arg(long)]
        group: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
        /// Quarantined messages instead of dead letters.
        #[arg(long)]
        quarantined: bool,
    },
    /// One dead letter (or quarantined message) with its payload.
    Show {
        id: i64,
        /// `id` is a quarantined message's.
        #[arg(long)]
        quarantined: bool,
    },
    /// Re-publish dead letters (or quarantined messages) to their original topic with their
    /// original message_id plus `replay_id` and `replay_count + 1` (rate-limited, one audit
    /// row each).
    Replay(Box<ReplayArgs>),
    /// Give up on a dead letter, or on every open one of a group of failures (audited, under
    /// one batch id). An order-create dead letter's message is withdrawn with it, so its
    /// reservation's unit goes back once, through compensation.
    Discard(DiscardArgs),
}

/// `seckill dlq discard`'s selection.
#[derive(Debug, clap::Args)]
pub struct DiscardArgs {
    /// This dead letter...
    #[arg(
        required_unless_present = "fingerprint",
        conflicts_with = "fingerprint"
    )]
    pub dlq_id: Option<i64>,
    /// ...or every open dead letter of this group of failures (`seckill dlq groups`).
    #[arg(long)]
    pub fingerprint: Option<String>,
    #[arg(long)]
    pub reason: String,
    /// Who decided (default: $USER).
    #[arg(long)]
    pub actor: Option<String>,
}

/// Rows read from each table when a fingerprint is looked up.
const FINGERPRINT_SCAN: i64 = 100_000;

/// `seckill dlq replay`'s selection and plan.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("read_back").args(["from_source", "from_archive"])))]
pub struct ReplayArgs {
    /// By id (OPEN or already REPLAYED; with --quarantined, quarantine ids).
    #[arg(long = "id")]
    pub ids: Vec<i64>,
    /// Every open member of this group of failures (`seckill dlq groups`): dead letters or
    /// quarantined messages, as the group's source says.
    #[arg(long, conflicts_with_all = ["ids", "group", "since", "until", "quarantined", "quarantine_reason"])]
    pub fingerprint: Option<String>,
    /// Replay this many (the oldest) first, and the rest only once each of them was seen
    /// applied (or found applied before) within --verify-secs; 0: all at once.
    #[arg(long, default_value_t = 3)]
    pub sample: usize,
    /// All OPEN dead letters (QUARANTINED messages) of this group (with --since/--until).
    #[arg(long)]
    pub group: Option<String>,
    /// First-seen window start (RFC 3339).
    #[arg(long)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// First-seen window end (RFC 3339).
    #[arg(long)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Quarantined messages instead of dead letters: what a consumer could not read, e.g.
    /// a schema version it did not know yet, sent back once a consumer that reads it runs.
    #[arg(long)]
    pub quarantined: bool,
    /// With --quarantined: only this quarantine reason (UNSUPPORTED_SCHEMA, INVALID_EVENT,
    /// INVALID_JSON).
    #[arg(long, requires = "quarantined")]
    pub quarantine_reason: Option<String>,
    /// Why (kept in the audit; not needed with --dry-run).
    #[arg(long, required_unless_present_any = ["dry_run", "pause", "resume"])]
    pub reason: Option<String>,
    #[arg(long)]
    pub actor: Option<String>,
    /// Messages per second at most.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// Replay even what is older than the inbox retention (it may apply twice), or whose
    /// schema this build does not know (the consumer will quarantine it).
    #[arg(long)]
    pub force: bool,
    /// Only show what the pre-checks find (already applied? reservation still held?
    /// schema known? older than the inbox retention?); nothing is sent or recorded.
    #[arg(long)]
    pub dry_run: bool,
    /// The pre-checks as JSON (with --dry-run).
    #[arg(long)]
    pub json: bool,
    /// Read the messages back from the source topic of --group (default: order creation),
    /// those the broker stored between --since and --until, instead of the dead letters; only
    /// the ones the group's inbox does not hold are sent again (see --include-applied).
    #[arg(long, conflicts_with_all = ["ids", "fingerprint", "quarantined", "from_archive"], requires = "since")]
    pub from_source: bool,
    /// Read the events the outbox sent to --group's topic (default: the projection's) back
    /// from the archive, those created between --since and --until: for events past the
    /// broker's retention. Only the ones the group's inbox does not hold are sent again.
    #[arg(long, conflicts_with_all = ["ids", "fingerprint", "quarantined"], requires = "since")]
    pub from_archive: bool,
    /// With --from-source or --from-archive: only the messages carrying this business key (a
    /// message, reservation, order or request id; an event, its key or its order).
    #[arg(long, requires = "read_back")]
    pub key: Option<String>,
    /// With --from-source or --from-archive: also the messages the inbox already holds (sent
    /// again as no-ops).
    #[arg(long, requires = "read_back")]
    pub include_applied: bool,
    /// With --from-source or --from-archive: read at most this many messages.
    #[arg(long, default_value_t = 10_000)]
    pub max: usize,
    /// Only the messages of this activity (its id in each message's body, or in its
    /// reservation id): one sale's replay apart from another's.
    #[arg(long)]
    pub activity: Option<i64>,
    /// Pause the running replay of this batch (`rpb_...`, printed when it starts): it stops
    /// before its next message until resumed.
    #[arg(long, value_name = "BATCH", conflicts_with_all = ["resume", "ids", "fingerprint", "group", "since", "from_source", "from_archive", "dry_run"])]
    pub pause: Option<String>,
    /// Let a paused replay batch go on where it stopped.
    #[arg(long, value_name = "BATCH", conflicts_with_all = ["ids", "fingerprint", "group", "since", "from_source", "from_archive", "dry_run"])]
    pub resume: Option<String>,
    /// After the sends, how long to watch the group's inbox for each replay's effect
    /// (recorded on its audit row: APPLIED:<decision>, DUPLICATE or NOT_OBSERVED).
    #[arg(long, default_value_t = 10)]
    pub verify_secs: u64,
}

/// `seckill dlq ...`. Returns false when the command found nothing to act on.
pub async fn run(settings: Settings, cmd: DlqCommand) -> anyhow::Result<bool> {
    let (mut client, conn) = crate::pg::connect_one(&settings.pg).await?;
    let conn = tokio::spawn(conn);
    let ok = match cmd {
        DlqCommand::Groups { group, limit, json } => {
            groups::print(&client, group.as_deref(), limit, json).await?
        }
        DlqCommand::List {
            status,
            group,
            limit,
            json,
            quarantined,
        } => {
            let listing = Listing {
                status,
                group,
                limit,
                json,
            };
            if quarantined {
                list_quarantined(&client, listing).await?
            } else {
                list_dead_letters(&client, listing).await?
            }
        }
        DlqCommand::Show { id, quarantined } => show(&client, id, quarantined).await?,
        DlqCommand::Replay(args) => replay_selected(&settings, &mut client, *args).await?,
        DlqCommand::Discard(args) => discard_selected(&settings, &client, args).await?,
    };
    drop(client);
    let _ = conn.await;
    Ok(ok)
}

/// `seckill dlq replay`: the rows the selection names, through the pre-checks and the plan.
async fn replay_selected(
    settings: &Settings,
    client: &mut tokio_postgres::Client,
    args: ReplayArgs,
) -> anyhow::Result<bool> {
    if let Some(batch) = args.pause.as_deref().or(args.resume.as_deref()) {
        let actor = actor_or_user(args.actor.clone());
        return batches::control(client, batch, args.pause.is_some(), &actor).await;
    }
    let reason = args.reason.clone().unwrap_or_default();
    anyhow::ensure!(
        args.dry_run || !reason.trim().is_empty(),
        "--reason must say why"
    );
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    let mut rows = if args.from_source {
        let selection = source::SourceSelection {
            group: args.group.as_deref(),
            since: args.since.unwrap_or_default(),
            until: args.until.unwrap_or_else(chrono::Utc::now),
            key: args.key.as_deref(),
            max: args.max,
        };
        source::rows(settings, &selection).await?
    } else if args.from_archive {
        let selection = from_archive::ArchiveSelection {
            group: args.group.as_deref(),
            since: args.since.unwrap_or_default(),
            until: args.until.unwrap_or_else(chrono::Utc::now),
            key: args.key.as_deref(),
            max: args.max,
        };
        from_archive::rows(settings, &selection)?
    } else {
        recorded_rows(client, &args).await?
    };
    if let Some(activity) = args.activity {
        rows.retain(|r| batches::activity_of(r) == Some(activity));
    }
    let names = settings.names();
    let batch_id = new_batch_id();
    let plan = replay::Plan {
        actor: &actor_or_user(args.actor),
        reason: &reason,
        rate: args.rate,
        force: args.force,
        verify: Duration::from_secs(args.verify_secs),
        batch_id: &batch_id,
        sample: args.sample,
        inbox_groups: &[
            names.order_create_group.clone(),
            names.timeout_group.clone(),
        ],
        gate: batches::Gate {
            batch_id: &batch_id,
            sent: Default::default(),
        },
    };
    // From the source topic, what the inbox holds was applied: not sent again unless asked.
    let skip_applied = (args.from_source || args.from_archive) && !args.include_applied;
    let output = (args.dry_run, args.json, skip_applied);
    replay_rows(settings, client, rows, &plan, output).await
}

/// The dead letters (or quarantined messages) `args` select: by id, by fingerprint, or by
/// group and window.
async fn recorded_rows(
    client: &tokio_postgres::Client,
    args: &ReplayArgs,
) -> anyhow::Result<Vec<pg_replay::ReplayRow>> {
    let (mut ids, mut quarantined) = (args.ids.clone(), args.quarantined);
    if let Some(f) = &args.fingerprint {
        let found = groups::by_fingerprint(client, f, FINGERPRINT_SCAN).await?;
        quarantined = found.source == "quarantined";
        ids = found.members;
    }
    anyhow::ensure!(
        !ids.is_empty() || args.group.is_some() || args.since.is_some() || args.activity.is_some(),
        "select what to replay with --id, --fingerprint, --group, --since, --activity or --from-source"
    );
    let selection = pg_replay::Selection {
        ids: &ids,
        group: args.group.as_deref(),
        since: args.since,
        until: args.until,
        quarantine_reason: args.quarantine_reason.as_deref(),
    };
    Ok(if quarantined {
        pg_replay::quarantined(client, &selection).await?
    } else {
        pg_replay::dead_letters(client, &selection).await?
    })
}

/// A command's `replay_batch_id`.
fn new_batch_id() -> String {
    format!("rpb_{}", ulid::Ulid::new())
}

/// Who acts: `--actor`, else `$USER`.
fn actor_or_user(actor: Option<String>) -> String {
    actor
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// What `dlq list` shows.
struct Listing {
    status: Option<String>,
    group: Option<String>,
    limit: i64,
    json: bool,
}

/// One listed row: its id, when it came, (group, message_id), then two columns and the error.
type TableRow<'a> = (
    i64,
    chrono::DateTime<chrono::Utc>,
    (&'a String, Option<&'a str>),
    [String; 3],
);

/// Prints a listing of dead letters or quarantined messages: `widths` of its fourth and fifth
/// columns (the error runs to the end of the line).
fn print_table<'a>(
    header: [&str; 5],
    widths: [usize; 2],
    rows: impl Iterator<Item = TableRow<'a>>,
) {
    let [w4, w5] = widths;
    let [id, when, subject, fourth, fifth] = header;
    println!("{id:>6}  {when:<20}  {subject:<40}  {fourth:<w4$}  {fifth:<w5$}  error");
    for (id, when, (group, message_id), [fourth, fifth, error]) in rows {
        let subject = format!("{group} / {}", message_id.unwrap_or("-"));
        let when = when.format("%Y-%m-%d %H:%M:%S").to_string();
        println!("{id:>6}  {when:<20}  {subject:<40}  {fourth:<w4$}  {fifth:<w5$}  {error}");
    }
}

async fn list_dead_letters(client: &tokio_postgres::Client, l: Listing) -> anyhow::Result<bool> {
    let status: DeadLetterStatus = match l.status {
        None => DeadLetterStatus::Open,
        Some(s) => s
            .to_uppercase()
            .parse()
            .map_err(|_| anyhow::anyhow!("--status must be OPEN, REPLAYED or DISCARDED"))?,
    };
    let rows = dlq::list(client, Some(status.as_str()), l.group.as_deref(), l.limit).await?;
    if l.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(true);
    }
    let header = [
        "id",
        "first seen",
        "group / message_id",
        "attempts",
        "status",
    ];
    let table = rows.iter().map(|r| {
        let subject = (&r.consumer_group, r.message_id.as_deref());
        let error = r.last_error.as_deref().unwrap_or("-");
        let cells = [r.attempts.to_string(), r.status.clone(), error.to_owned()];
        (r.dlq_id, r.first_seen, subject, cells)
    });
    print_table(header, [8, 10], table);
    println!("{} dead letter(s)", rows.len());
    Ok(true)
}

async fn list_quarantined(client: &tokio_postgres::Client, l: Listing) -> anyhow::Result<bool> {
    let status: QuarantineStatus = match l.status {
        None => QuarantineStatus::Quarantined,
        Some(s) => s.to_uppercase().parse().map_err(|_| {
            anyhow::anyhow!("--status must be QUARANTINED or REPLAYED with --quarantined")
        })?,
    };
    let rows = quarantine::list(client, Some(status.as_str()), l.group.as_deref(), l.limit).await?;
    if l.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(true);
    }
    let header = ["id", "received", "group / message_id", "reason", "status"];
    let table = rows.iter().map(|r| {
        let subject = (&r.consumer_group, r.message_id.as_deref());
        let cells = [r.reason.clone(), r.status.clone(), r.error.clone()];
        (r.quarantine_id, r.received_at, subject, cells)
    });
    print_table(header, [18, 11], table);
    println!("{} quarantined message(s)", rows.len());
    Ok(true)
}

async fn show(client: &tokio_postgres::Client, id: i64, quarantined: bool) -> anyhow::Result<bool> {
    let found = if quarantined {
        quarantine::show(client, id)
            .await?
            .map(|r| serde_json::to_string_pretty(&r))
    } else {
        dlq::show(client, id)
            .await?
            .map(|r| serde_json::to_string_pretty(&r))
    };
    match found {
        Some(text) => {
            println!("{}", text?);
            Ok(true)
        }
        None => {
            let what = if quarantined {
                "quarantined message"
            } else {
                "dead letter"
            };
            eprintln!("no {what} {id}");
            Ok(false)
        }
    }
}

/// The pre-checks, then (unless a dry run) the replay of `rows`; with `skip_applied`, the
/// rows the group's inbox already holds are left out.
async fn replay_rows(
    settings: &Settings,
    client: &mut tokio_postgres::Client,
    rows: Vec<pg_replay::ReplayRow>,
    plan: &replay::Plan<'_>,
    (dry_run, json, skip_applied): (bool, bool, bool),
) -> anyhow::Result<bool> {
    let checks = pre_checks(settings, client, &rows).await?;
    let (rows, checks): (Vec<_>, Vec<_>) = rows
        .into_iter()
        .zip(checks)
        .filter(|(_, c)| !skip_applied || c.already_applied.is_none())
        .unzip();
    if skip_applied {
        eprintln!("{} not applied by the group: replayed", rows.len());
    }
    if dry_run {
        checks::print_checks(&checks, json)?;
        return Ok(!rows.is_empty());
    }
    let publisher = crate::mq::connect_publisher(settings).await?;
    let batch = plan.batch_id;
    crate::pg::replay_batches::start(&*client, batch, rows.len(), plan.actor, plan.reason).await?;
    eprintln!(
        "replay {batch}: {} messages; `seckill dlq replay --pause {batch}` holds it",
        rows.len()
    );
    let rows = rows.into_iter().zip(checks).collect();
    let done = replay::replay(settings, client, publisher.as_ref(), rows, plan).await?;
    use crate::domain::status::ReplayBatchStatus::{Done, Running};
    crate::pg::replay_batches::set(&*client, batch, Running, Done).await?;
    println!(
        "replay {}: {} confirmed ({} applied, {} duplicate, {} not observed within {} s, {} in a group without an inbox), {} refused, {} failed, {} held back",
        plan.batch_id,
        done.confirmed,
        done.applied,
        done.duplicate,
        done.not_observed,
        plan.verify.as_secs(),
        done.unobservable,
        done.refused,
        done.failed,
        done.held_back
    );
    Ok(done.failed == 0 && done.refused == 0 && done.held_back == 0)
}

/// `seckill dlq discard`: one dead letter, or every open one of a group, under one batch id.
async fn discard_selected(
    settings: &Settings,
    client: &tokio_postgres::Client,
    args: DiscardArgs,
) -> anyhow::Result<bool> {
    anyhow::ensure!(!args.reason.trim().is_empty(), "--reason must say why");
    let ids = match (&args.fingerprint, args.dlq_id) {
        (Some(f), _) => {
            let found = groups::by_fingerprint(client, f, FINGERPRINT_SCAN).await?;
            anyhow::ensure!(
                found.source == "dead_letter",
                "group {f} holds quarantined messages: replay them once a consumer reads them"
            );
            found.members
        }
        (None, Some(id)) => vec![id],
        (None, None) => anyhow::bail!("name a dead letter or --fingerprint"),
    };
    let batch_id = new_batch_id();
    let actor = actor_or_user(args.actor);
    let who = dlq::Decider {
        actor: &actor,
        reason: &args.reason,
        batch_id: &batch_id,
    };
    let pool = crate::pg::connect_pool(&settings.pg, 1).await?;
    let mut c = pool.get().await?;
    let order_create = TxNames::order_create(settings);
    let mut discarded = 0;
    for dlq_id in &ids {
        match dlq::discard(&mut c, &order_create, *dlq_id, &who).await? {
            Some(effect) => {
                discarded += 1;
                println!(
                    "dead letter {dlq_id} discarded by {actor}: {}; {} ({effect})",
                    args.reason,
                    discard_effect(effect)
                );
            }
            None => eprintln!("dead letter {dlq_id} is not OPEN (or does not exist)"),
        }
    }
    println!("discard {batch_id}: {discarded} of {} discarded", ids.len());
    Ok(discarded == ids.len())
}

fn discard_effect(effect: &str) -> &'static str {
    match effect {
        dlq::effect::WITHDRAWN => {
            "its message withdrawn: the reservation's unit goes back through compensation"
        }
        dlq::effect::ALREADY_DECIDED => {
            "another copy of its message was already decided; nothing held"
        }
        dlq::effect::UNREADABLE => "its payload does not decode; no reservation to release",
        _ => "nothing held by it",
    }
}
