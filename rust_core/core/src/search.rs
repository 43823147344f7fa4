//! The planner's search: the dynamic program of `dp.rs` for every
//! micro-batch size and memory rule, then the candidates it and the
//! baselines give ranked by simulated iteration, and the walk over every
//! other layout that could simulate faster (`docs/cost-model.md`).
//!
//! Micro-batch sizes are searched in parallel with rayon and share the best
//! latency found so far for pruning.

use std::sync::atomic::AtomicU64;

use rayon::prelude::*;

use crate::baselines::{baseline_layouts, Baseline};
use crate::cost::{Cluster, StageCoster, StageDevices, WarmupPolicy};
use crate::dp::{
    concrete_allocs, Context, Dp, Found, LayoutWalk, MemoryBudget, Objective, OtherStageCount,
    PassResult, Step,
};
use crate::error::{Error, ErrorKind, Result};
use crate::evaluate::{estimate_stages, evaluate};
use crate::plan::{ChosenBy, Plan, PlanInputs, ScheduleChoice, Selection, Stage};
use crate::profile::{LayerCosts, Profile};
use crate::refine::{refine, same_up_to_machines, Refined};
use crate::schedule::{within_passes, ScheduleKind};
use crate::topology::Topology;
use crate::warmup::plan_with_chosen_warmups;

#[derive(Debug, Clone)]
pub struct SearchOptions {
    pub global_batch_size: u32,
    pub warmup_policy: WarmupPolicy,
    /// Smallest per-device slice of a micro-batch. None: the profile's
    /// smallest measured batch size.
    pub min_micro_batch_size: Option<u32>,
    /// Only these micro-batch sizes (must divide the global batch). None: all divisors.
    pub micro_batch_sizes: Option<Vec<u32>>,
    pub search_space: SearchSpace,
    /// Recorded in the plan.
    pub profile_path: Option<String>,
    /// Most memory the DP's tables may take (`DEFAULT_MAX_SEARCH_BYTES`);
    /// past it the search stops with a limit error.
    pub max_search_bytes: u64,
    /// Improve the chosen plan by local moves (`refine.rs`), up to
    /// `REFINE_MAX_DEVICES` GPUs. Off: the plan is the search space's.
    pub refine: bool,
}

/// Default of `SearchOptions::max_search_bytes` (`dapple plan
/// --max-search-gib`): 1 GiB, so that a search stays within 2 GiB. The
/// default space never comes near it on the shipped profiles (83 MB on
/// 128x8); the full space on 32x8 passes it in about half a minute.
pub const DEFAULT_MAX_SEARCH_BYTES: u64 = 1 << 30;

impl SearchOptions {
    pub fn new(global_batch_size: u32) -> Self {
        SearchOptions {
            global_batch_size,
            warmup_policy: WarmupPolicy::Auto,
            min_micro_batch_size: None,
            micro_batch_sizes: None,
            search_space: SearchSpace::Auto,
            profile_path: None,
            max_search_bytes: DEFAULT_MAX_SEARCH_BYTES,
            refine: true,
        }
    }
}

crate::named_enum! {
    /// Which stage replications and placements the search tries.
    pub enum SearchSpace("a search space") {
        /// Full up to 16 GPUs (the paper's clusters), machine-aligned above.
        Auto = "auto",
        /// Every GPU count for every stage, all three placement policies.
        Full = "full",
        /// Stages get a divisor of a machine's GPUs or whole machines (the
        /// fewest that give their largest slice), placed fresh-first or
        /// append-first with at most two machines partly used, or spread
        /// evenly over every machine in use (scatter-first). As in the full
        /// space, a plan may leave GPUs idle.
        /// On many machines the full space has too many ways to leave
        /// machines partly used (8x8 GPUs: 8.8 million states); this plans
        /// 128 layers on 16,384 GPUs in seconds.
        MachineAligned = "machine-aligned",
    }
}

/// Stages the layout walk may cost, and tasks it may simulate to cost
/// complete layouts, before it stops; past either the plan is the fastest found and
/// `selection.optimal` is false. About a second on the paper's cases.
const WALK_NODE_BUDGET: u64 = 500_000;
const WALK_SIMULATED_TASK_BUDGET: u64 = 20_000_000;
/// What building, checking and estimating one plan costs, in simulated
/// tasks, beyond its simulations (`cost_candidate`).
const PLAN_OVERHEAD_TASKS: u64 = 10_000;

/// Simulated tasks refinement may spend from each of its two starts
/// (`refine.rs`): well under a second each on the paper's cases.
const REFINE_TASK_BUDGET: u64 = 20_000_000;

/// Largest cluster whose chosen plan is refined. One GPU's move is a
/// visible share of a stage up to there; moves grow with the square of
/// the machines, and on 1,024 GPUs of whole-machine stages a single
/// GPU's move only splits a stage over one more machine.
const REFINE_MAX_DEVICES: u32 = 64;

/// Largest cluster the automatic choice searches in full. 128 layers on
/// 4x8 GPUs take 1.1 s in full when time is linear in the batch and 59 s
/// when small batches are less efficient (benchmarks/README.md).
const AUTO_FULL_MAX_DEVICES: u32 = 16;

/// Largest cluster on which every micro-batch size runs the DP on its own
/// and gives candidates (its best plans, those of other stage counts, the
/// baselines' layouts); above, the sizes share one bound.
const SIZES_ALONE_MAX_DEVICES: u32 = AUTO_FULL_MAX_DEVICES;

/// Largest cluster on which, after the shared-bound runs, every
/// micro-batch size runs again on its own (a second pass), pruned at the
/// fastest simulated time so far, to offer its best plan (`search`).
const SECOND_PASS_MAX_DEVICES: u32 = 64;

