//! Plan files and their evaluation.
//!
//! A plan says which layers run on which GPUs, with what micro-batching and
//! schedule, plus the estimate that chose it. `evaluate` costs any plan,
//! including one written by hand or by another planner, with the same model
//! the search uses, so plans can be compared on equal terms.

use serde::{Deserialize, Serialize};

use crate::cost::{
    alloc_size, pipeline_latency, smallest_slice, Alloc, Cluster, PipeStage, StageCost,
    StageCoster, WarmupPolicy,
};
use crate::error::{Error, Result};
use crate::format::{check_envelope, FileFormat, FileObject, PLAN, TOPOLOGY};
use crate::placement::Policy;
use crate::profile::{LayerCosts, Profile, BLOCK_KIND};
use crate::schedule::{Schedule, ScheduleKind};
use crate::topology::Topology;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub format: String,
    pub schema_version: u32,
    pub planner_version: String,
    pub inputs: PlanInputs,
    pub micro_batch_size: u32,
    pub micro_batches: u32,
    pub schedule: ScheduleChoice,
    pub stages: Vec<Stage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<Estimate>,
    /// How the planner chose this plan among its candidates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<Selection>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selection {
    /// How the candidates were ranked.
    pub chosen_by: ChosenBy,
    /// Candidates compared.
    pub candidates: u32,
    /// Simulated iteration of the chosen plan, when simulated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub simulated_ms: Option<f64>,
    /// Rank of the chosen plan by analytic estimate (0 = fastest estimate).
    pub estimate_rank: u32,
    /// Smallest formula (2) value over the whole search space: no plan of
    /// the space simulates faster, so `simulated_ms` is within
    /// simulated_ms / lower_bound_ms - 1 of the space's optimum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_bound_ms: Option<f64>,
    /// Where the chosen layout came from: "search", or the baseline
    /// strategy whose layout simulated fastest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// True when every plan of the space whose bound is below `simulated_ms`
    /// was simulated, so none is faster; false when the walk stopped at its
    /// budget and the plan is the fastest found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimal: Option<bool>,
}

crate::named_enum! {
    /// What kind of parallelism a plan's layout is.
    pub enum LayoutKind("a layout kind") {
        /// One stage on every GPU.
        DataParallel = "data parallel",
        /// One GPU per stage.
        Straight = "straight",
        /// Several stages, some replicated.
        Hybrid = "hybrid",
    }
}

