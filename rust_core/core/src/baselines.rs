//! Strategies to compare DAPPLE's plans against, built as ordinary plans so
//! the same estimate and simulator cost them.
//!
//! - data parallelism: one stage on every GPU (with or without AllReduce
//!   overlap is a simulation option);
//! - GPipe: one GPU per stage, layers in blocks of balanced time (the block
//!   partition torchgpipe's balance-by-time uses), all forwards then all
//!   backwards;
//! - straight: the same partition under early-backward scheduling;
//! - PipeDream's planner: its asynchronous objective (the slowest stage,
//!   replication allowed, section 3.1 of the PipeDream paper), then run
//!   synchronously as DAPPLE's section VI-F does;
//! - Whale's data parallelism and pipeline on mixed GPUs;
//! - Megatron-LM's uniform (t, p, d) shape (`baselines/megatron.rs`).
//!
//! Each layout gets the micro-batch size that makes it fastest and fits.

pub mod megatron;
pub mod pipedream;

use rayon::prelude::*;

use crate::baselines::megatron::megatron_plans;
use crate::baselines::pipedream::{pipedream_plan, planning_steps, Level, PipeDreamPlan, States};
use crate::cluster::topology::Topology;
use crate::cost::block_partition::{block_partition, weighted_block_partition};
use crate::cost::overlap::Overlap;
use crate::cost::{micro_batch_sizes, Cluster, StageCoster, WarmupPolicy};
use crate::error::{Error, Result};
use crate::model::profile::{LayerCosts, Profile};
use crate::plan::{warmup_depth, Plan, PlanInputs, ScheduleChoice, Stage};
use crate::schedule::ScheduleKind;
use crate::simulation::costing::ProfileCosts;
use crate::simulation::evaluate::{bound_estimate, evaluate_costed};
use crate::simulation::warmup::plan_with_chosen_warmups_below;

crate::named_enum! {
    /// The strategies `dapple compare` runs beside the search.
    pub enum Baseline("a baseline") {
        /// Every GPU runs the whole model.
        DataParallel = "data-parallel",
        /// Balanced blocks of layers, one GPU per stage, GPipe's schedule.
        GPipe = "gpipe",
        /// Balanced blocks of layers, one GPU per stage, early backward.
        Straight = "straight",
        /// PipeDream's own optimizer (`baselines/pipedream.rs`), run synchronously.
        PipeDream = "pipedream-planner",
        /// Whale's hardware-aware data parallelism: every GPU runs the whole
        /// model on a slice balanced by speed within memory (`cost/balance.rs`).
        WhaleDataParallel = "whale-data-parallel",
        /// Whale's hardware-aware pipeline (section 3.3.2): GPUs ordered by
        /// memory, largest first (earlier stages hold more micro-batches),
        /// as many stages as the largest machine has GPUs, each replicated
        /// over an equal share of the GPUs, layers split so that work over
        /// each stage's total speed is even, slices balanced within stages.
        WhalePipeline = "whale-pipeline",
        /// Megatron-LM's shape (`baselines/megatron.rs`): the best uniform split
        /// degree, pipeline depth and data parallelism, with 1F1B.
        Megatron = "megatron",
    }
}

/// A stage layout before micro-batching: layer ranges and their devices.
pub type Layout = Vec<(usize, usize, Vec<u32>)>;

/// The stages of a baseline on this topology, planned at `min_slice`
/// samples per GPU (the profile's smallest measured batch by default).
pub fn baseline_layout(
    kind: Baseline,
    profile: &Profile,
    topology: &Topology,
    min_slice: u32,
) -> Result<Layout> {
    let layers = LayerCosts::new(profile);
    let cluster = Cluster::for_model(topology, &layers)?;
    layout(kind, profile, &layers, &cluster, min_slice)
}

