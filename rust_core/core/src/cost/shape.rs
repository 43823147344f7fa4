//! How a stage runs its layers on its GPUs besides replicating them: Whale's
//! split degree t (tensor parallelism, with the sequence split too or not),
//! sharding over the replicas (ZeRO's levels, `cost/sharding.rs`), expert
//! parallelism, offloading and re-computation
//! (none, full, per layer or selective). A plain stage (t = 1, no sharding,
//! no re-computation) is what DAPPLE plans.
//!
//! A stage on G GPUs with split degree t runs the layers that can split on
//! G / t replicas of t shards each (t consecutive GPUs, spread evenly over
//! the machines they use: `uneven_split_group`);
//! layers that cannot split run data parallel over all G GPUs, as Whale's
//! collocated hybrid runs ResNet-50 beside its split classifier, and a
//! bridge gathers their outputs into the split layers (and scatters the
//! gradients back). This module says which layers split and what one GPU
//! holds; `cost.rs` prices the collectives on the stage's links.

use serde::{Deserialize, Serialize};

use crate::model::profile::{recompute_backward_bytes, LayerCosts, TimePrefix};
use crate::model::split::ShardCost;

crate::named_enum! {
    /// What a stage's forward keeps for its backward.
    pub enum Recompute("a re-computation mode") {
        /// Everything the layers keep (the profile's stored activations).
        None = "none",
        /// Only the stage's input; the backward runs the forward again
        /// (one checkpoint over the stage, as torch's `checkpoint` of the
        /// stage module: its backward holds the whole stage's activations
        /// of one micro-batch again).
        Full = "full",
        /// Each layer's input; the backward runs each layer's forward again
        /// just before that layer's backward, one layer at a time (Megatron-LM's
        /// `--recompute-granularity full --recompute-method uniform
        /// --recompute-num-layers 1`, torchtitan's full activation
        /// checkpointing of each block).
        PerLayer = "per-layer",
        /// Everything but what the profile marks as cheap to re-run and
        /// large to keep (the attention core's scores, probabilities and
        /// dropout mask: `selective_stored_bytes`), which the backward
        /// re-runs layer by layer (Megatron-LM's `--recompute-granularity
        /// selective`, Korthikanti et al.'s selective re-computation).
        Selective = "selective",
    }
}

impl Recompute {
    pub fn is_none(&self) -> bool {
        *self == Recompute::None
    }

    /// The forward the backward of layers `start..end` runs again, over
    /// their whole forward, on `times` (any GPU type, at slices of
    /// `batch`): what torch's checkpoint re-runs (full, per layer), the
    /// selective parts, or nothing.
    pub fn rerun_ratio(
        &self,
        layers: &LayerCosts,
        times: &TimePrefix,
        (start, end): (usize, usize),
        batch: u32,
    ) -> f64 {
        match self {
            Recompute::None => 0.0,
            Recompute::Full | Recompute::PerLayer => layers.rerun_ratio(times, start, end, batch),
            Recompute::Selective => layers.selective_ratio(times, start, end, batch),
        }
    }
}

// named_enum! declares the enum, so its default cannot be derived there.
#[allow(clippy::derivable_impls)]
impl Default for Recompute {
    fn default() -> Self {
        Recompute::None
    }
}

crate::named_enum! {
    /// Where a stage keeps its master weights and optimizer state, and so
    /// where it steps them (`cost/offload.rs`).
    pub enum Offload("an offload target") {
        /// On the GPUs, stepped there.
        None = "none",
        /// In host memory, stepped by the host's CPU (ZeRO-Offload,
        /// DeepSpeed's `offload_optimizer`): gradients go to the host and
        /// updated weights come back each iteration.
        Optimizer = "optimizer",
    }
}

impl Offload {
    pub fn is_none(&self) -> bool {
        *self == Offload::None
    }
}

