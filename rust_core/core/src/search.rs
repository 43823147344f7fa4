//! The planner's search: memoized dynamic programming over
//! (layers planned, cluster state), section IV-C of the paper.
//!
//! Pipelines are built from the last stage to the first. A partial plan is a
//! suffix of stages covering layers `j..N`; prepending a stage of layers
//! `i..j` on GPUs chosen by one of the three placement policies extends it.
//! The latency formula folds from the back with two numbers per suffix
//! (`cost::SuffixLatency`), and the memory of a stage depends only on how
//! many stages follow it (its warm-up depth K_i), so a suffix is summarised
//! by (stages, latency, steady) and suffixes reaching the same state are
//! kept only when no other one is at least as good in all three: the search
//! is exact over its space (partitions x replications x placements x
//! micro-batch sizes), which `tests::search_matches_brute_force` checks.
//!
//! States are symmetry-reduced (`placement::State`): which identical machine
//! a stage uses is never distinguished, so 2x8 has a handful of states per
//! layer instead of 2^16. Micro-batch sizes are searched in parallel with
//! rayon and share the best latency found so far for pruning.

use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::prelude::*;

use crate::baselines::{baseline_layouts, Baseline};
use crate::cost::{
    largest_slice, stage_memory_bytes, Alloc, Cluster, PipeStage, StageCoster, StageDevices,
    SuffixLatency, WarmupPolicy,
};
use crate::error::{Error, ErrorKind, Result};
use crate::evaluate::{estimate_stages, evaluate};
use crate::placement::{counts_to_alloc, Policy, State};
use crate::plan::{ChosenBy, Plan, PlanInputs, ScheduleChoice, Selection, Stage};
use crate::profile::{LayerCosts, Profile};
use crate::schedule::ScheduleKind;
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
}

impl SearchOptions {
    pub fn new(global_batch_size: u32) -> Self {
        SearchOptions {
            global_batch_size,
            warmup_policy: WarmupPolicy::Auto,
            min_micro_batch_size: None,
            micro_batch_sizes: None,
            search_space: SearchSpace::Auto,
            profile_path: None,
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
        /// Stages get a divisor of a machine's GPUs or whole machines, placed
        /// fresh-first or append-first, at most two machines partly used. On
        /// many machines the full space has too many ways to leave machines
        /// partly used (8x8 GPUs: 8.8 million states); this keeps the search
        /// to about a minute at 1024 GPUs.
        MachineAligned = "machine-aligned",
    }
}

/// Stages the layout walk may cost, and tasks it may simulate to cost
/// complete layouts, before it stops; past either the plan is the fastest found and
/// `selection.optimal` is false. About a second on the paper's cases.
const WALK_NODE_BUDGET: u64 = 500_000;
const WALK_SIMULATED_TASK_BUDGET: u64 = 20_000_000;
/// What building and costing one complete layout costs, in simulated tasks.
const LEAF_OVERHEAD_TASKS: u64 = 10_000;

/// Largest cluster the automatic choice searches in full. 128 layers on
/// 4x8 GPUs take 1.1 s in full when time is linear in the batch and 59 s
/// when small batches are less efficient (benchmarks/README.md).
const AUTO_FULL_MAX_DEVICES: u32 = 16;

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
/// baselines' layouts at every micro-batch size, are candidates; each gets
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
        None => (1..=gbs)
            .filter(|b| gbs.is_multiple_of(*b) && *b >= min_slice)
            .collect(),
    };
    if sizes.is_empty() {
        return Err(Error::incompatible(format!(
            "global batch size {gbs} cannot be split into micro-batches of at least {min_slice} samples \
             (the smallest profiled batch size; lower it with --min-micro-batch-size)"
        )));
    }
    let layers = LayerCosts::new(profile);
    let cluster = Cluster::new(topology);
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
    let sizes_alone = cluster.num_devices() <= AUTO_FULL_MAX_DEVICES;
    // One bound per pass, per size or shared by the sizes.
    let bound_sets = if sizes_alone { sizes.len() } else { 1 };
    let incumbents: Vec<AtomicU64> = (0..bound_sets * rules.len())
        .map(|_| AtomicU64::new(f64::INFINITY.to_bits()))
        .collect();
    let covering_ctx = &contexts[contexts.len() - 1];
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
            );
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
    let stats = SearchStats {
        micro_batch_sizes: sizes.clone(),
        states: results.iter().map(|r| r.3).sum(),
        stages_costed: results.iter().map(|r| r.4).sum(),
    };
    let covering = contexts.len() - 1;
    let lower_bound_ms = results
        .iter()
        .filter(|r| r.0 == covering)
        .filter_map(|r| r.2.as_ref().map(|f| f.value))
        .fold(f64::INFINITY, f64::min);
    if !lower_bound_ms.is_finite() {
        return Err(explain_infeasible(&contexts[covering], &sizes, gbs));
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
            let f = found.as_ref()?;
            Some((build_plan(&inputs, &contexts[*p], *b, gbs / b, f), "search"))
        })
        .collect();
    // The baselines' layouts are candidates too, up to 16 GPUs: there they
    // are cheap, and a plan that loses to a baseline would be a defect the
    // walk's budget could leave in place. On larger clusters a straight
    // pipeline has a stage per layer and PipeDream's DP is quadratic in the
    // GPUs; there the search's own candidates and the walk must do.
    if sizes_alone {
        for kind in [Baseline::Straight, Baseline::PipeDream] {
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
    // Each candidate gets its warm-up depths (auto) or its cost (fixed).
    let cost = |candidates: Vec<(Plan, &'static str)>| -> Result<Vec<(Plan, &'static str)>> {
        let costed: Vec<Option<(Plan, &'static str)>> = candidates
            .into_par_iter()
            .map(|(plan, source)| {
                let plan = match opts.warmup_policy {
                    WarmupPolicy::Auto => plan_with_chosen_warmups(&plan, profile)?.0,
                    // Baselines' layouts come uncosted; the search's own are costed.
                    _ if plan.estimate.is_none() => Some(Plan {
                        estimate: Some(evaluate(&plan, profile)?),
                        ..plan
                    }),
                    _ => Some(plan),
                };
                Ok(plan
                    .filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory))
                    .map(|p| (p, source)))
            })
            .collect::<Result<_>>()?;
        Ok(costed.into_iter().flatten().collect())
    };
    let mut ranked = cost(candidates)?;
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
        .filter(|(_, _, f)| f.value < best_so_far)
        .map(|(p, b, f)| (build_plan(&inputs, &contexts[*p], *b, gbs / b, f), "search"))
        .collect();
    if !alternatives.is_empty() {
        ranked.extend(cost(alternatives)?);
        ranked.sort_by(faster);
    }
    if ranked.is_empty() {
        return Err(explain_infeasible(&contexts[covering], &sizes, gbs));
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
            let found = Found {
                value,
                stages: steps.to_vec(),
            };
            let plan = build_plan(&inputs, ctx, b, m, &found);
            // The layout was simulated once to cost it, and again for each
            // warm-up vector tried; each simulation runs every stage's 2M
            // passes, and building the plan costs about as much again.
            let per_simulation = 2 * u64::from(m) * steps.len() as u64;
            let mut tasks = LEAF_OVERHEAD_TASKS + per_simulation;
            let plan = match opts.warmup_policy {
                WarmupPolicy::Auto => match plan_with_chosen_warmups(&plan, profile) {
                    Ok((p, simulations)) => {
                        tasks += simulations * per_simulation;
                        p
                    }
                    Err(e) => {
                        failure.get_or_insert(e);
                        None
                    }
                },
                _ => Some(plan),
            };
            work_left.set(work_left.get().saturating_sub(tasks));
            match plan.filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory)) {
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
    let candidates = ranked.len() as u32;
    ranked.extend(walk_best.map(|p| (p, "search")));
    ranked.sort_by(faster);
    let (chosen, source) = &ranked[0];
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
    });
    Ok(SearchResult { plan, stats })
}