/// The layout of a baseline on this cluster.
fn layout(
    kind: Baseline,
    profile: &Profile,
    layers: &LayerCosts,
    cluster: &Cluster,
    min_slice: u32,
) -> Result<Layout> {
    let n = layers.num_layers;
    let g = cluster.num_devices();
    Ok(match kind {
        Baseline::DataParallel | Baseline::WhaleDataParallel => vec![(0, n, (0..g).collect())],
        Baseline::GPipe | Baseline::Straight => {
            let t = layers.times_at(min_slice);
            let work: Vec<f64> = (0..n).map(|l| t.fwd(l, l + 1) + t.bwd(l, l + 1)).collect();
            block_partition(&work, g.min(n as u32) as usize)
                .into_iter()
                .enumerate()
                .map(|(i, (s, e))| (s, e, vec![i as u32]))
                .collect()
        }
        Baseline::PipeDream => pipedream_layout(profile, layers, cluster, min_slice)?,
        Baseline::WhalePipeline => whale_pipeline_layout(layers, cluster, min_slice),
        Baseline::Megatron => {
            return Err(Error::invalid(
                "the megatron baseline is a set of shaped plans (megatron::megatron_plans), not one layout",
            ))
        }
    })
}

/// Whale's pipeline (`Baseline::WhalePipeline`) on this cluster.
fn whale_pipeline_layout(layers: &LayerCosts, cluster: &Cluster, min_slice: u32) -> Layout {
    let n = layers.num_layers;
    let mut devices: Vec<u32> = (0..cluster.num_devices()).collect();
    let machine =
        |d: u32| &cluster.machines[cluster.machine_of(d).expect("a device of the cluster")];
    devices.sort_by(|&a, &b| {
        machine(b)
            .memory_bytes
            .total_cmp(&machine(a).memory_bytes)
            .then(a.cmp(&b))
    });
    let largest_machine = cluster.machines.iter().map(|m| m.gpus).max().unwrap_or(1);
    let stages = (largest_machine as usize).clamp(1, n.max(1));
    let replicas = devices.len() / stages;
    let groups: Vec<Vec<u32>> = devices
        .chunks(replicas)
        .take(stages)
        .map(<[u32]>::to_vec)
        .collect();
    // A GPU's capacity is its speed on the whole model.
    let coster = StageCoster::new(layers, cluster, min_slice, 1);
    let speed = |d: u32| {
        let m = cluster.machine_of(d).expect("a device of the cluster");
        coster.speed_on(m, 0, n, min_slice)
    };
    let capacities: Vec<f64> = groups
        .iter()
        .map(|g| g.iter().map(|&d| speed(d)).sum())
        .collect();
    let t = layers.times_at(min_slice);
    let work: Vec<f64> = (0..n).map(|l| t.fwd(l, l + 1) + t.bwd(l, l + 1)).collect();
    weighted_block_partition(&work, &capacities)
        .into_iter()
        .zip(groups)
        .map(|((s, e), g)| (s, e, g))
        .collect()
}

/// Work above which the PipeDream baseline refuses to plan: its dynamic
/// programme is quadratic in the workers of each level (about 2 s here).
const PIPEDREAM_MAX_STEPS: f64 = 2e9;

/// PipeDream's planner's inputs, read from dapple's profile and cluster.
#[derive(Debug, Clone)]
pub struct PipeDreamProblem {
    pub states: States,
    /// A machine's GPUs, then the machines (bottom level first).
    pub levels: Vec<Level>,
    /// The smallest GPU memory (its `-s`).
    pub memory_bytes: f64,
    /// First dapple layer of each state, then the layer count.
    pub first_layer: Vec<usize>,
    /// Which level numbers GPUs inside a machine, and which machines.
    gpu_level: Option<usize>,
    machine_level: Option<usize>,
}

impl PipeDreamProblem {
    /// PipeDream's levels are the GPUs of a machine at the machine's link
    /// speed, then the machines at the network's; states are the layers
    /// PipeDream keeps, in dapple's order, at `batch` samples per GPU.
    pub fn new(profile: &Profile, topology: &Topology, batch: u32) -> Result<PipeDreamProblem> {
        let layers = LayerCosts::new(profile);
        let cluster = Cluster::for_model(topology, &layers)?;
        PipeDreamProblem::on(profile, &layers, &cluster, batch)
    }