crate::named_enum! {
    /// How a planner ranked its candidates.
    pub enum ChosenBy("a ranking") {
        /// Smallest formula (2) value (plans of version 1).
        Estimate = "estimate",
        /// Shortest simulated iteration.
        Simulation = "simulation",
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanInputs {
    pub model: String,
    pub profile_sha256: String,
    /// Path the profile was read from, if it came from a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile_path: Option<String>,
    pub topology: Topology,
    pub global_batch_size: u32,
    pub options: PlanOptions,
}

impl PlanInputs {
    /// What a plan made from `profile` on `topology` records of its inputs.
    /// `made_by`: the search space ("full", "machine-aligned") or the
    /// baseline strategy that produced the plan.
    pub fn new(
        profile: &Profile,
        topology: &Topology,
        global_batch_size: u32,
        min_micro_batch_size: u32,
        made_by: &str,
        profile_path: Option<String>,
    ) -> PlanInputs {
        PlanInputs {
            model: profile.model.clone(),
            profile_sha256: profile.sha256(),
            profile_path,
            topology: topology.clone(),
            global_batch_size,
            options: PlanOptions {
                min_micro_batch_size,
                search_space: Some(made_by.into()),
            },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanOptions {
    /// Smallest per-device slice of a micro-batch the plan may use; by
    /// default the profile's smallest measured batch size.
    pub min_micro_batch_size: u32,
    /// Search space the planner used ("full" or "machine-aligned"), or the
    /// baseline strategy that made the plan ("data-parallel", "gpipe", ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub search_space: Option<String>,
}

/// Which schedule a plan runs: its kind and the rule its warm-up depths
/// follow (the action lists themselves are `schedule::Schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleChoice {
    /// "early-backward-1f1b" (DAPPLE) or "gpipe" (all forwards, then all
    /// backwards; every micro-batch is in flight at once).
    pub kind: ScheduleKind,
    /// "auto": K_i chosen per stage; "A": K_i = min(S - i, M); "B":
    /// K_i = min(2(S - i) - 1, M).
    pub warmup_policy: WarmupPolicy,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// Layers `layer_start .. layer_end` (end exclusive) of the profile.
    pub layer_start: usize,
    pub layer_end: usize,
    /// Global GPU ids (machine-major: machine m's GPUs come after machine m-1's).
    pub devices: Vec<u32>,
    /// Micro-batches this stage runs forward before its first backward (K_i).
    pub warmup_micro_batches: u32,
    /// Placement policy that put the stage on its devices, when the planner did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Policy>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Estimate {
    /// Simulated time of one iteration (`simulate.rs`): the plan's headline,
    /// and what the planner minimises. Absent only in version 1 plans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iteration_ms: Option<f64>,
    /// Pipeline latency L = Tw + Ts + Te of one iteration (formula 2): a
    /// lower bound of `iteration_ms` with the same costs, kept as its breakdown.
    pub latency_ms: f64,
    pub warmup_ms: f64,
    pub steady_ms: f64,
    pub ending_ms: f64,
    /// Pivot stage Q that makes formula (2) largest.
    pub pivot: PipelinePosition,
    /// Pivot of the paper's Algorithm 1, and formula (1) as printed with it.
    pub paper_pivot: PipelinePosition,
    pub paper_latency_ms: f64,
    /// All micro-batches one after another on one GPU of the profiled type.
    pub single_device_ms: f64,
    /// single_device_ms over the iteration time (simulated where known).
    pub speedup: f64,
    pub samples_per_second: f64,
    pub peak_memory_bytes: f64,
    pub fits_memory: bool,
    pub stages: Vec<StageEstimate>,
    /// Transfer between stage i and i+1.
    pub transfers: Vec<TransferEstimate>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelinePosition {
    pub kind: PositionKind,
    pub index: usize,
}

crate::named_enum! {
    /// What sits at a position of the pipeline.
    pub enum PositionKind("a pipeline position") {
        Stage = "stage",
        /// Transfer i sits between stages i and i+1.
        Transfer = "transfer",
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageEstimate {
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    pub allreduce_ms: f64,
    /// AllReduce time not hidden behind backward (equals allreduce_ms except
    /// for data parallelism, which overlaps it).
    pub exposed_allreduce_ms: f64,
    pub memory_bytes: f64,
    pub memory_limit_bytes: f64,
    /// Samples per device slice (largest slice when uneven).
    pub slice_size: u32,
    /// Simulated time the stage's GPUs do no forward or backward work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_ms: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferEstimate {
    pub bytes: f64,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
}

impl FileObject for Plan {
    const FORMAT: FileFormat = PLAN;

    /// The embedded topology is a topology file of its own: same checks.
    /// Whether the stages fit the topology and a profile is checked where
    /// the plan is used (`check_layout`, `evaluate`).
    fn check(&self) -> Result<()> {
        let topology = &self.inputs.topology;
        if let serde_json::Value::Object(obj) =
            serde_json::to_value(topology).expect("plain data always serializes")
        {
            check_envelope(&obj, TOPOLOGY).map_err(|e| e.under("inputs.topology"))?;
        }
        topology.validate().map_err(|e| e.under("inputs.topology"))
    }
}

impl Plan {
    /// A plan of this dapple version, not yet costed or selected.
    pub fn new(
        inputs: PlanInputs,
        micro_batch_size: u32,
        micro_batches: u32,
        schedule: ScheduleChoice,
        stages: Vec<Stage>,
    ) -> Plan {
        Plan {
            format: PLAN.name.into(),
            schema_version: PLAN.version,
            planner_version: crate::PLANNER_VERSION.into(),
            inputs,
            micro_batch_size,
            micro_batches,
            schedule,
            stages,
            estimate: None,
            selection: None,
        }
    }

    /// The simulated iteration, the plan's headline; version 1 plans, which
    /// were not simulated, give their formula value. None without an estimate.
    pub fn iteration_ms(&self) -> Option<f64> {
        self.estimate
            .as_ref()
            .map(|e| e.iteration_ms.unwrap_or(e.latency_ms))
    }

    pub fn layout_kind(&self) -> LayoutKind {
        if self.stages.len() == 1 {
            LayoutKind::DataParallel
        } else if self.stages.iter().all(|s| s.devices.len() == 1) {
            LayoutKind::Straight
        } else {
            LayoutKind::Hybrid
        }
    }

    /// "8:8"-style shape: replication of each stage.
    pub fn shape(&self) -> String {
        self.stages
            .iter()
            .map(|s| s.devices.len().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }
}

/// Micro-batches stage i runs forward before its first backward (K_i):
/// the warm-up policy's for early backward, all of them for GPipe; None
/// where the depth is the plan's own choice (policy auto).
pub fn warmup_depth(
    kind: ScheduleKind,
    policy: WarmupPolicy,
    stages_from_here: u32,
    micro_batches: u32,
) -> Option<u32> {
    match kind {
        ScheduleKind::EarlyBackward1F1B => policy.warmup(stages_from_here, micro_batches),
        ScheduleKind::GPipe => Some(micro_batches),
    }
}

/// Number of the profile's "block" layers (the model's own repeated layers)
/// in each stage, e.g. [23, 25] for BERT-48 split 23:25.
pub fn blocks_per_stage(profile: &Profile, plan: &Plan) -> Vec<usize> {
    plan.stages
        .iter()
        .map(|s| {
            profile.layers[s.layer_start.min(s.layer_end)..s.layer_end.min(profile.layers.len())]
                .iter()
                .filter(|l| l.kind.as_deref() == Some(BLOCK_KIND))
                .count()
        })
        .collect()
}

/// Check that `plan` can run `profile` on its topology and cost it.
pub fn evaluate(plan: &Plan, profile: &Profile) -> Result<Estimate> {
    with_coster(plan, profile, |coster, allocs, _| {
        estimate_stages(coster, plan, allocs)
    })
}

/// Check `plan` against `profile`, then run `f` with the stage coster of the
/// plan's topology and micro-batching, each stage's GPUs per machine and the
/// warm-up policy: the setup that estimating and simulating share.
pub(crate) fn with_coster<R>(
    plan: &Plan,
    profile: &Profile,
    f: impl FnOnce(&StageCoster, &[Alloc], WarmupPolicy) -> R,
) -> Result<R> {
    let (allocs, policy) = check(plan, profile)?;
    let layers = LayerCosts::new(profile);
    let cluster = Cluster::new(&plan.inputs.topology);
    let coster = StageCoster::new(&layers, &cluster, plan.micro_batch_size, plan.micro_batches);
    Ok(f(&coster, &allocs, policy))
}

/// Cost of every stage of a checked plan, and of every transfer between
/// consecutive stages (`transfers_ms[i]`: between stages i and i+1, each
/// way). `overlap`: hide a single stage's AllReduce behind its backward.
pub(crate) fn stage_costs(
    coster: &StageCoster,
    plan: &Plan,
    allocs: &[Alloc],
    overlap: bool,
) -> (Vec<StageCost>, Vec<f64>) {
    let mut stages = Vec::with_capacity(plan.stages.len());
    let mut transfers_ms = Vec::with_capacity(plan.stages.len().saturating_sub(1));
    for (i, (s, alloc)) in plan.stages.iter().zip(allocs).enumerate() {
        if i > 0 {
            transfers_ms.push(coster.transfer(s.layer_start, &allocs[i - 1], alloc));
        }
        stages.push(coster.stage(
            s.layer_start,
            s.layer_end,
            alloc,
            s.warmup_micro_batches,
            overlap,
        ));
    }
    (stages, transfers_ms)
}

/// Check that `plan` can run `profile` on its topology; returns each
/// stage's GPUs per machine and the warm-up policy.
pub(crate) fn check(plan: &Plan, profile: &Profile) -> Result<(Vec<Alloc>, WarmupPolicy)> {
    let allocs = check_layout(plan, Some(profile))?;
    Ok((allocs, plan.schedule.warmup_policy))
}

/// Check that `plan`'s stages can run on its topology: batch sizes that
/// agree, stages that follow each other from layer 0, devices that exist
/// and are used once, slices of at least the minimum, and warm-up depths
/// its schedule can run. With `profile`, also that the plan was made from
/// it and covers its layers; without, the layer count is the runtime's to
/// check against the model. Returns each stage's GPUs per machine.
pub fn check_layout(plan: &Plan, profile: Option<&Profile>) -> Result<Vec<Alloc>> {
    let topology = &plan.inputs.topology;
    let n = profile.map(|p| p.layers.len());
    let num_devices = topology.num_devices();
    if plan.stages.is_empty() {
        return Err(Error::field("stages", "a plan needs at least one stage"));
    }
    if plan.micro_batch_size == 0 {
        return Err(Error::field("micro_batch_size", "value 0 must be >= 1"));
    }
    if plan.micro_batches == 0 {
        return Err(Error::field("micro_batches", "value 0 must be >= 1"));
    }
    let gbs = plan.inputs.global_batch_size;
    if plan.micro_batch_size.checked_mul(plan.micro_batches) != Some(gbs) {
        return Err(Error::field(
            "micro_batches",
            format!(
                "micro_batch_size {} x micro_batches {} is not the global batch size {gbs}",
                plan.micro_batch_size, plan.micro_batches
            ),
        ));
    }
    let ScheduleChoice {
        kind,
        warmup_policy: policy,
    } = plan.schedule;
    let expected_hash = &plan.inputs.profile_sha256;
    if let Some(profile) = profile {
        if !expected_hash.is_empty() && *expected_hash != profile.sha256() {
            let mut e = Error::incompatible(format!(
                "the plan was made from another profile (sha256 {}..., this one is {}...)",
                &expected_hash[..expected_hash.len().min(12)],
                &profile.sha256()[..12]
            ));
            e.field = Some("inputs.profile_sha256".into());
            return Err(e);
        }
    }
    let mut expected_start = 0;
    // The stage that uses each device so far.
    let mut used_by: Vec<Option<usize>> = vec![None; num_devices as usize];
    let cluster = Cluster::new(topology);
    let mut allocs: Vec<Alloc> = Vec::with_capacity(plan.stages.len());
    for (i, s) in plan.stages.iter().enumerate() {
        let at = |f: &str| format!("stages[{i}].{f}");
        if s.layer_start != expected_start {
            return Err(Error::field(
                at("layer_start"),
                format!(
                    "value {} leaves a gap or overlap: the previous stage ends at {expected_start}",
                    s.layer_start
                ),
            ));
        }
        if s.layer_end <= s.layer_start || n.is_some_and(|n| s.layer_end > n) {
            let range = match n {
                Some(n) => format!(
                    "in {}..={n} (the profile has {n} layers)",
                    s.layer_start + 1
                ),
                None => format!("above layer_start {}", s.layer_start),
            };
            return Err(Error::field(
                at("layer_end"),
                format!("value {} must be {range}", s.layer_end),
            ));
        }
        expected_start = s.layer_end;
        if s.devices.is_empty() {
            return Err(Error::field(
                at("devices"),
                "a stage needs at least one device",
            ));
        }
        let alloc = cluster
            .alloc_of(&s.devices)
            .map_err(|e| e.under(&at("devices")))?;
        for &d in &s.devices {
            if let Some(other) = used_by[d as usize].replace(i) {
                let why = if other == i {
                    format!("device {d} is listed twice")
                } else {
                    format!("device {d} is used by two stages (also stages[{other}])")
                };
                return Err(Error::field(at("devices"), why));
            }
        }
        let replicas = alloc_size(&alloc);
        let min_slice = plan.inputs.options.min_micro_batch_size;
        if smallest_slice(plan.micro_batch_size, replicas) < min_slice.max(1) {
            return Err(Error::field(
                at("devices"),
                format!(
                    "{replicas} replicas split micro-batch {} into slices of {} samples, below the minimum {} \
                     (the profile's smallest measured batch size unless --min-micro-batch-size says otherwise)",
                    plan.micro_batch_size,
                    smallest_slice(plan.micro_batch_size, replicas),
                    min_slice.max(1)
                ),
            ));
        }
        let stages_from_here = (plan.stages.len() - i) as u32;
        let k = s.warmup_micro_batches;
        let m = plan.micro_batches;
        match warmup_depth(kind, policy, stages_from_here, m) {
            Some(expected) if k != expected => {
                let why = match kind {
                    ScheduleKind::GPipe => "GPipe runs all micro-batches forward first".to_string(),
                    ScheduleKind::EarlyBackward1F1B => {
                        format!("warm-up policy {} gives this stage", policy.name())
                    }
                };
                return Err(Error::field(
                    at("warmup_micro_batches"),
                    format!("value {k} differs from K_i = {expected} that {why}; fix one of them"),
                ));
            }
            Some(_) => {}
            None if !(1..=m).contains(&k) => {
                return Err(Error::field(
                    at("warmup_micro_batches"),
                    format!("value {k} must be in 1..={m} (the plan's micro-batches)"),
                ));
            }
            None => {
                // A stage that waits for more forwards than the stage before
                // it sends ahead of its own first backward deadlocks.
                if let Some(prev) = plan.stages[..i].last().map(|p| p.warmup_micro_batches) {
                    if k > prev {
                        return Err(Error::field(
                            at("warmup_micro_batches"),
                            format!(
                                "value {k} is deeper than stage {}'s {prev}: early backward deadlocks \
                                 unless K_i never grows along the pipeline",
                                i - 1
                            ),
                        ));
                    }
                }
            }
        }
        allocs.push(alloc);
    }
    match n {
        Some(n) if expected_start != n => Err(Error::field(
            format!("stages[{}].layer_end", plan.stages.len() - 1),
            format!("value {expected_start}: the stages must cover all {n} layers of the profile"),
        )),
        _ => Ok(allocs),
    }
}

/// Cost a plan whose stages have already been checked: formula (2) and
/// its terms, and the simulated iteration of the plan's own schedule.
pub(crate) fn estimate_stages(coster: &StageCoster, plan: &Plan, allocs: &[Alloc]) -> Estimate {
    let (costs, transfers_ms) = stage_costs(coster, plan, allocs, plan.stages.len() == 1);
    let mut pipe: Vec<PipeStage> = Vec::new();
    let mut stages = Vec::new();
    let mut transfers = Vec::new();
    for (i, (s, c)) in plan.stages.iter().zip(&costs).enumerate() {
        if i > 0 {
            let t = transfers_ms[i - 1];
            let bytes = coster.layers.cut_bytes_per_sample(s.layer_start)
                * f64::from(plan.micro_batch_size);
            transfers.push(TransferEstimate {
                bytes,
                fwd_ms: t,
                bwd_ms: t,
            });
            pipe.push(PipeStage::transfer(t));
        }
        pipe.push(c.as_pipe_stage());
        stages.push(StageEstimate {
            fwd_ms: c.fwd_ms,
            bwd_ms: c.bwd_ms,
            allreduce_ms: c.allreduce_ms,
            exposed_allreduce_ms: c.exposed_allreduce_ms,
            memory_bytes: c.memory_bytes,
            memory_limit_bytes: c.memory_limit_bytes,
            slice_size: c.slice,
            bubble_ms: None,
        });
    }
    let lat = pipeline_latency(&pipe, plan.micro_batches);
    let sim_stages = crate::simulate::sim_stages(coster.layers, plan, &costs);
    // A checked plan's own schedule always builds and runs.
    let simulation = plan_schedule(plan, None).and_then(|schedule| {
        crate::simulate::simulate_stages(&sim_stages, &transfers_ms, &schedule, false)
    });
    let iteration_ms = match &simulation {
        Ok(sim) => {
            for (st, timeline) in stages.iter_mut().zip(&sim.stages) {
                st.bubble_ms = Some(sim.iteration_ms - timeline.compute_ms);
            }
            Some(sim.iteration_ms)
        }
        Err(e) => unreachable!("a checked plan simulates: {e}"),
    };
    let headline = iteration_ms.unwrap_or(lat.latency_ms);
    let single = coster.single_device_ms();
    let peak = stages.iter().map(|s| s.memory_bytes).fold(0.0, f64::max);
    let fits = stages
        .iter()
        .all(|s| s.memory_bytes <= s.memory_limit_bytes);
    Estimate {
        iteration_ms,
        latency_ms: lat.latency_ms,
        warmup_ms: lat.warmup_ms,
        steady_ms: lat.steady_ms,
        ending_ms: lat.ending_ms,
        pivot: position(lat.pivot),
        paper_pivot: position(lat.paper_pivot),
        paper_latency_ms: lat.paper_latency_ms,
        single_device_ms: single,
        speedup: single / headline,
        samples_per_second: f64::from(plan.inputs.global_batch_size) / headline * 1e3,
        peak_memory_bytes: peak,
        fits_memory: fits,
        stages,
        transfers,
    }
}

/// The action lists a checked plan runs: its own schedule kind and K_i, or
/// `kind` instead. Early backward over a GPipe plan takes the K_i of the
/// plan's fixed policy (policy A when it has none).
pub fn plan_schedule(plan: &Plan, kind: Option<ScheduleKind>) -> Result<Schedule> {
    let own = plan.schedule.kind;
    let s_count = plan.stages.len();
    match kind.unwrap_or(own) {
        ScheduleKind::GPipe => Schedule::gpipe(s_count, plan.micro_batches),
        ScheduleKind::EarlyBackward1F1B if own == ScheduleKind::EarlyBackward1F1B => {
            let warmup: Vec<u32> = plan.stages.iter().map(|s| s.warmup_micro_batches).collect();
            Schedule::early_backward(s_count, plan.micro_batches, &warmup)
        }
        ScheduleKind::EarlyBackward1F1B => {
            let policy = match plan.schedule.warmup_policy {
                WarmupPolicy::Auto => WarmupPolicy::A,
                fixed => fixed,
            };
            Schedule::early_backward_with_policy(s_count, plan.micro_batches, policy)
        }
    }
}

/// Pipe-stage index (computation and communication interleaved) to a
/// position users can read.
fn position(pipe_index: usize) -> PipelinePosition {
    PipelinePosition {
        kind: if pipe_index.is_multiple_of(2) {
            PositionKind::Stage
        } else {
            PositionKind::Transfer
        },
        index: pipe_index / 2,
    }
}