impl SearchSpace {
    fn resolve(self, cluster: &Cluster) -> SearchSpace {
        match self {
            SearchSpace::Auto if cluster.num_devices() > AUTO_FULL_MAX_DEVICES => {
                SearchSpace::MachineAligned
            }
            SearchSpace::Auto => SearchSpace::Full,
            other => other,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct SearchStats {
    pub micro_batch_sizes: Vec<u32>,
    pub states: usize,
    pub stages_costed: u64,
    /// Plans refinement costed around the chosen one.
    pub refine_plans_costed: u64,
}

#[derive(Debug, Clone)]
pub struct SearchResult {
    pub plan: Plan,
    pub stats: SearchStats,
}

/// Find the plan with the shortest simulated iteration that fits in memory.
///
/// The DP minimises formula (2), a lower bound of the simulated time, for
/// every micro-batch size. Under warm-up policy auto it runs three times,
/// with stage memory counted at policy A's depths, policy B's and one
/// micro-batch in flight (the least any valid plan holds, so that pass
/// covers every plan of the space). The best plan of each run, and the
/// baselines' layouts at every micro-batch size, are candidates (above 16
/// GPUs the sizes share their bounds; up to 64 a second pass gives each
/// size's best plan below the fastest simulated one); each gets
/// the warm-up depths that simulate fastest within memory, and the
/// candidate with the shortest simulated iteration is returned. The
/// smallest bound over the space is recorded beside it
/// (`selection.lower_bound_ms`): no plan of the space simulates faster.
///
/// `profile` and `topology` are taken as read (`FileObject`), which checks
/// them; one built by hand must pass its `validate` first.
pub fn search(
    profile: &Profile,
    topology: &Topology,
    opts: &SearchOptions,
) -> Result<SearchResult> {
    debug_assert!(profile.validate().is_ok() && topology.validate().is_ok());
    let gbs = opts.global_batch_size;
    if gbs == 0 {
        return Err(Error::field("global_batch_size", "value 0 must be >= 1"));
    }
    let min_slice = profile.min_slice(opts.min_micro_batch_size);
    let sizes: Vec<u32> = match &opts.micro_batch_sizes {
        Some(list) => {
            for &b in list {
                if b == 0 || !gbs.is_multiple_of(b) {
                    return Err(Error::field(
                        "micro_batch_sizes",
                        format!("value {b} does not divide the global batch size {gbs}"),
                    ));
                }
            }
            list.iter().copied().filter(|&b| b >= min_slice).collect()
        }
        // Sizes whose micro-batches alone pass the simulation limit are left
        // out (`schedule::MAX_PASSES`); so are, below, plans whose stages
        // times micro-batches do.
        None => (1..=gbs)
            .filter(|b| gbs.is_multiple_of(*b) && *b >= min_slice && within_passes(1, gbs / b))
            .collect(),
    };
    if sizes.is_empty() {
        return Err(Error::incompatible(format!(
            "global batch size {gbs} cannot be split into micro-batches of at least {min_slice} samples \
             (the smallest profiled batch size; lower it with --min-micro-batch-size)"
        )));
    }
    let layers = LayerCosts::new(profile);
    let cluster = Cluster::for_model(topology, &layers)?;
    let space = opts.search_space.resolve(&cluster);
    // The run whose memory rule admits every plan of the space comes last:
    // its bounds are the space's.
    let passes: Vec<WarmupPolicy> = match opts.warmup_policy {
        WarmupPolicy::Auto => vec![WarmupPolicy::A, WarmupPolicy::B, WarmupPolicy::Auto],
        fixed => vec![fixed],
    };
    let contexts: Vec<Context> = passes
        .iter()
        .map(|&policy| Context {
            layers: &layers,
            cluster: &cluster,
            policy,
            min_slice,
            space,
            layout: None,
        })
        .collect();
    // One DP run per micro-batch size serves every pass: its entries carry
    // the strictest memory rule they fit (loosest first: one micro-batch,
    // then policy A's depths, then B's).
    let mut by_looseness: Vec<usize> = (0..contexts.len()).collect();
    by_looseness.sort_by_key(|&p| match contexts[p].policy {
        WarmupPolicy::Auto => 0,
        WarmupPolicy::A => 1,
        WarmupPolicy::B => 2,
    });
    let rules: Vec<WarmupPolicy> = by_looseness.iter().map(|&p| contexts[p].policy).collect();
    // Up to 16 GPUs every micro-batch size searches on its own, so each
    // size contributes its best plan per pass as a candidate. Above, the
    // sizes share each pass's best formula value for pruning (far less
    // work): a size that cannot reach it is cut and only the pass's best is
    // a candidate, though the walk below still visits the other sizes.
    let sizes_alone = cluster.num_devices() <= SIZES_ALONE_MAX_DEVICES;
    // One bound per pass, per size or shared by the sizes.
    let bound_sets = if sizes_alone { sizes.len() } else { 1 };
    let incumbents: Vec<AtomicU64> = (0..bound_sets * rules.len())
        .map(|_| AtomicU64::new(f64::INFINITY.to_bits()))
        .collect();
    let covering_ctx = &contexts[contexts.len() - 1];
    let budget = MemoryBudget::new(opts.max_search_bytes);
    let runs: Vec<(Vec<PassResult>, Vec<OtherStageCount>)> = (0..sizes.len())
        .into_par_iter()
        .map(|k| {
            let b = sizes[k];
            let set = if sizes_alone { k } else { 0 };
            let bounds = &incumbents[set * rules.len()..(set + 1) * rules.len()];
            let mut dp = Dp::new(
                covering_ctx,
                b,
                gbs / b,
                Objective::Latency,
                rules.clone(),
                Some(bounds),
            )
            .with_budget(&budget);
            let found = dp.run();
            // Up to 16 GPUs, each rule's best plan of every other stage
            // count is a candidate too: fewer, wider stages can simulate
            // faster than the formula's best (fewer bubbles).
            let others: Vec<OtherStageCount> = if sizes_alone {
                by_looseness
                    .iter()
                    .enumerate()
                    .flat_map(|(class, &p)| {
                        dp.other_stage_counts(class)
                            .into_iter()
                            .map(move |f| (p, b, f))
                    })
                    .collect()
            } else {
                Vec::new()
            };
            // Work is counted once, on the covering pass's row.
            let covering = contexts.len() - 1;
            let rows = found
                .into_iter()
                .zip(&by_looseness)
                .map(|(f, &p)| {
                    let (states, costed) = if p == covering {
                        (dp.states.len(), dp.stages_costed)
                    } else {
                        (0, 0)
                    };
                    (p, b, f, states, costed)
                })
                .collect();
            (rows, others)
        })
        .collect();
    if let Some(e) = search_memory_limit(&budget, &cluster, space) {
        return Err(e);
    }
    let (rows, others): (Vec<_>, Vec<_>) = runs.into_iter().unzip();
    let others: Vec<OtherStageCount> = others.into_iter().flatten().collect();
    let mut results: Vec<PassResult> = rows.into_iter().flatten().collect();
    if !sizes_alone {
        // Which sizes survive a shared bound depends on thread timing; each
        // run's best does not (the DP is exact, ties broken by fewer stages,
        // then larger micro-batches). Keep only that one.
        for p in 0..contexts.len() {
            let best = results
                .iter()
                .enumerate()
                .filter(|(_, r)| r.0 == p && r.2.is_some())
                .min_by(|(_, x), (_, y)| {
                    let (fx, fy) = (x.2.as_ref().unwrap(), y.2.as_ref().unwrap());
                    fx.value
                        .total_cmp(&fy.value)
                        .then(fx.stages.len().cmp(&fy.stages.len()))
                        .then(y.1.cmp(&x.1))
                })
                .map(|(i, _)| i);
            for (i, r) in results.iter_mut().enumerate() {
                if r.0 == p && Some(i) != best {
                    r.2 = None;
                }
            }
        }
    }
    let mut stats = SearchStats {
        micro_batch_sizes: sizes.clone(),
        states: results.iter().map(|r| r.3).sum(),
        stages_costed: results.iter().map(|r| r.4).sum(),
        refine_plans_costed: 0,
    };
    let covering = contexts.len() - 1;
    let lower_bound_ms = results
        .iter()
        .filter(|r| r.0 == covering)
        .filter_map(|r| r.2.as_ref().map(|f| f.value))
        .fold(f64::INFINITY, f64::min);
    if !lower_bound_ms.is_finite() {
        return Err(explain_infeasible(
            &contexts[covering],
            &sizes,
            gbs,
            &budget,
        ));
    }
    let inputs = PlanInputs::new(
        profile,
        topology,
        gbs,
        min_slice,
        space.name(),
        opts.profile_path.clone(),
    );
    let mut candidates: Vec<(Plan, &'static str)> = results
        .iter()
        .filter_map(|(p, b, found, _, _)| {
            let f = found
                .as_ref()
                .filter(|f| within_passes(f.stages.len(), gbs / b))?;
            Some((build_plan(&inputs, &contexts[*p], *b, gbs / b, f), "search"))
        })
        .collect();
    // The baselines' layouts are candidates too, up to 16 GPUs: there they
    // are cheap, and a plan that loses to a baseline would be a defect the
    // walk's budget could leave in place. On larger clusters a straight
    // pipeline has a stage per layer and PipeDream's DP is quadratic in the
    // GPUs; there the search's own candidates and the walk must do.
    if sizes_alone {
        // On GPUs of several kinds, Whale's balanced data parallelism and
        // pipeline too: their uneven slices are outside the search's own space.
        let mut kinds = vec![Baseline::Straight, Baseline::PipeDream];
        if cluster.is_mixed() {
            kinds.extend([Baseline::WhaleDataParallel, Baseline::WhalePipeline]);
        }
        for kind in kinds {
            // A baseline that does not apply to this cluster (PipeDream's
            // planner on machines of unequal size) offers no candidate.
            let layouts =
                match baseline_layouts(kind, profile, topology, gbs, min_slice, opts.warmup_policy)
                {
                    Err(e) if e.kind == ErrorKind::Incompatible => Vec::new(),
                    other => other?,
                };
            for plan in layouts {
                candidates.push((plan, kind.name()));
            }
        }
    }
    // Each candidate gets its warm-up depths (auto: many simulations) or
    // keeps its cost (fixed: already simulated once), in order of its
    // formula (2) value, a lower bound of its simulated time whatever its
    // depths: once that is above the fastest simulated so far, neither it
    // nor any later candidate can be faster, and none gets its depths.
    // Candidates are costed a batch per thread at a time.
    let cost = |candidates: Vec<(Plan, &'static str)>,
                mut fastest: f64|
     -> Result<Vec<(Plan, &'static str)>> {
        // Baselines' layouts come uncosted; the search's own are costed.
        let mut bounded: Vec<(Plan, &'static str)> = candidates
            .into_par_iter()
            .map(|(plan, source)| {
                Ok(match plan.estimate {
                    Some(_) => (plan, source),
                    None => (
                        Plan {
                            estimate: Some(evaluate(&plan, profile)?),
                            ..plan
                        },
                        source,
                    ),
                })
            })
            .collect::<Result<_>>()?;
        let bound = |p: &Plan| p.estimate.as_ref().expect("bounded").latency_ms;
        bounded.sort_by(|a, b| bound(&a.0).total_cmp(&bound(&b.0)));
        let width = rayon::current_num_threads().max(1);
        let mut costed: Vec<(Plan, &'static str)> = Vec::new();
        let mut left = bounded.into_iter().peekable();
        while left.peek().is_some_and(|(p, _)| bound(p) <= fastest) {
            let batch: Vec<(Plan, &'static str)> =
                std::iter::from_fn(|| left.next_if(|(p, _)| bound(p) <= fastest))
                    .take(width)
                    .collect();
            let done: Vec<Option<(Plan, &'static str)>> = batch
                .into_par_iter()
                .map(|(plan, source)| {
                    let plan = match opts.warmup_policy {
                        WarmupPolicy::Auto => plan_with_chosen_warmups(&plan, profile)?.0,
                        _ => Some(plan),
                    };
                    Ok(plan
                        .filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory))
                        .map(|p| (p, source)))
                })
                .collect::<Result<_>>()?;
            for (plan, source) in done.into_iter().flatten() {
                let simulated = plan.estimate.as_ref().and_then(|e| e.iteration_ms);
                fastest = fastest.min(simulated.unwrap_or(f64::INFINITY));
                costed.push((plan, source));
            }
        }
        Ok(costed)
    };
    // Plans offered to simulation, whether or not their bound let them be
    // simulated: a count that does not depend on the number of threads.
    let mut offered = candidates.len() as u32;
    let mut ranked = cost(candidates, f64::INFINITY)?;
    let key = |p: &Plan| {
        let e = p.estimate.as_ref().expect("candidates are costed");
        (
            e.iteration_ms.expect("costed plans are simulated"),
            e.latency_ms,
        )
    };
    // Shortest simulated iteration; ties go to the smaller bound, fewer
    // stages, then larger micro-batches.
    let faster = |(a, _): &(Plan, &str), (b, _): &(Plan, &str)| {
        let (ka, kb) = (key(a), key(b));
        ka.0.total_cmp(&kb.0)
            .then(ka.1.total_cmp(&kb.1))
            .then(a.stages.len().cmp(&b.stages.len()))
            .then(b.micro_batch_size.cmp(&a.micro_batch_size))
    };
    ranked.sort_by(faster);
    // The other stage counts' best plans, where their bound is below the
    // fastest simulated so far (else they cannot be faster).
    let best_so_far = ranked.first().map_or(f64::INFINITY, |(p, _)| key(p).0);
    let alternatives: Vec<(Plan, &'static str)> = others
        .iter()
        .filter(|(_, b, f)| f.value < best_so_far && within_passes(f.stages.len(), gbs / b))
        .map(|(p, b, f)| (build_plan(&inputs, &contexts[*p], *b, gbs / b, f), "search"))
        .collect();
    if !alternatives.is_empty() {
        offered += alternatives.len() as u32;
        ranked.extend(cost(alternatives, best_so_far)?);
        ranked.sort_by(faster);
    }
    // Where the sizes shared one bound, only the best formula value's size
    // gave candidates; another size's best plan may simulate faster. Up to
    // 64 GPUs each size runs again on its own, pruned at the fastest
    // simulated time so far (a plan whose formula value is above it cannot
    // simulate faster), and its best plan under each rule is a candidate.
    // The pass has its own table budget: past it, it adds nothing, and the
    // plans found so far stand.
    if !sizes_alone && cluster.num_devices() <= SECOND_PASS_MAX_DEVICES {
        if let Some(fastest) = ranked.first().map(|(p, _)| key(p).0) {
            let second_budget = MemoryBudget::new(opts.max_search_bytes);
            // One size's pass: each rule's best plan (rule, size, plan),
            // and the pass's work.
            struct SizePass {
                found: Vec<(usize, u32, Found)>,
                states: usize,
                stages_costed: u64,
            }
            let each: Vec<SizePass> = sizes
                .par_iter()
                .map(|&b| {
                    let bounds: Vec<AtomicU64> = rules
                        .iter()
                        .map(|_| AtomicU64::new(fastest.to_bits()))
                        .collect();
                    let mut dp = Dp::new(
                        covering_ctx,
                        b,
                        gbs / b,
                        Objective::Latency,
                        rules.clone(),
                        Some(&bounds),
                    )
                    .with_budget(&second_budget);
                    let found: Vec<(usize, u32, Found)> = dp
                        .run()
                        .into_iter()
                        .zip(&by_looseness)
                        .filter_map(|(f, &p)| f.map(|f| (p, b, f)))
                        .collect();
                    SizePass {
                        found,
                        states: dp.states.len(),
                        stages_costed: dp.stages_costed,
                    }
                })
                .collect();
            for pass in &each {
                stats.states += pass.states;
                stats.stages_costed += pass.stages_costed;
            }
            // A pass's best plan at a size the first runs already offered
            // is the same plan.
            let offered_before = |p: usize, b: u32| {
                results
                    .iter()
                    .any(|r| r.0 == p && r.1 == b && r.2.is_some())
            };
            let more: Vec<(Plan, &'static str)> = if second_budget.exceeded().is_some() {
                Vec::new()
            } else {
                each.iter()
                    .flat_map(|pass| &pass.found)
                    .filter(|(p, b, f)| {
                        !offered_before(*p, *b) && within_passes(f.stages.len(), gbs / b)
                    })
                    .map(|(p, b, f)| (build_plan(&inputs, &contexts[*p], *b, gbs / b, f), "search"))
                    .collect()
            };
            offered += more.len() as u32;
            ranked.extend(cost(more, fastest)?);
            ranked.sort_by(faster);
        }
    }
    if ranked.is_empty() {
        return Err(explain_infeasible(
            &contexts[covering],
            &sizes,
            gbs,
            &budget,
        ));
    }
    // Every other layout whose bound is below the best simulated time could
    // still simulate faster: walk them all, per micro-batch size, each walk
    // lowering its own bound as it finds faster plans.
    // Sizes go in order of their smallest bound (most promising first) and
    // share one bound and one budget, so the outcome does not depend on
    // thread timing.
    // A size searched alone without a plan has none that fits. Sizes cut by
    // a shared bound come last, with no bound of their own.
    let mut order: Vec<(f64, u32)> = results
        .iter()
        .filter(|r| r.0 == covering && (r.2.is_some() || !sizes_alone))
        .map(|r| (r.2.as_ref().map_or(f64::NEG_INFINITY, |f| f.value), r.1))
        .collect();
    order.sort_by(|a, b| {
        let unknown = |x: f64| x == f64::NEG_INFINITY;
        unknown(a.0)
            .cmp(&unknown(b.0))
            .then(a.0.total_cmp(&b.0))
            .then(b.1.cmp(&a.1))
    });
    let mut walk_best: Option<Plan> = None;
    let mut failure: Option<Error> = None;
    let mut bound = key(&ranked[0].0).0;
    let mut nodes_left = WALK_NODE_BUDGET;
    let work_left = std::cell::Cell::new(WALK_SIMULATED_TASK_BUDGET);
    // A candidate at the space's bound is optimal: nothing to walk.
    let mut optimal = true;
    if bound <= lower_bound_ms * (1.0 + 1e-12) {
        order.clear();
    }
    for (size_bound, b) in order {
        if size_bound >= bound {
            continue; // no layout of this size can be faster
        }
        let ctx = &contexts[covering];
        let m = gbs / b;
        let mut dp = Dp::new(ctx, b, m, Objective::Latency, vec![ctx.policy], None);
        let mut visit = |steps: &[Step], value: f64| -> f64 {
            if !within_passes(steps.len(), m) {
                return f64::INFINITY; // not simulated: over the limit
            }
            let found = Found {
                value,
                stages: steps.to_vec(),
            };
            let plan = build_plan(&inputs, ctx, b, m, &found);
            let (plan, tasks) = match cost_candidate(&plan, profile) {
                Ok(costed) => costed,
                Err(e) => {
                    failure.get_or_insert(e);
                    (None, PLAN_OVERHEAD_TASKS)
                }
            };
            work_left.set(work_left.get().saturating_sub(tasks));
            match plan {
                Some(p) if walk_best.as_ref().is_none_or(|w| key(&p).0 < key(w).0) => {
                    let ms = key(&p).0;
                    walk_best = Some(p);
                    ms
                }
                _ => f64::INFINITY,
            }
        };
        let mut walk = LayoutWalk {
            bound,
            nodes_left,
            work_left: &work_left,
            complete: true,
            visit: &mut visit,
        };
        dp.walk_layouts(&mut walk);
        (bound, nodes_left) = (walk.bound, walk.nodes_left);
        if !walk.complete {
            optimal = false;
            break;
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    let candidates = offered;
    ranked.extend(walk_best.map(|p| (p, "search")));
    ranked.sort_by(faster);
    let (chosen, source) = &ranked[0];
    // Local moves around the chosen plan, outside the space too, where a
    // GPU's move is a visible share of the cluster (`refine.rs`).
    let refined = if opts.refine && cluster.num_devices() <= REFINE_MAX_DEVICES {
        let refine_from = |plan: &Plan| {
            refine(
                plan,
                profile,
                &layers,
                &cluster,
                min_slice,
                REFINE_TASK_BUDGET,
            )
        };
        let mut r = refine_from(chosen)?;
        stats.refine_plans_costed = r.plans_costed;
        // A second start: the refined layout placed anew, as the paper's
        // policies place it at its smallest formula value, and refined in
        // turn. Moves change a few GPUs at a time, and a placement of the
        // same layout can lie past every path of faster single moves.
        // Skipped where it is a plan already refined, up to which alike
        // machines hold what (on 16x1, always).
        if let Some(placed) =
            best_placement_of(&r.plan, profile, &inputs, &layers, &cluster, min_slice)?
                .filter(|p| !same_up_to_machines(p, &r.plan, &cluster))
        {
            let again = refine_from(&placed)?;
            stats.refine_plans_costed += 1 + again.plans_costed;
            if key(&again.plan).0 < key(&r.plan).0 * (1.0 - 1e-9) {
                r = Refined {
                    from_ms: r.from_ms,
                    // The placement anew counts as one move.
                    moves_kept: r.moves_kept + 1 + again.moves_kept,
                    ..again
                };
            }
        }
        (r.moves_kept > 0).then_some(r)
    } else {
        None
    };
    let chosen = refined.as_ref().map_or(chosen, |r| &r.plan);
    let (chosen_ms, chosen_bound) = key(chosen);
    let estimate_rank = ranked
        .iter()
        .filter(|(p, _)| key(p).1 < chosen_bound)
        .count() as u32;
    let mut plan = chosen.clone();
    // A baseline's layout is recorded as this search's plan.
    plan.inputs = inputs;
    plan.selection = Some(Selection {
        chosen_by: ChosenBy::Simulation,
        candidates,
        simulated_ms: Some(chosen_ms),
        estimate_rank,
        lower_bound_ms: Some(lower_bound_ms),
        source: Some((*source).into()),
        optimal: Some(optimal),
        refined_from_ms: refined.as_ref().map(|r| r.from_ms),
    });
    Ok(SearchResult { plan, stats })
}

/// Where a run stopped at the budget: how far the tables got, and what to do.
fn search_memory_limit(
    budget: &MemoryBudget,
    cluster: &Cluster,
    space: SearchSpace,
) -> Option<Error> {
    let bytes = budget.exceeded()?;
    let gib = |x: u64| x as f64 / f64::from(1u32 << 30);
    let advice = if space == SearchSpace::Full {
        "use the machine-aligned space (--search-space machine-aligned), or merge layers in the profile"
    } else {
        "merge layers in the profile"
    };
    Some(Error::limit(format!(
        "the search's tables reached {:.2} GiB on {} GPUs in the {} space, past the limit of {:.2} GiB; \
         {advice}, or raise the limit (--max-search-gib)",
        gib(bytes),
        cluster.num_devices(),
        space.name(),
        gib(budget.limit_bytes),
    )))
}

/// Why no plan came out: none fits in memory (the least any needs, with
/// numbers), or the space held none at all (a plan may leave GPUs idle, so
/// one GPU holding every layer is always in it: not expected).
fn explain_infeasible(ctx: &Context, sizes: &[u32], gbs: u32, budget: &MemoryBudget) -> Error {
    let least = sizes
        .iter()
        .filter_map(|&b| {
            let mut dp = Dp::new(
                ctx,
                b,
                gbs / b,
                Objective::PeakMemory,
                vec![ctx.policy],
                None,
            )
            .with_budget(budget);
            dp.run().pop().flatten().map(|f| (b, f))
        })
        .min_by(|a, b| a.1.value.total_cmp(&b.1.value));
    // Past the limit a run stops and finds nothing: say so instead.
    if let Some(e) = search_memory_limit(budget, ctx.cluster, ctx.space) {
        return e;
    }
    let gib = |x: f64| x / (1u64 << 30) as f64;
    match least {
        None => Error::incompatible(format!(
            "no plan of the search space fits {} layers on {} GPUs with global batch size {gbs} and slices of \
             at least {} samples per GPU",
            ctx.layers.num_layers,
            ctx.cluster.num_devices(),
            ctx.min_slice,
        )),
        Some((b, f)) => {
            let memory = ctx.cluster.machines.iter().map(|m| m.memory_bytes);
            let largest = memory.clone().fold(0.0, f64::max);
            let smallest = memory.fold(f64::INFINITY, f64::min);
            // Small memories read in bytes, not as 0.00 GiB.
            let size = |x: f64| {
                if x < f64::from(1u32 << 20) {
                    format!("{x:.0} bytes")
                } else {
                    format!("{:.2} GiB", gib(x))
                }
            };
            let has = if smallest == largest {
                format!("a GPU has {}", size(largest))
            } else {
                format!("the GPUs have {} to {}", size(smallest), size(largest))
            };
            Error::infeasible(format!(
                "no plan fits in GPU memory: the plan needing the least memory per GPU still needs {} \
                 (micro-batch size {b}, {} stage(s)) but {has}",
                size(f.value),
                f.stages.len(),
            ))
        }
    }
}

/// The full space's placement of `plan`'s layout (each stage's layers
/// and GPU count) with the smallest formula (2) value under the plan's
/// warm-up policy, costed as a candidate; None when none fits.
fn best_placement_of(
    plan: &Plan,
    profile: &Profile,
    inputs: &PlanInputs,
    layers: &LayerCosts,
    cluster: &Cluster,
    min_slice: u32,
) -> Result<Option<Plan>> {
    let layout: Vec<(usize, usize, u32)> = plan
        .stages
        .iter()
        .map(|s| (s.layer_start, s.layer_end, s.devices.len() as u32))
        .collect();
    let policy = plan.schedule.warmup_policy;
    let ctx = Context {
        layers,
        cluster,
        policy,
        min_slice,
        space: SearchSpace::Full,
        layout: Some(&layout),
    };
    let (b, m) = (plan.micro_batch_size, plan.micro_batches);
    let mut dp = Dp::new(&ctx, b, m, Objective::Latency, vec![policy], None);
    let Some(found) = dp.run().into_iter().next().flatten() else {
        return Ok(None);
    };
    let placed = build_plan(inputs, &ctx, b, m, &found);
    Ok(cost_candidate(&placed, profile)?.0)
}

/// A candidate costed as the search ranks it: under warm-up policy auto
/// with the depths that simulate fastest within memory (`warmup.rs`), else
/// at its fixed policy's depths (estimated now unless it was). None when
/// it does not fit in memory. Also the work it took, in simulated tasks:
/// the layout is simulated once to cost it and again for each warm-up
/// vector tried, each simulation runs every stage's 2M passes, and
/// building and checking the plan costs `PLAN_OVERHEAD_TASKS`.
pub(crate) fn cost_candidate(plan: &Plan, profile: &Profile) -> Result<(Option<Plan>, u64)> {
    let per_simulation = 2 * u64::from(plan.micro_batches) * plan.stages.len() as u64;
    let mut tasks = PLAN_OVERHEAD_TASKS + per_simulation;
    let costed = match plan.schedule.warmup_policy {
        WarmupPolicy::Auto => {
            let (chosen, simulations) = plan_with_chosen_warmups(plan, profile)?;
            tasks += simulations * per_simulation;
            chosen
        }
        _ if plan.estimate.is_some() => Some(plan.clone()),
        _ => Some(Plan {
            estimate: Some(evaluate(plan, profile)?),
            ..plan.clone()
        }),
    };
    let fits = costed.filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory));
    Ok((fits, tasks))
}

fn build_plan(inputs: &PlanInputs, ctx: &Context, b: u32, m: u32, found: &Found) -> Plan {
    let plan = plan_of_steps(inputs, ctx, b, m, &found.stages);
    let estimate = plan.estimate.as_ref().expect("estimated");
    debug_assert!(
        (estimate.latency_ms - found.value).abs() <= 1e-6 * found.value.abs().max(1.0),
        "search value {} and plan estimate {} disagree",
        found.value,
        estimate.latency_ms
    );
    plan
}

/// The plan of placement steps (last stage first), estimated.
fn plan_of_steps(inputs: &PlanInputs, ctx: &Context, b: u32, m: u32, steps: &[Step]) -> Plan {
    let allocs = concrete_allocs(ctx.cluster, steps, |s, r, p| ctx.replay(s, r, p));
    let count = steps.len() as u32;
    let coster = StageCoster::new(ctx.layers, ctx.cluster, b, m);
    let stages: Vec<Stage> = steps
        .iter()
        .rev()
        .zip(ctx.cluster.number_devices(&allocs))
        .zip(&allocs)
        .enumerate()
        .map(
            |(i, (((start, end, placement, _), devices), alloc))| Stage {
                layer_start: *start,
                layer_end: *end,
                devices,
                warmup_micro_batches: ctx.memory_warmup(count - i as u32, m),
                placement: Some(placement.policy),
                // Replicas are numbered machine by machine, as the alloc lists them.
                slices: coster.searched_slices(
                    *start,
                    *end,
                    &StageDevices::new(ctx.cluster, alloc.clone()),
                    ctx.min_slice,
                ),
                tensor_parallel: 1,
                shard_optimizer: false,
                recompute: crate::shape::Recompute::None,
            },
        )
        .collect();
    let schedule = ScheduleChoice {
        kind: ScheduleKind::EarlyBackward1F1B,
        warmup_policy: ctx.policy,
    };
    let mut plan = Plan::new(inputs.clone(), b, m, schedule, stages);
    plan.estimate = Some(estimate_stages(&coster, &plan, &allocs));
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{largest_slice, smallest_slice};
    use crate::format::PROFILE;
    use crate::placement::State;
    use crate::plan::PlanOptions;
    use crate::profile::{Layer, Measurement};
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    fn random_profile(rng: &mut StdRng, layers: usize) -> Profile {
        Profile {
            format: PROFILE.name.into(),
            schema_version: PROFILE.version,
            model: "random".into(),
            source: None,
            device: None,
            optimizer: "adam".into(),
            other_devices: Vec::new(),
            parameter_state: None,
            model_flops_per_sample: None,
            layers: (0..layers)
                .map(|i| Layer {
                    name: format!("l{i}"),
                    kind: None,
                    param_bytes: rng.gen_range(0..400_000_000),
                    inputs: None,
                    measurements: vec![Measurement {
                        batch_size: 1,
                        fwd_ms: rng.gen_range(0.1..10.0),
                        bwd_ms: rng.gen_range(0.1..20.0),
                        activation_bytes: rng.gen_range(0..200_000_000),
                        stored_activation_bytes: None,
                    }],
                    split: Vec::new(),
                })
                .collect(),
        }
    }

    /// Every non-increasing vector of warm-up depths with K_i <= caps[i].
    fn all_warmups(caps: &[u32]) -> Vec<Vec<u32>> {
        let mut out = vec![vec![]];
        for &cap in caps {
            out = out
                .into_iter()
                .flat_map(|v: Vec<u32>| {
                    let top = v.last().copied().unwrap_or(u32::MAX).min(cap);
                    (1..=top).map(move |k| {
                        let mut w = v.clone();
                        w.push(k);
                        w
                    })
                })
                .collect();
        }
        out
    }

    /// Smallest simulated iteration of a checked plan's layout over every
    /// valid vector of warm-up depths that fits in memory (policy auto).
    fn best_over_warmups(plan: &Plan, profile: &Profile) -> Option<f64> {
        let (stages, transfers) = crate::simulate::sim_inputs(plan, profile, true).unwrap();
        let caps = crate::warmup::deepest_warmups(&stages, plan.micro_batches)?;
        all_warmups(&caps)
            .iter()
            .map(|k| {
                crate::simulate::early_backward_iteration_ms(
                    &stages,
                    &transfers,
                    plan.micro_batches,
                    k,
                )
                .unwrap()
            })
            .min_by(f64::total_cmp)
    }

    /// Every plan of the search space, costed by `evaluate::evaluate`:
    /// all partitions, replications and placements, from the last stage.
    /// Returns the smallest formula (2) value and the smallest simulated
    /// iteration (over every valid warm-up vector under policy auto).
    fn brute_force(
        profile: &Profile,
        topology: &Topology,
        gbs: u32,
        policy: WarmupPolicy,
    ) -> Option<(f64, f64)> {
        let n = profile.layers.len();
        let layer_costs = LayerCosts::new(profile);
        let cluster = Cluster::for_model(topology, &layer_costs).unwrap();
        let machines = cluster.group_and_gpus();
        let mut best: Option<(f64, f64)> = None;
        let min_slice = profile.min_batch_size();
        for b in (1..=gbs).filter(|b| gbs.is_multiple_of(*b) && *b >= min_slice) {
            let coster = StageCoster::new(&layer_costs, &cluster, b, gbs / b);
            // (layer j the suffix starts at, state, steps so far)
            let mut stack: Vec<(usize, State, Vec<Step>)> =
                vec![(n, State::empty(&machines), vec![])];
            while let Some((j, state, steps)) = stack.pop() {
                if j == 0 {
                    let allocs =
                        concrete_allocs(&cluster, &steps, |s, r, p| s.place(r, p).unwrap());
                    let count = steps.len() as u32;
                    let plan_stages: Vec<Stage> = steps
                        .iter()
                        .rev()
                        .zip(cluster.number_devices(&allocs))
                        .zip(&allocs)
                        .enumerate()
                        .map(|(i, (((s, e, _, _), devices), alloc))| Stage {
                            layer_start: *s,
                            layer_end: *e,
                            devices,
                            warmup_micro_batches: policy
                                .warmup(count - i as u32, gbs / b)
                                .unwrap_or(1),
                            placement: None,
                            tensor_parallel: 1,
                            shard_optimizer: false,
                            recompute: crate::shape::Recompute::None,
                            // Mixed GPUs take Whale's balanced slices.
                            slices: coster.searched_slices(
                                *s,
                                *e,
                                &StageDevices::new(&cluster, alloc.clone()),
                                min_slice,
                            ),
                        })
                        .collect();
                    let plan = Plan::new(
                        PlanInputs {
                            model: "random".into(),
                            profile_sha256: String::new(),
                            profile_path: None,
                            topology: topology.clone(),
                            global_batch_size: gbs,
                            options: PlanOptions {
                                min_micro_batch_size: min_slice,
                                search_space: None,
                            },
                        },
                        b,
                        gbs / b,
                        ScheduleChoice {
                            kind: ScheduleKind::EarlyBackward1F1B,
                            warmup_policy: policy,
                        },
                        plan_stages,
                    );
                    let est = evaluate(&plan, profile).expect("brute-force plans are valid");
                    let sim = est.iteration_ms.unwrap();
                    // Formula (2) is a lower bound of the simulation, for every plan.
                    assert!(
                        sim >= est.latency_ms * (1.0 - 1e-12),
                        "{sim} < {}",
                        est.latency_ms
                    );
                    if !est.fits_memory {
                        continue;
                    }
                    let sim = match policy {
                        WarmupPolicy::Auto => best_over_warmups(&plan, profile).unwrap(),
                        _ => sim,
                    };
                    best = Some(match best {
                        None => (est.latency_ms, sim),
                        Some((l, s)) => (l.min(est.latency_ms), s.min(sim)),
                    });
                    continue;
                }
                let free = state.free();
                for i in 0..j {
                    for r in 1..=free {
                        if smallest_slice(b, r) < min_slice {
                            continue;
                        }
                        for (placement, takes) in state.placements(r) {
                            let next = state.taken(&takes);
                            let mut steps2 = steps.clone();
                            steps2.push((i, j, placement, r));
                            stack.push((i, next, steps2));
                        }
                    }
                }
            }
        }
        best
    }

    /// A cluster of `shape` ("2x4") with one of three link mixes, and GPU
    /// memories small enough that the limit binds in some cases.
    fn random_topology(rng: &mut StdRng, shape: &str, case: usize) -> (String, Topology) {
        let links = ["nvlink-10gbps", "pcie-25gbps", "nvlink-1gbps"][case % 3];
        let spec = format!("{shape}-{links}");
        let mut topology = Topology::from_spec(&spec).unwrap();
        topology.machine_groups[0].gpu.memory_bytes = rng.gen_range(2_000_000_000..12_000_000_000);
        (spec, topology)
    }

    /// `random_topology` with its last machine made of slower GPUs with
    /// other memory (Whale's mixed clusters); every other case the profile
    /// times that GPU type itself, with per-layer speed ratios of its own.
    fn random_mixed(
        rng: &mut StdRng,
        shape: &str,
        case: usize,
        profile: &mut Profile,
    ) -> (String, Topology) {
        let (spec, mut topology) = random_topology(rng, shape, case);
        // Small models on part of the cases, where replicas on both kinds
        // of GPU are worth their AllReduce.
        if !case.is_multiple_of(3) {
            for l in &mut profile.layers {
                l.param_bytes /= 100;
            }
        }
        let mut slow = topology.machine_groups[0].clone();
        topology.machine_groups[0].machines -= 1;
        slow.machines = 1;
        slow.gpu.gpu_type = "slow".into();
        slow.gpu.memory_bytes = rng.gen_range(2_000_000_000..12_000_000_000);
        if case.is_multiple_of(2) {
            slow.gpu.relative_speed = Some(rng.gen_range(0.3..0.9));
        } else {
            profile.device = Some(crate::topology::DEFAULT_GPU_TYPE.into());
            profile.other_devices = vec![crate::profile::DeviceTimes {
                device: "slow".into(),
                source: None,
                layers: profile
                    .layers
                    .iter()
                    .map(|l| crate::profile::LayerTimes {
                        name: l.name.clone(),
                        measurements: l
                            .measurements
                            .iter()
                            .map(|m| crate::profile::TimeMeasurement {
                                batch_size: m.batch_size,
                                fwd_ms: m.fwd_ms * rng.gen_range(1.1..3.0),
                                bwd_ms: m.bwd_ms * rng.gen_range(1.1..3.0),
                            })
                            .collect(),
                    })
                    .collect(),
            }];
        }
        if topology.machine_groups[0].machines == 0 {
            topology.machine_groups.remove(0);
        }
        topology.machine_groups.push(slow);
        topology.validate().unwrap();
        profile.validate().unwrap();
        (format!("{spec} with one slow machine"), topology)
    }

    /// On mixed GPUs (one machine slower, with other memory, at a relative
    /// speed or at times of its own) the search's space holds Whale's
    /// balanced slices, and it still returns the simulated optimum of that
    /// space, or a candidate from outside it that is faster still.
    #[test]
    fn search_finds_the_simulated_optimum_on_mixed_gpus() {
        let mut rng = StdRng::seed_from_u64(20261124);
        let shapes = ["2x1", "2x2", "3x1", "2x3", "3x2"];
        let mut uneven = 0;
        for case in 0..60 {
            let layers = rng.gen_range(1..=4);
            let mut profile = random_profile(&mut rng, layers);
            let (spec, topology) =
                random_mixed(&mut rng, shapes[case % shapes.len()], case, &mut profile);
            let gbs = [4, 6, 8][case % 3];
            let mut opts = SearchOptions::new(gbs);
            opts.search_space = SearchSpace::Full;
            let expected = brute_force(&profile, &topology, gbs, WarmupPolicy::Auto);
            match (expected, search(&profile, &topology, &opts)) {
                (None, Err(_)) => {}
                (Some((bound, optimum)), Ok(r)) => {
                    let sim = r.plan.estimate.as_ref().unwrap().iteration_ms.unwrap();
                    let selection = r.plan.selection.as_ref().unwrap();
                    let what = format!(
                        "case {case} ({spec}, {layers} layers, gbs {gbs}): search {sim} ({}, from {:?}), optimum {optimum}",
                        r.plan.shape(),
                        selection.source
                    );
                    assert!(sim <= optimum * (1.0 + 1e-9), "{what}");
                    // The space's own plan, before refinement moved it.
                    let space_ms = selection.refined_from_ms.unwrap_or(sim);
                    if selection.source.as_deref() == Some("search") {
                        assert!((space_ms - optimum).abs() <= 1e-9 * optimum, "{what}");
                    }
                    assert!((selection.lower_bound_ms.unwrap() - bound).abs() <= 1e-9 * bound);
                    uneven += r
                        .plan
                        .stages
                        .iter()
                        .filter(|s| {
                            s.slices
                                .as_ref()
                                .is_some_and(|v| v.iter().min() != v.iter().max())
                        })
                        .count();
                    let again = evaluate(&r.plan, &profile).unwrap();
                    assert_eq!(Some(&again), r.plan.estimate.as_ref(), "{what}");
                }
                (e, g) => panic!(
                    "case {case}: brute force {e:?}, search {:?}",
                    g.map(|r| r.plan.shape())
                ),
            }
        }
        // The cases do exercise uneven slices.
        assert!(uneven > 10, "{uneven} stages with uneven slices");
    }

    #[test]
    fn search_matches_brute_force() {
        let mut rng = StdRng::seed_from_u64(20201122);
        let shapes = ["1x2", "1x4", "2x2", "2x3", "1x8", "2x4", "4x1", "3x2"];
        for case in 0..160 {
            let (spec, topology) = random_topology(&mut rng, shapes[case % shapes.len()], case);
            let layers = rng.gen_range(1..=if topology.num_devices() >= 8 { 5 } else { 7 });
            let profile = random_profile(&mut rng, layers);
            let gbs = [4, 6, 8, 12][case % 4];
            let policy = if case.is_multiple_of(2) {
                WarmupPolicy::A
            } else {
                WarmupPolicy::B
            };
            let mut opts = SearchOptions::new(gbs);
            opts.warmup_policy = policy;
            opts.search_space = SearchSpace::Full;
            let expected = brute_force(&profile, &topology, gbs, policy);
            let got = search(&profile, &topology, &opts);
            match (expected.map(|e| e.0), got) {
                (None, Err(_)) => {}
                (Some(e), Ok(r)) => {
                    // The DP's bound is the smallest formula (2) value of the space.
                    let l = r.plan.selection.as_ref().unwrap().lower_bound_ms.unwrap();
                    assert!((l - e).abs() <= 1e-9 * e, "case {case} ({spec}, {layers} layers, gbs {gbs}): search {l}, brute force {e}");
                    // The returned plan re-evaluates to the same numbers, and
                    // simulates no faster than the bound.
                    let again = evaluate(&r.plan, &profile).unwrap();
                    assert_eq!(Some(&again), r.plan.estimate.as_ref());
                    assert!(again.iteration_ms.unwrap() >= l * (1.0 - 1e-9));
                    assert!(again.fits_memory);
                }
                (e, g) => panic!(
                    "case {case}: brute force {e:?}, search {:?}",
                    g.map(|r| r.plan.shape())
                ),
            }
        }
    }

    /// The acceptance test of the objective: on small random cases the
    /// search returns a plan whose simulated iteration is the smallest over
    /// every plan of the space (partitions, replications, placements, idle
    /// GPUs, micro-batch sizes) and every valid warm-up vector within memory;
    /// refinement then keeps it or finds a faster plan outside the space.
    #[test]
    fn search_finds_the_simulated_optimum() {
        let mut rng = StdRng::seed_from_u64(20261123);
        let shapes = ["1x2", "1x4", "2x2", "2x3", "1x3", "2x1", "1x8", "2x4"];
        for case in 0..120 {
            let (spec, topology) = random_topology(&mut rng, shapes[case % shapes.len()], case);
            let devices = topology.num_devices();
            let most_layers = match devices {
                8.. => 4,
                4.. => 5,
                _ => 7,
            };
            let layers = rng.gen_range(1..=most_layers);
            let profile = random_profile(&mut rng, layers);
            let gbs = [4, 6, 8][case % 3];
            let mut opts = SearchOptions::new(gbs);
            opts.search_space = SearchSpace::Full;
            let expected = brute_force(&profile, &topology, gbs, WarmupPolicy::Auto);
            match (expected, search(&profile, &topology, &opts)) {
                (None, Err(_)) => {}
                (Some((bound, optimum)), Ok(r)) => {
                    let sim = r.plan.estimate.as_ref().unwrap().iteration_ms.unwrap();
                    let selection = r.plan.selection.as_ref().unwrap();
                    // The space's plan is its optimum; refinement may only
                    // move it to a faster plan outside the space.
                    let space_ms = selection.refined_from_ms.unwrap_or(sim);
                    let what = format!(
                        "case {case} ({spec}, {layers} layers, gbs {gbs}): search {sim} (space {space_ms}, {}), optimum {optimum}",
                        r.plan.shape()
                    );
                    assert!((space_ms - optimum).abs() <= 1e-9 * optimum, "{what}");
                    assert!(sim <= space_ms, "{what}");
                    assert_eq!(selection.optimal, Some(true));
                    assert!((selection.lower_bound_ms.unwrap() - bound).abs() <= 1e-9 * bound);
                }
                (e, g) => panic!(
                    "case {case}: brute force {e:?}, search {:?}",
                    g.map(|r| r.plan.shape())
                ),
            }
        }
    }

    #[test]
    fn a_layout_placed_anew_has_the_smallest_bound_of_its_placements() {
        // Random layouts (2-4 stages of random layers and GPU counts, some
        // GPUs idle), a third of them on mixed GPUs. Every placement the
        // paper's policies give a layout is enumerated; placing it anew
        // keeps its stages and finds the smallest formula value of those.
        let mut rng = StdRng::seed_from_u64(77);
        let shapes = ["2x2", "2x3", "2x4", "3x2", "1x4"];
        let mut compared = 0;
        for case in 0..60 {
            let (mut spec, mut topology) =
                random_topology(&mut rng, shapes[case % shapes.len()], case);
            let layer_count = rng.gen_range(2..=5);
            let mut profile = random_profile(&mut rng, layer_count);
            if case % 3 == 0 {
                (spec, topology) =
                    random_mixed(&mut rng, shapes[case % shapes.len()], case, &mut profile);
            }
            let layers = LayerCosts::new(&profile);
            let cluster = Cluster::for_model(&topology, &layers).unwrap();
            let gpus = topology.num_devices();
            let stages = rng.gen_range(2..=layer_count.min(gpus as usize).min(4));
            let mut cuts: Vec<usize> = (1..layer_count).collect();
            cuts.shuffle(&mut rng);
            cuts.truncate(stages - 1);
            cuts.sort_unstable();
            let bounds: Vec<usize> = std::iter::once(0)
                .chain(cuts)
                .chain([layer_count])
                .collect();
            let policy = [WarmupPolicy::Auto, WarmupPolicy::A][case % 2];
            let gbs = 8;
            let b = [2, 4][case % 2];
            // GPU counts: one each, then some of the rest at random, at
            // most one per sample of a micro-batch.
            let mut counts = vec![1u32; stages];
            for _ in 0..rng.gen_range(0..=gpus - stages as u32) {
                let k = rng.gen_range(0..stages);
                if counts[k] < b {
                    counts[k] += 1;
                }
            }
            let mut next = 0u32;
            let plan_stages: Vec<Stage> = (0..stages)
                .map(|k| {
                    let devices: Vec<u32> = (next..next + counts[k]).collect();
                    next += counts[k];
                    Stage {
                        layer_start: bounds[k],
                        layer_end: bounds[k + 1],
                        devices,
                        warmup_micro_batches: policy.memory_depth((stages - k) as u32, gbs / b),
                        placement: None,
                        tensor_parallel: 1,
                        shard_optimizer: false,
                        recompute: crate::shape::Recompute::None,
                        slices: None,
                    }
                })
                .collect();
            let inputs = PlanInputs::new(&profile, &topology, gbs, 1, "full", None);
            let schedule = ScheduleChoice {
                kind: ScheduleKind::EarlyBackward1F1B,
                warmup_policy: policy,
            };
            let plan = Plan::new(inputs, b, gbs / b, schedule, plan_stages);
            let layout: Vec<(usize, usize, u32)> = plan
                .stages
                .iter()
                .map(|s| (s.layer_start, s.layer_end, s.devices.len() as u32))
                .collect();
            let ctx = Context {
                layers: &layers,
                cluster: &cluster,
                policy,
                min_slice: 1,
                space: SearchSpace::Full,
                layout: None,
            };
            // Every placement of the layout, back to front, by the policies,
            // at the formula value the search's own plans are built with.
            let mut smallest = f64::INFINITY;
            let mut stack: Vec<(State, Vec<Step>)> =
                vec![(State::empty(&cluster.group_and_gpus()), Vec::new())];
            while let Some((state, steps)) = stack.pop() {
                let Some(&(start, end, count)) = layout.iter().rev().nth(steps.len()) else {
                    let value = plan_of_steps(&plan.inputs, &ctx, b, gbs / b, &steps)
                        .estimate
                        .unwrap();
                    if value.fits_memory {
                        smallest = smallest.min(value.latency_ms);
                    }
                    continue;
                };
                for (placement, takes) in state.placements(count) {
                    let mut more = steps.clone();
                    more.push((start, end, placement, count));
                    stack.push((state.taken(&takes), more));
                }
            }
            let placed =
                best_placement_of(&plan, &profile, &plan.inputs, &layers, &cluster, 1).unwrap();
            let shape = |p: &Plan| -> Vec<(usize, usize, usize)> {
                p.stages
                    .iter()
                    .map(|s| (s.layer_start, s.layer_end, s.devices.len()))
                    .collect()
            };
            match placed {
                Some(placed) => {
                    assert_eq!(shape(&placed), shape(&plan), "case {case} ({spec})");
                    let bound = placed.estimate.as_ref().unwrap().latency_ms;
                    assert!(
                        (bound - smallest).abs() <= 1e-9 * smallest,
                        "case {case} ({spec}): placed {bound}, smallest {smallest}"
                    );
                    compared += 1;
                }
                // Nothing fits at one micro-batch in flight, or none whose
                // depths fit once chosen.
                None => assert!(
                    !smallest.is_finite() || policy == WarmupPolicy::Auto,
                    "case {case} ({spec}): {smallest} fits but nothing was placed"
                ),
            }
        }
        assert!(compared >= 30, "{compared} layouts compared");
    }

    #[test]
    fn refinement_runs_up_to_64_gpus() {
        let mut rng = StdRng::seed_from_u64(64);
        let profile = random_profile(&mut rng, 2);
        let refined = |spec: &str| {
            let topology = Topology::from_spec(spec).unwrap();
            let r = search(
                &profile,
                &topology,
                &SearchOptions::new(8 * topology.num_devices()),
            )
            .unwrap();
            r.stats.refine_plans_costed
        };
        assert!(refined("8x8-nvlink-25gbps") > 0);
        assert_eq!(refined("9x8-nvlink-25gbps"), 0);
        // Asked not to, it does not refine.
        let topology = Topology::from_spec("2x2-nvlink").unwrap();
        let mut opts = SearchOptions::new(16);
        opts.refine = false;
        let r = search(&profile, &topology, &opts).unwrap();
        assert_eq!(r.stats.refine_plans_costed, 0);
        assert_eq!(r.plan.selection.unwrap().refined_from_ms, None);
    }

    #[test]
    fn the_search_stops_at_its_memory_limit() {
        let mut rng = StdRng::seed_from_u64(9);
        let profile = random_profile(&mut rng, 8);
        let topology = Topology::from_spec("2x4-nvlink").unwrap();
        let mut opts = SearchOptions::new(8);
        opts.search_space = SearchSpace::Full;
        assert!(search(&profile, &topology, &opts).is_ok());
        opts.max_search_bytes = 4096;
        let e = search(&profile, &topology, &opts).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Limit);
        assert!(e.message.contains("--max-search-gib"), "{e}");
    }

    #[test]
    fn no_plan_fits_reports_the_smallest_need() {
        let mut rng = StdRng::seed_from_u64(7);
        let profile = random_profile(&mut rng, 3);
        let mut topology = Topology::from_spec("1x2-nvlink").unwrap();
        topology.machine_groups[0].gpu.memory_bytes = 1000;
        let e = search(&profile, &topology, &SearchOptions::new(4)).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Infeasible);
        assert!(e.message.contains("GiB"), "{e}");
    }

    #[test]
    fn batch_too_small_for_the_slices_is_incompatible() {
        let mut rng = StdRng::seed_from_u64(8);
        let mut profile = random_profile(&mut rng, 3);
        for l in &mut profile.layers {
            l.measurements[0].batch_size = 4;
        }
        let topology = Topology::from_spec("1x2-nvlink").unwrap();
        let e = search(&profile, &topology, &SearchOptions::new(2)).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Incompatible);
        assert!(e.message.contains("global batch size 2"), "{e}");
    }

    #[test]
    fn data_parallel_and_straight_are_special_cases() {
        // Tiny parameters and fast links: data parallelism wins.
        let mut p = crate::profile::chain_profile(&[(1.0, 2.0); 4], 1);
        for l in &mut p.layers {
            l.param_bytes = 10;
        }
        let t = Topology::from_spec("1x4-nvlink").unwrap();
        let r = search(&p, &t, &SearchOptions::new(16)).unwrap();
        assert_eq!(r.plan.shape(), "4");
        // Huge parameters on a slow network, tiny activations: a straight
        // pipeline (no replication, no AllReduce) wins.
        for l in &mut p.layers {
            l.param_bytes = 2_000_000_000;
            l.measurements[0].activation_bytes = 10;
        }
        let t = Topology::from_spec("4x1-1gbps").unwrap();
        let mut big = t.clone();
        big.machine_groups[0].gpu.memory_bytes = 1 << 40;
        let r = search(&p, &big, &SearchOptions::new(16)).unwrap();
        assert_eq!(r.plan.shape(), "1:1:1:1");
        assert_eq!(r.plan.stages[0].devices, vec![0]);
    }

    #[test]
    fn machine_aligned_stages_get_the_fewest_gpus_for_their_slice() {
        let mut rng = StdRng::seed_from_u64(8);
        let profile = random_profile(&mut rng, 4);
        let layers = LayerCosts::new(&profile);
        let topology = Topology::from_spec("64x8-nvlink-25gbps").unwrap();
        let cluster = Cluster::for_model(&topology, &layers).unwrap();
        let ctx = Context {
            layers: &layers,
            cluster: &cluster,
            policy: WarmupPolicy::Auto,
            min_slice: 1,
            space: SearchSpace::MachineAligned,
            layout: None,
        };
        let empty = State::empty(&cluster.group_and_gpus());
        // 200 samples: 1, 2 and 4 GPUs (slices 200, 100, 50), then whole
        // machines while the slice still shrinks: 8 GPUs (25), 16 (13), 24
        // (9), 32 (7), 40 (5), 48 (5: left out), 56 (4), 64 (4: left out) ...
        let counts = ctx.replica_counts(&empty, 200, 200);
        assert_eq!(&counts[..8], &[1, 2, 4, 8, 16, 24, 32, 40]);
        assert!(!counts.contains(&48) && counts.contains(&56) && !counts.contains(&64));
        let slices: Vec<u32> = counts.iter().map(|&r| largest_slice(200, r)).collect();
        assert!(slices.windows(2).all(|w| w[0] > w[1]), "{slices:?}");
        // The first stage may take every GPU left, aligned or not.
        let two_taken = empty.taken(&empty.aligned_placements(2, 2)[0].1);
        let counts = ctx.replica_counts(&two_taken, 512, 512);
        assert_eq!(counts.last(), Some(&510));
        // A count is kept only where it can be placed: with every machine
        // partly used (1 GPU each of 12), no whole machine is free, so 40
        // GPUs cannot be placed and 48 (4 on each machine, the same slice
        // of 100 samples: 3) stands for them.
        let twelve = State::empty(&[(0, 8); 12]);
        let spread = twelve.taken(&twelve.even_scatter(12).unwrap());
        let counts = ctx.replica_counts(&spread, 84, 100);
        assert!(counts.contains(&48) && !counts.contains(&40), "{counts:?}");
        // The full space keeps every count.
        let full = Context {
            space: SearchSpace::Full,
            ..ctx
        };
        assert_eq!(
            full.replica_counts(&empty, 200, 200),
            (1..=200).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_machine_aligned_plan_may_leave_machines_idle() {
        // Large parameters over a slow network between machines: AllReduce
        // across all four machines costs more than it saves, so the fastest
        // plan leaves machines idle (the space used to forbid it).
        let mut p = crate::profile::chain_profile(&[(1.0, 2.0); 2], 1);
        for l in &mut p.layers {
            l.param_bytes = 200_000_000;
        }
        let mut t = Topology::from_spec("4x8-nvlink-1gbps").unwrap();
        t.machine_groups[0].gpu.memory_bytes = 1 << 40;
        let mut opts = SearchOptions::new(64);
        opts.search_space = SearchSpace::MachineAligned;
        let r = search(&p, &t, &opts).unwrap();
        let used: usize = r.plan.stages.iter().map(|s| s.devices.len()).sum();
        assert!(used < 32, "{} uses all 32 GPUs", r.plan.shape());
        // Data parallelism on all 32 GPUs, in the space before, is slower.
        let all = crate::baselines::baseline_plan(
            Baseline::DataParallel,
            &p,
            &t,
            64,
            None,
            WarmupPolicy::Auto,
        )
        .unwrap();
        let simulated = |plan: &Plan| plan.estimate.as_ref().unwrap().iteration_ms.unwrap();
        assert!(simulated(&r.plan) < simulated(&all));
    }
}