    fn on(
        profile: &Profile,
        layers: &LayerCosts,
        cluster: &Cluster,
        batch: u32,
    ) -> Result<PipeDreamProblem> {
        let machines = &cluster.machines;
        let gpus_per_machine = machines[0].gpus;
        if machines.iter().any(|m| m.gpus != gpus_per_machine) {
            return Err(Error::incompatible(
                "pipedream-planner needs machines with equal GPU counts (PipeDream plans a machine, then the machines)",
            ));
        }
        let bytes_per_s = |bytes_per_ms: f64| bytes_per_ms * 1e3;
        let mut levels = Vec::new();
        let gpu_level = (gpus_per_machine > 1).then_some(0);
        if gpu_level.is_some() {
            let intra = machines
                .iter()
                .map(|m| m.intra_bytes_per_ms)
                .fold(f64::INFINITY, f64::min);
            levels.push(Level {
                workers: gpus_per_machine as usize,
                bandwidth_bytes_per_s: bytes_per_s(intra),
            });
        }
        let machine_level = (machines.len() > 1 || levels.is_empty()).then_some(levels.len());
        if machine_level.is_some() {
            levels.push(Level {
                workers: machines.len(),
                bandwidth_bytes_per_s: bytes_per_s(cluster.inter_bytes_per_ms),
            });
        }
        let (states, first_layer) = pipedream_states(profile, layers, cluster, batch);
        Ok(PipeDreamProblem {
            states,
            levels,
            memory_bytes: machines
                .iter()
                .map(|m| m.memory_bytes)
                .fold(f64::INFINITY, f64::min),
            first_layer,
            gpu_level,
            machine_level,
        })
    }

    /// PipeDream's plan as dapple stages: layer ranges, and each stage's
    /// GPU-level replicas on each of its machines, consecutive device ids
    /// as PipeDream numbers them.
    fn layout(&self, plan: &PipeDreamPlan, cluster: &Cluster) -> Layout {
        plan.stages
            .iter()
            .map(|stage| {
                let (gpus, first_gpu) = self.gpu_level.map_or((1, 0), |l| stage.placement[l]);
                let (count, first_machine) =
                    self.machine_level.map_or((1, 0), |l| stage.placement[l]);
                let devices = (first_machine..first_machine + count)
                    .flat_map(|m| {
                        let base = cluster.machines[m].first_device + first_gpu as u32;
                        base..base + gpus as u32
                    })
                    .collect();
                (
                    self.first_layer[stage.first_state],
                    self.first_layer[stage.end_state],
                    devices,
                )
            })
            .collect()
    }
}

/// PipeDream's planner (crate::baselines::pipedream) on dapple's profile and cluster.
fn pipedream_layout(
    profile: &Profile,
    layers: &LayerCosts,
    cluster: &Cluster,
    batch: u32,
) -> Result<Layout> {
    let problem = PipeDreamProblem::on(profile, layers, cluster, batch)?;
    let steps = planning_steps(problem.states.len(), &problem.levels);
    if steps > PIPEDREAM_MAX_STEPS {
        return Err(Error::incompatible(format!(
            "pipedream-planner: {} layers on {} GPUs take about {steps:.1e} planning steps, over the limit of {PIPEDREAM_MAX_STEPS:.0e} (PipeDream's planner is quadratic in the machines)",
            problem.states.len(),
            cluster.num_devices()
        )));
    }
    let plan = pipedream_plan(&problem.states, &problem.levels, problem.memory_bytes)
        .ok_or_else(|| Error::infeasible("pipedream-planner finds no plan for this model"))?;
    Ok(problem.layout(&plan, cluster))
}

