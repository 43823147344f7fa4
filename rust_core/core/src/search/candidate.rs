//! Candidates: plans offered to the ranking (the DP passes' best plans,
//! the baselines' layouts, the walk's), each costed by simulation with the
//! warm-up depths that simulate fastest within memory, and ranked by
//! simulated iteration. The walk and refinement cost their plans the same
//! way (`cost_candidate`).

use rayon::prelude::*;

use crate::baselines::megatron::uniform_plans;
use crate::baselines::{baseline_layouts, Baseline};
use crate::cost::overlap::Overlap;
use crate::cost::{Cluster, StageCoster, StageDevices, WarmupPolicy};
use crate::error::{ErrorKind, Result};
use crate::plan::{Plan, PlanInputs, ScheduleChoice, Stage};
use crate::schedule::{within_passes, ScheduleKind};
use crate::simulation::costing::ProfileCosts;
use crate::simulation::evaluate::{
    bound_estimate, bound_estimate_stages, estimate_stages, evaluate_costed,
};

use crate::cluster::topology::Topology;
use crate::plan::hints::{Hints, NO_HINTS};
use crate::simulation::warmup::plan_with_chosen_warmups_below;

use super::dp::{concrete_allocs, Dp, Found, Objective, Step};
use super::space::{hints_admit, layout_of, Context, SearchSpace, ShapeChoices, Space};

/// What building, checking and estimating one plan costs, in simulated
/// tasks, beyond its simulations (`cost_candidate`).
pub(crate) const PLAN_OVERHEAD_TASKS: u64 = 10_000;

/// A plan offered to the ranking, and what offered it: "search" for the
/// search's own plans, else the baseline's name.
pub(crate) struct Candidate {
    pub(crate) plan: Plan,
    pub(crate) source: &'static str,
}

impl Candidate {
    pub(crate) fn searched(plan: Plan) -> Candidate {
        Candidate {
            plan,
            source: "search",
        }
    }

    /// Shortest simulated iteration first; ties go to the smaller bound,
    /// fewer stages, then larger micro-batches.
    fn faster(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
        let (ka, kb) = (
            simulated_and_bound_ms(&a.plan),
            simulated_and_bound_ms(&b.plan),
        );
        ka.0.total_cmp(&kb.0)
            .then(ka.1.total_cmp(&kb.1))
            .then(a.plan.stages.len().cmp(&b.plan.stages.len()))
            .then(b.plan.micro_batch_size.cmp(&a.plan.micro_batch_size))
    }
}

/// A costed plan's simulated iteration and formula (2) value (its bound).
pub(crate) fn simulated_and_bound_ms(plan: &Plan) -> (f64, f64) {
    let e = plan.estimate.as_ref().expect("candidates are costed");
    (
        e.iteration_ms.expect("costed plans are simulated"),
        e.latency_ms,
    )
}

/// The candidates costed so far that fit in memory, fastest first.
pub(crate) struct Ranking<'p> {
    costs: &'p ProfileCosts<'p>,
    warmup_policy: WarmupPolicy,
    /// Candidates the hints do not admit are never ranked.
    hints: &'p Hints,
    pub(crate) ranked: Vec<Candidate>,
    /// Plans offered to simulation, whether or not their bound let them be
    /// simulated: a count that does not depend on the number of threads.
    pub(crate) offered: u32,
}

impl<'p> Ranking<'p> {
    pub(crate) fn new(
        costs: &'p ProfileCosts<'p>,
        warmup_policy: WarmupPolicy,
        hints: &'p Hints,
    ) -> Ranking<'p> {
        Ranking {
            costs,
            warmup_policy,
            hints,
            ranked: Vec::new(),
            offered: 0,
        }
    }

    pub(crate) fn costs(&self) -> &'p ProfileCosts<'p> {
        self.costs
    }

    pub(crate) fn warmup_policy(&self) -> WarmupPolicy {
        self.warmup_policy
    }

    /// The fastest simulated iteration so far.
    pub(crate) fn fastest_ms(&self) -> Option<f64> {
        self.ranked
            .first()
            .map(|c| simulated_and_bound_ms(&c.plan).0)
    }

    /// Cost `candidates` (those that could beat `fastest_ms`) and rank the
    /// ones that fit.
    pub(crate) fn offer(&mut self, mut candidates: Vec<Candidate>, fastest_ms: f64) -> Result<()> {
        // The baselines' and uniform layouts are made without the hints.
        candidates.retain(|c| hints_admit(self.hints, &c.plan));
        self.offered += candidates.len() as u32;
        let costed =
            simulate_in_bound_order(candidates, fastest_ms, self.costs, self.warmup_policy)?;
        self.ranked.extend(costed);
        self.ranked.sort_by(Candidate::faster);
        Ok(())
    }

    /// Rank a plan costed elsewhere (the walk's), not counted as offered.
    pub(crate) fn add_costed(&mut self, plan: Plan) {
        self.ranked.push(Candidate::searched(plan));
        self.ranked.sort_by(Candidate::faster);
    }
}

