//! Plan files: which layers run on which GPUs, with what micro-batching and
//! schedule, plus the estimate that chose it, and what a plan implies
//! without costing (its shape, its action lists) and whether it can run
//! (`check.rs`). Costing a plan is `simulation/evaluate.rs`'s.

use serde::{Deserialize, Serialize};

mod check;
pub mod hints;
pub mod layout;
pub(crate) use check::check_layout_hashed;
pub use check::{check, check_layout};

use crate::cluster::placement::Policy;
use crate::cluster::topology::Topology;
use crate::cost::overlap::Overlap;
use crate::cost::shape::StageShape;
use crate::cost::{StageCost, WarmupPolicy};
use crate::error::{Error, Result};
use crate::formats::format::{check_envelope, FileFormat, FileObject, PLAN, TOPOLOGY};
use crate::model::profile::{LayerCosts, Profile, BLOCK_KIND};
use crate::plan::hints::Hints;
use crate::schedule::pipeline_order::PipelineOrder;
use crate::schedule::{steady_state_mini_batches, Schedule, ScheduleKind};

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
    /// the space simulates faster, so the space's plan (`refined_from_ms`
    /// where refinement moved it, else `simulated_ms`) is within its time
    /// / lower_bound_ms - 1 of the space's optimum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_bound_ms: Option<f64>,
    /// False when no plan of the search space fits the GPUs' memory: the
    /// chosen plan is a candidate from beside the space (a uniform layout
    /// it does not hold) and the space has no bound to record; true when
    /// one fits. Absent in plans written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub space_fits: Option<bool>,
    /// Where the chosen layout came from: "search", or the baseline
    /// strategy whose layout simulated fastest (where refinement then
    /// moved it, the layout it started from).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// True when every plan of the space whose bound is below the space's
    /// plan's time (`refined_from_ms`, else `simulated_ms`) was simulated, so
    /// none is faster; false when the walk stopped at its budget and the
    /// space's plan is the fastest found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimal: Option<bool>,
    /// Simulated iteration of the chosen layout before refinement (local
    /// moves, and its layout placed anew; `search/refine.rs`) made it faster;
    /// absent when nothing did. A refined
    /// plan may lie outside the search space, and may be faster than its
    /// optimum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refined_from_ms: Option<f64>,
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
                hints: Hints::default(),
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
    /// The user's constraints the search kept to (`plan::hints`); empty
    /// (absent in the file): none.
    #[serde(default, skip_serializing_if = "Hints::is_empty")]
    pub hints: Hints,
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
    /// Stages (chunks) each pipeline rank holds: above 1 only for the
    /// chunked kinds, whose order says which rank runs each stage
    /// (`Plan::stage_ranks`).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub chunks: u32,
    /// What communication the runtime hides behind computation
    /// (`cost/overlap.rs`); absent: DAPPLE's, a data-parallel plan's gradient
    /// reduction only.
    #[serde(default, skip_serializing_if = "Overlap::is_default")]
    pub overlap: Overlap,
}

impl ScheduleChoice {
    /// `kind` at warm-up `policy`, one stage a rank, DAPPLE's overlap.
    pub fn new(kind: ScheduleKind, warmup_policy: WarmupPolicy) -> ScheduleChoice {
        ScheduleChoice {
            kind,
            warmup_policy,
            chunks: 1,
            overlap: Overlap::default(),
        }
    }

    /// This schedule, its runtime hiding what `overlap` says.
    pub fn overlapping(self, overlap: Overlap) -> ScheduleChoice {
        ScheduleChoice { overlap, ..self }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "file::Stage", into = "file::Stage")]
pub struct Stage {
    /// Layers `layer_start .. layer_end` (end exclusive) of the profile.
    pub layer_start: usize,
    pub layer_end: usize,
    /// Global GPU ids (machine-major: machine m's GPUs come after machine m-1's).
    pub devices: Vec<u32>,
    /// Micro-batches this stage runs forward before its first backward (K_i).
    pub warmup_micro_batches: u32,
    /// Placement policy that put the stage on its devices, when the planner did.
    pub placement: Option<Policy>,
    /// Samples of each micro-batch each device takes, in `devices` order,
    /// summing to the micro-batch size: uneven slices for GPUs of unequal
    /// speed or memory (Whale's balancing, `cost/balance.rs`). Absent: the even
    /// split of `cost::slice_ranges`.
    pub slices: Option<Vec<u32>>,
    /// How the stage runs its layers besides replicating them
    /// (`cost/shape.rs`), the one type the search, the costs, the checks
    /// and the runtime's layout read. A plan file writes its fields beside
    /// the stage's own (`file::Stage`).
    pub shape: StageShape,
}