/// PipeDream's view of the model at `batch` samples per GPU, and the first
/// dapple layer of each state (plus the layer count at the end).
///
/// As its optimizer does, sources named `Input*` are dropped (their layers
/// join the first stage and cost nothing) and so are sinks named
/// `__getitem__*` (they join the stage before them). A state's output is
/// every kept layer's activation that a later kept layer reads, plus the
/// state's own last layer: PipeDream's augmented antichain.
fn pipedream_states(
    profile: &Profile,
    layers: &LayerCosts,
    cluster: &Cluster,
    batch: u32,
) -> (States, Vec<usize>) {
    let n = profile.layers.len();
    let readers = profile.readers();
    let dropped: Vec<bool> = (0..n)
        .map(|l| {
            let name = &profile.layers[l].name;
            let source = profile.reads(l).is_empty();
            (source && name.starts_with("Input"))
                || (readers[l].is_empty() && name.starts_with("__getitem__"))
        })
        .collect();
    let kept: Vec<usize> = (0..n).filter(|&l| !dropped[l]).collect();
    let times = layers.times_at(batch);
    // PipeDream plans for one GPU type: the slowest, on the whole model.
    let coster = StageCoster::new(layers, cluster, batch, 1);
    let speed = (0..cluster.machines.len())
        .map(|m| coster.speed_on(m, 0, n, batch))
        .fold(f64::INFINITY, f64::min);
    let activation = |l: usize| profile.layers[l].activation_bytes_per_sample() * f64::from(batch);
    let compute_s: Vec<f64> = kept
        .iter()
        .map(|&l| (times.fwd(l, l + 1) + times.bwd(l, l + 1)) / speed / 1e3)
        .collect();
    let activation_bytes: Vec<f64> = kept.iter().map(|&l| activation(l)).collect();
    let parameter_bytes: Vec<f64> = kept
        .iter()
        .map(|&l| profile.layers[l].param_bytes as f64)
        .collect();
    // The last kept reader of each layer, to find what leaves a prefix.
    let last_kept_reader: Vec<Option<usize>> = (0..n)
        .map(|l| readers[l].iter().copied().filter(|&r| !dropped[r]).max())
        .collect();
    let output_activation_bytes: Vec<f64> = kept
        .iter()
        .map(|&last| {
            activation(last)
                + kept
                    .iter()
                    .take_while(|&&l| l < last)
                    .filter(|&&l| last_kept_reader[l].is_some_and(|r| r > last))
                    .map(|&l| activation(l))
                    .sum::<f64>()
        })
        .collect();
    let mut first_layer: Vec<usize> = kept.clone();
    if let Some(first) = first_layer.first_mut() {
        *first = 0;
    }
    first_layer.push(n);
    (
        States::from_per_state(
            &compute_s,
            &activation_bytes,
            &parameter_bytes,
            &output_activation_bytes,
        ),
        first_layer,
    )
}

/// A layout: each stage's layers `start..end` and its devices.
pub type StageLayout = (usize, usize, Vec<u32>);

/// The baseline's layout at every micro-batch size it can take (each
/// device's slice at least `min_slice`), with the K_i of `policy` (one
/// micro-batch under auto, whose depths are chosen later). Not costed.
pub(crate) fn baseline_layouts(
    kind: Baseline,
    costs: &ProfileCosts,
    topology: &Topology,
    global_batch_size: u32,
    min_slice: u32,
    policy: WarmupPolicy,
) -> Result<Vec<Plan>> {
    let profile = costs.profile;
    if kind == Baseline::Megatron {
        return megatron_plans(profile, topology, global_batch_size, min_slice);
    }
    let layers = &costs.layers;
    let cluster = Cluster::for_model(topology, layers)?;
    let stages = layout(kind, profile, layers, &cluster, min_slice)?;
    let inputs = PlanInputs::new(
        profile,
        topology,
        global_batch_size,
        min_slice,
        kind.name(),
        None,
    );
    let mut plans = layout_at_every_size(&inputs, &stages, baseline_schedule(kind), policy);
    if matches!(kind, Baseline::WhaleDataParallel | Baseline::WhalePipeline) {
        for plan in &mut plans {
            balance_slices(plan, layers, &cluster, min_slice);
        }
    }
    Ok(plans)
}

/// Each stage's slices by Whale's Algorithm 1 (`cost/balance.rs`): in proportion
/// to its GPUs' speeds, then shifted within their memories, counting the
/// stage's K_i micro-batches in flight. A stage that cannot be balanced
/// keeps the even split (its estimate then says it does not fit); on GPUs
/// of one kind the balanced split is the even one.
fn balance_slices(plan: &mut Plan, layers: &LayerCosts, cluster: &Cluster, min_slice: u32) {
    let coster = StageCoster::new(layers, cluster, plan.micro_batch_size, plan.micro_batches);
    for stage in &mut plan.stages {
        let machines: Vec<usize> = stage
            .devices
            .iter()
            .map(|&d| cluster.machine_of(d).expect("a layout's own device"))
            .collect();
        stage.slices = coster.balanced_slices(
            stage.layer_start,
            stage.layer_end,
            &machines,
            stage.warmup_micro_batches,
            min_slice,
        );
    }
}

/// The baseline whose plan `dapple compare` runs each asynchronous
/// schedule on: the XPipe paper runs every method on one partition, and
/// compares XPipe with GPipe.
pub const ASYNCHRONOUS_ROWS_ON: Baseline = Baseline::GPipe;