/// Each candidate gets its warm-up depths (auto: many simulations) or
/// keeps its cost (fixed: already simulated once), in order of its
/// formula (2) value, a lower bound of its simulated time whatever its
/// depths: once that is above the fastest simulated so far (`fastest_ms`,
/// then each one simulated), neither it nor any later candidate can be
/// faster, and none gets its depths. Candidates are costed a batch per
/// thread at a time. Returns the ones costed that fit in memory.
fn simulate_in_bound_order(
    candidates: Vec<Candidate>,
    mut fastest_ms: f64,
    costs: &ProfileCosts,
    warmup_policy: WarmupPolicy,
) -> Result<Vec<Candidate>> {
    let mut bounded = estimated(candidates, costs)?;
    let bound = |c: &Candidate| c.plan.estimate.as_ref().expect("bounded").latency_ms;
    bounded.sort_by(|a, b| bound(a).total_cmp(&bound(b)));
    let width = crate::simulation::costing::SIMULATED_AT_ONCE;
    let mut costed: Vec<Candidate> = Vec::new();
    let mut left = bounded.into_iter().peekable();
    while left.peek().is_some_and(|c| bound(c) <= fastest_ms) {
        let batch: Vec<Candidate> = std::iter::from_fn(|| left.next_if(|c| bound(c) <= fastest_ms))
            .take(width)
            .collect();
        let done: Vec<Option<Candidate>> = batch
            .into_par_iter()
            .map(|Candidate { plan, source }| {
                let plan = match warmup_policy {
                    WarmupPolicy::Auto => {
                        plan_with_chosen_warmups_below(&plan, costs, f64::INFINITY)?.0
                    }
                    _ if simulated(&plan) => Some(plan),
                    _ => Some(Plan {
                        estimate: Some(evaluate_costed(&plan, costs)?),
                        ..plan
                    }),
                };
                Ok(plan
                    .filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory))
                    .map(|plan| Candidate { plan, source }))
            })
            .collect::<Result<_>>()?;
        for candidate in done.into_iter().flatten() {
            let simulated = candidate
                .plan
                .estimate
                .as_ref()
                .and_then(|e| e.iteration_ms);
            fastest_ms = fastest_ms.min(simulated.unwrap_or(f64::INFINITY));
            costed.push(candidate);
        }
    }
    Ok(costed)
}

/// Has the plan's estimate been simulated?
fn simulated(plan: &Plan) -> bool {
    plan.estimate
        .as_ref()
        .is_some_and(|e| e.iteration_ms.is_some())
}

/// The candidates with an estimate, at least its bound: baselines' layouts
/// come uncosted; the search's own with their bound.
fn estimated(candidates: Vec<Candidate>, costs: &ProfileCosts) -> Result<Vec<Candidate>> {
    candidates
        .into_par_iter()
        .map(|Candidate { plan, source }| {
            let plan = match plan.estimate {
                Some(_) => plan,
                None => Plan {
                    estimate: Some(bound_estimate(&plan, costs)?),
                    ..plan
                },
            };
            Ok(Candidate { plan, source })
        })
        .collect()
}