/// An empty, plain stage: what struct literals fill in (`..Default::default()`)
/// for the fields they do not name (no placement, even slices, no split).
impl Default for Stage {
    fn default() -> Self {
        Stage {
            layer_start: 0,
            layer_end: 0,
            devices: Vec::new(),
            warmup_micro_batches: 1,
            placement: None,
            slices: None,
            shape: StageShape::PLAIN,
        }
    }
}

impl Stage {
    /// Replicas of the stage's split layers (`StageShape::replicas`).
    pub fn replicas(&self) -> u32 {
        self.shape.replicas(self.devices.len() as u32)
    }

    /// Each replica's devices (`StageShape::split_groups`).
    pub fn split_groups(&self) -> std::slice::Chunks<'_, u32> {
        self.shape.split_groups(&self.devices)
    }

    /// The devices of each of the stage's expert groups
    /// (`experts::expert_group`), in order of their first device; where
    /// the experts are not spread, each of the stage's devices alone.
    pub fn expert_groups(&self) -> Vec<Vec<u32>> {
        let (et, e) = (
            self.shape.expert_tensor_degree() as usize,
            self.shape.expert_parallel.max(1) as usize,
        );
        (0..self.devices.len())
            .filter(|&p| (p / et).is_multiple_of(e))
            .map(|p| {
                crate::model::experts::expert_group(p, et, e)
                    .filter_map(|q| self.devices.get(q).copied())
                    .collect()
            })
            .collect()
    }

    /// The devices holding the same experts (`experts::expert_replicas`),
    /// one group for each place in an expert group, in order of their
    /// first device.
    pub fn expert_replica_groups(&self) -> Vec<Vec<u32>> {
        let (et, e) = (
            self.shape.expert_tensor_degree() as usize,
            self.shape.expert_parallel.max(1) as usize,
        );
        let gpus = self.devices.len();
        (0..gpus.min(et * e))
            .map(|p| {
                crate::model::experts::expert_replicas(p, et, e, gpus)
                    .map(|q| self.devices[q])
                    .collect()
            })
            .collect()
    }

    /// The stage over layers `start..end` instead: its devices and shape
    /// kept, but experts spread only where the new layers have some.
    pub fn over_layers(self, (start, end): (usize, usize), layers: &LayerCosts) -> Stage {
        let shape = if layers.has_experts(start, end) {
            self.shape
        } else {
            StageShape {
                expert_parallel: 1,
                expert_tensor_parallel: None,
                ..self.shape
            }
        };
        Stage {
            layer_start: start,
            layer_end: end,
            shape,
            ..self
        }
    }
}

/// A stage as plan files write it: the shape's fields at the same level as
/// the stage's own, as every plan version has had them. `Stage` reads and
/// writes itself through `file::Stage` (`#[serde(flatten)]` would keep the
/// layout, but not `deny_unknown_fields`); the conversions name every
/// field, so a field added to `StageShape` must be given its key here. The
/// mirror is named `Stage` too: serde's errors name the type they expected
/// ("expected struct Stage").
mod file {
    use serde::{Deserialize, Serialize};

