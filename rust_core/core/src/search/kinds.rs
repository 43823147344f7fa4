//! The search's phase 6, the schedule kind: the layouts the search
//! ranked, each run as every synchronous kind it may choose, and the
//! fastest that fits.
//!
//! Phases 1-5 search layouts, micro-batch sizes and warm-up depths for
//! DAPPLE's early backward. Here the chosen plan and each ranked candidate
//! are also costed as ZB-H1 and ZB-H2 (their depths fixed by the kind; on
//! its own cut and cut again by the ranks' speeds) and cut into chunks of
//! each chunked kind (`search/interleave.rs`; not under layout hints), in order
//! of a bound (the busiest stage's passes and AllReduce, or for a kind
//! that cuts the layers again the layers' work spread evenly over the
//! ranks), until no candidate left
//! can be faster by it. `search_offering` adds the candidates of a search
//! at warm-up policy A, whose depths ZB-H1 runs. The walk of phase 4
//! prunes by early backward's bound, which the other kinds can beat: a
//! layout the walk left out could be faster as one of them, so the kinds
//! are compared over the layouts the searches kept (docs/schedules.md).
//! On a small space every layout that fits is kept (`walk::every_layout`)
//! and run as every kind without a bound: the choice is exact there.

use crate::cost::WarmupPolicy;
use crate::error::{Error, Result};
use crate::plan::{warmup_depth, Plan};
use crate::schedule::ScheduleKind;
use crate::search::interleave::{balanced_bound_ms, cut_by_rank_speeds, fastest_chunking};
use crate::search::SearchOptions;
use crate::simulation::costing::ProfileCosts;
use crate::simulation::evaluate::evaluate_costed;

/// The synchronous kinds the search chooses among; early backward is the
/// search's own. (GPipe is never faster than early backward on one
/// layout and holds more activations: it is planned when named.)
pub const SEARCHED_KINDS: [ScheduleKind; 7] = [
    ScheduleKind::EarlyBackward1F1B,
    ScheduleKind::ZeroBubbleH1,
    ScheduleKind::ZeroBubbleH2,
    ScheduleKind::Interleaved1F1B,
    ScheduleKind::InterleavedZeroBubble,
    ScheduleKind::ZeroBubbleV,
    ScheduleKind::DualPipeV,
];

/// The kinds a search chooses among: the one `opts` names, or
/// [`SEARCHED_KINDS`]. Under hints that shape the layout, auto plans one
/// stage a rank, as they describe it; a chunked kind named with `--stages`
/// takes that many ranks, and is refused with a cut or a range, which its
/// chunks would not keep.
pub(crate) fn asked_kinds(opts: &SearchOptions) -> Result<Vec<ScheduleKind>> {
    let hints = &opts.hints;
    match opts.schedule {
        Some(kind) if kind.is_chunked() && hints.fix_boundaries() => {
            let one_stage_a_rank: Vec<&str> = SEARCHED_KINDS
                .iter()
                .filter(|k| !k.is_chunked())
                .map(|k| k.name())
                .collect();
            Err(Error::incompatible(format!(
                "schedule {kind} cuts each rank's layers again into chunks, which the hints {} \
                 fix; plan it without the cuts and ranges, or with --schedule {}",
                hints.describe(),
                crate::formats::names::one_of(&one_stage_a_rank)
            )))
        }
        Some(kind) => Ok(vec![kind]),
        None => Ok(SEARCHED_KINDS
            .into_iter()
            .filter(|k| !(hints.shape_layout() && k.is_chunked()))
            .collect()),
    }
}

/// The search's error where no layout it ranked runs as any of `kinds`
/// within memory, with what the kind's order asks of the micro-batches.
pub(crate) fn none_runs(kinds: &[ScheduleKind]) -> Error {
    let names: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
    let needs = match kinds {
        [ScheduleKind::DualPipeV] => " (DualPipeV also needs two micro-batches a stage)",
        [ScheduleKind::ZeroBubbleH1
        | ScheduleKind::Interleaved1F1B
        | ScheduleKind::InterleavedZeroBubble] => {
            " (its order also needs the micro-batches in equal rounds of at least the ranks)"
        }
        _ => "",
    };
    Error::infeasible(format!(
        "no layout the search ranked runs as {} within memory{needs}",
        names.join(" or ")
    ))
}