#[allow(clippy::derivable_impls)]
impl Default for Offload {
    fn default() -> Self {
        Offload::None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageShape {
    /// GPUs each layer that can split is sharded over (1: none is).
    pub tensor_parallel: u32,
    /// Sequence parallelism in the split layers whose pattern allows it
    /// (`SplitPattern::sequence_parallel`); only with t > 1.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
    /// ZeRO's level of sharding over the stage's replicas
    /// (`cost/sharding.rs`): 0 none; 1 the master weights and optimizer
    /// state (ZeRO-1); 2 the gradients too (ZeRO-2); 3 the weights too
    /// (ZeRO-3, FSDP). A plan older than version 12 says level 1 as
    /// `shard_optimizer: true`.
    #[serde(
        default,
        alias = "shard_optimizer",
        deserialize_with = "crate::cost::sharding::level_or_flag",
        skip_serializing_if = "is_zero"
    )]
    pub shard_level: u8,
    /// Level 3: each micro-batch's forward frees the weights it gathered,
    /// and its backward gathers them again (FSDP's
    /// `reshard_after_forward=True`); false keeps them for the backward.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reshard_after_forward: bool,
    pub recompute: Recompute,
    /// Expert parallelism: the routed experts of the layers that have
    /// them spread over groups of this many consecutive replicas
    /// (`model/experts.rs`; 1: every replica holds every expert).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub expert_parallel: u32,
    /// The GPUs each routed expert's columns are split over, where it
    /// differs from t (Megatron-LM's `--expert-tensor-parallel-size`);
    /// None: t. Read it through `expert_tensor_degree`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_tensor_parallel: Option<u32>,
    /// Master weights and optimizer state in host memory (`cost/offload.rs`).
    #[serde(default, skip_serializing_if = "Offload::is_none")]
    pub offload: Offload,
    /// Context parallelism: each sample's sequence cut over this many
    /// consecutive split groups (`model/context.rs`; 1: none). A replica is
    /// t c GPUs: tensor innermost, then context, as Megatron-LM orders them.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub context_parallel: u32,
}

fn one() -> u32 {
    1
}

fn is_one(x: &u32) -> bool {
    *x == 1
}

fn is_zero(x: &u8) -> bool {
    *x == 0
}

impl StageShape {
    /// DAPPLE's stage: replicas only.
    pub const PLAIN: StageShape = StageShape {
        tensor_parallel: 1,
        sequence_parallel: false,
        shard_level: 0,
        reshard_after_forward: false,
        recompute: Recompute::None,
        expert_parallel: 1,
        expert_tensor_parallel: None,
        offload: Offload::None,
        context_parallel: 1,
    };

    pub fn is_plain(&self) -> bool {
        *self == StageShape::PLAIN
    }

    /// Whether each GPU AllReduces all its layers' gradients over every
    /// replica, as a plain stage does (re-computation aside): no split,
    /// no sharding, no experts spread.
    pub fn reduces_as_plain(&self) -> bool {
        self.tensor_parallel <= 1
            && self.expert_parallel <= 1
            && self.context_parallel <= 1
            && !self.shards_optimizer()
    }

    /// Sharding level 1 or above: each GPU keeps and steps its replica
    /// group's shard of the master weights and optimizer state.
    pub fn shards_optimizer(&self) -> bool {
        self.sharding().shards_optimizer()
    }

    /// The stage's sharding level, whose rules `cost/sharding.rs` holds.
    pub fn sharding(&self) -> crate::cost::sharding::ShardLevel {
        crate::cost::sharding::ShardLevel::new(self.shard_level, self.reshard_after_forward)
    }

    /// The expert tensor degree et: the GPUs each routed expert's columns
    /// are split over (t unless the shape says otherwise).
    pub fn expert_tensor_degree(&self) -> u32 {
        self.expert_tensor_parallel
            .unwrap_or(self.tensor_parallel)
            .max(1)
    }

    /// Data replicas of the split layers on `gpus` GPUs, each taking its
    /// own samples: t c GPUs each (a plain stage has one per GPU). A t c
    /// above `gpus`, which `plan::check` refuses, counts as one replica,
    /// so that checks before it can run.
    pub fn replicas(&self, gpus: u32) -> u32 {
        gpus / self.replica_gpus().clamp(1, gpus.max(1))
    }

    /// The GPUs of one data replica of the split layers: t c.
    pub fn replica_gpus(&self) -> u32 {
        self.tensor_parallel.max(1) * self.context_parallel.max(1)
    }

    /// The GPUs on `gpus` that hold the same shard of the split layers'
    /// weights: every data replica's context ranks (gpus / t). Their
    /// gradients are reduced, and sharding shards, over them.
    pub fn weight_replicas(&self, gpus: u32) -> u32 {
        gpus / self.tensor_parallel.clamp(1, gpus.max(1))
    }

    /// The split groups of a stage's `devices` (listed in ascending order):
    /// each replica's t shards are t consecutive devices, as the cost model
    /// groups them. A plain stage's groups are its single GPUs.
    pub fn split_groups<'a>(&self, devices: &'a [u32]) -> std::slice::Chunks<'a, u32> {
        devices.chunks(self.tensor_parallel.max(1) as usize)
    }
}