/// Megatron-LM's uniform shapes and Whale's collocated split
/// (`baselines/megatron.rs`), as candidates, in every search: where the DP stops at
/// its work limit before any plan is complete, a uniform pipeline is still
/// a plan (issue 44: a 128-layer chain on 128x8 found none). Above 16 GPUs
/// the DP splits stages only at the degree of the fastest of them
/// (`uniform_degree`), so these also bring the other degrees into the
/// choice. `plain_only`: only plain stages (no split, ZeRO-1 or
/// re-computation), where the search's stages are plain; none cut its
/// sequence more than `max_context_parallel` ways.
pub(crate) fn megatron_candidates(
    costs: &ProfileCosts,
    topology: &Topology,
    (global_batch_size, min_slice): (u32, u32),
    (plain_only, max_context_parallel): (bool, u32),
    overlap: Overlap,
) -> Vec<Candidate> {
    uniform_plans(costs.profile, topology, global_batch_size, min_slice)
        .into_iter()
        .map(|(plan, source)| (plan.overlapping(overlap), source))
        .filter(|(plan, _)| !plain_only || plan.stages.iter().all(|s| s.shape.is_plain()))
        .filter(|(plan, _)| {
            plan.stages
                .iter()
                .all(|s| s.shape.context_parallel <= max_context_parallel)
        })
        .filter(|(plan, _)| within_passes(plan.stages.len(), plan.micro_batches))
        // Every offered plan must be one `evaluate` accepts.
        .filter(|(plan, _)| costs.check(plan).is_ok())
        .map(|(plan, source)| Candidate { plan, source })
        .collect()
}

/// The split degree of the uniform candidate with the smallest formula (2)
/// value that fits in memory at its warm-up depths, whether it splits
/// the sequence, and its context degree; None where none fits. Each candidate keeps its estimate,
/// which the ranking then reuses.
pub(crate) fn uniform_degree(
    candidates: &mut [Candidate],
    costs: &ProfileCosts,
) -> Option<super::space::UniformShape> {
    candidates
        .iter_mut()
        .filter_map(|c| {
            let estimate = c.plan.estimate.insert(bound_estimate(&c.plan, costs).ok()?);
            let first = &c.plan.stages[0];
            let shape = (
                first.shape.tensor_parallel,
                first.shape.sequence_parallel,
                first.shape.context_parallel,
            );
            estimate.fits_memory.then_some((estimate.latency_ms, shape))
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, shape)| shape)
}

/// The baselines' layouts at every micro-batch size, as candidates:
/// a straight pipeline and PipeDream's plan, and on GPUs of several kinds
/// Whale's balanced data parallelism and pipeline too (their uneven slices
/// are outside the search's own space). A baseline that does not apply to
/// the cluster (PipeDream's planner on machines of unequal size) offers
/// none.
pub(crate) fn baseline_candidates(
    costs: &ProfileCosts,
    topology: &Topology,
    space: &Space,
    warmup_policy: WarmupPolicy,
) -> Result<Vec<Candidate>> {
    let (global_batch_size, min_slice) = (space.global_batch_size, space.covering().min_slice);
    let mut kinds = vec![Baseline::Straight, Baseline::PipeDream];
    if space.cluster().is_mixed() {
        kinds.extend([Baseline::WhaleDataParallel, Baseline::WhalePipeline]);
    }
    let mut candidates = Vec::new();
    for kind in kinds {
        let layouts = match baseline_layouts(
            kind,
            costs,
            topology,
            global_batch_size,
            min_slice,
            warmup_policy,
        ) {
            Err(e) if e.kind == ErrorKind::Incompatible => Vec::new(),
            other => other?,
        };
        candidates.extend(layouts.into_iter().map(|plan| Candidate {
            plan: plan.overlapping(space.covering().overlap),
            source: kind.name(),
        }));
    }
    Ok(candidates)
}

