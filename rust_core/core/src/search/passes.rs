//! The DP passes: one DP run (`dp.rs`) per micro-batch size serves every
//! memory rule of the space (`space.rs`) and gives each rule's best plan,
//! and up to 16 GPUs each rule's best plan of every other stage count. Up
//! to 16 GPUs every size runs on its own; above, the sizes share one bound
//! per rule, and up to 64 GPUs a second pass runs each size on its own,
//! pruned at the fastest simulated time so far. Micro-batch sizes run in
//! parallel with rayon.

use std::sync::atomic::AtomicU64;

use rayon::prelude::*;

use crate::cost::WarmupPolicy;
use crate::error::Error;
use crate::model::profile::LayerCosts;

use super::dp::{Dp, Found, MemoryBudget, Objective};
use super::space::{SearchSpace, Space, AUTO_FULL_MAX_DEVICES, FULL_SPACE_MAX_SHARED_GPUS};

/// Largest cluster on which every micro-batch size runs the DP on its own
/// and gives candidates (its best plans, those of other stage counts, the
/// baselines' layouts); above, the sizes share one bound.
pub(crate) const SIZES_ALONE_MAX_DEVICES: u32 = AUTO_FULL_MAX_DEVICES;

/// Largest cluster on which, after the shared-bound runs, every
/// micro-batch size runs again on its own (a second pass), pruned at the
/// fastest simulated time so far, to offer its best plan.
pub(crate) const SECOND_PASS_MAX_DEVICES: u32 = 64;

/// The DP's step limit at each micro-batch size (`--max-search-steps`).
/// It holds for the whole search, not for each run: a size whose run
/// passed it is not run again (by the second pass, or the search at
/// warm-up policy A that ZB-H1 adds): it gets a run with no steps left,
/// which stops within its first stage option, so its layouts are left to
/// the walk as its first run's were.
#[derive(Clone, Copy)]
pub(crate) struct StepLimit<'a> {
    pub(crate) per_size: u64,
    /// Sizes whose run in this search passed `per_size`.
    pub(crate) passed_at: &'a [u32],
}

impl<'a> StepLimit<'a> {
    pub(crate) fn new(per_size: u64, passed_at: &'a [u32]) -> Self {
        StepLimit {
            per_size,
            passed_at,
        }
    }

    fn at(&self, micro_batch_size: u32) -> u64 {
        if self.passed_at.contains(&micro_batch_size) {
            0
        } else {
            self.per_size
        }
    }
}

/// One pass's best plan at one micro-batch size.
#[derive(Clone)]
pub(crate) struct PassBest {
    /// Index into `Space::contexts`.
    pub(crate) pass: usize,
    pub(crate) micro_batch_size: u32,
    /// None where no plan fits, or where another size's plan was the
    /// pass's best under a shared bound.
    pub(crate) found: Option<Found>,
    /// Where the size's run passed the work limit before it finished (so
    /// `found` is the best plan it had completed, not the size's best):
    /// the floor below which no plan of the size has its formula value
    /// (`Dp::floor_ms`). The size's other plans are left to the walk.
    pub(crate) abandoned_floor_ms: Option<f64>,
}

/// A pass's best plan of another stage count at one micro-batch size.
#[derive(Clone)]
pub(crate) struct OtherStageCount {
    pub(crate) pass: usize,
    pub(crate) micro_batch_size: u32,
    pub(crate) found: Found,
}

/// What the DP passes found, and the work they took.
pub(crate) struct PassResults {
    /// The memory rule of each pass (of `Space::contexts`, by index).
    pub(crate) rules: Vec<WarmupPolicy>,
    /// Every pass at every micro-batch size, size by size.
    pub(crate) bests: Vec<PassBest>,
    /// Up to 16 GPUs, every pass's best plan of each other stage count.
    pub(crate) other_stage_counts: Vec<OtherStageCount>,
    pub(crate) states: usize,
    pub(crate) stages_costed: u64,
}

