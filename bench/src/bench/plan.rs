//! The request plan: who asks for what, with which request id and token.

use std::collections::{BTreeMap, HashSet};

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{BenchArgs, Planned};
use crate::tokens::{read_tokens_file, Minter};
use seckill::config::Settings;

/// Gives every planned request its buyer's token (one token per buyer, as a shop's login
/// would hand out), taken from `file` or signed before the clock starts.
pub(super) fn with_tokens(
    settings: &Settings,
    minter: &Minter,
    file: Option<&Path>,
    plan: &mut [Planned],
) -> anyhow::Result<()> {
    if settings.auth.buyers != seckill::config::BuyerIdentity::Token {
        return Ok(());
    }
    let mut tokens = match file {
        Some(f) => read_tokens_file(f)?,
        None => Default::default(),
    };
    let users: Vec<i64> = plan
        .iter()
        .map(|p| p.user_id)
        .filter(|u| !tokens.contains_key(u))
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    tokens.extend(minter.bearer_for(&users)?);
    for p in plan.iter_mut() {
        p.auth = tokens.get(&p.user_id).cloned();
    }
    Ok(())
}

/// The SKU of each fresh request: even over `--skus`, or by Zipf popularity (`--sku-zipf`).
struct SkuPicker {
    first: i64,
    /// Cumulative weights of the SKUs in rank order (empty: even).
    cumulative: Vec<f64>,
    skus: i64,
}

impl SkuPicker {
    fn new(args: &BenchArgs) -> Self {
        let skus = args.skus.max(1);
        let mut cumulative = Vec::new();
        if args.sku_zipf > 0.0 {
            let mut total = 0.0;
            for rank in 1..=skus {
                total += 1.0 / (rank as f64).powf(args.sku_zipf);
                cumulative.push(total);
            }
        }
        SkuPicker {
            first: args.sku_id,
            cumulative,
            skus,
        }
    }

    fn pick(&self, rng: &mut impl Rng) -> i64 {
        match self.cumulative.last() {
            None => self.first + rng.random_range(0..self.skus),
            Some(&total) => {
                let x = rng.random_range(0.0..total);
                let rank = self.cumulative.partition_point(|&c| c <= x);
                self.first + rank.min(self.cumulative.len() - 1) as i64
            }
        }
    }
}

/// Builds the request plan: fresh buyers, repeat buyers and repeated requests, shuffled in time
/// (the same plan for the same `--seed`).
pub(super) fn plan(args: &BenchArgs, run_tag: &str) -> Vec<Planned> {
    let mut rng = match args.seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_rng(&mut rand::rng()),
    };
    let skus = SkuPicker::new(args);
    let activities = &args.activity_id;
    let mut out: Vec<Planned> = Vec::with_capacity(args.requests);
    let mut next_user: i64 = 1;
    for i in 0..args.requests {
        if !out.is_empty() && rng.random_bool(args.dup_request_share.clamp(0.0, 1.0)) {
            let prev = out[rng.random_range(0..out.len())].clone();
            out.push(prev);
            continue;
        }
        let fresh_left = (next_user as usize) <= args.buyers;
        let repeat = next_user > 1
            && (!fresh_left || rng.random_bool(args.repeat_buyer_share.clamp(0.0, 1.0)));
        let user_id = if repeat {
            rng.random_range(1..next_user)
        } else {
            next_user += 1;
            next_user - 1
        };
        // One activity draws nothing: a plan of one activity stays what it was.
        let activity_id = match activities.len() {
            0 | 1 => activities.first().copied().unwrap_or(1),
            n => activities[rng.random_range(0..n)],
        };
        out.push(Planned {
            activity_id,
            user_id,
            sku_id: skus.pick(&mut rng),
            request_id: format!("{run_tag}-{i}"),
            auth: None,
        });
    }
    out
}

/// Distinct buyers asking for each (activity, SKU) of the plan (one reservation per buyer
/// per SKU).
pub(super) fn buyers_per_sku(plan: &[Planned]) -> BTreeMap<(i64, i64), usize> {
    let mut pairs: BTreeMap<(i64, i64), HashSet<i64>> = BTreeMap::new();
    for p in plan {
        pairs
            .entry((p.activity_id, p.sku_id))
            .or_default()
            .insert(p.user_id);
    }
    pairs
        .into_iter()
        .map(|(sku, users)| (sku, users.len()))
        .collect()
}