    use super::{is_one, one};
    use crate::cluster::placement::Policy;
    use crate::cost::shape::{Offload, Recompute, StageShape};

    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct Stage {
        layer_start: usize,
        layer_end: usize,
        devices: Vec<u32>,
        warmup_micro_batches: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        placement: Option<Policy>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slices: Option<Vec<u32>>,
        /// Whale's split degree: the GPUs each layer that can split is sharded
        /// over, in groups of consecutive devices, each taking as many GPUs of
        /// each machine it uses as the others (`cost/shape.rs`).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        tensor_parallel: u32,
        /// Sequence parallelism in the split layers (`StageShape`); t > 1 only.
        #[serde(default, skip_serializing_if = "is_false")]
        sequence_parallel: bool,
        /// ZeRO's sharding level over the stage's replicas (`cost/sharding.rs`):
        /// 0 none, 1 optimizer state, 2 and gradients, 3 and weights. Plans
        /// before version 12 wrote level 1 as `shard_optimizer: true`.
        #[serde(
            default,
            alias = "shard_optimizer",
            deserialize_with = "crate::cost::sharding::level_or_flag",
            skip_serializing_if = "is_zero"
        )]
        shard_level: u8,
        /// Level 3: each micro-batch's forward frees the weights it gathered
        /// (FSDP's `reshard_after_forward`).
        #[serde(default, skip_serializing_if = "is_false")]
        reshard_after_forward: bool,
        /// What the forward keeps for the backward: "none" re-computes nothing.
        #[serde(default, skip_serializing_if = "Recompute::is_none")]
        recompute: Recompute,
        /// Expert parallelism: the routed experts spread over groups of this
        /// many consecutive replicas (`model/experts.rs`; 1: none).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        expert_parallel: u32,
        /// The GPUs each routed expert's columns are split over, where not t
        /// (`StageShape::expert_tensor_degree`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expert_tensor_parallel: Option<u32>,
        /// Where the master weights and optimizer state live: "optimizer"
        /// keeps them in host memory and steps them there (`cost/offload.rs`).
        #[serde(default, skip_serializing_if = "Offload::is_none")]
        offload: Offload,
        /// Context parallelism: each sample's sequence cut over this many
        /// consecutive split groups (`StageShape`, `model/context.rs`; 1: none).
        #[serde(default = "one", skip_serializing_if = "is_one")]
        context_parallel: u32,
    }

    impl From<Stage> for super::Stage {
        fn from(file: Stage) -> super::Stage {
            super::Stage {
                layer_start: file.layer_start,
                layer_end: file.layer_end,
                devices: file.devices,
                warmup_micro_batches: file.warmup_micro_batches,
                placement: file.placement,
                slices: file.slices,
                shape: StageShape {
                    tensor_parallel: file.tensor_parallel,
                    sequence_parallel: file.sequence_parallel,
                    shard_level: file.shard_level,
                    reshard_after_forward: file.reshard_after_forward,
                    recompute: file.recompute,
                    expert_parallel: file.expert_parallel,
                    expert_tensor_parallel: file.expert_tensor_parallel,
                    offload: file.offload,
                    context_parallel: file.context_parallel,
                },
            }
        }
    }

    impl From<super::Stage> for Stage {
        fn from(stage: super::Stage) -> Stage {
            let shape = stage.shape;
            Stage {
                layer_start: stage.layer_start,
                layer_end: stage.layer_end,
                devices: stage.devices,
                warmup_micro_batches: stage.warmup_micro_batches,
                placement: stage.placement,
                slices: stage.slices,
                tensor_parallel: shape.tensor_parallel,
                sequence_parallel: shape.sequence_parallel,
                shard_level: shape.shard_level,
                reshard_after_forward: shape.reshard_after_forward,
                recompute: shape.recompute,
                expert_parallel: shape.expert_parallel,
                expert_tensor_parallel: shape.expert_tensor_parallel,
                offload: shape.offload,
                context_parallel: shape.context_parallel,
            }
        }
    }

    fn is_zero(x: &u8) -> bool {
        *x == 0
    }

    fn is_false(x: &bool) -> bool {
        !*x
    }
}

fn one() -> u32 {
    1
}