fn baseline_schedule(kind: Baseline) -> ScheduleKind {
    if kind == Baseline::GPipe {
        ScheduleKind::GPipe
    } else {
        ScheduleKind::EarlyBackward1F1B
    }
}

/// `stages` as a plan at every micro-batch size that gives each device at
/// least `inputs.options.min_micro_batch_size` samples, with the K_i of
/// `policy` (one micro-batch under auto). Not costed.
pub(crate) fn layout_at_every_size(
    inputs: &PlanInputs,
    stages: &[StageLayout],
    schedule_kind: ScheduleKind,
    policy: WarmupPolicy,
) -> Vec<Plan> {
    let global_batch_size = inputs.global_batch_size;
    let min_slice = inputs.options.min_micro_batch_size;
    let widest = stages
        .iter()
        .map(|(_, _, d)| d.len() as u32)
        .max()
        .unwrap_or(1);
    let count = stages.len() as u32;
    micro_batch_sizes(global_batch_size, min_slice, widest, stages.len())
        .into_iter()
        .map(|b| {
            let m = global_batch_size / b;
            Plan::new(
                inputs.clone(),
                b,
                m,
                ScheduleChoice::new(schedule_kind, policy),
                stages
                    .iter()
                    .enumerate()
                    .map(|(i, (s, e, d))| Stage {
                        layer_start: *s,
                        layer_end: *e,
                        devices: d.clone(),
                        warmup_micro_batches: warmup_depth(
                            schedule_kind,
                            policy,
                            count - i as u32,
                            m,
                        )
                        .unwrap_or(1),
                        placement: None,
                        slices: None,
                        ..Default::default()
                    })
                    .collect(),
            )
        })
        .collect()
}

/// The baseline's plan at the micro-batch size (and, under warm-up policy
/// auto, the warm-up depths) whose simulated iteration is shortest and fits.
pub fn baseline_plan(
    kind: Baseline,
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
    policy: WarmupPolicy,
) -> Result<Plan> {
    fastest_baseline_plan(
        kind,
        profile,
        topology,
        global_batch_size,
        min_micro_batch_size,
        (policy, Overlap::default()),
    )
}

/// The first of [`baseline_plans`], found in order of formula (2)'s bound
/// (`fastest_in_bound_order`), with the runtime's `overlap`.
pub fn fastest_baseline_plan(
    kind: Baseline,
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
    (policy, overlap): (WarmupPolicy, Overlap),
) -> Result<Plan> {
    let min_slice = profile.min_slice(min_micro_batch_size);
    let policy = baseline_policy(kind, policy);
    let costs = ProfileCosts::new(profile);
    let layouts = baseline_layouts(kind, &costs, topology, global_batch_size, min_slice, policy)?;
    fastest_in_bound_order(
        layouts
            .into_iter()
            .map(|plan| plan.overlapping(overlap))
            .collect(),
        &costs,
        policy,
        kind.name(),
        global_batch_size,
        min_slice,
    )
}

/// The warm-up policy a baseline runs under: Megatron's stages warm up as
/// 1F1B does, whatever the search's policy.
fn baseline_policy(kind: Baseline, policy: WarmupPolicy) -> WarmupPolicy {
    if kind == Baseline::Megatron {
        WarmupPolicy::A
    } else {
        policy
    }
}

/// Every plan of the baseline that fits, each at its warm-up depths,
/// fastest first: [`baseline_plan`] is the first. Megatron's are its
/// every uniform shape (t, p, d, ZeRO-1, re-computation) and micro-batch
/// size, from which `dapple plan --for` takes the fastest a runtime runs.
pub fn baseline_plans(
    kind: Baseline,
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
    (policy, overlap): (WarmupPolicy, Overlap),
) -> Result<Vec<Plan>> {
    let min_slice = profile.min_slice(min_micro_batch_size);
    let policy = baseline_policy(kind, policy);
    let costs = ProfileCosts::new(profile);
    let layouts = baseline_layouts(kind, &costs, topology, global_batch_size, min_slice, policy)?;
    every_that_fits(
        layouts
            .into_iter()
            .map(|plan| plan.overlapping(overlap))
            .collect(),
        &costs,
        policy,
        kind.name(),
        global_batch_size,
        min_slice,
    )
}

