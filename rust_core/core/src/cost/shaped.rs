//! The cost of a stage of any shape (`shape.rs`): split layers, ZeRO-1,
//! re-computation. A plain stage costs what `StageCoster::stage_on` says;
//! this adds, on alike GPUs with even slices:
//! - split layers' compute divided by t and their AllReduces inside each
//!   replica's t GPUs, forward and backward (on the critical path, as in
//!   Megatron-LM), and the bridges between split and whole layers (an
//!   all-gather of the cut's activations into the split layers, a
//!   reduce-scatter of their gradients back; half an AllReduce each);
//! - gradient AllReduces over all the stage's GPUs for whole layers, and
//!   over each shard's replicas for split ones (the t shards' rings share
//!   each machine's network);
//! - ZeRO-1: a reduce-scatter of gradients and an all-gather of weights in
//!   place of the AllReduce, the optimizer's state over the replicas;
//! - full re-computation: the forward again in the backward, and only the
//!   stage's input kept per micro-batch.

use super::{largest_slice, Alloc, AllreduceCurve, Cluster, StageCost, StageCoster, StageDevices};
use crate::profile::LayerCosts;
use crate::shape::{shards, stage_memory, Recompute, StageMemory, StageShape};
use crate::split::ShardCost;

/// The collectives of a stage split `t` ways, its GPUs taken in device
/// order: each replica's t shards are t consecutive GPUs, and each shard's
/// replicas every t-th GPU. Groups of a kind run at once, so those that
/// share a machine share its network.
struct SplitGroups {
    shards: AllreduceCurve,
    replicas: AllreduceCurve,
}

impl SplitGroups {
    fn new(cluster: &Cluster, devices: &StageDevices, t: u32) -> SplitGroups {
        let machines = devices.replica_machines();
        let t = t as usize;
        let alloc_of = |members: &[usize]| -> Alloc {
            let mut alloc: Alloc = Vec::new();
            for &m in members {
                match alloc.iter_mut().find(|(x, _)| *x == m) {
                    Some((_, c)) => *c += 1,
                    None => alloc.push((m, 1)),
                }
            }
            alloc
        };
        // How many groups of a kind touch machine m, at most over the group's machines.
        let sharers = |group: &Alloc, touching: &dyn Fn(usize) -> usize| {
            group.iter().map(|&(m, _)| touching(m)).max().unwrap_or(1) as u32
        };
        let shard_group = alloc_of(&machines[..t.min(machines.len())]);
        let replica_members: Vec<usize> = machines.iter().step_by(t).copied().collect();
        let replica_group = alloc_of(&replica_members);
        let chunks_on = |m: usize| machines.chunks(t).filter(|c| c.contains(&m)).count();
        let shards_on = |m: usize| {
            (0..t)
                .filter(|&k| machines.iter().skip(k).step_by(t).any(|&x| x == m))
                .count()
        };
        SplitGroups {
            shards: AllreduceCurve::for_group(
                cluster,
                &shard_group,
                sharers(&shard_group, &chunks_on),
            ),
            replicas: AllreduceCurve::for_group(
                cluster,
                &replica_group,
                sharers(&replica_group, &shards_on),
            ),
        }
    }
}

/// The layers of a shaped stage: each one's shard at the stage's split
/// degree (None: whole, data parallel over all its GPUs), and the slices
/// of a micro-batch whole layers (a GPU's) and split ones (a replica's) take.
struct ShapedLayers {
    gpus: u32,
    replicas: u32,
    whole_slice: u32,
    split_slice: u32,
    shards: Vec<Option<ShardCost>>,
}

impl ShapedLayers {
    fn any_split(&self) -> bool {
        self.shards.iter().any(Option::is_some)
    }

    fn memory(
        &self,
        layers: &LayerCosts,
        start: usize,
        end: usize,
        shape: &StageShape,
    ) -> StageMemory {
        let slices = (self.whole_slice, self.split_slice);
        stage_memory(
            layers,
            start,
            end,
            shape,
            &self.shards,
            slices,
            (self.gpus, self.replicas),
        )
    }
}

/// Forward and backward milliseconds of one micro-batch.
#[derive(Default)]
struct Passes {
    fwd_ms: f64,
    bwd_ms: f64,
}