fn is_one(x: &u32) -> bool {
    *x == 1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Estimate {
    /// Simulated time of one iteration (`simulation/simulate.rs`): the plan's headline,
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
    /// Model FLOPs utilisation: the profile's model FLOPs of an iteration
    /// over every GPU of the topology at its bf16 peak (`cluster/gpus.rs`) for the
    /// iteration's time. Absent where the profile gives no FLOPs or a GPU
    /// type is not in the catalog.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    pub peak_memory_bytes: f64,
    pub fits_memory: bool,
    pub stages: Vec<StageCost>,
    /// Transfer between stage i and i+1.
    pub transfers: Vec<TransferEstimate>,
    /// What each stage's simulated peak memory is made of.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory: Vec<crate::cost::shape::MemoryTerms>,
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
pub struct TransferEstimate {
    pub bytes: f64,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
}

impl FileObject for Plan {
    const FORMAT: FileFormat = PLAN;

    /// The embedded topology is a topology file of its own: same checks;
    /// the stages must run on it (`check_layout`). Whether they fit a
    /// profile is checked where the plan is costed (`evaluate`).
    fn check(&self) -> Result<()> {
        let topology = &self.inputs.topology;
        if let serde_json::Value::Object(obj) =
            serde_json::to_value(topology).expect("plain data always serializes")
        {
            check_envelope(&obj, TOPOLOGY).map_err(|e| e.under("inputs.topology"))?;
        }
        topology
            .validate()
            .map_err(|e| e.under("inputs.topology"))?;
        let hash = &self.inputs.profile_sha256;
        if !(hash.is_empty()
            || (hash.len() == 64
                && hash
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))))
        {
            return Err(Error::field(
                "inputs.profile_sha256",
                format!("value {hash:?} must be 64 lowercase hex digits, or empty for unknown"),
            ));
        }
        // Its stages on its own topology (what needs the profile is checked
        // where the plan is costed).
        check_layout(self, None)?;
        // Times, sizes, ratios and counts: an estimate or selection read
        // from a file holds no negative number (the schema's minimum 0).
        let recorded = [
            ("estimate", self.estimate.as_ref().map(serde_json::to_value)),
            (
                "selection",
                self.selection.as_ref().map(serde_json::to_value),
            ),
        ];
        for (field, value) in recorded {
            if let Some(value) = value {
                check_no_negative(&value.expect("plain data always serializes"), field)?;
            }
        }
        if self.inputs.options.min_micro_batch_size == 0 {
            return Err(Error::field(
                "inputs.options.min_micro_batch_size",
                "value 0 must be >= 1",
            ));
        }
        if let Some(estimate) = &self.estimate {
            if let Some(i) = estimate.stages.iter().position(|s| s.slice_size == 0) {
                return Err(Error::field(
                    format!("estimate.stages[{i}].slice_size"),
                    "value 0 must be >= 1",
                ));
            }
        }
        Ok(())
    }
}

/// Every number in `value` is at least 0; else an error naming its path.
fn check_no_negative(value: &serde_json::Value, path: &str) -> Result<()> {
    match value {
        serde_json::Value::Number(n) if n.as_f64().is_some_and(|x| x < 0.0) => {
            Err(Error::field(path, format!("value {n} must be >= 0")))
        }
        serde_json::Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| check_no_negative(v, &format!("{path}[{i}]"))),
        serde_json::Value::Object(fields) => fields
            .iter()
            .try_for_each(|(k, v)| check_no_negative(v, &format!("{path}.{k}"))),
        _ => Ok(()),
    }
}

impl Plan {
    /// Every stage re-computes, whatever its `recompute` says: an
    /// asynchronous plan before version 4 meant that (and may hold stages
    /// on unlike GPUs, which a stage's own `recompute` may not).
    pub fn recomputes_every_stage(&self) -> bool {
        self.schema_version < 4 && self.schedule.kind.is_asynchronous()
    }

    /// Pipeline ranks: one a stage, or one every `schedule.chunks` stages
    /// of a chunked kind.
    pub fn ranks(&self) -> usize {
        self.stages.len() / self.schedule.chunks.max(1) as usize
    }

    /// The pipeline rank of each stage: stage s's own, or under a chunked
    /// kind the rank its order puts stage s on.
    pub fn stage_ranks(&self) -> Vec<u32> {
        if self.schedule.kind.is_chunked() {
            let s = &self.schedule;
            s.kind.chunk_ranks(self.ranks() as u32, s.chunks)
        } else {
            (0..self.stages.len() as u32).collect()
        }
    }

    /// The pipeline order a plan of a chunked kind runs.
    pub fn chunked_order(&self) -> Result<PipelineOrder> {
        let s = &self.schedule;
        s.kind
            .chunked_order(self.ranks() as u32, self.micro_batches, s.chunks)
    }

