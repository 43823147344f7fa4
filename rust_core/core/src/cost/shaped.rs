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
//! - sequence parallelism: a split layer's replicated share and input
//!   divided by t too (`SplitPattern::shard`);
//! - re-computation: the forward again in the backward, and only the
//!   stage's input kept per micro-batch (full), or each layer's (per
//!   layer); or the selective parts again, and all but them kept.

use super::{largest_slice, Alloc, AllreduceCurve, Cluster, StageCost, StageCoster, StageDevices};
use crate::overlap::{exposed_before_forward, exposed_behind_backward};
use crate::shape::{MemorySums, StageMemory, StageShape};
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

/// A shaped stage's layers `start..end` at split degree `t`, summed one
/// layer at a time from its last (the search's order, so that growing a
/// stage by a layer costs one layer): compute, the split layers'
/// AllReduces and the bridges between split and whole layers, gradient
/// bytes, and memory. One sum serves every shape at `t`: ZeRO-1 and
/// re-computation are applied when it is priced
/// ([`StageCoster::shaped_cost`]).
pub struct ShapedSums {
    t: u32,
    sequence_parallel: bool,
    start: usize,
    end: usize,
    gpus: u32,
    replicas: u32,
    whole_slice: u32,
    split_slice: u32,
    /// Built where t > 1 (used only once some layer splits).
    groups: Option<SplitGroups>,
    /// The first layer's shard (None: whole, or no layer yet).
    first_shard: Option<ShardCost>,
    any_split: bool,
    /// Where the run of whole layers the stage starts with ends (None: it
    /// starts split, or has no layer): such a run is priced from the
    /// profile's range sums, as a plain stage's layers are, so that a
    /// stage that splits nothing costs what the plain one does.
    whole_run_end: Option<usize>,
    /// Passes of the layers after that run, and the bridges.
    settled_fwd_ms: f64,
    settled_bwd_ms: f64,
    split_gradient_bytes: f64,
    /// Of whole layers, summed a layer at a time (used where some layer
    /// splits; else the range's, as a plain stage's).
    whole_gradient_bytes: f64,
    memory: MemorySums,
}

impl ShapedSums {
    /// The first layer summed.
    pub fn start(&self) -> usize {
        self.start
    }