impl Default for StageShape {
    fn default() -> Self {
        StageShape::PLAIN
    }
}

/// The first split group of a stage on `alloc` ((machine, GPUs), machine
/// by machine, as a stage's ascending devices lie) that is uneven, by
/// index, with its GPUs on each machine it uses; None when all are even.
/// Groups are `t` consecutive GPUs; each must take as many GPUs of each
/// machine it uses as every other group (a group may span machines, but
/// not unevenly: its collectives would wait on one machine). `t` must
/// divide the stage's GPUs.
pub fn uneven_split_group(alloc: &[(usize, u32)], t: u32) -> Option<(usize, Vec<u32>)> {
    let machines: Vec<usize> = alloc
        .iter()
        .flat_map(|&(m, c)| std::iter::repeat_n(m, c as usize))
        .collect();
    let shape_of = |group: &[usize]| -> Vec<u32> {
        let mut counts: Vec<u32> = Vec::new();
        for (k, &m) in group.iter().enumerate() {
            if k > 0 && group[k - 1] == m {
                *counts.last_mut().expect("a count") += 1;
            } else {
                counts.push(1);
            }
        }
        counts.sort_unstable();
        counts
    };
    let first = shape_of(&machines[..(t as usize).min(machines.len())]);
    machines
        .chunks(t as usize)
        .map(shape_of)
        .enumerate()
        .find(|(_, shape)| *shape != first || shape.windows(2).any(|w| w[0] != w[1]))
}

/// What one GPU of a stage holds, in bytes: model state all the time, and
/// per micro-batch in flight. At K micro-batches in flight a GPU holds
/// `fixed_bytes + K * per_micro_batch_bytes`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageMemory {
    /// Weights, gradients, master weights and optimizer state (`model_state`),
    /// and what the running backward needs on top: `working_bytes`, or
    /// under full re-computation `recompute_backward_bytes` (one
    /// micro-batch's re-run activations with the working memory on them).
    pub fixed_bytes: f64,
    pub per_micro_batch_bytes: f64,
    pub model_state_bytes: f64,
    /// One copy of the weights (what stashing or prediction copies).
    pub weight_bytes: f64,
    /// Kept from one micro-batch's forward to its backward.
    pub stored_bytes: f64,
    /// What re-computation keeps per micro-batch: the stage's input, and
    /// on the last stage what the loss keeps outside the checkpoint.
    pub input_bytes: f64,
    /// What the running backward needs on top (in `fixed_bytes`).
    pub working_bytes: f64,
    /// What a re-computed backward brings back: the re-run's activations
    /// and weight copies, less what the loss kept.
    pub rerun_bytes: f64,
    /// What a re-computed backward needs on top of `input_bytes`, at its
    /// peak (`profile::recompute_backward_bytes`; in `fixed_bytes` when the
    /// stage re-computes).
    pub recompute_backward_bytes: f64,
    /// The gradients (in `model_state_bytes`): made by the stage's first
    /// backward, freed by its optimizer step.
    pub gradient_bytes: f64,
    /// What the optimizer's step allocates above the model state, on the
    /// weights the GPU steps (a ZeRO-1 shard's); 0 where it steps on the host.
    pub optimizer_step_bytes: f64,
    /// The weights the GPU steps (all it holds, or its ZeRO-1 shard's).
    pub stepped_weight_bytes: f64,
    /// Of `model_state_bytes`, the master weights and optimizer state:
    /// what offloading would move to the host (0 where it did).
    pub optimizer_state_bytes: f64,
    /// Offloaded: the master weights and optimizer state the GPU's host
    /// keeps for it (not in `model_state_bytes`); else 0.
    pub host_bytes: f64,
}

impl StageMemory {
    /// The peak with `micro_batches_in_flight`: the backward's, or the
    /// optimizer step's where that is larger (activations are gone by then).
    pub fn at(&self, micro_batches_in_flight: u32) -> f64 {
        let backward =
            self.fixed_bytes + f64::from(micro_batches_in_flight) * self.per_micro_batch_bytes;
        backward.max(self.model_state_bytes + self.optimizer_step_bytes)
    }