/// Any layout (another planner's, a paper's) as the plan it runs fastest
/// as: the micro-batch size (and, under warm-up policy auto, the warm-up
/// depths) whose simulated iteration is shortest and fits, costed the way
/// `dapple compare` costs a baseline. `made_by` is recorded as the plan's
/// `inputs.options.search_space`.
#[allow(clippy::too_many_arguments)]
pub fn layout_plan(
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    stages: &[StageLayout],
    schedule_kind: ScheduleKind,
    policy: WarmupPolicy,
    min_micro_batch_size: Option<u32>,
    made_by: &str,
) -> Result<Plan> {
    let min_slice = profile.min_slice(min_micro_batch_size);
    let inputs = PlanInputs::new(
        profile,
        topology,
        global_batch_size,
        min_slice,
        made_by,
        None,
    );
    let layouts = layout_at_every_size(&inputs, stages, schedule_kind, policy);
    fastest_that_fits(
        layouts,
        &ProfileCosts::new(profile),
        policy,
        made_by,
        global_batch_size,
        min_slice,
    )
}

/// The fastest of `layouts` that fits (`every_that_fits`' first).
pub(crate) fn fastest_that_fits(
    layouts: Vec<Plan>,
    costs: &ProfileCosts,
    policy: WarmupPolicy,
    name: &str,
    global_batch_size: u32,
    min_slice: u32,
) -> Result<Plan> {
    let fitting = every_that_fits(layouts, costs, policy, name, global_batch_size, min_slice)?;
    Ok(fitting
        .into_iter()
        .next()
        .expect("every_that_fits is an error when none fits"))
}

/// Every one of `layouts` that fits, costed (under warm-up policy auto,
/// at the depths that simulate fastest), fastest first (ties in the order
/// given); an infeasible error naming the smallest need where none fits.
pub(crate) fn every_that_fits(
    layouts: Vec<Plan>,
    costs: &ProfileCosts,
    policy: WarmupPolicy,
    name: &str,
    global_batch_size: u32,
    min_slice: u32,
) -> Result<Vec<Plan>> {
    // Each micro-batch size is checked and costed like a hand-written
    // plan, in parallel; the order below is the layouts'.
    let costed: Vec<(Option<Plan>, f64)> = layouts
        .into_par_iter()
        .map(|plan| cost_layout(plan, costs, policy))
        .collect::<Result<_>>()?;
    let mut fitting: Vec<Plan> = Vec::new();
    let mut smallest_need: Option<f64> = None;
    for (costed, need) in costed {
        match costed {
            Some(plan) => fitting.push(plan),
            None => smallest_need = Some(smallest_need.map_or(need, |s: f64| s.min(need))),
        }
    }
    // Stable: of equal times, the first given stays first, as before.
    fitting.sort_by(|a, b| simulated_ms(a).total_cmp(&simulated_ms(b)));
    if !fitting.is_empty() {
        return Ok(fitting);
    }
    Err(none_fits(smallest_need, name, global_batch_size, min_slice))
}

/// A costed plan's simulated iteration (infinite without one).
fn simulated_ms(plan: &Plan) -> f64 {
    plan.iteration_ms().unwrap_or(f64::INFINITY)
}

/// `plan` costed like a hand-written plan (under warm-up policy auto at
/// the depths that simulate fastest), where it fits; with what its own
/// depths need of memory.
fn cost_layout(
    plan: Plan,
    costs: &ProfileCosts,
    policy: WarmupPolicy,
) -> Result<(Option<Plan>, f64)> {
    let estimate = evaluate_costed(&plan, costs)?;
    let need = estimate.peak_memory_bytes;
    let searched = policy == WarmupPolicy::Auto && plan.schedule.kind != ScheduleKind::GPipe;
    let costed = if searched {
        plan_with_chosen_warmups_below(&plan, costs, f64::INFINITY)?.0
    } else {
        Some(Plan {
            estimate: Some(estimate),
            ..plan
        })
    };
    Ok((
        costed.filter(|p| p.estimate.as_ref().is_some_and(|e| e.fits_memory)),
        need,
    ))
}