/// Why no plan came out: either no plan of the space uses every GPU with
/// the allowed slices, or none fits in memory; say which, with numbers.
fn explain_infeasible(ctx: &Context, sizes: &[u32], gbs: u32) -> Error {
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
            );
            dp.run().pop().flatten().map(|f| (b, f))
        })
        .min_by(|a, b| a.1.value.total_cmp(&b.1.value));
    let gib = |x: f64| x / (1u64 << 30) as f64;
    match least {
        None => Error::incompatible(format!(
            "no plan can give all {} GPUs work: with global batch size {gbs} and slices of at least {} samples \
             per GPU the {} layers cannot be spread over them",
            ctx.cluster.num_devices(),
            ctx.min_slice,
            ctx.layers.num_layers
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

struct Context<'a> {
    layers: &'a LayerCosts,
    cluster: &'a Cluster,
    policy: WarmupPolicy,
    min_slice: u32,
    space: SearchSpace,
}

/// Most partly used machines a machine-aligned state may have.
const MAX_PARTLY_USED_MACHINES: usize = 2;

impl Context<'_> {
    /// Layers a stage of `replicas` GPUs ending at layer `j` may start at,
    /// with `free` GPUs left before it. A stage that takes every GPU left is
    /// the first one. In the full space any other may be first too, leaving
    /// GPUs idle (over a slow network fewer GPUs can be faster). In the
    /// machine-aligned space every GPU is used, so the layers in front must
    /// be able to take the GPUs left, at most `max_replicas` per layer: on
    /// large clusters plans that strand GPUs are many and never the fastest.
    fn starts(
        &self,
        replicas: u32,
        free: u32,
        j: usize,
        max_replicas: u32,
    ) -> std::ops::RangeInclusive<usize> {
        if replicas == free {
            0..=0
        } else if self.space == SearchSpace::Full {
            0..=j - 1
        } else {
            let left = free - replicas;
            (left.div_ceil(max_replicas).max(1) as usize)..=j - 1
        }
    }

    /// K_i the DP counts in a stage's memory under this context's policy.
    fn memory_warmup(&self, stages_from_here: u32, micro_batches: u32) -> u32 {
        self.policy.memory_depth(stages_from_here, micro_batches)
    }

    /// Where a stage of `replicas` GPUs may go from `state`. The stage
    /// that takes every free GPU (the first one) is always allowed.
    fn placements(&self, state: &State, replicas: u32) -> Vec<(Policy, Vec<u32>)> {
        match self.space {
            SearchSpace::MachineAligned if replicas != state.free() => {
                state.aligned_placements(replicas, MAX_PARTLY_USED_MACHINES)
            }
            _ => state.placements(replicas),
        }
    }

    /// The placement `policy` gave when the search ran.
    fn replay(&self, state: &State, replicas: u32, policy: Policy) -> Vec<u32> {
        self.placements(state, replicas)
            .into_iter()
            .find(|(p, _)| *p == policy)
            .map(|(_, c)| c)
            .expect("replaying a placement the search made")
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Objective {
    Latency,
    /// Smallest per-GPU memory, ignoring limits: only to explain infeasibility.
    PeakMemory,
}

const NO_PARENT: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Entry {
    latency: SuffixLatency,
    peak_memory: f64,
    stages: u32,
    parent: u32,
    /// State the parent entry belongs to (its placement is computed from it).
    parent_state: u32,
    layer_start: u32,
    layer_end: u32,
    policy: Policy,
    replicas: u32,
    /// The strictest memory rule of the run every stage fits under: an
    /// index into `Dp::rules`.
    class: u8,
}

struct StateData {
    key: State,
    front: Vec<u32>,
}

/// One pass's outcome at one micro-batch size: (pass index, micro-batch
/// size, its best plan, DP states made, stages costed).
type PassResult = (usize, u32, Option<Found>, usize, u64);

/// A pass's best plan of another stage count at one micro-batch size:
/// (pass index, micro-batch size, plan).
type OtherStageCount = (usize, u32, Found);

/// A complete plan found by one DP run, as placement steps from the last
/// stage to the first.
struct Found {
    value: f64,
    /// (layer_start, layer_end, parent state, policy, replicas), last stage first.
    stages: Vec<(usize, usize, State, Policy, u32)>,
}

struct Dp<'c, 'a> {
    ctx: &'c Context<'a>,
    coster: StageCoster<'a>,
    micro_batch: u32,
    micro_batches: u32,
    objective: Objective,
    /// The memory rules (warm-up depths counted in stage memory) this run
    /// serves at once, loosest first. Each rule's depths are at least the
    /// previous one's, so a stage that fits under rule c fits under every
    /// rule before it, and one DP run finds the best plan of each rule.
    rules: Vec<WarmupPolicy>,
    /// The best formula value found per rule, shared with other runs; none
    /// when the run has no bound to prune with.
    incumbents: Option<&'c [AtomicU64]>,
    states: Vec<StateData>,
    /// index[j]: state id of each cluster state whose suffix starts at layer j.
    index: Vec<FxHashMap<State, u32>>,
    entries: Vec<Entry>,
    stages_costed: u64,
    /// Lower bounds on the forward (and forward+backward) time of layers
    /// 0..j whatever stages hold them, for pruning.
    fwd_floor: Vec<f64>,
    fwd_bwd_floor: Vec<f64>,
    /// GPU-time floor of layers 0..j: whatever stages hold them, the GPUs
    /// spend at least this long on them per micro-batch (r GPUs on a stage
    /// each spend its per-slice time).
    work_floor: Vec<f64>,
}

impl<'c, 'a> Dp<'c, 'a> {
    fn new(
        ctx: &'c Context<'a>,
        micro_batch: u32,
        micro_batches: u32,
        objective: Objective,
        rules: Vec<WarmupPolicy>,
        incumbents: Option<&'c [AtomicU64]>,
    ) -> Self {
        debug_assert!(incumbents.is_none_or(|i| i.len() == rules.len()));
        let coster = StageCoster::new(ctx.layers, ctx.cluster, micro_batch, micro_batches);
        let n = ctx.layers.num_layers;
        let fastest = ctx
            .cluster
            .machines
            .iter()
            .map(|m| m.speed)
            .fold(0.0, f64::max);
        let max_replicas = ctx.cluster.num_devices().min(micro_batch);
        let slices: Vec<u32> = {
            let mut v: Vec<u32> = (1..=max_replicas)
                .map(|r| largest_slice(micro_batch, r))
                .collect();
            v.dedup();
            v
        };
        let mut fwd_floor = vec![0.0; n + 1];
        let mut fwd_bwd_floor = vec![0.0; n + 1];
        let mut work_floor = vec![0.0; n + 1];
        for l in 0..n {
            let w = (1..=max_replicas.max(1))
                .map(|r| {
                    f64::from(r)
                        * coster.fwd_bwd_lower_bound(
                            l,
                            l + 1,
                            largest_slice(micro_batch, r),
                            fastest,
                        )
                })
                .fold(f64::INFINITY, f64::min);
            work_floor[l + 1] = work_floor[l] + w;
            let f = slices
                .iter()
                .map(|&s| coster.fwd_lower_bound(l, l + 1, s, fastest))
                .fold(f64::INFINITY, f64::min);
            let fb = slices
                .iter()
                .map(|&s| coster.fwd_bwd_lower_bound(l, l + 1, s, fastest))
                .fold(f64::INFINITY, f64::min);
            fwd_floor[l + 1] = fwd_floor[l] + f;
            fwd_bwd_floor[l + 1] = fwd_bwd_floor[l] + fb;
        }
        Dp {
            ctx,
            coster,
            micro_batch,
            micro_batches,
            objective,
            rules,
            incumbents,
            states: Vec::new(),
            index: vec![FxHashMap::default(); n + 1],
            entries: Vec::new(),
            stages_costed: 0,
            fwd_floor,
            fwd_bwd_floor,
            work_floor,
        }
    }

    /// Most GPUs one stage can use: every replica needs a slice of at
    /// least the smallest allowed size.
    fn max_replicas(&self) -> u32 {
        (self.micro_batch / self.ctx.min_slice).min(self.ctx.cluster.num_devices())
    }

    /// The largest formula value a suffix of class `class` can still be
    /// useful at: the best plan known under the loosest rule it could
    /// improve (rules 0..=class), which is the largest of those bounds.
    fn incumbent(&self, class: u8) -> f64 {
        self.incumbents.map_or(f64::INFINITY, |all| {
            all[..=usize::from(class)]
                .iter()
                .map(|a| f64::from_bits(a.load(Ordering::Relaxed)))
                .fold(f64::NEG_INFINITY, f64::max)
        })
    }

    /// The largest bound any suffix is pruned against (the largest of the
    /// rules' best values so far): above it nothing can be useful.
    fn loosest_incumbent(&self) -> f64 {
        self.incumbent((self.rules.len() - 1) as u8)
    }

    /// A complete plan of class `class` is a plan of rules 0..=class.
    fn offer_incumbent(&self, value: f64, class: u8) {
        if let Some(all) = self.incumbents {
            for a in &all[..=usize::from(class)] {
                let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    (value < f64::from_bits(old)).then_some(value.to_bits())
                });
            }
        }
    }

    /// Can a suffix with these numbers, still missing layers 0..j, end
    /// below the best complete plan its class could improve? Only strictly
    /// worse ones are cut, so ties survive and the result does not depend
    /// on thread timing. `free`: GPUs left for layers 0..j.
    fn promising(&self, latency: SuffixLatency, j: usize, free: u32, class: u8) -> bool {
        if self.objective != Objective::Latency {
            return true;
        }
        self.completion_floor(latency, j, free) <= self.incumbent(class) * (1.0 + 1e-12)
    }

    /// K_i counted in the memory of a stage with `stages_from_here` stages
    /// from it to the end under rule `class`.
    fn rule_warmup(&self, class: usize, stages_from_here: u32) -> u32 {
        self.rules[class].memory_depth(stages_from_here, self.micro_batches)
    }

    /// The strictest rule, at most `ceiling`, under which `cost` (computed
    /// at any depth) fits with `stages_from_here` stages from it on; None
    /// when it fits under none.
    fn fitting_class(
        &self,
        cost: &crate::cost::StageCost,
        start: usize,
        end: usize,
        stages_from_here: u32,
        ceiling: u8,
    ) -> Option<u8> {
        (0..=ceiling).rev().find(|&c| {
            let warmup = self.rule_warmup(usize::from(c), stages_from_here);
            stage_memory_bytes(self.ctx.layers, start, end, cost.slice_size, warmup)
                <= cost.memory_limit_bytes
        })
    }

    /// Ids of the states whose suffix starts at layer `j`, in creation order
    /// (ids grow as states are made, so sorting restores it).
    fn states_starting_at(&self, j: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = self.index[j].values().copied().collect();
        ids.sort_unstable();
        ids
    }

    fn state_id(&mut self, start: usize, key: &State) -> u32 {
        if let Some(&id) = self.index[start].get(key) {
            return id;
        }
        let id = self.states.len() as u32;
        self.index[start].insert(key.clone(), id);
        self.states.push(StateData {
            key: key.clone(),
            front: Vec::new(),
        });
        id
    }

    /// `a` is at least as good as `b` for every completion of the suffix.
    fn dominates(&self, a: &Entry, b: &Entry) -> bool {
        if a.stages > b.stages || a.class < b.class {
            return false;
        }
        match self.objective {
            Objective::Latency => {
                a.latency.best <= b.latency.best && a.latency.steady <= b.latency.steady
            }
            Objective::PeakMemory => a.peak_memory <= b.peak_memory,
        }
    }

    fn insert(&mut self, state: u32, entry: Entry) {
        let front = &self.states[state as usize].front;
        if front
            .iter()
            .any(|&e| self.dominates(&self.entries[e as usize], &entry))
        {
            return;
        }
        let keep: Vec<u32> = front
            .iter()
            .copied()
            .filter(|&e| !self.dominates(&entry, &self.entries[e as usize]))
            .collect();
        let id = self.entries.len() as u32;
        self.entries.push(entry);
        let front = &mut self.states[state as usize].front;
        *front = keep;
        front.push(id);
    }

    /// The best plan under each rule (`rules[c]`), if any fits.
    fn run(&mut self) -> Vec<Option<Found>> {
        let n = self.ctx.layers.num_layers;
        let machines = self.ctx.cluster.group_and_gpus();
        let root_state = self.state_id(n, &State::empty(&machines));
        let root = Entry {
            latency: SuffixLatency::EMPTY,
            peak_memory: 0.0,
            stages: 0,
            parent: NO_PARENT,
            parent_state: NO_PARENT,
            layer_start: n as u32,
            layer_end: n as u32,
            policy: Policy::FreshFirst,
            replicas: 0,
            class: (self.rules.len() - 1) as u8,
        };
        self.entries.push(root);
        self.states[root_state as usize].front.push(0);
        let max_replicas = self.max_replicas();
        if self.objective == Objective::Latency {
            self.seed_incumbent(&machines, max_replicas);
        }
        for j in (1..=n).rev() {
            for sid in self.states_starting_at(j) {
                self.expand_state(sid, j, max_replicas);
            }
        }
        let finals: Vec<u32> = self
            .states_starting_at(0)
            .iter()
            .flat_map(|&s| self.states[s as usize].front.clone())
            .collect();
        (0..self.rules.len())
            .map(|class| {
                let best = finals
                    .iter()
                    .copied()
                    .filter(|&e| usize::from(self.entries[e as usize].class) >= class)
                    .min_by(|&a, &b| {
                        let (ea, eb) = (&self.entries[a as usize], &self.entries[b as usize]);
                        self.value(ea)
                            .total_cmp(&self.value(eb))
                            .then(ea.stages.cmp(&eb.stages))
                    })?;
                Some(self.found(best))
            })
            .collect()
    }

    /// For rule `class`: the best complete plan of each stage count other
    /// than that of the rule's best plan, best first.
    fn other_stage_counts(&self, class: usize) -> Vec<Found> {
        let mut best_per_count: Vec<Option<u32>> = Vec::new();
        for s in self.states_starting_at(0) {
            for &e in &self.states[s as usize].front {
                let entry = &self.entries[e as usize];
                if usize::from(entry.class) < class {
                    continue;
                }
                let count = entry.stages as usize;
                if best_per_count.len() <= count {
                    best_per_count.resize(count + 1, None);
                }
                let slot = &mut best_per_count[count];
                if slot.is_none_or(|b| self.value(entry) < self.value(&self.entries[b as usize])) {
                    *slot = Some(e);
                }
            }
        }
        let mut found: Vec<Found> = best_per_count
            .into_iter()
            .flatten()
            .map(|e| self.found(e))
            .collect();
        found.sort_by(|a, b| {
            a.value
                .total_cmp(&b.value)
                .then(a.stages.len().cmp(&b.stages.len()))
        });
        found.into_iter().skip(1).collect()
    }

    /// The plan ending in entry `best`, as placement steps.
    fn found(&self, best: u32) -> Found {
        let value = self.value(&self.entries[best as usize]);
        let mut stages = Vec::new();
        let mut cur = best;
        while self.entries[cur as usize].parent != NO_PARENT {
            let e = self.entries[cur as usize];
            let parent_key = self.states[e.parent_state as usize].key.clone();
            stages.push((
                e.layer_start as usize,
                e.layer_end as usize,
                parent_key,
                e.policy,
                e.replicas,
            ));
            cur = e.parent;
        }
        stages.reverse(); // last pipeline stage first, the order they were placed
        Found { value, stages }
    }

    fn value(&self, e: &Entry) -> f64 {
        match self.objective {
            Objective::Latency => e.latency.best,
            Objective::PeakMemory => e.peak_memory,
        }
    }

    /// Cost a few simple plans (k equal-work stages of G/k GPUs each,
    /// fresh-first) so that pruning has a bound from the start.
    fn seed_incumbent(&mut self, machines: &[(usize, u32)], max_replicas: u32) {
        let n = self.ctx.layers.num_layers;
        let g = self.ctx.cluster.num_devices();
        for k in (1..=g.min(n as u32)).filter(|k| g.is_multiple_of(*k)) {
            let r = g / k;
            if r > max_replicas {
                continue;
            }
            // Cut where the running work passes each k-th of the total.
            let slice = largest_slice(self.micro_batch, r);
            let work = |a: usize, b: usize| self.coster.fwd_bwd_lower_bound(a, b, slice, 1.0);
            let total = work(0, n);
            let mut bounds = vec![0usize];
            for s in 1..k as usize {
                let target = total * s as f64 / f64::from(k);
                let prev = *bounds.last().unwrap();
                let mut cut = prev + 1;
                while cut < n - (k as usize - s) && work(0, cut) < target {
                    cut += 1;
                }
                bounds.push(cut);
            }
            bounds.push(n);
            let mut state = State::empty(machines);
            let mut latency = SuffixLatency::EMPTY;
            let mut adjacent: Alloc = Vec::new();
            let mut class = Some((self.rules.len() - 1) as u8);
            for (idx, w) in bounds.windows(2).enumerate().rev() {
                // Only plans of the search space: a bound from outside it
                // could prune every plan inside it.
                let Some((_, counts)) = self.ctx.placements(&state, r).into_iter().next() else {
                    class = None;
                    break;
                };
                let alloc = counts_to_alloc(&counts);
                let stages_from_here = k - idx as u32;
                let cost = self.coster.stage(w[0], w[1], &alloc, 1, k == 1);
                class =
                    class.and_then(|c| self.fitting_class(&cost, w[0], w[1], stages_from_here, c));
                if class.is_none() {
                    break;
                }
                if !adjacent.is_empty() {
                    let t = self.coster.transfer(w[1], &alloc, &adjacent);
                    latency = latency.prepend(PipeStage::transfer(t), self.micro_batches);
                }
                latency = latency.prepend(cost.as_pipe_stage(), self.micro_batches);
                let next = state.taken(&counts);
                adjacent = next.adjacent_alloc();
                state = next;
            }
            if let Some(class) = class {
                self.offer_incumbent(latency.best, class);
            }
        }
    }

    /// Prepend every possible stage to every suffix of state `sid` (which
    /// starts at layer `j`). Work that does not depend on the suffix (the
    /// placement, the transfer, the stage cost for a given warm-up depth)
    /// is done once per state, not once per suffix.
    fn expand_state(&mut self, sid: u32, j: usize, max_replicas: u32) {
        let key = self.states[sid as usize].key.clone();
        let free = key.free();
        let adjacent = key.adjacent_alloc();
        let mut suffixes: Vec<(u32, Entry)> = self.states[sid as usize]
            .front
            .iter()
            .map(|&e| (e, self.entries[e as usize]))
            .filter(|(_, e)| self.promising(e.latency, j, free, e.class))
            .collect();
        if suffixes.is_empty() {
            return;
        }
        suffixes.sort_by_key(|(_, e)| e.stages);
        let is_root = suffixes[0].1.stages == 0;
        struct Candidate {
            replicas: u32,
            policy: Policy,
            devices: StageDevices,
            next_key: State,
            transfer_ms: f64,
            /// Where the stage may start: `first..end`.
            first: usize,
            end: usize,
        }
        let m = f64::from(self.micro_batches);
        let prune_above = self.loosest_incumbent() * (1.0 + 1e-12);
        let mut options: Vec<Candidate> = Vec::new();
        for r in 1..=free.min(max_replicas) {
            // Where the stage may start: a stage that takes every GPU left
            // is the first one; any other may be too, leaving the rest idle
            // (a plan need not use every GPU: over a slow network fewer GPUs
            // can be faster).
            let starts = self.ctx.starts(r, free, j, max_replicas);
            let (first, last) = (*starts.start(), *starts.end());
            // The layers in front of the stage keep some GPU busy for at
            // least M * work_floor[i] / (GPUs left) (a term of the
            // completion floor), which grows with i: drop the starts where
            // that alone is above every bound, before placing or costing.
            let left = free - r;
            let end = if self.objective == Objective::Latency && left > 0 && first <= last {
                let floor_above = f64::from(left) * prune_above / m;
                first + self.work_floor[first..=last].partition_point(|&w| w <= floor_above)
            } else {
                last + 1
            };
            if first >= end {
                continue;
            }
            for (policy, counts) in self.ctx.placements(&key, r) {
                let alloc = counts_to_alloc(&counts);
                let transfer_ms = if is_root {
                    0.0
                } else {
                    self.coster.transfer(j, &alloc, &adjacent)
                };
                let next_key = key.taken(&counts);
                options.push(Candidate {
                    replicas: r,
                    policy,
                    devices: StageDevices::new(self.ctx.cluster, alloc),
                    next_key,
                    transfer_ms,
                    first,
                    end,
                });
            }
        }
        for opt in &options {
            // Grow the new stage i..j one layer at a time. Its time and memory
            // only grow, so once it alone is slower than the best plan known or
            // does not fit, no larger stage will.
            for i in (opt.first..opt.end).rev() {
                let mut next: Option<u32> = None;
                // Time does not depend on the warm-up depth, memory is
                // checked per rule below: cost the stage once.
                let only_stage = i == 0 && suffixes[0].1.stages == 0;
                let cost = self.coster.stage_on(i, j, &opt.devices, 1, only_stage);
                self.stages_costed += 1;
                let loosest_bound = self.loosest_incumbent();
                let mut stop_growing = false;
                for (k, &(eid, entry)) in suffixes.iter().enumerate() {
                    let stages = entry.stages + 1;
                    let class = match self.fitting_class(&cost, i, j, stages, entry.class) {
                        Some(class) => class,
                        // Peak memory ignores limits (to explain infeasibility).
                        None if self.objective == Objective::PeakMemory => 0,
                        None => {
                            // Not even under the loosest rule. More stages
                            // behind means more micro-batches in flight: the
                            // remaining suffixes need more memory.
                            stop_growing |= k == 0;
                            break;
                        }
                    };
                    if self.objective == Objective::Latency {
                        let slowest = m * (cost.fwd_ms + cost.bwd_ms);
                        if slowest > loosest_bound * (1.0 + 1e-12) {
                            stop_growing |= k == 0;
                            break;
                        }
                        if slowest > self.incumbent(class) * (1.0 + 1e-12) {
                            continue;
                        }
                    }
                    let memory_bytes = stage_memory_bytes(
                        self.ctx.layers,
                        i,
                        j,
                        cost.slice_size,
                        self.rule_warmup(usize::from(class), stages),
                    );
                    let mut latency = entry.latency;
                    if entry.stages > 0 {
                        let t = opt.transfer_ms;
                        latency = latency.prepend(PipeStage::transfer(t), self.micro_batches);
                    }
                    latency = latency.prepend(cost.as_pipe_stage(), self.micro_batches);
                    if !self.promising(latency, i, free - opt.replicas, class) {
                        continue;
                    }
                    if i == 0 && self.objective == Objective::Latency {
                        self.offer_incumbent(latency.best, class);
                    }
                    let target = match next {
                        Some(t) => t,
                        None => {
                            let t = self.state_id(i, &opt.next_key);
                            next = Some(t);
                            t
                        }
                    };
                    self.insert(
                        target,
                        Entry {
                            latency,
                            peak_memory: entry.peak_memory.max(memory_bytes),
                            stages,
                            parent: eid,
                            parent_state: sid,
                            layer_start: i as u32,
                            layer_end: j as u32,
                            policy: opt.policy,
                            replicas: opt.replicas,
                            class,
                        },
                    );
                }
                if stop_growing {
                    break;
                }
            }
        }
    }
}

/// One placement step of a layout being built from the back:
/// (layer_start, layer_end, state before, policy, replicas).
type Step = (usize, usize, State, Policy, u32);

/// Depth-first enumeration of every layout whose formula (2) value is
/// below a bound that only falls (`LayoutWalk::bound`). Each complete
/// layout goes to `visit`, which returns the new bound (the best simulated
/// time so far). Stops early, incomplete (`complete` false), when
/// `nodes_left` or `work_left` runs out.
struct LayoutWalk<'w, F: FnMut(&[Step], f64) -> f64> {
    bound: f64,
    nodes_left: u64,
    /// Simulated tasks the costing of complete layouts may still take
    /// (choosing one layout's warm-up depths simulates it many times).
    work_left: &'w std::cell::Cell<u64>,
    complete: bool,
    visit: &'w mut F,
}