    /// Whether the sums price `shape`: the same split degree and sequence
    /// parallelism (ZeRO-1 and re-computation are applied when priced).
    pub fn prices(&self, shape: &StageShape) -> bool {
        self.t == shape.tensor_parallel.max(1) && self.sequence_parallel == shape.sequence_parallel
    }
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
        let sums = self.shaped_sums(start, end, devices, shape);
        let (mut cost, memory) = self.shaped_cost(&sums, devices, shape, only_stage);
        cost.memory_bytes = memory.at(warmup);
        cost
    }

    /// One GPU's memory of the stage as `shape` runs it.
    pub fn stage_memory(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
    ) -> StageMemory {
        let sums = self.shaped_sums(start, end, devices, shape);
        self.shaped_cost(&sums, devices, shape, false).1
    }

    /// Layers `start..end` on `devices` at `shape`'s split degree and
    /// sequence parallelism, summed.
    pub fn shaped_sums(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
    ) -> ShapedSums {
        let mut sums = self.empty_shaped_sums(end, devices, shape);
        while sums.start > start {
            self.prepend_layer(&mut sums, devices);
        }
        sums
    }

    /// No layers yet of a stage ending at layer `end`, run as `shape`.
    pub fn empty_shaped_sums(
        &self,
        end: usize,
        devices: &StageDevices,
        shape: &StageShape,
    ) -> ShapedSums {
        let t = shape.tensor_parallel.max(1);
        let gpus = devices.replicas;
        let replicas = StageShape {
            tensor_parallel: t,
            ..StageShape::PLAIN
        }
        .replicas(gpus);
        ShapedSums {
            t,
            sequence_parallel: shape.sequence_parallel,
            start: end,
            end,
            gpus,
            replicas,
            whole_slice: largest_slice(self.micro_batch, gpus),
            split_slice: largest_slice(self.micro_batch, replicas),
            groups: (t > 1).then(|| SplitGroups::new(self.cluster, devices, t)),
            first_shard: None,
            any_split: false,
            whole_run_end: None,
            settled_fwd_ms: 0.0,
            settled_bwd_ms: 0.0,
            split_gradient_bytes: 0.0,
            whole_gradient_bytes: 0.0,
            memory: MemorySums::default(),
        }
    }

    /// Add the layer before `sums`' first: its compute (split layers' a
    /// shard's, with their AllReduces inside each replica's t GPUs), the
    /// bridge where it meets the next layer split one way and it the
    /// other (an all-gather of the cut's activations into split layers, a
    /// reduce-scatter of their gradients back: half an AllReduce each), its
    /// gradients and its memory.
    pub fn prepend_layer(&self, sums: &mut ShapedSums, devices: &StageDevices) {
        let l = sums.start - 1;
        let shard = if sums.t > 1 {
            self.layers.shard(l, sums.t, sums.sequence_parallel)
        } else {
            None
        };
        let (timing, speed) = devices.paces[0];
        let shard_group = |groups: &Option<SplitGroups>, bytes: f64| {
            groups.as_ref().map_or(0.0, |g| g.shards.ms(bytes))
        };
        match &shard {
            Some(s) => {
                if let Some(end) = sums.whole_run_end.take() {
                    let whole = self.times(timing, sums.whole_slice);
                    sums.settled_fwd_ms += whole.fwd(l + 1, end) / speed;
                    sums.settled_bwd_ms += whole.bwd(l + 1, end) / speed;
                }
                let split = self.times(timing, sums.split_slice);
                let samples = f64::from(sums.split_slice);
                // Each pass's AllReduces, priced a call at a time.
                let calls = f64::from(s.allreduce_calls_per_pass);
                let allreduces = |bytes_per_sample: f64| {
                    calls * shard_group(&sums.groups, bytes_per_sample * samples / calls)
                };
                sums.settled_fwd_ms += split.fwd(l, l + 1) / speed * s.compute_factor
                    + allreduces(s.fwd_allreduce_bytes_per_sample);
                sums.settled_bwd_ms += split.bwd(l, l + 1) / speed * s.compute_factor
                    + allreduces(s.bwd_allreduce_bytes_per_sample);
                sums.split_gradient_bytes += self.layers.gradient_bytes(l, l + 1) * s.param_factor;
            }
            None => {
                sums.whole_run_end.get_or_insert(l + 1);
                sums.whole_gradient_bytes += self.layers.gradient_bytes(l, l + 1);
            }
        }
        if l + 1 < sums.end && sums.first_shard.is_some() != shard.is_some() {
            let cut_bytes = self.layers.cut_bytes_per_sample(l + 1) * f64::from(sums.split_slice);
            let gather_ms = shard_group(&sums.groups, cut_bytes) / 2.0;
            if shard.is_none() {
                sums.settled_fwd_ms += gather_ms;
            }
            sums.settled_bwd_ms += gather_ms;
        }
        sums.memory.add_layer(
            self.layers,
            l,
            shard.as_ref(),
            (sums.whole_slice, sums.split_slice),
            (sums.gpus, sums.replicas),
        );
        sums.any_split |= shard.is_some();
        sums.first_shard = shard;
        sums.start = l;
    }

    /// The cost, with one micro-batch in flight, and the memory of the
    /// summed stage as `shape` (at the sums' split degree) runs it.
    /// Gradients: whole layers' AllReduce over all the stage's GPUs, split
    /// ones' over each shard's replicas (ZeRO-1: a reduce-scatter and an
    /// all-gather in their place); full re-computation runs the forward
    /// again in the backward and keeps only the stage's input.
    pub fn shaped_cost(
        &self,
        sums: &ShapedSums,
        devices: &StageDevices,
        shape: &StageShape,
        only_stage: bool,
    ) -> (StageCost, StageMemory) {
        debug_assert!(sums.prices(shape));
        let (split_ms, whole_gradient_bytes) = match &sums.groups {
            Some(g) if sums.any_split => (
                g.replicas.ms(sums.split_gradient_bytes),
                sums.whole_gradient_bytes,
            ),
            _ => (0.0, self.layers.gradient_bytes(sums.start, sums.end)),
        };
        let (timing, speed) = devices.paces[0];
        let (mut fwd_ms, mut bwd_ms) = (sums.settled_fwd_ms, sums.settled_bwd_ms);
        if let Some(end) = sums.whole_run_end {
            let whole = self.times(timing, sums.whole_slice);
            fwd_ms += whole.fwd(sums.start, end) / speed;
            bwd_ms += whole.bwd(sums.start, end) / speed;
        }
        let reduce_ms = devices.allreduce.ms(whole_gradient_bytes) + split_ms;
        let (exposed, allreduce_ms) = self.exposed_reduction(
            sums,
            devices,
            shape,
            only_stage,
            reduce_ms,
            (fwd_ms, bwd_ms),
        );
        let first_slice = match &sums.first_shard {
            Some(s) => f64::from(sums.split_slice) * s.input_factor,
            None => f64::from(sums.whole_slice),
        };
        let input_bytes = first_slice * self.layers.cut_bytes_per_sample(sums.start);
        let memory = sums.memory.memory(self.layers, shape, input_bytes);
        if !shape.recompute.is_none() {
            // The forward again, but what torch's checkpoint does not re-run
            // of the last layer, or the selective parts alone (shares from
            // the profile's own times).
            let own = self.times(0, sums.whole_slice);
            bwd_ms += fwd_ms
                * shape.recompute.rerun_ratio(
                    self.layers,
                    own,
                    (sums.start, sums.end),
                    sums.whole_slice,
                );
        }
        let slice = if sums.any_split {
            sums.split_slice
        } else {
            sums.whole_slice
        };
        let cost = StageCost {
            fwd_ms,
            bwd_ms,
            allreduce_ms,
            exposed_allreduce_ms: exposed,
            memory_bytes: memory.at(1),
            memory_limit_bytes: devices.memory_limit_bytes,
            slice_size: slice,
            bubble_ms: None,
        };
        (cost, memory)
    }

    /// The gradient reduction of the summed stage (`reduce_ms`: its
    /// AllReduces) as the runtime runs it: under ZeRO-1 a reduce-scatter of
    /// the gradients and an all-gather of the weights in its place (half an
    /// AllReduce's volume each, in its own bytes); what the runtime hides
    /// behind the passes (`fwd_ms`, `bwd_ms`: one micro-batch's, before
    /// re-computation) as `self.overlap` says, bucket by bucket over the
    /// layers, each layer's share of a pass its share of the plain stage's,
    /// and of the bytes its share of the gradients. Returns (exposed, all).
    fn exposed_reduction(
        &self,
        sums: &ShapedSums,
        devices: &StageDevices,
        shape: &StageShape,
        only_stage: bool,
        reduce_ms: f64,
        (fwd_ms, bwd_ms): (f64, f64),
    ) -> (f64, f64) {
        let weights_per_gradient_byte = self.layers.weights_per_gradient_byte();
        let all = if shape.shard_optimizer {
            reduce_ms * (1.0 + weights_per_gradient_byte) / 2.0
        } else {
            reduce_ms
        };
        let hides_reduce = self.overlap.hides_grad_reduce(only_stage, shape);
        let hides_gather = self.overlap.hides_param_gather(shape);
        if !hides_reduce && !hides_gather {
            return (all, all);
        }
        if hides_reduce && shape.tensor_parallel <= 1 && !shape.shard_optimizer {
            // Its AllReduce overlaps the backward as a plain stage's.
            let exposed = if devices.replicas > 1 {
                let slice = largest_slice(self.micro_batch, devices.replicas);
                self.exposed_plain_allreduce(sums.start, sums.end, devices, slice)
            } else {
                all
            };
            return (exposed, all);
        }
        let (scatter_ms, gather_ms) = if shape.shard_optimizer {
            (reduce_ms / 2.0, reduce_ms / 2.0 * weights_per_gradient_byte)
        } else {
            (reduce_ms, 0.0)
        };
        let (start, end) = (sums.start, sums.end);
        let plain = self.times(devices.paces[0].0, sums.whole_slice);
        let share = |part: f64, whole: f64| if whole > 0.0 { part / whole } else { 0.0 };
        // Each GPU's gradient bytes of a layer, its share of the stage's
        // (split layers hold a shard's).
        let all_bytes = self.layers.gradient_bytes(start, end);
        let per_gpu_bytes = if sums.any_split {
            sums.whole_gradient_bytes + sums.split_gradient_bytes
        } else {
            all_bytes
        };
        let bytes =
            |l: usize| self.layers.gradient_bytes(l, l + 1) * share(per_gpu_bytes, all_bytes);
        // A bucket's time: its share of the bytes of the whole transfer.
        let of_bytes = |total_ms: f64| move |b: f64| total_ms * share(b, per_gpu_bytes);
        let scatter = if hides_reduce {
            let layer_bwd = |l: usize| bwd_ms * share(plain.bwd(l, l + 1), plain.bwd(start, end));
            exposed_behind_backward(
                (start..end).rev().map(|l| (layer_bwd(l), bytes(l))),
                of_bytes(scatter_ms),
            )
        } else {
            scatter_ms
        };
        let gather = if hides_gather {
            let layer_fwd = |l: usize| fwd_ms * share(plain.fwd(l, l + 1), plain.fwd(start, end));
            exposed_before_forward(
                (start..end).map(|l| (layer_fwd(l), bytes(l))),
                of_bytes(gather_ms),
            )
        } else {
            gather_ms
        };
        (scatter + gather, all)
    }
}