/// The first of `every_that_fits`, found without simulating every layout:
/// the layouts are costed in order of formula (2)'s bound, which no
/// simulation beats, a batch per thread at a time, until the bound left is
/// above the fastest that fits (issue 67: a global batch of 100,000 gives
/// a straight pipeline micro-batch sizes down to one sample, 100,000
/// micro-batches, none of which could be the fastest). Of equal times the
/// layout given first is taken, as `every_that_fits` takes it.
pub(crate) fn fastest_in_bound_order(
    layouts: Vec<Plan>,
    costs: &ProfileCosts,
    policy: WarmupPolicy,
    name: &str,
    global_batch_size: u32,
    min_slice: u32,
) -> Result<Plan> {
    let mut bounded: Vec<(f64, usize, Plan)> = layouts
        .into_par_iter()
        .enumerate()
        .map(|(i, plan)| Ok((bound_estimate(&plan, costs)?.latency_ms, i, plan)))
        .collect::<Result<_>>()?;
    bounded.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let width = crate::simulation::costing::SIMULATED_AT_ONCE;
    let mut best: Option<(f64, usize, Plan)> = None;
    let mut smallest_need: Option<f64> = None;
    let mut left = bounded.into_iter().peekable();
    // A bound within rounding of the fastest may still tie it, and ties
    // go to the layout given first: those are costed too.
    let open = |bound: f64, best: &Option<(f64, usize, Plan)>| {
        best.as_ref().is_none_or(|b| bound <= b.0 * (1.0 + 1e-9))
    };
    while left.peek().is_some_and(|(bound, _, _)| open(*bound, &best)) {
        let batch: Vec<(f64, usize, Plan)> =
            std::iter::from_fn(|| left.next_if(|(bound, _, _)| open(*bound, &best)))
                .take(width)
                .collect();
        let done: Vec<(usize, (Option<Plan>, f64))> = batch
            .into_par_iter()
            .map(|(_, i, plan)| Ok((i, cost_layout(plan, costs, policy)?)))
            .collect::<Result<_>>()?;
        for (i, (costed, need)) in done {
            match costed {
                Some(plan) => {
                    let ms = simulated_ms(&plan);
                    if best.as_ref().is_none_or(|b| (ms, i) < (b.0, b.1)) {
                        best = Some((ms, i, plan));
                    }
                }
                None => smallest_need = Some(smallest_need.map_or(need, |s: f64| s.min(need))),
            }
        }
    }
    match best {
        Some((_, _, plan)) => Ok(plan),
        None => Err(none_fits(smallest_need, name, global_batch_size, min_slice)),
    }
}