impl Dp<'_, '_> {
    /// Walk every layout of this micro-batch size whose bound is below
    /// `walk.bound`; `walk.complete` says whether it finished within budget.
    fn walk_layouts<F: FnMut(&[Step], f64) -> f64>(&mut self, walk: &mut LayoutWalk<F>) {
        let n = self.ctx.layers.num_layers;
        let machines = self.ctx.cluster.group_and_gpus();
        let max_replicas = self.max_replicas();
        let mut steps = Vec::new();
        self.walk_from(
            n,
            &State::empty(&machines),
            SuffixLatency::EMPTY,
            0,
            max_replicas,
            &mut steps,
            walk,
        );
    }

    /// Smallest formula value any completion of this suffix (still missing
    /// layers 0..j, with `free` GPUs left) can have.
    fn completion_floor(&self, latency: SuffixLatency, j: usize, free: u32) -> f64 {
        let mut floor =
            (latency.best + self.fwd_floor[j]).max(latency.steady + self.fwd_bwd_floor[j]);
        if j > 0 && free > 0 {
            // Some stage of the prefix does at least its share of the work
            // M times, and formula (2) is at least M (F_q + B_q) for each q.
            floor = floor.max(f64::from(self.micro_batches) * self.work_floor[j] / f64::from(free));
        }
        floor
    }