    /// The least one GPU would hold, with one micro-batch in flight, were
    /// the optimizer offloaded: the backward's peak less the optimizer's
    /// state (the search leaves an offloaded shape unpriced where this is
    /// over the GPU's memory).
    pub fn offloaded_floor_bytes(&self) -> f64 {
        self.fixed_bytes + self.per_micro_batch_bytes - self.optimizer_state_bytes
    }
}

/// The terms of one GPU's peak memory in a stage, as the simulation has
/// them: model state, `micro_batches_in_flight` x `per_micro_batch_bytes`,
/// the running backward's `working_bytes`, and `other_bytes`, the rest of
/// the peak (a re-computed forward's activations, an asynchronous
/// schedule's weight versions and XPipe's own moments).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryTerms {
    /// Weights, gradients, master weights and optimizer state.
    pub model_state_bytes: f64,
    /// What one micro-batch keeps from its forward to its backward: its
    /// activations (on the last stage with the loss's), autocast's weight
    /// copies; under re-computation only the stage's input.
    pub per_micro_batch_bytes: f64,
    /// Most micro-batches in flight at once.
    pub micro_batches_in_flight: u32,
    pub working_bytes: f64,
    pub other_bytes: f64,
    /// The peak: the sum of the terms.
    pub peak_bytes: f64,
    /// What the allocator reserves per byte it allocates (the profile's
    /// `allocator_reserved_factor`): the peak times this must fit the GPU.
    pub allocator_reserved_factor: f64,
}

/// What one GPU of a stage holds of its layers, summed a layer at a time
/// (the search grows stages from their last layer): whole layers take
/// `whole_slice` samples of a micro-batch, split ones `split_slice` (a
/// replica's); sharding divides whole layers' state over all the stage's
/// `gpus` and split ones' over their `replicas`. Each part of the state is
/// summed whole and sharded, so one sum serves a stage at every sharding
/// level. A plain stage is `stage_memory_bytes` in `cost.rs`.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemorySums {
    /// The master weights and optimizer state.
    optimizer_state_bytes: f64,
    sharded_optimizer_state_bytes: f64,
    weight_bytes: f64,
    /// The weights each GPU steps when sharded (its shard of them), and
    /// holds at level 3.
    sharded_weight_bytes: f64,
    gradient_bytes: f64,
    /// The gradients each GPU keeps at level 2 and above.
    sharded_gradient_bytes: f64,
    /// The most weights and gradients of one layer a GPU holds whole: what
    /// a level-3 stage gathers before running a layer, and what a level-2
    /// one holds before reducing a layer's gradients (`cost/sharding.rs`).
    layer_weight_peak_bytes: f64,
    layer_gradient_peak_bytes: f64,
    stored_bytes: f64,
    working_bytes: f64,
    rerun_working_bytes: f64,
    loss_kept_bytes: f64,
    /// Per-layer re-computation: every layer's input, as each layer's
    /// first GPU keeps it (inputs of the stage's later layers; the stage's
    /// own input is added in `memory`).
    later_inputs_bytes: f64,
    /// Per-layer re-computation: the most any one layer's re-run and
    /// backward need on top of what was kept.
    layer_rerun_peak_bytes: f64,
    /// Selective re-computation: what the layers stop keeping, and the
    /// most one layer's re-run brings back at once.
    selective_bytes: f64,
    selective_layer_peak_bytes: f64,
    /// The layer summed last (the stage's first so far), for its input.
    first_layer: Option<usize>,
    first_input_factor: f64,
}