/// The full space's placement of `plan`'s layout (each stage's layers
/// and GPU count) with the smallest formula (2) value under the plan's
/// warm-up policy, costed as a candidate; None when none fits.
pub(crate) fn best_placement_of(
    plan: &Plan,
    costs: &ProfileCosts,
    inputs: &PlanInputs,
    cluster: &Cluster,
    min_slice: u32,
) -> Result<Option<Plan>> {
    let layout = layout_of(plan);
    let policy = plan.schedule.warmup_policy;
    let ctx = Context {
        layers: &costs.layers,
        cluster,
        policy,
        overlap: plan.schedule.overlap,
        min_slice,
        space: SearchSpace::Full,
        layout: Some(&layout),
        shapes: ShapeChoices::of_layout(&layout),
        hints: &NO_HINTS,
    };
    let (b, m) = (plan.micro_batch_size, plan.micro_batches);
    let mut dp = Dp::new(&ctx, b, m, Objective::Latency, vec![policy], None);
    let Some(found) = dp.run().into_iter().next().flatten() else {
        return Ok(None);
    };
    let placed = build_plan(inputs, &ctx, b, m, &found);
    Ok(cost_candidate(&placed, costs)?.0)
}

/// A candidate costed as the search ranks it: under warm-up policy auto
/// with the depths that simulate fastest within memory (`simulation/warmup.rs`), else
/// at its fixed policy's depths (estimated now unless it was). None when
/// it does not fit in memory. Also the work it took, in simulated tasks:
/// the layout is simulated once to cost it (every stage's 2M tasks, F and
/// B), the warm-up choice's passes (two tasks each) on top, and building
/// and checking the plan costs `PLAN_OVERHEAD_TASKS`.
pub(crate) fn cost_candidate(plan: &Plan, costs: &ProfileCosts) -> Result<(Option<Plan>, u64)> {
    cost_candidate_below(plan, costs, f64::INFINITY)
}

/// [`cost_candidate`] where only a plan faster than `below_ms` is wanted:
/// under warm-up policy auto, one whose chosen depths simulate no faster
/// is None without its full simulation (the walk's case).
pub(crate) fn cost_candidate_below(
    plan: &Plan,
    costs: &ProfileCosts,
    below_ms: f64,
) -> Result<(Option<Plan>, u64)> {
    let per_simulation = 2 * u64::from(plan.micro_batches) * plan.stages.len() as u64;
    let mut tasks = PLAN_OVERHEAD_TASKS + per_simulation;
    let costed = match plan.schedule.warmup_policy {
        WarmupPolicy::Auto => {
            let (chosen, simulated_passes) = plan_with_chosen_warmups_below(plan, costs, below_ms)?;
            tasks += 2 * simulated_passes;
            chosen
        }
        _ if simulated(plan) => Some(plan.clone()),
        _ => Some(Plan {
            estimate: Some(evaluate_costed(plan, costs)?),
            ..plan.clone()
        }),
    };
    let fits = costed.filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory));
    Ok((fits, tasks))
}

pub(crate) fn build_plan(
    inputs: &PlanInputs,
    ctx: &Context,
    b: u32,
    m: u32,
    found: &Found,
) -> Plan {
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
pub(crate) fn plan_of_steps(
    inputs: &PlanInputs,
    ctx: &Context,
    b: u32,
    m: u32,
    steps: &[Step],
) -> Plan {
    let allocs = concrete_allocs(ctx.cluster, steps, |s, r, p| ctx.replay(s, r, p));
    let count = steps.len() as u32;
    let coster = StageCoster::new(ctx.layers, ctx.cluster, b, m).overlapping(ctx.overlap);
    let stages: Vec<Stage> = steps
        .iter()
        .rev()
        .zip(ctx.cluster.number_devices(&allocs))
        .zip(&allocs)
        .enumerate()
        .map(|(i, ((step, devices), alloc))| Stage {
            layer_start: step.layer_start,
            layer_end: step.layer_end,
            devices,
            warmup_micro_batches: ctx.memory_warmup(count - i as u32, m),
            placement: Some(step.placement.policy),
            // Replicas are numbered machine by machine, as the alloc lists them.
            slices: coster.searched_slices(
                step.layer_start,
                step.layer_end,
                &StageDevices::new(ctx.cluster, alloc.clone()),
                ctx.min_slice,
            ),
            shape: step.shape,
        })
        .collect();
    let schedule =
        ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, ctx.policy).overlapping(ctx.overlap);
    let mut plan = Plan::new(inputs.clone(), b, m, schedule, stages);
    plan.estimate = Some(match ctx.policy {
        WarmupPolicy::Auto => bound_estimate_stages(&coster, &plan, &allocs),
        _ => estimate_stages(&coster, &plan, &allocs),
    });
    plan
}