/// What a sale without faults must accept: min(stock, distinct buyers) for every (activity,
/// SKU).
pub(super) fn expected_accepted(
    buyers: &BTreeMap<(i64, i64), usize>,
    stock: &BTreeMap<(i64, i64), i64>,
) -> usize {
    buyers
        .iter()
        .map(|(sku, &n)| n.min(stock.get(sku).copied().unwrap_or(0).max(0) as usize))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(requests: usize, buyers: usize, dup: f64, repeat: f64) -> BenchArgs {
        BenchArgs {
            api: String::new(),
            activity_id: vec![1],
            sku_id: 1,
            skus: 1,
            sku_zipf: 0.0,
            seed: None,
            tokens_file: None,
            give_up_ms: 10_000,
            rate: None,
            cpu: Vec::new(),
            scenario: "test".into(),
            requests,
            buyers,
            concurrency: 1,
            dup_request_share: dup,
            repeat_buyer_share: repeat,
            drain_timeout_secs: 1,
            pay_share: 0.0,
            settle_timeout_secs: 1,
            json: false,
            tolerate_faults: false,
            load_only: false,
            stock: None,
            summary_prefix: "BENCH".into(),
            signing: crate::tokens::SigningArgs {
                signing_key: String::new(),
                signing_kid: String::new(),
                signing_alg: String::new(),
            },
        }
    }

    #[test]
    fn plan_respects_buyers_and_shares() {
        let p = plan(&args(10_000, 2_000, 0.0, 0.0), "t");
        assert_eq!(p.len(), 10_000);
        let users: HashSet<i64> = p.iter().map(|x| x.user_id).collect();
        assert!(p.iter().all(|x| x.sku_id == 1));
        assert_eq!(users.len(), 2_000);
        assert!(p.iter().all(|x| (1..=2_000).contains(&x.user_id)));
        let reqs: HashSet<&str> = p.iter().map(|x| x.request_id.as_str()).collect();
        assert_eq!(
            reqs.len(),
            10_000,
            "no repeated request ids without dup share"
        );

        let p = plan(&args(10_000, 10_000, 0.5, 0.0), "t");
        let reqs: HashSet<&str> = p.iter().map(|x| x.request_id.as_str()).collect();
        assert!(
            reqs.len() < 6_000,
            "about half repeat an earlier request: {}",
            reqs.len()
        );
    }

    #[test]
    fn many_skus_spread_the_plan_over_consecutive_ids() {
        let mut a = args(1000, 1000, 0.0, 0.0);
        a.sku_id = 10;
        a.skus = 4;
        let p = plan(&a, "t");
        let skus: HashSet<i64> = p.iter().map(|x| x.sku_id).collect();
        assert_eq!(skus, HashSet::from([10, 11, 12, 13]));
    }

    #[test]
    fn zipf_popularity_falls_with_rank_and_a_seed_repeats_the_plan() {
        let mut a = args(20_000, 15_000, 0.02, 0.05);
        a.skus = 10;
        a.sku_zipf = 1.0;
        a.seed = Some(7);
        let p = plan(&a, "t");
        let count = |sku: i64| p.iter().filter(|x| x.sku_id == sku).count() as f64;
        // 1/rank: the first SKU is asked for about twice as often as the second, ten times
        // as often as the tenth (H(10) = 2.93: 34 % of the requests).
        let (first, second, tenth) = (count(1), count(2), count(10));
        assert!((0.30..0.38).contains(&(first / 20_000.0)), "{first}");
        assert!((1.7..2.3).contains(&(first / second)), "{first} / {second}");
        assert!((7.0..13.0).contains(&(first / tenth)), "{first} / {tenth}");
        let again = plan(&a, "t");
        let shape = |p: &[Planned]| -> Vec<(i64, i64)> {
            p.iter().map(|x| (x.user_id, x.sku_id)).collect()
        };
        assert_eq!(shape(&p), shape(&again), "the same seed, the same crowd");
        a.seed = Some(8);
        assert_ne!(shape(&p), shape(&plan(&a, "t")));
    }

    #[test]
    fn several_activities_share_the_crowd_evenly_with_the_same_popularity_inside() {
        let mut a = args(30_000, 30_000, 0.0, 0.0);
        a.activity_id = vec![7, 8, 9];
        a.skus = 10;
        a.sku_zipf = 1.0;
        a.seed = Some(3);
        let p = plan(&a, "t");
        for activity in [7, 8, 9] {
            let share = p.iter().filter(|x| x.activity_id == activity).count() as f64 / 30_000.0;
            assert!((0.30..0.37).contains(&share), "{activity}: {share}");
            let first = p
                .iter()
                .filter(|x| x.activity_id == activity && x.sku_id == 1)
                .count() as f64;
            let tenth = p
                .iter()
                .filter(|x| x.activity_id == activity && x.sku_id == 10)
                .count() as f64;
            assert!((7.0..13.0).contains(&(first / tenth)), "{first} / {tenth}");
        }
        // Each (activity, SKU) is its own stock: buyers are counted per pair.
        assert_eq!(buyers_per_sku(&p).len(), 30);
    }
}