impl MemorySums {
    /// Add layer `layer`, split as `shard` says (None: whole), of which a
    /// GPU holds `held` of the parameters besides (expert parallelism's
    /// share, `ExpertPattern::param_factor`; 1: all). Its sequence is cut
    /// `context` ways (`model/context.rs`): a GPU keeps 1/context of the slice's
    /// activations, and the ring's chunks of keys and values beside the
    /// running layer's working memory. Sharding divides whole layers' state
    /// over all `gpus` and split ones' over their `weight_replicas`.
    pub fn add_layer(
        &mut self,
        layers: &LayerCosts,
        layer: usize,
        (shard, held): (Option<&ShardCost>, f64),
        (whole_slice, split_slice, context): (u32, u32, u32),
        (gpus, weight_replicas): (u32, u32),
    ) {
        let (split_param_factor, stored_factor, slice, sharers) = match shard {
            Some(s) => (
                s.param_factor,
                s.stored_factor,
                split_slice,
                weight_replicas,
            ),
            None => (1.0, 1.0, whole_slice, gpus),
        };
        let slice = f64::from(slice) / f64::from(context.max(1));
        let (l, next) = (layer, layer + 1);
        let param_factor = split_param_factor * held;
        self.optimizer_state_bytes +=
            split_param_factor * layers.held_optimizer_state_bytes(l, next, 1, held);
        self.sharded_optimizer_state_bytes +=
            split_param_factor * layers.held_optimizer_state_bytes(l, next, sharers, held);
        // What a sharded GPU keeps of the weights and gradients: 1/sharers
        // of the whole layer's, whichever experts it holds.
        let sharers_f = f64::from(sharers.max(1));
        self.sharded_weight_bytes += split_param_factor * layers.param_bytes(l, next) / sharers_f;
        self.sharded_gradient_bytes +=
            split_param_factor * layers.gradient_bytes(l, next) / sharers_f;
        self.layer_weight_peak_bytes = self
            .layer_weight_peak_bytes
            .max(param_factor * layers.param_bytes(l, next));
        self.layer_gradient_peak_bytes = self
            .layer_gradient_peak_bytes
            .max(param_factor * layers.gradient_bytes(l, next));
        // The selective part lies in what the split divides (the attention
        // core, split by heads): a shard keeps 1/t of it.
        let selective_factor = match shard {
            Some(_) => f64::from(weight_replicas) / f64::from(gpus.max(1)),
            None => 1.0,
        };
        self.weight_bytes += param_factor * layers.param_bytes(l, next);
        self.gradient_bytes += param_factor * layers.gradient_bytes(l, next);
        // What a micro-batch keeps (`LayerCosts::in_flight_bytes`): the
        // activations of its slice, and autocast's copies of the weights.
        self.stored_bytes += stored_factor * slice * layers.stored_bytes_per_sample(l, next)
            + param_factor * layers.weight_copy_bytes(l, next);
        self.loss_kept_bytes +=
            stored_factor * slice * layers.loss_stored_bytes_per_sample_of_layer(l);
        // The ring's chunks of keys and values (split by heads, as the
        // selective part is) beside the layer's backward.
        let ring_bytes = match layers.context(l) {
            Some(p) if context > 1 => {
                crate::model::context::RING_BUFFER_CHUNKS
                    * selective_factor
                    * slice
                    * p.kv_bytes_per_sample
            }
            _ => 0.0,
        };
        self.working_bytes = self.working_bytes.max(
            stored_factor * slice * layers.backward_working_bytes_per_sample_of_layer(l)
                + ring_bytes,
        );
        self.rerun_working_bytes = self
            .rerun_working_bytes
            .max(stored_factor * slice * layers.rerun_working_bytes_per_sample_of_layer(l));
        let selective =
            selective_factor * slice * layers.selective_stored_bytes_per_sample_of_layer(l);
        self.selective_bytes += selective;
        self.selective_layer_peak_bytes = self.selective_layer_peak_bytes.max(selective);
        // Per layer: the layer after this one keeps its input (this
        // layer's output, whole on every GPU of a split stage without
        // sequence parallelism), and this layer's re-run and backward.
        if let Some(after) = self.first_layer {
            self.later_inputs_bytes += self.first_input_factor * layers.cut_bytes_per_sample(after);
        }
        self.first_layer = Some(l);
        self.first_input_factor = slice * shard.map_or(1.0, |s| s.input_factor);
        let samples = stored_factor * slice;
        let loss_kept = samples * layers.loss_stored_bytes_per_sample_of_layer(l);
        let own = recompute_backward_bytes(
            samples * layers.backward_working_bytes_per_sample_of_layer(l),
            samples * layers.stored_bytes_per_sample(l, next)
                + param_factor * layers.weight_copy_bytes(l, next)
                - loss_kept,
            samples * layers.rerun_working_bytes_per_sample_of_layer(l),
            loss_kept,
        );
        self.layer_rerun_peak_bytes = self.layer_rerun_peak_bytes.max(own);
    }