/// `plan`'s layout run as `kind`, with the depths the kind gives, costed;
/// None where it does not fit, or the kind cannot run its micro-batches
/// (torch's ZB-H1 order takes them in equal rounds). Early backward keeps
/// the plan's own depths. The kinds that defer their Ws (ZB-H1, ZB-H2)
/// also run the layout's layers cut again by its ranks' speeds, the
/// faster of the two, where `asked` lets it: the search's cut balanced
/// early backward's stages, whose bubbles differ from theirs.
pub(super) fn as_kind(
    plan: &Plan,
    kind: ScheduleKind,
    asked: &Asked,
    costs: &ProfileCosts,
) -> Result<Option<Plan>> {
    if kind.is_chunked() {
        return Ok(fastest_chunking(plan, costs, kind, asked.chunks));
    }
    let own = on_its_cut(plan, kind, costs);
    let recut = (asked.recut && kind.defers_weight_gradients())
        .then(|| cut_by_rank_speeds(plan, costs).ok())
        .flatten()
        .and_then(|cut| on_its_cut(&cut, kind, costs));
    Ok(own
        .into_iter()
        .chain(recut)
        .min_by(|a, b| simulated_ms(a).total_cmp(&simulated_ms(b))))
}

/// `plan`'s layout, its own cut, run as `kind` of one stage a rank.
fn on_its_cut(plan: &Plan, kind: ScheduleKind, costs: &ProfileCosts) -> Option<Plan> {
    if kind == plan.schedule.kind && plan.estimate.is_some() {
        return Some(plan.clone());
    }
    let mut other = plan.clone();
    other.schedule.kind = kind;
    let (count, m) = (other.stages.len() as u32, other.micro_batches);
    for (i, stage) in other.stages.iter_mut().enumerate() {
        let policy = other.schedule.warmup_policy;
        if let Some(k) = warmup_depth(kind, policy, count - i as u32, m) {
            stage.warmup_micro_batches = k;
        }
    }
    // The plan checked as `plan` was; only the kind's own rules can refuse it.
    let estimate = evaluate_costed(&other, costs).ok()?;
    estimate.fits_memory.then_some(Plan {
        estimate: Some(estimate),
        ..other
    })
}

/// A costed plan's simulated iteration.
fn simulated_ms(plan: &Plan) -> f64 {
    plan.iteration_ms().unwrap_or(f64::INFINITY)
}

/// The least time `plan`'s layout can take under any synchronous kind: its
/// busiest stage's forwards and backwards of every micro-batch, then its
/// AllReduce. (A chunked kind cuts the layers again: its layouts are
/// ranked by `balanced_bound_ms` instead.)
fn busiest_stage_ms(plan: &Plan) -> f64 {
    let m = f64::from(plan.micro_batches);
    plan.estimate.as_ref().map_or(0.0, |e| {
        e.stages
            .iter()
            .map(|s| m * (s.fwd_ms + s.bwd_ms) + s.tail_ms())
            .fold(0.0, f64::max)
    })
}