    /// The order of `plan`'s own schedule (its warm-up depths K_i, or a
    /// chunked kind's order), one
    /// pipeline rank per stage, where torch's pipelining can run the plan
    /// as it is: it runs one data-parallel and one tensor-parallel degree
    /// on every pipeline rank, each replica taking an equal slice. Stages
    /// replicated or split unevenly, uneven slices (mixed GPUs) and an
    /// asynchronous schedule are refused, naming what differs.
    pub fn pipeline_order(&self) -> Result<PipelineOrder> {
        let plan = self;
        let degrees = |what: &str, per_stage: Vec<u32>| {
            if per_stage.windows(2).all(|w| w[0] == w[1]) {
                return Ok(());
            }
            let list: Vec<String> = per_stage.iter().map(ToString::to_string).collect();
            Err(Error::incompatible(format!(
                "stages {what} unevenly ({} by stage): torch's pipelining runs one degree on every \
                 pipeline rank",
                list.join(", ")
            )))
        };
        let split = |s: &crate::plan::Stage| s.shape.tensor_parallel.max(1);
        degrees(
            "replicated",
            plan.stages
                .iter()
                .map(|s| s.devices.len() as u32 / split(s))
                .collect(),
        )?;
        degrees("split", plan.stages.iter().map(split).collect())?;
        if let Some(i) = plan.stages.iter().position(|s| {
            s.slices
                .as_ref()
                .is_some_and(|v| v.windows(2).any(|w| w[0] != w[1]))
        }) {
            return Err(Error::incompatible(format!(
                "stage {i} gives its GPUs uneven slices of each micro-batch (mixed GPUs): \
                 torch's data parallelism splits a micro-batch evenly"
            )));
        }
        if plan.schedule.kind.is_chunked() {
            return plan.chunked_order();
        }
        plan_schedule(plan, None)?.pipeline_order()
    }

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

    /// Whether some stage reduces its gradients behind its backward, as the
    /// plan's runtime hides them (`Overlap::hides_grad_reduce`).
    pub fn hides_grad_reduce(&self) -> bool {
        let only_stage = self.stages.len() == 1;
        self.reducing_stages().any(|s| {
            self.schedule
                .overlap
                .hides_grad_reduce(only_stage, &s.shape)
        })
    }

    /// Whether some ZeRO-1 stage gathers its weights behind the next forward.
    pub fn hides_param_gather(&self) -> bool {
        self.reducing_stages()
            .any(|s| self.schedule.overlap.hides_param_gather(&s.shape))
    }

    /// The stages whose GPUs reduce their gradients: more than one holds
    /// the same weights (data replicas, or context ranks).
    fn reducing_stages(&self) -> impl Iterator<Item = &Stage> {
        self.stages
            .iter()
            .filter(|s| s.shape.weight_replicas(s.devices.len() as u32) > 1)
    }