    /// Extend the suffix (layers `j..`, on the GPUs `state` has used) by
    /// every stage that could lead below the bound, most promising first, so
    /// that fast plans are found early and lower the bound for the rest.
    #[allow(clippy::too_many_arguments)]
    fn walk_from<F: FnMut(&[Step], f64) -> f64>(
        &mut self,
        j: usize,
        state: &State,
        latency: SuffixLatency,
        stages: u32,
        max_replicas: u32,
        steps: &mut Vec<Step>,
        walk: &mut LayoutWalk<F>,
    ) {
        struct Child {
            floor: f64,
            start: usize,
            policy: Policy,
            replicas: u32,
            next: State,
            latency: SuffixLatency,
        }
        let free = state.free();
        let adjacent = state.adjacent_alloc();
        let m = f64::from(self.micro_batches);
        let warmup = self.ctx.memory_warmup(stages + 1, self.micro_batches);
        let mut children: Vec<Child> = Vec::new();
        for r in 1..=free.min(max_replicas) {
            for (policy, counts) in self.ctx.placements(state, r) {
                let alloc = counts_to_alloc(&counts);
                let transfer = if stages == 0 {
                    None
                } else {
                    Some(self.coster.transfer(j, &alloc, &adjacent))
                };
                let next = state.taken(&counts);
                let starts = self.ctx.starts(r, free, j, max_replicas);
                for i in starts.rev() {
                    if walk.nodes_left == 0 {
                        walk.complete = false;
                        return;
                    }
                    walk.nodes_left -= 1;
                    let cost = self
                        .coster
                        .stage(i, j, &alloc, warmup, i == 0 && stages == 0);
                    self.stages_costed += 1;
                    // A longer stage is no faster and no smaller.
                    if !cost.fits() || m * (cost.fwd_ms + cost.bwd_ms) >= walk.bound {
                        break;
                    }
                    let mut l = latency;
                    if let Some(t) = transfer {
                        l = l.prepend(PipeStage::transfer(t), self.micro_batches);
                    }
                    l = l.prepend(cost.as_pipe_stage(), self.micro_batches);
                    let floor = self.completion_floor(l, i, free - r);
                    if floor < walk.bound {
                        children.push(Child {
                            floor,
                            start: i,
                            policy,
                            replicas: r,
                            next: next.clone(),
                            latency: l,
                        });
                    }
                }
            }
        }
        // Stable: equal floors keep the order they were made in.
        children.sort_by(|a, b| a.floor.total_cmp(&b.floor));
        for c in children {
            if !walk.complete {
                return;
            }
            if c.floor >= walk.bound {
                break; // sorted: no later child is below the bound either
            }
            steps.push((c.start, j, state.clone(), c.policy, c.replicas));
            if c.start == 0 {
                if walk.work_left.get() == 0 {
                    walk.complete = false;
                    steps.pop();
                    return;
                }
                walk.bound = (walk.visit)(steps, c.latency.best).min(walk.bound);
            } else {
                self.walk_from(
                    c.start,
                    &c.next,
                    c.latency,
                    stages + 1,
                    max_replicas,
                    steps,
                    walk,
                );
            }
            steps.pop();
        }
    }
}