impl StageCoster<'_> {
    /// Cost of layers `start..end` on `devices` run as `shape` says, with
    /// `warmup` micro-batches in flight. A plain shape is
    /// [`StageCoster::stage_on`]; any other needs alike GPUs (no stage on
    /// mixed GPUs is split, sharded or re-computed by this model).
    pub fn stage_shaped(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
        warmup: u32,
        only_stage: bool,
    ) -> StageCost {
        if shape.is_plain() {
            return self.stage_on(start, end, devices, warmup, only_stage);
        }
        let (mut cost, memory) = self.stage_shaped_memory(start, end, devices, shape, only_stage);
        cost.memory_bytes = memory.at(warmup);
        cost
    }

    /// [`StageCoster::stage_shaped`] of a shape that is not plain, with one
    /// micro-batch in flight, and its memory at any depth (what the search
    /// checks under each warm-up rule).
    pub fn stage_shaped_memory(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
        only_stage: bool,
    ) -> (StageCost, StageMemory) {
        debug_assert!(!shape.is_plain());
        let (memory, slice, passes, allreduce_ms) = self.shaped_parts(start, end, devices, shape);
        let exposed = if only_stage && shape.tensor_parallel == 1 && !shape.shard_optimizer {
            // Data parallelism re-computing: its AllReduce overlaps the backward as a plain one's.
            self.stage_on(start, end, devices, 1, only_stage)
                .exposed_allreduce_ms
        } else {
            allreduce_ms
        };
        let cost = StageCost {
            fwd_ms: passes.fwd_ms,
            bwd_ms: passes.bwd_ms,
            allreduce_ms,
            exposed_allreduce_ms: exposed,
            memory_bytes: memory.at(1),
            memory_limit_bytes: devices.memory_limit_bytes,
            slice_size: slice,
            bubble_ms: None,
        };
        (cost, memory)
    }

    /// One GPU's memory of the stage as `shape` runs it.
    pub fn stage_memory(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
    ) -> StageMemory {
        self.shaped_layers(start, end, devices, shape)
            .memory(self.layers, start, end, shape)
    }

    /// Which layers of the stage split at its degree, and the slices whole
    /// and split layers take.
    fn shaped_layers(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
    ) -> ShapedLayers {
        let t = shape.tensor_parallel.max(1);
        let gpus = devices.replicas;
        ShapedLayers {
            gpus,
            replicas: gpus / t,
            whole_slice: largest_slice(self.micro_batch, gpus),
            split_slice: largest_slice(self.micro_batch, gpus / t),
            shards: shards(self.layers, start, end, t),
        }
    }

    /// Memory, the slice a split replica takes (else a GPU's), the passes
    /// and the gradient synchronisation of a shaped stage.
    fn shaped_parts(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
    ) -> (StageMemory, u32, Passes, f64) {
        let layers = self.shaped_layers(start, end, devices, shape);
        let memory = layers.memory(self.layers, start, end, shape);
        // The split's groups, made once for its AllReduces, bridges and gradients.
        let groups = layers
            .any_split()
            .then(|| SplitGroups::new(self.cluster, devices, shape.tensor_parallel));
        let mut passes = self.split_passes(start, end, devices, &layers, groups.as_ref());
        if shape.recompute == Recompute::Full {
            passes.bwd_ms += passes.fwd_ms;
        }
        let allreduce_ms =
            self.gradient_sync_ms(start, end, devices, &layers.shards, groups.as_ref(), shape);
        let slice = if layers.any_split() {
            layers.split_slice
        } else {
            layers.whole_slice
        };
        (memory, slice, passes, allreduce_ms)
    }

    /// Compute, the split layers' AllReduces and the bridges of one
    /// micro-batch, on the stage's (alike) GPUs.
    fn split_passes(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shaped: &ShapedLayers,
        groups: Option<&SplitGroups>,
    ) -> Passes {
        let (timing, speed) = devices.paces[0];
        let (whole_slice, split_slice) = (shaped.whole_slice, shaped.split_slice);
        let layer_shards = &shaped.shards;
        let (whole, split) = (
            self.times(timing, whole_slice),
            self.times(timing, split_slice),
        );
        // Only split layers and bridges use the shards' group, and they exist only with it.
        let shard_group = |bytes: f64| groups.map_or(0.0, |g| g.shards.ms(bytes));
        let mut passes = Passes::default();
        let mut run_start = start;
        for (i, l) in (start..end).enumerate() {
            let shard = layer_shards[i];
            let next_is_same = (l + 1 < end) && layer_shards[i + 1].is_some() == shard.is_some();
            if let Some(s) = shard {
                let samples = f64::from(split_slice);
                passes.fwd_ms += split.fwd(l, l + 1) / speed * s.compute_factor
                    + shard_group(s.fwd_allreduce_bytes_per_sample * samples);
                passes.bwd_ms += split.bwd(l, l + 1) / speed * s.compute_factor
                    + shard_group(s.bwd_allreduce_bytes_per_sample * samples);
            } else if !next_is_same {
                // Whole layers in runs: one range of the prefix sums, as a plain stage.
                passes.fwd_ms += whole.fwd(run_start, l + 1) / speed;
                passes.bwd_ms += whole.bwd(run_start, l + 1) / speed;
            }
            if !next_is_same {
                run_start = l + 1;
            }
            // A bridge where whole layers meet split ones (never at t = 1).
            if l + 1 < end && layer_shards[i + 1].is_some() != shard.is_some() {
                let gather_ms =
                    shard_group(self.layers.cut_bytes_per_sample(l + 1) * f64::from(split_slice))
                        / 2.0;
                if shard.is_none() {
                    passes.fwd_ms += gather_ms;
                }
                passes.bwd_ms += gather_ms;
            }
        }
        passes
    }

    /// Gradient AllReduces (ZeRO-1: reduce-scatter and all-gather) of one
    /// iteration: whole layers' over all the stage's GPUs, split layers'
    /// over each shard's replicas.
    fn gradient_sync_ms(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        layer_shards: &[Option<ShardCost>],
        groups: Option<&SplitGroups>,
        shape: &StageShape,
    ) -> f64 {
        let (mut whole_bytes, mut split_bytes) = (0.0, 0.0);
        for (l, shard) in (start..end).zip(layer_shards) {
            let bytes = self.layers.gradient_bytes(l, l + 1);
            match shard {
                Some(s) => split_bytes += bytes * s.param_factor,
                None => whole_bytes += bytes,
            }
        }
        let split_ms = groups.map_or(0.0, |g| g.replicas.ms(split_bytes));
        let ms = devices.allreduce.ms(whole_bytes) + split_ms;
        if shape.shard_optimizer {
            // Half an AllReduce's volume in gradients, half in weights.
            ms * (1.0 + self.layers.weights_per_gradient_byte()) / 2.0
        } else {
            ms
        }
    }
}