/// Whether every micro-batch size runs the DP on its own and gives its own
/// candidates: up to 16 GPUs.
pub(crate) fn sizes_alone(space: &Space) -> bool {
    space.cluster().num_devices() <= SIZES_ALONE_MAX_DEVICES
}

/// Run the DP once per micro-batch size, each run serving every pass.
/// Up to 16 GPUs every micro-batch size searches on its own, so each size
/// contributes its best plan per pass as a candidate. Above, the sizes
/// share each pass's best formula value for pruning (far less work): a
/// size that cannot reach it is cut and only the pass's best is a
/// candidate, though the walk still visits the other sizes.
pub(crate) fn run_passes(
    space: &Space,
    budget: &MemoryBudget,
    steps: StepLimit,
) -> Result<PassResults, Error> {
    let alone = sizes_alone(space);
    let rules = space.rules.len();
    // One bound per pass, per size or shared by the sizes.
    let bound_sets = if alone { space.sizes.len() } else { 1 };
    let incumbents: Vec<AtomicU64> = (0..bound_sets * rules)
        .map(|_| AtomicU64::new(f64::INFINITY.to_bits()))
        .collect();
    if !alone {
        // Every size's seeds before any run: a run that started first
        // would prune against none of the others'.
        space.sizes.par_iter().for_each(|&b| {
            size_dp(space, b, &incumbents).seed_bounds();
        });
    }
    let runs: Vec<SizeRun> = (0..space.sizes.len())
        .into_par_iter()
        .map(|k| {
            let set = if alone { k } else { 0 };
            let bounds = &incumbents[set * rules..(set + 1) * rules];
            let b = space.sizes[k];
            run_size(space, b, bounds, (budget, steps.at(b)), (alone, !alone))
        })
        .collect();
    if let Some(e) = search_memory_limit(budget, space.cluster(), space.space()) {
        return Err(e);
    }
    let mut results = PassResults {
        rules: space.contexts.iter().map(|c| c.policy).collect(),
        bests: Vec::new(),
        other_stage_counts: Vec::new(),
        states: 0,
        stages_costed: 0,
    };
    for run in runs {
        results.bests.extend(run.bests);
        results.other_stage_counts.extend(run.other_stage_counts);
        results.states += run.states;
        results.stages_costed += run.stages_costed;
    }
    if !alone {
        keep_only_each_pass_best(&mut results.bests, space.contexts.len());
    }
    Ok(results)
}

/// One micro-batch size's DP run.
struct SizeRun {
    bests: Vec<PassBest>,
    other_stage_counts: Vec<OtherStageCount>,
    states: usize,
    stages_costed: u64,
}

fn run_size(
    space: &Space,
    b: u32,
    bounds: &[AtomicU64],
    (budget, work_limit): (&MemoryBudget, u64),
    (alone, seeded): (bool, bool),
) -> SizeRun {
    let mut dp = size_dp(space, b, bounds)
        .with_budget(budget)
        .with_work_limit(work_limit);
    if !seeded {
        dp.seed_bounds();
    }
    let found = dp.run();
    let abandoned_floor_ms = dp.abandoned.then(|| dp.floor_ms());
    // Up to 16 GPUs, each rule's best plan of every other stage count is a
    // candidate too: fewer, wider stages can simulate faster than the
    // formula's best (fewer bubbles).
    let other_stage_counts: Vec<OtherStageCount> = if alone {
        space
            .by_looseness
            .iter()
            .enumerate()
            .flat_map(|(class, &pass)| {
                dp.other_stage_counts(class)
                    .into_iter()
                    .map(move |found| OtherStageCount {
                        pass,
                        micro_batch_size: b,
                        found,
                    })
            })
            .collect()
    } else {
        Vec::new()
    };
    let bests = found
        .into_iter()
        .zip(&space.by_looseness)
        .map(|(found, &pass)| PassBest {
            pass,
            micro_batch_size: b,
            found,
            abandoned_floor_ms,
        })
        .collect();
    SizeRun {
        bests,
        other_stage_counts,
        states: dp.states.len(),
        stages_costed: dp.stages_costed,
    }
}