/// Turn placement steps on canonical states into concrete device ids:
/// replay them while tracking which real machine each canonical position
/// is, then number machines of a group and GPUs of a machine in pipeline
/// order, so stage 0 starts at device 0.
fn concrete_allocs(
    cluster: &Cluster,
    steps: &[(usize, usize, State, Policy, u32)],
    replay: impl Fn(&State, u32, Policy) -> Vec<u32>,
) -> Vec<Alloc> {
    let mut position_to_machine: Vec<usize> = (0..cluster.machines.len()).collect();
    let mut per_stage: Vec<Alloc> = Vec::new();
    for (_, _, parent, policy, replicas) in steps {
        let counts = replay(parent, *replicas, *policy);
        let mut alloc: Alloc = counts_to_alloc(&counts)
            .into_iter()
            .map(|(p, c)| (position_to_machine[p], c))
            .collect();
        alloc.sort_unstable();
        per_stage.push(alloc);
        let (_, order) = parent.take(&counts);
        position_to_machine = order.iter().map(|&p| position_to_machine[p]).collect();
    }
    per_stage.reverse(); // pipeline order
                         // Relabel machines within each group by first use in pipeline order.
    let groups: Vec<usize> = cluster.machines.iter().map(|m| m.group).collect();
    let mut relabel: Vec<Option<usize>> = vec![None; groups.len()];
    let mut next_in_group: HashMap<usize, usize> = HashMap::new();
    for alloc in &per_stage {
        for &(m, _) in alloc {
            if relabel[m].is_none() {
                let g = groups[m];
                let first_of_group = groups.iter().position(|&x| x == g).unwrap();
                let k = next_in_group.entry(g).or_insert(0);
                relabel[m] = Some(first_of_group + *k);
                *k += 1;
            }
        }
    }
    per_stage
        .into_iter()
        .map(|a| {
            let mut v: Alloc = a
                .into_iter()
                .map(|(m, c)| (relabel[m].expect("used machine"), c))
                .collect();
            v.sort_unstable();
            v
        })
        .collect()
}