    /// The stage's memory as `shape` runs it, its first layer taking
    /// `input_bytes` per micro-batch in; `layers` prices the optimizer's step.
    pub fn memory(&self, layers: &LayerCosts, shape: &StageShape, input_bytes: f64) -> StageMemory {
        let input_bytes = input_bytes + self.loss_kept_bytes;
        let level = shape.sharding();
        // A part's bytes as a GPU keeps them: its shard where the level shards it.
        let kept = |sharded: bool, whole: f64, shard: f64| if sharded { shard } else { whole };
        let weights = (self.weight_bytes, self.sharded_weight_bytes);
        let optimizer_state = kept(
            level.shards_optimizer(),
            self.optimizer_state_bytes,
            self.sharded_optimizer_state_bytes,
        );
        let gradients = kept(
            level.shards_gradients(),
            self.gradient_bytes,
            self.sharded_gradient_bytes,
        );
        let resident_weights = kept(level.shards_weights_in_flight(), weights.0, weights.1);
        let stepped = kept(level.shards_optimizer(), weights.0, weights.1);
        // Held whole for a moment on top (`ShardLevel::gathered_bytes`).
        let gathered =
            level.gathered_bytes(self.layer_weight_peak_bytes, self.layer_gradient_peak_bytes);
        let state = resident_weights + gradients + optimizer_state;
        // Offloaded, the host keeps the optimizer's part and steps it.
        let (state, host_bytes, step_bytes, on_gpu_optimizer_state) = match shape.offload {
            Offload::None => (
                state,
                0.0,
                layers.optimizer_step_bytes(stepped),
                optimizer_state,
            ),
            Offload::Optimizer => (state - optimizer_state, optimizer_state, 0.0, 0.0),
        };
        let (stored, working) = (self.stored_bytes, self.working_bytes);
        let rerun = stored - self.loss_kept_bytes;
        let recompute_backward = recompute_backward_bytes(
            working,
            rerun,
            self.rerun_working_bytes,
            self.loss_kept_bytes,
        );
        let (fixed, per_micro_batch, recompute_backward, input_bytes) = match shape.recompute {
            Recompute::None => (state + working, stored, recompute_backward, input_bytes),
            Recompute::Full => (
                state + recompute_backward,
                input_bytes,
                recompute_backward,
                input_bytes,
            ),
            Recompute::PerLayer => {
                let kept = input_bytes + self.later_inputs_bytes;
                let peak = self.layer_rerun_peak_bytes;
                (state + peak, kept, peak, kept)
            }
            Recompute::Selective => {
                // Everything but the selective part kept; one layer's of it
                // back at a time, on top of the backward's working memory.
                let kept = stored - self.selective_bytes;
                let peak = working + self.selective_layer_peak_bytes;
                (state + peak, kept, peak, kept)
            }
        };
        StageMemory {
            fixed_bytes: fixed + gathered,
            per_micro_batch_bytes: per_micro_batch,
            model_state_bytes: state,
            weight_bytes: self.weight_bytes,
            stored_bytes: stored,
            input_bytes,
            working_bytes: working,
            rerun_bytes: rerun,
            recompute_backward_bytes: recompute_backward,
            gradient_bytes: gradients,
            optimizer_step_bytes: step_bytes,
            stepped_weight_bytes: stepped,
            optimizer_state_bytes: on_gpu_optimizer_state,
            host_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two layers of `profile_with_memory_terms`, summed whole from
    /// the last, at slices of 2 on one GPU.
    fn two_layers_summed() -> (LayerCosts, MemorySums) {
        let layers = LayerCosts::new(&crate::model::profile::profile_with_memory_terms());
        let mut sums = MemorySums::default();
        for l in (0..2).rev() {
            sums.add_layer(&layers, l, (None, 1.0), (2, 2, 1), (1, 1));
        }
        (layers, sums)
    }

    #[test]
    fn summed_memory_of_a_plain_stage_is_the_cost_models() {
        // Layer by layer, as the search grows a stage, with the terms of
        // `cost::tests::a_stage_memory_counts_each_term`.
        let (layers, sums) = two_layers_summed();
        let m = sums.memory(&layers, &StageShape::PLAIN, 0.0);
        assert_eq!(m.fixed_bytes, 16_000.0 + 40.0);
        assert_eq!(m.per_micro_batch_bytes, 600.0 + 1_500.0);
        assert_eq!(
            m.at(3),
            crate::cost::stage_memory_bytes(&layers, 0, 2, 2, 3)
        );
        // An optimizer step that needs 2 bytes per parameter byte over the
        // model state (8000 here) is the peak below 4 micro-batches in
        // flight: 16,000 + 8,000 against 16,040 + 3 x 2,100.
        let mut stepped = crate::model::profile::profile_with_memory_terms();
        stepped.optimizer_step_bytes = Some(8_000);
        let stepped_layers = LayerCosts::new(&stepped);
        let mut sums = MemorySums::default();
        for l in (0..2).rev() {
            sums.add_layer(&stepped_layers, l, (None, 1.0), (2, 2, 1), (1, 1));
        }
        let m = sums.memory(&stepped_layers, &StageShape::PLAIN, 0.0);
        assert_eq!(
            (m.gradient_bytes, m.optimizer_step_bytes),
            (4_000.0, 8_000.0)
        );
        assert_eq!((m.at(3), m.at(4)), (24_000.0, 16_040.0 + 4.0 * 2_100.0));
        for k in [3, 4] {
            assert_eq!(
                m.at(k),
                crate::cost::stage_memory_bytes(&stepped_layers, 0, 2, 2, k)
            );
        }
        // Under ZeRO-1 over 4 GPUs each steps a quarter of the weights.
        let mut sums = MemorySums::default();
        for l in (0..2).rev() {
            sums.add_layer(&stepped_layers, l, (None, 1.0), (2, 2, 1), (4, 4));
        }
        let zero = StageShape {
            shard_level: 1,
            ..StageShape::PLAIN
        };
        assert_eq!(
            sums.memory(&stepped_layers, &zero, 0.0)
                .optimizer_step_bytes,
            2_000.0
        );
        // Re-computing, a micro-batch in flight keeps the stage's input (7
        // bytes here) and what the loss keeps outside the checkpoint: 200
        // bytes at batch 4, 2 x 50 for a slice of 2 (part of l1's stored 800).
        let mut p = crate::model::profile::profile_with_memory_terms();
        p.layers[1].measurements[0].loss_stored_bytes = Some(200);
        let layers = LayerCosts::new(&p);
        let mut sums = MemorySums::default();
        for l in (0..2).rev() {
            sums.add_layer(&layers, l, (None, 1.0), (2, 2, 1), (1, 1));
        }
        let full = StageShape {
            recompute: Recompute::Full,
            ..StageShape::PLAIN
        };
        let m = sums.memory(&layers, &full, 7.0);
        assert_eq!((m.per_micro_batch_bytes, m.input_bytes), (107.0, 107.0));
        // The re-run brings back the stored activations and weight copies
        // but the loss's: 600 + 1500 - 100. On them l0's backward needs 40
        // (l1's working 20 a slice is less than the loss's 100, all the
        // loss's). Before the re-run the loss's backward needs 40 over what
        // was kept; after it, 2000 + 40 with the loss's 100 gone: 1940.
        assert_eq!(
            (m.rerun_bytes, m.recompute_backward_bytes),
            (2000.0, 1940.0)
        );
        assert_eq!(m.fixed_bytes, 16_000.0 + 1_940.0);
        assert_eq!(
            m.recompute_backward_bytes,
            layers.recompute_backward_bytes(0, 2, 2)
        );
    }

    #[test]
    fn each_sharding_level_divides_the_zero_papers_sixteen_bytes_as_its_rule_says() {
        // Mixed precision with Adam: 2 bytes of weights, 2 of gradients and
        // 12 of master weights and moments a parameter (ZeRO, Fig. 1), over
        // 2,000 parameters (4,000 bytes of bf16 weights; the larger layer
        // 1,500 of them), sharded over 4 GPUs.
        let mut p = crate::model::profile::profile_with_memory_terms();
        p.parameter_state = Some(crate::model::profile::ParameterState {
            weight_bytes: 2.0,
            gradient_bytes: 2.0,
            master_weight_bytes: 4.0,
            optimizer_bytes: 8.0,
        });
        let layers = LayerCosts::new(&p);
        let mut sums = MemorySums::default();
        for l in (0..2).rev() {
            sums.add_layer(&layers, l, (None, 1.0), (2, 2, 1), (4, 4));
        }
        let at = |shard_level, reshard_after_forward| {
            sums.memory(
                &layers,
                &StageShape {
                    shard_level,
                    reshard_after_forward,
                    ..StageShape::PLAIN
                },
                0.0,
            )
        };
        let state = |m: StageMemory| m.model_state_bytes;
        assert_eq!(state(at(0, false)), 2000.0 * 16.0);
        assert_eq!(state(at(1, false)), 2000.0 * (2.0 + 2.0 + 12.0 / 4.0));
        assert_eq!(state(at(2, false)), 2000.0 * (2.0 + (2.0 + 12.0) / 4.0));
        assert_eq!(state(at(3, true)), 2000.0 * 16.0 / 4.0);
        // Kept after the forward, the weights are whole while micro-batches
        // are in flight: level 2's state.
        assert_eq!(state(at(3, false)), state(at(2, false)));
        // On top: the larger layer's 3,000 bytes of gradients before their
        // reduce-scatter (levels 2 and 3), and re-sharded, its weights
        // gathered and the next layer's prefetched (2 x 3,000 at most).
        let on_top = |m: StageMemory| m.fixed_bytes - m.model_state_bytes;
        let base = on_top(at(1, false));
        assert_eq!(on_top(at(0, false)), base);
        assert_eq!(on_top(at(2, false)) - base, 3000.0);
        assert_eq!(on_top(at(3, false)) - base, 3000.0);
        assert_eq!(on_top(at(3, true)) - base, 9000.0);
        // A sharded GPU keeps its gradients' shard and steps its weights' shard.
        assert_eq!(at(1, false).gradient_bytes, 4000.0);
        assert_eq!(at(2, false).gradient_bytes, 1000.0);
        assert_eq!(at(3, true).stepped_weight_bytes, 1000.0);
    }

    #[test]
    fn per_layer_recomputation_keeps_every_layers_input_and_re_runs_one_layer_at_a_time() {
        // The two layers of `profile_with_memory_terms` at slices of 2: l0
        // stores 100 and works 20 a sample, l1 stores 200 and works 10 a
        // sample with 1500 of weight copies; l0 outputs 25 a sample.
        let (layers, sums) = two_layers_summed();
        let per_layer = StageShape {
            recompute: Recompute::PerLayer,
            ..StageShape::PLAIN
        };
        let m = sums.memory(&layers, &per_layer, 7.0);
        // Kept a micro-batch: the stage's input (7) and l1's (2 x 25).
        assert_eq!(layers.cut_bytes_per_sample(1), 25.0);
        assert_eq!((m.per_micro_batch_bytes, m.input_bytes), (57.0, 57.0));
        // The backward's peak is l1's re-run (2 x 200 + 1500) with its
        // working memory (2 x 10) on it; l0's is 2 x 100 + 2 x 20.
        assert_eq!(m.recompute_backward_bytes, 1920.0);
        assert_eq!(m.fixed_bytes, 16_000.0 + 1920.0);
        // The whole stage re-run at once holds both layers' activations again.
        let full = StageShape {
            recompute: Recompute::Full,
            ..StageShape::PLAIN
        };
        let whole = sums.memory(&layers, &full, 7.0);
        assert_eq!(whole.recompute_backward_bytes, 200.0 + 1900.0 + 40.0);
        assert_eq!(whole.per_micro_batch_bytes, 7.0);
    }

    #[test]
    fn a_split_stage_has_one_replica_per_group_of_t_consecutive_devices() {
        let shape = StageShape {
            tensor_parallel: 4,
            ..StageShape::PLAIN
        };
        let devices: Vec<u32> = (8..16).collect();
        assert_eq!(shape.replicas(8), 2);
        let groups: Vec<&[u32]> = shape.split_groups(&devices).collect();
        assert_eq!(groups, vec![&[8, 9, 10, 11][..], &[12, 13, 14, 15][..]]);
        // plain: a replica and a group per GPU
        assert_eq!(StageShape::PLAIN.replicas(8), 8);
        assert_eq!(StageShape::PLAIN.split_groups(&devices).count(), 8);
        // a t above the stage's GPUs (refused by the plan's check) is one replica, not zero
        assert_eq!(shape.replicas(2), 1);
        assert_eq!(shape.replicas(0), 0);
    }

    #[test]
    fn an_older_plans_flag_reads_as_level_one() {
        let shape: StageShape = serde_json::from_str(
            r#"{"tensor_parallel": 1, "shard_optimizer": true, "recompute": "none"}"#,
        )
        .unwrap();
        assert_eq!(
            shape.sharding(),
            crate::cost::sharding::ShardLevel::Optimizer
        );
        let shape: StageShape = serde_json::from_str(
            r#"{"tensor_parallel": 1, "shard_level": 3, "reshard_after_forward": true, "recompute": "none"}"#,
        )
        .unwrap();
        assert_eq!(
            shape.sharding(),
            crate::cost::sharding::ShardLevel::Weights {
                reshard_after_forward: true
            }
        );
        let text = serde_json::to_string(&shape).unwrap();
        assert!(text.contains(r#""shard_level":3"#), "{text}");
        let e = serde_json::from_str::<StageShape>(
            r#"{"tensor_parallel": 1, "shard_level": 4, "recompute": "none"}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("sharding level 4 is none of"), "{e}");
    }
}