/// Micro-batch size `b`'s DP run, serving every pass and pruning at `bounds`.
fn size_dp<'c, 'a>(space: &'c Space<'a>, b: u32, bounds: &'c [AtomicU64]) -> Dp<'c, 'a> {
    Dp::new(
        space.covering(),
        b,
        space.micro_batches(b),
        Objective::Latency,
        space.rules.clone(),
        Some(bounds),
    )
}

/// Under a shared bound, which sizes survive depends on thread timing;
/// each pass's best does not (the DP is exact, ties broken by fewer
/// stages, then larger micro-batches). Keep only that one.
fn keep_only_each_pass_best(bests: &mut [PassBest], passes: usize) {
    for p in 0..passes {
        let best = bests
            .iter()
            .enumerate()
            .filter(|(_, r)| r.pass == p && r.found.is_some())
            .min_by(|(_, x), (_, y)| {
                let (fx, fy) = (x.found.as_ref().unwrap(), y.found.as_ref().unwrap());
                fx.value
                    .total_cmp(&fy.value)
                    .then(fx.stages.len().cmp(&fy.stages.len()))
                    .then(y.micro_batch_size.cmp(&x.micro_batch_size))
            })
            .map(|(i, _)| i);
        for (i, r) in bests.iter_mut().enumerate() {
            if r.pass == p && Some(i) != best {
                r.found = None;
            }
        }
    }
}

impl PassResults {
    /// These results as `space`'s passes, where every rule of `space` was
    /// one of these passes' (one DP run gives each of its rules' best plans
    /// as a run of that rule alone would: `Dp::rules`), over the same
    /// layers, cluster, shapes and micro-batch sizes. The work is not
    /// counted again. None where a rule is missing.
    pub(crate) fn for_space(&self, space: &Space) -> Option<PassResults> {
        let pass_of: Vec<usize> = space
            .contexts
            .iter()
            .map(|c| self.rules.iter().position(|&r| r == c.policy))
            .collect::<Option<_>>()?;
        let now = |pass: usize| pass_of.iter().position(|&p| p == pass);
        Some(PassResults {
            rules: space.contexts.iter().map(|c| c.policy).collect(),
            bests: (self.bests.iter())
                .filter_map(|r| {
                    Some(PassBest {
                        pass: now(r.pass)?,
                        ..r.clone()
                    })
                })
                .collect(),
            other_stage_counts: (self.other_stage_counts.iter())
                .filter_map(|o| {
                    Some(OtherStageCount {
                        pass: now(o.pass)?,
                        ..o.clone()
                    })
                })
                .collect(),
            states: 0,
            stages_costed: 0,
        })
    }

    /// The smallest formula (2) value over the space: no plan of it
    /// simulates faster. Infinite when no plan fits. A size whose run was
    /// abandoned counts with its floor.
    pub(crate) fn lower_bound_ms(&self, space: &Space) -> f64 {
        self.bests
            .iter()
            .filter(|r| r.pass == space.covering_pass())
            .filter_map(|r| r.abandoned_floor_ms.or(r.found.as_ref().map(|f| f.value)))
            .fold(f64::INFINITY, f64::min)
    }