fn build_plan(inputs: &PlanInputs, ctx: &Context, b: u32, m: u32, found: &Found) -> Plan {
    let allocs = concrete_allocs(ctx.cluster, &found.stages, |s, r, p| ctx.replay(s, r, p));
    let count = found.stages.len() as u32;
    let stages: Vec<Stage> = found
        .stages
        .iter()
        .rev()
        .zip(ctx.cluster.number_devices(&allocs))
        .enumerate()
        .map(|(i, ((start, end, _, policy, _), devices))| Stage {
            layer_start: *start,
            layer_end: *end,
            devices,
            warmup_micro_batches: ctx.memory_warmup(count - i as u32, m),
            placement: Some(*policy),
        })
        .collect();
    let schedule = ScheduleChoice {
        kind: ScheduleKind::EarlyBackward1F1B,
        warmup_policy: ctx.policy,
    };
    let mut plan = Plan::new(inputs.clone(), b, m, schedule, stages);
    let coster = StageCoster::new(ctx.layers, ctx.cluster, b, m);
    let estimate = estimate_stages(&coster, &plan, &allocs);
    debug_assert!(
        (estimate.latency_ms - found.value).abs() <= 1e-6 * found.value.abs().max(1.0),
        "search value {} and plan estimate {} disagree",
        found.value,
        estimate.latency_ms
    );
    plan.estimate = Some(estimate);
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::smallest_slice;
    use crate::format::PROFILE;
    use crate::plan::PlanOptions;
    use crate::profile::{Layer, Measurement};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random_profile(rng: &mut StdRng, layers: usize) -> Profile {
        Profile {
            format: PROFILE.name.into(),
            schema_version: PROFILE.version,
            model: "random".into(),
            source: None,
            device: None,
            optimizer: "adam".into(),
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
        let cluster = Cluster::new(topology);
        let machines = cluster.group_and_gpus();
        let mut best: Option<(f64, f64)> = None;
        let min_slice = profile.min_batch_size();
        for b in (1..=gbs).filter(|b| gbs % b == 0 && *b >= min_slice) {
            // (layer j the suffix starts at, state, steps so far)
            let mut stack: Vec<(usize, State, Vec<(usize, usize, State, Policy, u32)>)> =
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
                        .enumerate()
                        .map(|(i, ((s, e, _, _, _), devices))| Stage {
                            layer_start: *s,
                            layer_end: *e,
                            devices,
                            warmup_micro_batches: policy
                                .warmup(count - i as u32, gbs / b)
                                .unwrap_or(1),
                            placement: None,
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
                        for (placement, counts) in state.placements(r) {
                            let next = state.taken(&counts);
                            let mut steps2 = steps.clone();
                            steps2.push((i, j, state.clone(), placement, r));
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

    #[test]
    fn search_matches_brute_force() {
        let mut rng = StdRng::seed_from_u64(20201122);
        let shapes = ["1x2", "1x4", "2x2", "2x3", "1x8", "2x4", "4x1", "3x2"];
        for case in 0..160 {
            let (spec, topology) = random_topology(&mut rng, shapes[case % shapes.len()], case);
            let layers = rng.gen_range(1..=if topology.num_devices() >= 8 { 5 } else { 7 });
            let profile = random_profile(&mut rng, layers);
            let gbs = [4, 6, 8, 12][case % 4];
            let policy = if case % 2 == 0 {
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
    /// GPUs, micro-batch sizes) and every valid warm-up vector within memory.
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
                    assert!(
                        (sim - optimum).abs() <= 1e-9 * optimum,
                        "case {case} ({spec}, {layers} layers, gbs {gbs}): search {sim} ({}), optimum {optimum}",
                        r.plan.shape()
                    );
                    let selection = r.plan.selection.as_ref().unwrap();
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
}