    /// This plan, not yet costed, as a runtime that hides what `overlap`
    /// says runs it.
    pub fn overlapping(self, overlap: Overlap) -> Plan {
        Plan {
            schedule: self.schedule.overlapping(overlap),
            estimate: None,
            ..self
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

    /// "8:8"-style shape: replication of each stage; under a chunked kind
    /// each rank's, then its chunks ("8:8 (v=2)").
    pub fn shape(&self) -> String {
        let ranks = self.ranks();
        let gpus: Vec<String> = self.stages[..ranks]
            .iter()
            .map(|s| s.devices.len().to_string())
            .collect();
        match self.schedule.kind.is_chunked() {
            true => format!("{} (v={})", gpus.join(":"), self.schedule.chunks),
            false => gpus.join(":"),
        }
    }
}

/// Micro-batches stage i runs forward before its first backward (K_i):
/// the warm-up policy's for early backward, all of them for GPipe, one per
/// stage from here up to M for ZB-H1 (its first I waits as policy A's
/// first B does), two per stage from here less one up to M for ZB-H2
/// (policy B's), one per stage from here for the asynchronous kinds
/// (PipeDream's 1F1B, which runs across mini-batches and so is not capped
/// by M); None where the
/// depth is the plan's own choice (policy auto).
pub fn warmup_depth(
    kind: ScheduleKind,
    policy: WarmupPolicy,
    stages_from_here: u32,
    micro_batches: u32,
) -> Option<u32> {
    match kind {
        ScheduleKind::EarlyBackward1F1B => policy.warmup(stages_from_here, micro_batches),
        ScheduleKind::GPipe => Some(micro_batches),
        ScheduleKind::ZeroBubbleH1 => Some(stages_from_here.min(micro_batches)),
        ScheduleKind::ZeroBubbleH2 => WarmupPolicy::B.warmup(stages_from_here, micro_batches),
        _ => Some(stages_from_here),
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

/// The action lists a checked plan runs: its own schedule kind and K_i, or
/// `kind` instead. Early backward over a GPipe plan takes the K_i of the
/// plan's fixed policy (policy A when it has none). An asynchronous kind
/// runs `schedule::steady_state_mini_batches` mini-batches, enough to
/// measure its steady state.
pub fn plan_schedule(plan: &Plan, kind: Option<ScheduleKind>) -> Result<Schedule> {
    let asynchronous = kind.unwrap_or(plan.schedule.kind).is_asynchronous();
    let mini_batches = if asynchronous {
        steady_state_mini_batches(plan.stages.len(), plan.micro_batches)?
    } else {
        1
    };
    plan_schedule_over(plan, kind, mini_batches)
}

/// [`plan_schedule`] with an asynchronous kind running `mini_batches`
/// mini-batches (a run's steps); the synchronous kinds run one.
pub fn plan_schedule_over(
    plan: &Plan,
    kind: Option<ScheduleKind>,
    mini_batches: u32,
) -> Result<Schedule> {
    let own = plan.schedule.kind;
    let s_count = plan.stages.len();
    if own.is_chunked() && kind.is_some_and(|k| k != own) {
        return Err(Error::incompatible(format!(
            "the plan's ranks hold several stages each ({own}): it runs its own order only"
        )));
    }
    match kind.unwrap_or(own) {
        asynchronous @ (ScheduleKind::XPipe
        | ScheduleKind::PipeDream
        | ScheduleKind::SpecTrain
        | ScheduleKind::Async) => {
            Schedule::asynchronous(asynchronous, s_count, plan.micro_batches, mini_batches)
        }
        ScheduleKind::GPipe => Schedule::gpipe(s_count, plan.micro_batches),
        chunked @ (ScheduleKind::Interleaved1F1B
        | ScheduleKind::InterleavedZeroBubble
        | ScheduleKind::ZeroBubbleV
        | ScheduleKind::DualPipeV) => Err(Error::incompatible(format!(
            "{chunked} runs a pipeline order of several stages a rank, not one list a stage"
        ))),
        ScheduleKind::ZeroBubbleH1 => Schedule::zero_bubble_h1(s_count, plan.micro_batches),
        ScheduleKind::ZeroBubbleH2 => Schedule::zero_bubble_h2(s_count, plan.micro_batches),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A stage's file keeps its shape's fields at the stage's level, writes
    /// only those that differ from a plain stage's, reads the
    /// `shard_optimizer` of plans before version 12, and has no `shape`
    /// key; its errors name the struct `Stage`.
    #[test]
    fn a_stage_file_holds_its_shape_fields_beside_its_own() {
        let stage = Stage {
            layer_end: 2,
            devices: vec![0, 1, 2, 3],
            shape: StageShape {
                tensor_parallel: 2,
                shard_level: 1,
                ..StageShape::PLAIN
            },
            ..Default::default()
        };
        let text = serde_json::to_string(&stage).unwrap();
        assert_eq!(
            text,
            r#"{"layer_start":0,"layer_end":2,"devices":[0,1,2,3],"warmup_micro_batches":1,"tensor_parallel":2,"shard_level":1}"#
        );
        assert_eq!(serde_json::from_str::<Stage>(&text).unwrap(), stage);
        let before_12 = text.replace(r#""shard_level":1"#, r#""shard_optimizer":true"#);
        assert_eq!(serde_json::from_str::<Stage>(&before_12).unwrap(), stage);
        let nested = text.replace(r#""tensor_parallel":2,"shard_level":1"#, r#""shape":{}"#);
        let error = |text: &str| serde_json::from_str::<Stage>(text).unwrap_err().to_string();
        let e = error(&nested);
        assert!(
            e.starts_with("unknown field `shape`, expected one of"),
            "{e}"
        );
        let e = error("5");
        assert!(e.contains("expected struct Stage at"), "{e}");
    }
}