    /// The micro-batch sizes whose runs passed the work limit, ascending.
    pub(crate) fn abandoned_sizes(&self) -> Vec<u32> {
        let mut sizes: Vec<u32> = self
            .bests
            .iter()
            .filter(|r| r.abandoned_floor_ms.is_some())
            .map(|r| r.micro_batch_size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// Whether the first runs already offered pass `pass`'s best plan at
    /// micro-batch size `b` (a run abandoned at the work limit offered a
    /// plan, perhaps not the best).
    pub(crate) fn offered(&self, pass: usize, b: u32) -> bool {
        self.bests.iter().any(|r| {
            r.pass == pass
                && r.micro_batch_size == b
                && r.found.is_some()
                && r.abandoned_floor_ms.is_none()
        })
    }
}

/// The second pass, where the sizes shared one bound on up to 64 GPUs:
/// only the best formula value's size gave candidates, and another size's
/// best plan may simulate faster. Each size runs again on its own, pruned
/// at `fastest_ms` (a plan whose formula value is above it cannot simulate
/// faster), and each rule's best plan is returned, with the pass's work
/// (states, stages costed). The pass has its own table budget: past it, it
/// returns no plan, and the plans found so far stand.
pub(crate) fn second_pass(
    space: &Space,
    fastest_ms: f64,
    (max_search_bytes, steps): (u64, StepLimit),
) -> (Vec<PassBest>, usize, u64) {
    let budget = MemoryBudget::new(max_search_bytes);
    let each: Vec<SizeRun> = space
        .sizes
        .par_iter()
        .map(|&b| {
            let bounds: Vec<AtomicU64> = space
                .rules
                .iter()
                .map(|_| AtomicU64::new(fastest_ms.to_bits()))
                .collect();
            let mut run = run_size(space, b, &bounds, (&budget, steps.at(b)), (false, false));
            run.bests.retain(|r| r.found.is_some());
            run
        })
        .collect();
    let states = each.iter().map(|run| run.states).sum();
    let stages_costed = each.iter().map(|run| run.stages_costed).sum();
    let bests = if budget.exceeded().is_some() {
        Vec::new()
    } else {
        each.into_iter().flat_map(|run| run.bests).collect()
    };
    (bests, states, stages_costed)
}

/// Where a run stopped at the budget: how far the tables got, and what to do.
pub(crate) fn search_memory_limit(
    budget: &MemoryBudget,
    cluster: &crate::cost::Cluster,
    space: SearchSpace,
) -> Option<Error> {
    let bytes = budget.exceeded()?;
    let advice = if space == SearchSpace::Full {
        "use the machine-aligned space (--search-space machine-aligned), or merge layers in the profile"
    } else {
        "merge layers in the profile"
    };
    Some(Error::limit(format!(
        "the search's tables reached {:.2} GiB on {} GPUs in the {} space, past the limit of {:.2} GiB; \
         {advice}, or raise the limit (--max-search-gib)",
        gib(bytes as f64),
        cluster.num_devices(),
        space.name(),
        gib(budget.limit_bytes as f64),
    )))
}

/// A limit error, before searching, for the full space on more GPUs of
/// multi-GPU machines than `FULL_SPACE_MAX_SHARED_GPUS` with the table
/// limit at most its default (single-GPU machines have no partly used
/// patterns: 64x1 plans in 2 s); None otherwise.
pub(crate) fn full_space_limit_error(
    cluster: &crate::cost::Cluster,
    space: SearchSpace,
    (max_search_bytes, default_bytes): (u64, u64),
) -> Option<Error> {
    let shared: u32 = cluster
        .machines
        .iter()
        .map(|m| m.gpus)
        .filter(|&g| g > 1)
        .sum();
    let over = space.resolve(cluster) == SearchSpace::Full
        && shared > FULL_SPACE_MAX_SHARED_GPUS
        && max_search_bytes <= default_bytes;
    over.then(|| {
        Error::limit(format!(
            "the full search space on {shared} GPUs of multi-GPU machines is past what its tables hold at \
             the default limit of {:.2} GiB (its partly used machine patterns grow combinatorially: it searches \
             up to {FULL_SPACE_MAX_SHARED_GPUS}); use the machine-aligned space (--search-space machine-aligned), \
             or raise the limit (--max-search-gib) to search it anyway",
            gib(default_bytes as f64),
        ))
    })
}

/// An error when no plan can fit, shown before any search. Every GPU's
/// peak holds its share of the model's state and, at its stage's first
/// backward, its share of what one micro-batch keeps of every layer of
/// the stage. However the layers are split, sharded, cut by context,
/// spread or replicated, the shares cover the whole: every weight and
/// gradient is on some GPU, and so is the master weights' and optimizer's
/// state unless some machine has a host to offload it to
/// (`cost/offload.rs`); and each layer keeps, over the GPUs of its stage,
/// at least the least of what its re-computation modes keep
/// ([`least_kept_bytes_per_sample`]) for the smallest micro-batch. So the
/// largest GPU's peak is at least their sum over all the GPUs. None where
/// that fits the largest GPU. `recomputes`: the space re-computes (every
/// space but DAPPLE's plain stages, `StageShapes::plain_only`).
pub(crate) fn memory_floor_error(
    layers: &LayerCosts,
    cluster: &crate::cost::Cluster,
    sizes: &[u32],
    recomputes: bool,
) -> Option<Error> {
    let smallest_size = *sizes.iter().min()?;
    let smallest = f64::from(smallest_size);
    let n = layers.num_layers;
    let per_sample = least_kept_bytes_per_sample(layers, recomputes);
    let offloadable = cluster.has_a_host();
    let state = layers.model_state_bytes(0, n)
        - if offloadable {
            layers.held_optimizer_state_bytes(0, n, 1, 1.0)
        } else {
            0.0
        };
    let gpus = f64::from(cluster.num_devices());
    let (state_floor, activation_floor) = (state / gpus, per_sample * smallest / gpus);
    let largest = gpu_memory_range(cluster).1;
    (state_floor + activation_floor > largest).then(|| {
        let (held, advice) = if offloadable {
            ("weights and gradients", "more GPUs or larger ones")
        } else {
            (
                "weights, gradients and optimizer state",
                "more GPUs or larger ones, or machines with hosts to offload the optimizer to",
            )
        };
        // A smaller micro-batch helps only where one is left to take.
        let advice = if state_floor > largest {
            format!("the state alone needs {advice}")
        } else if smallest_size > 1 {
            "lower the global batch size".to_string()
        } else {
            "more GPUs or larger ones, or a shorter sequence".to_string()
        };
        Error::infeasible(format!(
            "no plan fits in GPU memory: every plan keeps at least {:.2} GiB on some GPU (the model's {held}, \
             {:.2} GiB, and the least its activations keep, {:.2} MiB a sample{}, of a micro-batch of at least \
             {smallest} samples, over {gpus} GPUs), but {}; {advice}",
            gib(state_floor + activation_floor),
            gib(state),
            per_sample / f64::from(1u32 << 20),
            if recomputes { " re-computing" } else { "" },
            gpu_memories(cluster),
        ))
    })
}

/// Per sample, the least the layers keep from a micro-batch's forward to
/// its backward, each at the least of its modes: everything but what the
/// loss keeps (no re-computation), everything but the selective part
/// (selective), or its input alone (per layer: `Recompute::PerLayer`
/// keeps each layer's input and re-runs one layer at a time). A stage
/// takes one mode for all its layers, so its keep is at least the sum of
/// its layers' least.
pub(crate) fn least_kept_bytes_per_sample(layers: &LayerCosts, recomputes: bool) -> f64 {
    (0..layers.num_layers)
        .map(|l| {
            let kept = layers.stored_bytes_per_sample_of_layer(l)
                - layers.loss_stored_bytes_per_sample_of_layer(l);
            if !recomputes {
                return kept;
            }
            let selective = layers.stored_bytes_per_sample_of_layer(l)
                - layers.selective_stored_bytes_per_sample_of_layer(l);
            kept.min(selective).min(layers.cut_bytes_per_sample(l))
        })
        .sum()
}

/// The search for the least memory a plan needs prunes nothing by time
/// (every layout is a candidate), so it may take this many times the
/// search's steps: BERT-48 on A with 128 MiB GPUs needs between 1e7 and 2e7 per size.
const EXPLAIN_STEPS_FACTOR: u64 = 4;

/// Why no plan came out: none fits in memory (the least any needs, with
/// numbers), or the space held none at all (a plan may leave GPUs idle, so
/// one GPU holding every layer is always in it: not expected). Its runs
/// stop at `EXPLAIN_STEPS_FACTOR` times the search's work limit; past it
/// the error says that no plan fits, without the least need.
pub(crate) fn explain_infeasible(space: &Space, budget: &MemoryBudget, work_limit: u64) -> Error {
    let (ctx, gbs) = (space.covering(), space.global_batch_size);
    let mut abandoned = false;
    let least = space
        .sizes
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
            .with_budget(budget)
            .with_work_limit(work_limit.saturating_mul(EXPLAIN_STEPS_FACTOR));
            let found = dp.run().pop().flatten().map(|f| (b, f));
            abandoned |= dp.abandoned;
            found
        })
        .min_by(|a, b| a.1.value.total_cmp(&b.1.value));
    // Past the limit a run stops and finds nothing: say so instead.
    if let Some(e) = search_memory_limit(budget, ctx.cluster, ctx.space) {
        return e;
    }
    // The search itself finished and found nothing that fits: that stands;
    // only the least need (an unpruned search) is past the work limit.
    if abandoned {
        return Error::infeasible(format!(
            "no plan of the search space fits in GPU memory ({} layers on {} GPUs, global batch size \
             {gbs}); the least memory a plan needs was not found: that search stopped at its limit \
             of {} steps per micro-batch size ({EXPLAIN_STEPS_FACTOR} x --max-search-steps)",
            ctx.layers.num_layers,
            ctx.cluster.num_devices(),
            work_limit.saturating_mul(EXPLAIN_STEPS_FACTOR),
        ));
    }
    match least {
        None => Error::incompatible(format!(
            "no plan of the search space fits {} layers on {} GPUs with global batch size {gbs} and slices of \
             at least {} samples per GPU",
            ctx.layers.num_layers,
            ctx.cluster.num_devices(),
            ctx.min_slice,
        )),
        Some((b, f)) => {
            let has = gpu_memories(ctx.cluster);
            // Offloaded stages count where their hosts hold what they offload.
            let hosts = ctx.cluster.machines.iter().filter_map(|m| m.host);
            let offloading = match hosts.map(|h| h.memory_bytes).reduce(f64::min) {
                Some(host) if ctx.shapes.offload => format!(
                    ", offloading the optimizer where a host's {} a GPU holds it",
                    size(host)
                ),
                _ => String::new(),
            };
            Error::infeasible(format!(
                "no plan fits in GPU memory: the plan needing the least memory per GPU still needs {} \
                 (micro-batch size {b}, {} stage(s){offloading}) but {has}",
                size(f.value),
                f.stages.len(),
            ))
        }
    }
}

/// Bytes as GiB, for messages.
fn gib(bytes: f64) -> f64 {
    bytes / f64::from(1u32 << 30)
}

/// Bytes for a message: small memories in bytes, not as 0.00 GiB.
fn size(bytes: f64) -> String {
    if bytes < f64::from(1u32 << 20) {
        format!("{bytes:.0} bytes")
    } else {
        format!("{:.2} GiB", gib(bytes))
    }
}

/// What the cluster's GPUs hold, for a message: "a GPU has ..." or, on
/// GPUs of several memories, their range.
fn gpu_memories(cluster: &crate::cost::Cluster) -> String {
    let (smallest, largest) = gpu_memory_range(cluster);
    if smallest == largest {
        format!("a GPU has {}", size(largest))
    } else {
        format!("the GPUs have {} to {}", size(smallest), size(largest))
    }
}

/// The smallest and the largest memory of the cluster's GPUs (as the
/// search fits plans: after the allocator's reserve).
fn gpu_memory_range(cluster: &crate::cost::Cluster) -> (f64, f64) {
    let memory = cluster.machines.iter().map(|m| m.memory_bytes);
    (
        memory.clone().fold(f64::INFINITY, f64::min),
        memory.fold(0.0, f64::max),
    )
}