/// The error where no layout fits: the smallest need named, or that no
/// micro-batch size gives every GPU `min_slice` samples.
fn none_fits(
    smallest_need: Option<f64>,
    name: &str,
    global_batch_size: u32,
    min_slice: u32,
) -> Error {
    match smallest_need {
        Some(need) => Error::infeasible(format!(
            "{name} does not fit in GPU memory at any micro-batch size: it needs at least {:.2} GiB per GPU",
            need / (1u64 << 30) as f64
        )),
        None => Error::incompatible(format!(
            "{name}: no micro-batch size of global batch {global_batch_size} gives every GPU at least {min_slice} samples"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::profile::chain_profile;

    #[test]
    fn a_baseline_found_in_bound_order_is_the_fastest_of_every_layout_that_fits() {
        // `baseline_plan` stops where formula (2)'s bound passes the
        // fastest simulated; it is `baseline_plans`' first, which simulates
        // every micro-batch size, on random chains and clusters.
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(67);
        let kinds = [
            Baseline::DataParallel,
            Baseline::GPipe,
            Baseline::Straight,
            Baseline::WhalePipeline,
        ];
        let specs = ["1x4-nvlink-10gbps", "2x4-pcie-25gbps", "4x2-nvlink-1gbps"];
        let mut compared = 0;
        for case in 0..40 {
            let layers: Vec<(f64, f64)> = (0..rng.gen_range(4..=12))
                .map(|_| (rng.gen_range(0.1..5.0), rng.gen_range(0.1..10.0)))
                .collect();
            let p = chain_profile(&layers, 1);
            let t = Topology::from_spec(specs[case % specs.len()]).unwrap();
            let gbs = [64, 256, 1000][case % 3];
            for kind in kinds {
                for policy in [WarmupPolicy::Auto, WarmupPolicy::A] {
                    let every =
                        baseline_plans(kind, &p, &t, gbs, None, (policy, Overlap::default()));
                    let first = baseline_plan(kind, &p, &t, gbs, None, policy);
                    match (every, first) {
                        (Ok(every), Ok(first)) => {
                            let at = |p: &Plan| (p.micro_batch_size, p.iteration_ms());
                            assert!(
                                first == every[0],
                                "case {case} {kind:?} {policy:?}: {:?} against {:?}, bound {:?}",
                                at(&first),
                                every.iter().map(at).collect::<Vec<_>>(),
                                every
                                    .iter()
                                    .map(|p| p.estimate.as_ref().unwrap().latency_ms)
                                    .collect::<Vec<_>>()
                            );
                            compared += 1;
                        }
                        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
                        (a, b) => panic!(
                            "case {case} {kind:?}: {:?} against {:?}",
                            a.map(|p| p.len()),
                            b.map(|p| p.shape())
                        ),
                    }
                }
            }
        }
        assert!(compared >= 200, "{compared}");
    }

    #[test]
    fn baselines_are_valid_plans_of_their_kind() {
        let p = chain_profile(&[(1.0, 2.0); 8], 1);
        let t = Topology::from_spec("2x2-nvlink-10gbps").unwrap();
        let dp = baseline_plan(Baseline::DataParallel, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(dp.shape(), "4");
        let gp = baseline_plan(Baseline::GPipe, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(gp.shape(), "1:1:1:1");
        assert_eq!(gp.schedule.kind, crate::schedule::ScheduleKind::GPipe);
        assert!(gp
            .stages
            .iter()
            .all(|s| s.warmup_micro_batches == gp.micro_batches));
        let st = baseline_plan(Baseline::Straight, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(
            st.stages
                .iter()
                .map(|s| s.layer_end - s.layer_start)
                .collect::<Vec<_>>(),
            vec![2, 2, 2, 2]
        );
        let pd = baseline_plan(Baseline::PipeDream, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert_eq!(pd.stages.iter().map(|s| s.devices.len()).sum::<usize>(), 4);
    }

    #[test]
    fn every_plan_that_fits_comes_fastest_first_and_the_baseline_is_the_first() {
        let config = crate::model::transformer::TransformerConfig::named("llama-2-7b").unwrap();
        let options = crate::model::transformer::TransformerOptions {
            gpu: "a100".into(),
            seq_len: 1024,
            micro_batch_sizes: vec![1, 2],
            efficiency: Some(0.5),
            attention: None,
            expert_imbalance: 1.0,
            dispatcher: crate::model::experts::TokenDispatcher::AllToAll,
            gradients: crate::model::transformer::GradientPrecision::Bf16,
            host_us_per_kernel: crate::model::transformer::HOST_US_PER_KERNEL,
        };
        let p = crate::model::transformer::transformer_profile("llama-2-7b", &config, &options)
            .unwrap();
        let t = Topology::from_spec("2x8-a100-80gb").unwrap();
        let all = baseline_plans(
            Baseline::Megatron,
            &p,
            &t,
            64,
            None,
            (WarmupPolicy::Auto, Overlap::default()),
        )
        .unwrap();
        assert!(all.len() > 10, "{}", all.len());
        let ms: Vec<f64> = all
            .iter()
            .map(|plan| plan.iteration_ms().unwrap())
            .collect();
        assert!(ms.windows(2).all(|w| w[0] <= w[1]));
        assert!(all
            .iter()
            .all(|plan| plan.estimate.as_ref().unwrap().fits_memory));
        let best = baseline_plan(Baseline::Megatron, &p, &t, 64, None, WarmupPolicy::Auto).unwrap();
        assert_eq!(best.stages, all[0].stages);
        assert_eq!(best.iteration_ms(), all[0].iteration_ms());
        // Shapes differ among them: with and without re-computation.
        assert!(all
            .iter()
            .any(|plan| plan.stages[0].shape.recompute.is_none()));
    }

    #[test]
    fn pipedream_replicates_a_heavy_stage() {
        // One layer much heavier than the rest, tiny weights: PipeDream gives it
        // more GPUs so that no stage is slower than the others.
        let mut p = chain_profile(&[(6.0, 12.0), (1.0, 2.0), (1.0, 2.0)], 1);
        for l in &mut p.layers {
            l.param_bytes = 10;
        }
        let t = Topology::from_spec("1x4-nvlink").unwrap();
        let pd = baseline_plan(Baseline::PipeDream, &p, &t, 8, None, WarmupPolicy::A).unwrap();
        assert!(pd.stages[0].devices.len() >= 2, "{}", pd.shape());
    }
}