/// The fastest plan that fits among `chosen` and `ranked` run as each kind
/// in `kinds`: `chosen` as each kind first, then the ranked layouts in
/// order of their bound while it is below the fastest found, or all of
/// them where `every_layout` says they are every layout of a small space
/// (the bound of a kind that cuts the layers again is a ranking, not a
/// proof: exact only there). A ranked plan
/// searched under another warm-up policy than `chosen`'s is a candidate of
/// the kinds whose depths are fixed only; every result records `chosen`'s
/// policy.
pub(crate) fn fastest_kind(
    chosen: &Plan,
    ranked: &[&Plan],
    kinds: &[ScheduleKind],
    opts: &SearchOptions,
    costs: &ProfileCosts,
    every_layout: bool,
) -> Result<Option<Plan>> {
    let mut best: Option<Plan> = None;
    let policy = chosen.schedule.warmup_policy;
    let asked = Asked {
        kinds,
        chunks: opts.chunks,
        policy,
        recut: !opts.hints.fix_boundaries(),
    };
    keep_faster(&mut best, chosen, &asked, costs)?;
    // A kind that cuts a layout's layers again (a chunked kind, or ZB-H1
    // and ZB-H2 re-cut by the ranks' speeds) can beat the layout's own
    // busiest stage: its layouts are ranked by the even spread too.
    let cuts_again = kinds
        .iter()
        .any(|k| k.is_chunked() || (asked.recut && k.defers_weight_gradients()));
    let bound = |p: &Plan| {
        let own_cut = busiest_stage_ms(p);
        match cuts_again {
            true => own_cut.min(balanced_bound_ms(p, costs)),
            false => own_cut,
        }
    };
    let mut others: Vec<(f64, &Plan)> = ranked.iter().map(|p| (bound(p), *p)).collect();
    others.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (bound, plan) in others {
        if !every_layout && best.as_ref().is_some_and(|b| bound >= simulated_ms(b)) {
            break;
        }
        keep_faster(&mut best, plan, &asked, costs)?;
    }
    Ok(best)
}

/// What the kind phase runs each layout as: `kinds`, a chunked kind with
/// `chunks` a rank where given, every result under warm-up `policy`.
pub(super) struct Asked<'a> {
    pub(super) kinds: &'a [ScheduleKind],
    pub(super) chunks: Option<u32>,
    pub(super) policy: WarmupPolicy,
    /// Whether a layout's layers may be cut again (not where hints fix
    /// where stages begin).
    pub(super) recut: bool,
}

/// `plan` run as each of `kinds` under warm-up policy `policy`, kept in
/// `best` where it fits and is faster.
fn keep_faster(
    best: &mut Option<Plan>,
    plan: &Plan,
    asked: &Asked,
    costs: &ProfileCosts,
) -> Result<()> {
    for &kind in asked.kinds {
        let depths_searched = kind == ScheduleKind::EarlyBackward1F1B;
        if depths_searched && plan.schedule.warmup_policy != asked.policy {
            continue;
        }
        // One rank's layers cut into chunks are worth running too: each
        // chunk reduces its gradients once its backward is done, behind
        // the chunks still running (issue 67: resnet50-fc1000k on 4x8 V100,
        // 101.1 ms interleaved against 102.5 as early backward).
        let Some(mut run) = as_kind(plan, kind, asked, costs)? else {
            continue;
        };
        run.schedule.warmup_policy = asked.policy;
        if best
            .as_ref()
            .is_none_or(|b| simulated_ms(&run) < simulated_ms(b))
        {
            *best = Some(run);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::hints::Hints;

    #[test]
    fn layout_hints_keep_auto_to_one_stage_a_rank_and_a_named_chunked_kind_to_its_ranks() {
        let mut opts = SearchOptions::new(64);
        assert_eq!(asked_kinds(&opts).unwrap(), SEARCHED_KINDS.to_vec());
        opts.hints = Hints {
            stages: Some(4),
            ..Hints::default()
        };
        let auto = asked_kinds(&opts).unwrap();
        assert_eq!(
            auto,
            [
                ScheduleKind::EarlyBackward1F1B,
                ScheduleKind::ZeroBubbleH1,
                ScheduleKind::ZeroBubbleH2
            ]
        );
        // --stages counts a chunked kind's ranks.
        opts.schedule = Some(ScheduleKind::ZeroBubbleV);
        assert_eq!(asked_kinds(&opts).unwrap(), [ScheduleKind::ZeroBubbleV]);
        // A cut its chunks would not keep is refused, the hints named.
        opts.hints.cuts = vec![10];
        let e = asked_kinds(&opts).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Incompatible);
        assert!(e.to_string().contains("--stages 4 --pin-cut 10"), "{e}");
        // Only the micro-batches hinted: auto chooses among them all.
        opts.schedule = None;
        opts.hints = Hints {
            micro_batches: Some(8),
            ..Hints::default()
        };
        assert_eq!(asked_kinds(&opts).unwrap(), SEARCHED_KINDS.to_vec());
    }
}
