//! The cost of a stage of any shape (`cost/shape.rs`): split layers, sharding,
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
//! - sharding (`cost/sharding.rs`): reduce-scatters of gradients and all-gathers
//!   of weights in place of the AllReduce, once an iteration or with every
//!   micro-batch as the level says, and what the level keeps sharded;
//! - sequence parallelism: a split layer's replicated share and input
//!   divided by t too (`SplitPattern::shard`);
//! - re-computation: the forward again in the backward, and only the
//!   stage's input kept per micro-batch (full), or each layer's (per
//!   layer); or the selective parts again, and all but them kept;
//! - an offloaded optimizer: its state in host memory, its step on the
//!   host after the last backward (`offload.rs`).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use super::all_to_all::AllToAll;
use super::offload::offloaded_step_ms;
use super::{
    largest_slice, Alloc, Cluster, Collective, CollectiveCurve, StageCost, StageCoster,
    StageDevices,
};
use crate::cost::overlap::{exposed_before_forward, exposed_behind_backward};
use crate::cost::shape::{MemorySums, Offload, Recompute, StageMemory, StageShape};
use crate::model::context::RingTraffic;
use crate::model::experts::ALL_TO_ALLS_PER_PASS;
use crate::model::split::ShardCost;

/// The collectives of a stage split `t` ways, its GPUs taken in device
/// order: each replica's t shards are t consecutive GPUs, and each shard's
/// replicas every t-th GPU. Groups of a kind run at once, so those that
/// share a machine share its network.
struct SplitGroups {
    shards: CollectiveCurve,
    replicas: CollectiveCurve,
    /// Whether the shards' all-gathers and reduce-scatters cost half their
    /// AllReduce (no link of theirs has a curve of its own for them).
    shards_halve: bool,
    /// The shards' collectives of the last two sizes priced, (bytes, ms of
    /// each `Collective`, NaN until asked): a stage's layers are mostly
    /// alike, so a stage grown a layer at a time asks for the same few
    /// again and again.
    shards_priced: Cell<[(f64, [f64; 3]); 2]>,
}

impl SplitGroups {
    fn new(cluster: &Cluster, machines: &[usize], t: u32) -> SplitGroups {
        let shards = consecutive_group(cluster, machines, t as usize);
        SplitGroups {
            shards_halve: shards.halves_allreduce(Collective::AllGather)
                && shards.halves_allreduce(Collective::ReduceScatter),
            shards,
            replicas: strided_group(cluster, machines, t as usize),
            shards_priced: Cell::new([(f64::NAN, [f64::NAN; 3]); 2]),
        }
    }

    /// A `kind` of collective of `bytes` inside a replica's t shards.
    fn shards_ms(&self, kind: Collective, bytes: f64) -> f64 {
        let (priced, share) = match kind {
            Collective::AllReduce => (Collective::AllReduce, 1.0),
            _ if self.shards_halve => (Collective::AllReduce, 0.5),
            _ => (kind, 1.0),
        };
        let [last, before] = self.shards_priced.get();
        let (mut entry, other) = if last.0 == bytes {
            (last, before)
        } else if before.0 == bytes {
            (before, last)
        } else {
            ((bytes, [f64::NAN; 3]), last)
        };
        let ms = &mut entry.1[priced as usize];
        if ms.is_nan() {
            *ms = self.shards.of(priced, bytes);
        }
        let ms = *ms;
        self.shards_priced.set([entry, other]);
        ms * share
    }
}

/// The AllReduce of `size` consecutive GPUs of a stage whose GPUs sit on
/// `machines` (in device order), beside the other such groups, which run
/// at once: a replica's t shards, or an expert's et shards.
fn consecutive_group(cluster: &Cluster, machines: &[usize], size: usize) -> CollectiveCurve {
    let group = alloc_of(&machines[..size.min(machines.len())]);
    let sharing = sharers(&group, machines, |i| i / size.max(1));
    CollectiveCurve::for_group(cluster, &group, sharing)
}

/// The GPUs per machine of a group whose members sit on `members`.
fn alloc_of(members: &[usize]) -> Alloc {
    let mut alloc: Alloc = Vec::new();
    for &m in members {
        match alloc.iter_mut().find(|(x, _)| *x == m) {
            Some((_, c)) => *c += 1,
            None => alloc.push((m, 1)),
        }
    }
    alloc
}

/// How many groups of a kind touch machine m, at most over `group`'s
/// machines, where `group_of(i)` names the group of the stage's i-th GPU
/// (on `machines[i]`). One pass over the stage's GPUs (a stage of 1,024
/// GPUs asked each machine of each group about every GPU).
fn sharers(group: &Alloc, machines: &[usize], group_of: impl Fn(usize) -> usize) -> u32 {
    let mut members: Vec<usize> = group.iter().map(|&(m, _)| m).collect();
    members.sort_unstable();
    let mut touches: Vec<(usize, usize)> = machines
        .iter()
        .enumerate()
        .map(|(i, &m)| (m, group_of(i)))
        .collect();
    touches.sort_unstable();
    touches.dedup();
    let most = touches
        .chunk_by(|a, b| a.0 == b.0)
        .filter(|on| members.binary_search(&on[0].0).is_ok())
        .map(<[(usize, usize)]>::len)
        .max();
    most.unwrap_or(1) as u32
}

/// The AllReduce of every `stride`-th GPU of a stage whose GPUs sit on
/// `machines` (in device order), beside the `stride` groups of that shape
/// (one per first GPU) that run at once: a shard's replicas (stride t),
/// or the replicas that hold the same experts (stride t e).
fn strided_group(cluster: &Cluster, machines: &[usize], stride: usize) -> CollectiveCurve {
    let members: Vec<usize> = machines.iter().step_by(stride).copied().collect();
    let group = alloc_of(&members);
    let sharing = sharers(&group, machines, |i| i % stride);
    CollectiveCurve::for_group(cluster, &group, sharing)
}

/// The AllReduce of one context group of a stage whose GPUs sit on
/// `machines` (in device order): `c` GPUs `t` apart (each data replica's
/// t c GPUs hold c split groups in a row), beside the stage's other
/// context groups, which run at once.
fn context_group(cluster: &Cluster, machines: &[usize], (t, c): (usize, usize)) -> CollectiveCurve {
    let members: Vec<usize> = (0..c).map(|j| machines[j * t]).collect();
    let group = alloc_of(&members);
    // GPU i is shard i mod t of data replica i / (t c).
    let sharing = sharers(&group, machines, |i| i / (t * c) * t + i % t);
    CollectiveCurve::for_group(cluster, &group, sharing)
}

/// The collectives of a stage's expert groups (`model/experts.rs`) of `e`
/// expert replicas, for the layers that split `t` ways (expert replicas of
/// `et` consecutive GPUs) and those that run whole (each GPU a replica):
/// the token exchange, the gather of the exchanged copies over each
/// expert's et shards (et > 1), and the gradient AllReduce of the routed
/// experts over the GPUs that hold the same ones.
#[derive(Debug, PartialEq)]
pub(crate) struct ExpertGroups {
    split_exchange: AllToAll,
    whole_exchange: AllToAll,
    /// An expert's et shards, where et > 1.
    expert_shards: Option<CollectiveCurve>,
    split_reduce: CollectiveCurve,
    whole_reduce: CollectiveCurve,
}

/// The expert groups of one allocation at each (e, et) priced on it, built
/// once: many stages of a search share an allocation. A memo of values
/// derived from the allocation, so two are equal whatever they hold.
#[derive(Default, Clone)]
pub(crate) struct ExpertGroupsMemo(RefCell<Vec<(ExpertDegrees, Rc<ExpertGroups>)>>);

/// An expert degree and expert tensor degree.
type ExpertDegrees = (u32, u32);

impl ExpertGroupsMemo {
    /// The groups at (e, et) of the allocation whose GPUs sit on
    /// `machines` (in device order; the memo's own allocation).
    fn get(
        &self,
        coster: &StageCoster,
        machines: &[usize],
        (e, et): (u32, u32),
    ) -> Rc<ExpertGroups> {
        if let Some((_, groups)) = self.0.borrow().iter().find(|(key, _)| *key == (e, et)) {
            return Rc::clone(groups);
        }
        let deduplicated = coster.layers.deduplicates_tokens();
        let groups = Rc::new(ExpertGroups::new(
            coster.cluster,
            machines,
            (e, et),
            deduplicated,
        ));
        self.0.borrow_mut().push(((e, et), Rc::clone(&groups)));
        groups
    }
}

impl std::fmt::Debug for ExpertGroupsMemo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertGroupsMemo({} built)", self.0.borrow().len())
    }
}

impl PartialEq for ExpertGroupsMemo {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl ExpertGroups {
    /// `deduplicated`: some layer exchanges its tokens as DeepEP does.
    fn new(
        cluster: &Cluster,
        machines: &[usize],
        (e, et): (u32, u32),
        deduplicated: bool,
    ) -> ExpertGroups {
        let (e, et) = (e as usize, et as usize);
        ExpertGroups {
            split_exchange: AllToAll::new(cluster, machines, (et, e), deduplicated),
            whole_exchange: AllToAll::new(cluster, machines, (1, e), deduplicated),
            expert_shards: (et > 1).then(|| consecutive_group(cluster, machines, et)),
            split_reduce: strided_group(cluster, machines, et * e),
            whole_reduce: strided_group(cluster, machines, e),
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
    /// The context degree (1: none), and its groups' collective where c > 1.
    c: u32,
    context: Option<CollectiveCurve>,
    /// The expert degree (1: none) and expert tensor degree, and the
    /// expert groups where e > 1.
    e: u32,
    et: u32,
    experts: Option<Rc<ExpertGroups>>,
    start: usize,
    end: usize,
    gpus: u32,
    /// The GPUs holding each shard of the split layers' weights (t apart:
    /// the data replicas and their context ranks).
    weight_replicas: u32,
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
    /// splits or experts spread; else the range's, as a plain stage's).
    whole_gradient_bytes: f64,
    /// One GPU's gradients of the routed experts it holds (e > 1), of
    /// split layers and of whole ones: reduced over the replicas that
    /// hold the same experts.
    split_expert_gradient_bytes: f64,
    whole_expert_gradient_bytes: f64,
    /// The forward selective re-computation runs again, on the profile's
    /// own times at the whole layers' slice (`LayerCosts::selective_ratio`'s
    /// numerator, summed as the stage grows).
    selective_rerun_fwd_ms: f64,
    memory: MemorySums,
    /// What every shape priced from these sums shares (`CommonCost`), kept
    /// until a layer is added: several shapes are priced at each length.
    common: Cell<Option<CommonCost>>,
    /// A sharded shape's gradient reduce-scatter and weight gather, ms,
    /// kept as `common` is.
    sharded_collectives: Cell<Option<(f64, f64)>>,
}

/// The part of a summed stage's cost that no shape changes: one
/// micro-batch's passes (before re-computation and sharding's collectives),
/// the gradient reduction as AllReduces, and the bytes of the stage's input
/// a GPU keeps per micro-batch.
#[derive(Debug, Clone, Copy)]
struct CommonCost {
    fwd_ms: f64,
    bwd_ms: f64,
    reduce_ms: f64,
    input_bytes: f64,
}

impl ShapedSums {
    /// The first layer summed.
    pub fn start(&self) -> usize {
        self.start
    }

    /// The share of each sample's tokens one GPU runs: 1 / c.
    fn context_share(&self) -> f64 {
        1.0 / f64::from(self.c)
    }

    /// Whether the sums price `shape`: the same split degree, sequence
    /// parallelism, expert degree, expert tensor degree and context degree
    /// (sharding and re-computation are applied when priced).
    pub fn prices(&self, shape: &StageShape) -> bool {
        self.t == shape.tensor_parallel.max(1)
            && self.c == shape.context_parallel.max(1)
            && self.sequence_parallel == shape.sequence_parallel
            && self.e == shape.expert_parallel.max(1)
            && self.et == shape.expert_tensor_degree()
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
        let (t, e, et) = (
            shape.tensor_parallel.max(1),
            shape.expert_parallel.max(1),
            shape.expert_tensor_degree(),
        );
        let c = shape.context_parallel.max(1);
        let gpus = devices.replicas;
        let sums_shape = StageShape {
            tensor_parallel: t,
            context_parallel: c,
            ..StageShape::PLAIN
        };
        let replicas = sums_shape.replicas(gpus);
        let machines = if t > 1 || e > 1 || c > 1 {
            devices.replica_machines()
        } else {
            Vec::new()
        };
        ShapedSums {
            t,
            sequence_parallel: shape.sequence_parallel,
            c,
            context: (c > 1)
                .then(|| context_group(self.cluster, &machines, (t as usize, c as usize))),
            e,
            et,
            experts: (e > 1).then(|| devices.expert_groups.get(self, &machines, (e, et))),
            start: end,
            end,
            gpus,
            weight_replicas: sums_shape.weight_replicas(gpus),
            // Whole layers run data parallel over the stage's GPUs / c,
            // each cutting its samples' sequence c ways.
            whole_slice: largest_slice(self.micro_batch, gpus / c),
            split_slice: largest_slice(self.micro_batch, replicas),
            groups: (t > 1).then(|| SplitGroups::new(self.cluster, &machines, t)),
            first_shard: None,
            any_split: false,
            whole_run_end: None,
            settled_fwd_ms: 0.0,
            settled_bwd_ms: 0.0,
            split_gradient_bytes: 0.0,
            whole_gradient_bytes: 0.0,
            split_expert_gradient_bytes: 0.0,
            whole_expert_gradient_bytes: 0.0,
            selective_rerun_fwd_ms: 0.0,
            memory: MemorySums::default(),
            common: Cell::new(None),
            sharded_collectives: Cell::new(None),
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
        sums.common.set(None);
        sums.sharded_collectives.set(None);
        let shard = if sums.t > 1 {
            self.layers
                .shard_at(l, sums.t, sums.sequence_parallel, sums.split_slice)
        } else {
            None
        };
        let (timing, speed) = devices.paces[0];
        let shard_group = |groups: &Option<SplitGroups>, kind: Collective, bytes: f64| {
            groups.as_ref().map_or(0.0, |g| g.shards_ms(kind, bytes))
        };
        // Expert parallelism: the layer's routed experts spread, their
        // share of its gradients reduced apart, its tokens exchanged.
        let (held, gather_taken_bytes_per_sample) =
            self.prepend_experts(sums, l, shard.as_ref(), devices);
        // What the AllReduce of all the stage's replicas reduces of the layer.
        let spread = sums.experts.as_ref().and(self.layers.experts(l));
        let replicated_gradient_bytes =
            self.layers.gradient_bytes(l, l + 1) * spread.map_or(1.0, |p| 1.0 - p.param_fraction);
        // A GPU's share of each sample's tokens (context parallelism).
        let tokens = sums.context_share();
        match &shard {
            Some(s) => {
                if let Some(end) = sums.whole_run_end.take() {
                    let whole = self.times(timing, sums.whole_slice);
                    sums.settled_fwd_ms += whole.fwd(l + 1, end) / speed * tokens;
                    sums.settled_bwd_ms += whole.bwd(l + 1, end) / speed * tokens;
                }
                let split = self.times(timing, sums.split_slice);
                let samples = f64::from(sums.split_slice) * tokens;
                // Each pass's AllReduces (sequence parallel: reduce-scatters
                // and all-gathers), priced a call at a time, less the
                // gather the experts' exchange replaced.
                let taken = gather_taken_bytes_per_sample;
                let calls = s.allreduce_calls_per_pass - u32::from(taken > 0.0);
                let calls_ms = |bytes_per_sample: f64, of_call: &dyn Fn(f64) -> f64| {
                    if calls == 0 || bytes_per_sample <= 0.0 {
                        return 0.0;
                    }
                    let calls = f64::from(calls);
                    calls * of_call((bytes_per_sample - taken).max(0.0) * samples / calls)
                };
                let reduce = |bytes: f64| {
                    if s.scatter_gather {
                        shard_group(&sums.groups, Collective::ReduceScatter, bytes)
                            + shard_group(&sums.groups, Collective::AllGather, bytes)
                    } else {
                        shard_group(&sums.groups, Collective::AllReduce, bytes)
                    }
                };
                let gather = |bytes: f64| shard_group(&sums.groups, Collective::AllGather, bytes);
                sums.settled_fwd_ms += split.fwd(l, l + 1) / speed * s.compute_factor * tokens
                    + calls_ms(s.fwd_allreduce_bytes_per_sample, &reduce);
                sums.settled_bwd_ms += split.bwd(l, l + 1) / speed * s.compute_factor * tokens
                    + calls_ms(s.bwd_allreduce_bytes_per_sample, &reduce)
                    + calls_ms(s.bwd_regather_bytes_per_sample, &gather);
                sums.split_gradient_bytes += replicated_gradient_bytes * s.param_factor;
            }
            None => {
                sums.whole_run_end.get_or_insert(l + 1);
                sums.whole_gradient_bytes += replicated_gradient_bytes;
            }
        }
        self.prepend_ring(sums, l, shard.is_some(), devices);
        sums.selective_rerun_fwd_ms += self.layers.selective_rerun_fwd_ms(
            self.times(0, sums.whole_slice),
            l,
            sums.whole_slice,
        );
        if l + 1 < sums.end && sums.first_shard.is_some() != shard.is_some() {
            let cut_bytes =
                self.layers.cut_bytes_per_sample(l + 1) * f64::from(sums.split_slice) * tokens;
            if shard.is_none() {
                sums.settled_fwd_ms += shard_group(&sums.groups, Collective::AllGather, cut_bytes);
            }
            sums.settled_bwd_ms += shard_group(&sums.groups, Collective::ReduceScatter, cut_bytes);
        }
        sums.memory.add_layer(
            self.layers,
            l,
            (shard.as_ref(), held),
            (sums.whole_slice, sums.split_slice, sums.c),
            (sums.gpus, sums.weight_replicas),
        );
        sums.any_split |= shard.is_some();
        sums.first_shard = shard;
        sums.start = l;
    }

    /// Context parallelism's ring for layer `l` (split by heads where
    /// `split`): each pass's exchange of keys and values over the context
    /// group (`RingTraffic`; the c - 1 steps move what an all-gather of
    /// them would, half an AllReduce's volume), less the attention core's
    /// time it runs beside.
    fn prepend_ring(&self, sums: &mut ShapedSums, l: usize, split: bool, devices: &StageDevices) {
        let (Some(group), Some(pattern)) = (&sums.context, self.layers.context(l)) else {
            return;
        };
        let (slice, heads) = if split {
            (sums.split_slice, 1.0 / f64::from(sums.t))
        } else {
            (sums.whole_slice, 1.0)
        };
        let kv_bytes = pattern.kv_bytes_per_sample * f64::from(slice) * heads;
        if kv_bytes <= 0.0 {
            return;
        }
        let traffic = RingTraffic::of(kv_bytes, sums.c);
        let gather_ms =
            |sent: f64| group.of(Collective::AllGather, sent / traffic.fwd_bytes * kv_bytes);
        let (timing, speed) = devices.paces[0];
        let times = self.times(timing, slice);
        let compute_factor = if split {
            self.layers
                .shard_at(l, sums.t, sums.sequence_parallel, slice)
                .map_or(1.0, |s| s.compute_factor)
        } else {
            1.0
        };
        let share = compute_factor * sums.context_share() * pattern.attention_compute_fraction;
        let exposed =
            |sent: f64, pass_ms: f64| (gather_ms(sent) - pass_ms / speed * share).max(0.0);
        let fwd = exposed(traffic.fwd_bytes, times.fwd(l, l + 1));
        let bwd = exposed(traffic.bwd_bytes, times.bwd(l, l + 1));
        sums.settled_fwd_ms += fwd;
        sums.settled_bwd_ms += bwd;
    }

    /// The exchange of layer `l`'s tokens where the sums spread its
    /// experts (split as `shard` says), its experts' gradients and passes
    /// added to `sums`, at the pace of the busiest GPU (the router's
    /// `imbalance`). Returns what a GPU holds of the layer's parameters
    /// (`ExpertPattern::param_factor`; 1 where nothing is spread) and the
    /// bytes per sample of the split layer's collectives the exchange
    /// replaces.
    fn prepend_experts(
        &self,
        sums: &mut ShapedSums,
        l: usize,
        shard: Option<&ShardCost>,
        devices: &StageDevices,
    ) -> (f64, f64) {
        let Some((groups, pattern)) = sums.experts.as_ref().zip(self.layers.experts(l)) else {
            return (1.0, 0.0);
        };
        let gradient_bytes = self.layers.gradient_bytes(l, l + 1) * pattern.param_fraction;
        // Each GPU sends its own tokens' copies: a replica's slice, or its
        // 1/t of it where the sequence is split too.
        // The GPUs that share what a GPU would hold of the experts without
        // spreading them: a shard's, or the whole layer's.
        let (exchange, sent_bytes, sharers) = match shard {
            Some(s) => {
                let sharers = f64::from(sums.e) * f64::from(sums.et) / f64::from(sums.t);
                sums.split_expert_gradient_bytes += gradient_bytes / sharers * s.param_factor;
                let sent_bytes = f64::from(sums.split_slice)
                    * s.input_factor
                    * pattern.all_to_all_bytes_per_sample;
                (&groups.split_exchange, sent_bytes, sharers)
            }
            None => {
                sums.whole_expert_gradient_bytes += gradient_bytes / f64::from(sums.e);
                (
                    &groups.whole_exchange,
                    f64::from(sums.whole_slice) * pattern.all_to_all_bytes_per_sample,
                    f64::from(sums.e),
                )
            }
        };
        let held = pattern.param_factor(sharers);
        // The busiest GPU receives `imbalance` times the mean's copies.
        let received_bytes = sent_bytes * pattern.imbalance;
        let mut pass_ms = ALL_TO_ALLS_PER_PASS * exchange.ms(pattern, received_bytes);
        // Of a split layer's collectives, the gather into the mixture that
        // the exchange replaces where the shards hold different tokens
        // (under sequence parallelism); then each expert's et shards
        // gather the copies they received and scatter the outputs back
        // (Megatron-LM's all-to-all dispatcher), an AllReduce's worth of
        // the gathered bytes each pass.
        let mut gather_taken_bytes_per_sample = 0.0;
        if shard.is_some_and(|s| s.input_factor < 1.0) {
            gather_taken_bytes_per_sample = pattern.split_gather_bytes_per_sample;
            pass_ms += groups
                .expert_shards
                .as_ref()
                .map_or(0.0, |g| g.ms(f64::from(sums.et) * received_bytes));
        }
        sums.settled_fwd_ms += pass_ms;
        sums.settled_bwd_ms += pass_ms;
        let (timing, speed) = devices.paces[0];
        let (slice, factor) = match shard {
            Some(s) => (sums.split_slice, s.compute_factor),
            None => (sums.whole_slice, 1.0),
        };
        let times = self.times(timing, slice);
        let (fwd_ms, bwd_ms) = (times.fwd(l, l + 1), times.bwd(l, l + 1));
        // Each GPU holds 1 / sharers of the experts: the part of the
        // passes that grows with the experts held shrinks with them.
        let (held_fwd, held_bwd) = self.layers.experts_held_shares(l, slice);
        let dropped = pattern.held_dropped_share(sharers) * factor / speed;
        sums.settled_fwd_ms -= dropped * held_fwd * fwd_ms;
        sums.settled_bwd_ms -= dropped * held_bwd * bwd_ms;
        if pattern.imbalance > 1.0 {
            // And runs its experts over them: the layer's expert share of
            // its passes, `imbalance` times over.
            let longer = (pattern.imbalance - 1.0) * pattern.compute_fraction * factor / speed;
            sums.settled_fwd_ms += longer * fwd_ms;
            sums.settled_bwd_ms += longer * bwd_ms;
        }
        (held, gather_taken_bytes_per_sample)
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
        let common = self.common_cost(sums, devices);
        let (mut fwd_ms, mut bwd_ms) = (common.fwd_ms, common.bwd_ms);
        let reduce_ms = common.reduce_ms;
        let reduction = self.exposed_reduction(
            sums,
            devices,
            shape,
            only_stage,
            reduce_ms,
            (fwd_ms, bwd_ms),
        );
        let (exposed, allreduce_ms) = (reduction.exposed_ms, reduction.all_ms);
        let memory = sums.memory.memory(self.layers, shape, common.input_bytes);
        if !shape.recompute.is_none() {
            // The forward again, but what torch's checkpoint does not re-run
            // of the last layer, or the selective parts alone (shares from
            // the profile's own times).
            let own = self.times(0, sums.whole_slice);
            let ratio = match shape.recompute {
                // The sums hold its numerator: O(1), not a pass over the layers.
                Recompute::Selective => {
                    let whole = own.fwd(sums.start, sums.end);
                    if whole > 0.0 {
                        sums.selective_rerun_fwd_ms / whole
                    } else {
                        0.0
                    }
                }
                recompute => recompute.rerun_ratio(
                    self.layers,
                    own,
                    (sums.start, sums.end),
                    sums.whole_slice,
                ),
            };
            bwd_ms += fwd_ms * ratio;
        }
        // A sharded stage's collectives with every micro-batch, where its
        // passes do not hide them (`cost/sharding.rs`; a re-run forward
        // uses the weights the backward gathers).
        fwd_ms += reduction.fwd_exposed_ms;
        bwd_ms += reduction.bwd_exposed_ms;
        let slice = if sums.any_split {
            sums.split_slice
        } else {
            sums.whole_slice
        };
        let (offloaded_step_ms, host_memory_limit_bytes) = match shape.offload {
            Offload::None => (0.0, 0.0),
            Offload::Optimizer => (
                offloaded_step_ms(self.layers, devices, memory.stepped_weight_bytes),
                devices.host.map_or(0.0, |h| h.memory_bytes),
            ),
        };
        let cost = StageCost {
            fwd_ms,
            bwd_ms,
            allreduce_ms,
            exposed_allreduce_ms: exposed,
            offloaded_step_ms,
            host_memory_bytes: memory.host_bytes,
            host_memory_limit_bytes,
            memory_bytes: memory.at(1),
            memory_limit_bytes: devices.memory_limit_bytes,
            slice_size: slice,
            bubble_ms: None,
        };
        (cost, memory)
    }

    /// A `kind` of collective of the summed stage's gradients, each
    /// group's bytes times `scale` (the weights' bytes a gradient byte, for
    /// a sharded stage's weight gather): whole layers' over all the
    /// stage's GPUs, split ones' over each shard's replicas, experts' over
    /// their groups.
    fn gradient_collective_ms(
        &self,
        sums: &ShapedSums,
        devices: &StageDevices,
        kind: Collective,
        scale: f64,
    ) -> f64 {
        let (split_ms, whole_gradient_bytes) = match &sums.groups {
            Some(g) if sums.any_split => (
                g.replicas.of(kind, sums.split_gradient_bytes * scale),
                sums.whole_gradient_bytes,
            ),
            _ if sums.experts.is_some() => (0.0, sums.whole_gradient_bytes),
            _ => (0.0, self.layers.gradient_bytes(sums.start, sums.end)),
        };
        let expert_ms = sums.experts.as_ref().map_or(0.0, |g| {
            g.split_reduce
                .of(kind, sums.split_expert_gradient_bytes * scale)
                + g.whole_reduce
                    .of(kind, sums.whole_expert_gradient_bytes * scale)
        });
        devices.collectives.of(kind, whole_gradient_bytes * scale) + split_ms + expert_ms
    }

    /// A sharded shape's gradient reduce-scatter and weight gather (of the
    /// weights' bytes), ms, worked out at the first such shape priced at
    /// its length.
    fn sharded_collectives_ms(&self, sums: &ShapedSums, devices: &StageDevices) -> (f64, f64) {
        if let Some(ms) = sums.sharded_collectives.get() {
            return ms;
        }
        let weights_per_gradient_byte = self.layers.weights_per_gradient_byte();
        let collective = |kind, scale| self.gradient_collective_ms(sums, devices, kind, scale);
        let ms = (
            collective(Collective::ReduceScatter, 1.0),
            collective(Collective::AllGather, weights_per_gradient_byte),
        );
        sums.sharded_collectives.set(Some(ms));
        ms
    }

    /// What every shape of `sums` shares (`CommonCost`), worked out at the
    /// first shape priced at its length.
    fn common_cost(&self, sums: &ShapedSums, devices: &StageDevices) -> CommonCost {
        if let Some(common) = sums.common.get() {
            return common;
        }
        let (timing, speed) = devices.paces[0];
        let (mut fwd_ms, mut bwd_ms) = (sums.settled_fwd_ms, sums.settled_bwd_ms);
        if let Some(end) = sums.whole_run_end {
            let whole = self.times(timing, sums.whole_slice);
            fwd_ms += whole.fwd(sums.start, end) / speed * sums.context_share();
            bwd_ms += whole.bwd(sums.start, end) / speed * sums.context_share();
        }
        let first_slice = match &sums.first_shard {
            Some(s) => f64::from(sums.split_slice) * s.input_factor,
            None => f64::from(sums.whole_slice),
        };
        let common = CommonCost {
            fwd_ms,
            bwd_ms,
            reduce_ms: self.gradient_collective_ms(sums, devices, Collective::AllReduce, 1.0),
            input_bytes: first_slice
                * sums.context_share()
                * self.layers.cut_bytes_per_sample(sums.start),
        };
        sums.common.set(Some(common));
        common
    }

    /// The gradient reduction of the summed stage (`reduce_ms`: its
    /// AllReduces) as the runtime runs it. Sharded, a reduce-scatter of
    /// the gradients and an all-gather of the weights take its place (half
    /// an AllReduce's volume each, in its own bytes), each as often as the
    /// level says (`ShardLevel::traffic`): once an iteration after the last
    /// backward, or with every micro-batch's passes. What the runtime hides
    /// behind the passes (`fwd_ms`, `bwd_ms`: one micro-batch's, before
    /// re-computation) is as `self.overlap` says, bucket by bucket over the
    /// layers, each layer's share of a pass its share of the plain stage's,
    /// and of the bytes its share of the gradients.
    fn exposed_reduction(
        &self,
        sums: &ShapedSums,
        devices: &StageDevices,
        shape: &StageShape,
        only_stage: bool,
        reduce_ms: f64,
        (fwd_ms, bwd_ms): (f64, f64),
    ) -> Reduction {
        let traffic = shape.sharding().traffic();
        let (scatter_ms, gather_ms) = if shape.shards_optimizer() {
            self.sharded_collectives_ms(sums, devices)
        } else {
            (reduce_ms, 0.0)
        };
        let all = if shape.shards_optimizer() {
            f64::from(traffic.iteration_scatters) * scatter_ms
                + f64::from(traffic.iteration_gathers) * gather_ms
        } else {
            reduce_ms
        };
        let hides_reduce = self.overlap.hides_grad_reduce(only_stage, shape);
        let hides_gather = self.overlap.hides_param_gather(shape);
        let exposing = |exposed| Reduction::of(&traffic, (all, shape.shards_optimizer()), exposed);
        if !hides_reduce && !hides_gather {
            return exposing((scatter_ms, gather_ms, gather_ms));
        }
        if hides_reduce && shape.reduces_as_plain() {
            // Its AllReduce overlaps the backward as a plain stage's.
            let exposed = if devices.replicas > 1 {
                let slice = largest_slice(self.micro_batch, devices.replicas);
                self.exposed_plain_allreduce(sums.start, sums.end, devices, slice)
            } else {
                all
            };
            return Reduction {
                exposed_ms: exposed,
                all_ms: all,
                fwd_exposed_ms: 0.0,
                bwd_exposed_ms: 0.0,
            };
        }
        let (start, end) = (sums.start, sums.end);
        let plain = self.times(devices.paces[0].0, sums.whole_slice);
        let share = |part: f64, whole: f64| if whole > 0.0 { part / whole } else { 0.0 };
        // Each GPU's gradient bytes of a layer, its share of the stage's
        // (split layers hold a shard's).
        let all_bytes = self.layers.gradient_bytes(start, end);
        let per_gpu_bytes = if sums.any_split || sums.experts.is_some() {
            sums.whole_gradient_bytes
                + sums.split_gradient_bytes
                + sums.whole_expert_gradient_bytes
                + sums.split_expert_gradient_bytes
        } else {
            all_bytes
        };
        let bytes =
            |l: usize| self.layers.gradient_bytes(l, l + 1) * share(per_gpu_bytes, all_bytes);
        // A bucket's time: its share of the bytes of the whole transfer.
        let of_bytes = |total_ms: f64| move |b: f64| total_ms * share(b, per_gpu_bytes);
        let layer_fwd = |l: usize| fwd_ms * share(plain.fwd(l, l + 1), plain.fwd(start, end));
        let layer_bwd = |l: usize| bwd_ms * share(plain.bwd(l, l + 1), plain.bwd(start, end));
        let scatter = if hides_reduce {
            exposed_behind_backward(
                (start..end).rev().map(|l| (layer_bwd(l), bytes(l))),
                of_bytes(scatter_ms),
            )
        } else {
            scatter_ms
        };
        let (gather_fwd, gather_bwd) = if hides_gather {
            (
                exposed_before_forward(
                    (start..end).map(|l| (layer_fwd(l), bytes(l))),
                    of_bytes(gather_ms),
                ),
                // The backward's gathers, last layer first (FSDP's
                // backward prefetch).
                exposed_before_forward(
                    (start..end).rev().map(|l| (layer_bwd(l), bytes(l))),
                    of_bytes(gather_ms),
                ),
            )
        } else {
            (gather_ms, gather_ms)
        };
        exposing((scatter, gather_fwd, gather_bwd))
    }
}

/// A stage's gradient reduction and weight gathers, in ms: `all_ms` after
/// its last backward (`exposed_ms` of it not hidden), and what each
/// micro-batch's forward and backward wait for besides their own passes.
struct Reduction {
    exposed_ms: f64,
    all_ms: f64,
    fwd_exposed_ms: f64,
    bwd_exposed_ms: f64,
}

impl Reduction {
    /// What `traffic` leaves exposed, from the exposed part of each of its
    /// collectives: a reduce-scatter's (unsharded, the AllReduce's), a
    /// gather's before a forward and before a backward. `all_ms`: the
    /// collectives after the last backward.
    fn of(
        traffic: &crate::cost::sharding::ShardTraffic,
        (all_ms, sharded): (f64, bool),
        (scatter, gather_fwd, gather_bwd): (f64, f64, f64),
    ) -> Reduction {
        let after_backward = if sharded {
            f64::from(traffic.iteration_scatters) * scatter
                + f64::from(traffic.iteration_gathers) * gather_fwd
        } else {
            scatter
        };
        Reduction {
            exposed_ms: after_backward,
            all_ms,
            fwd_exposed_ms: f64::from(traffic.gathers_before_forward) * gather_fwd,
            bwd_exposed_ms: f64::from(traffic.gathers_before_backward) * gather_bwd
                + f64::from(traffic.scatters_after_backward) * scatter,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::topology::Topology;
    use crate::model::experts::{ExpertPattern, TokenDispatcher};
    use crate::model::profile::{profile_of_layers, LayerCosts};

    #[test]
    fn sums_grown_a_layer_at_a_time_price_every_shape_as_fresh_ones() {
        // The search grows one sum a layer at a time and prices several
        // shapes at each length (the shared part kept between them, the
        // selective share summed as it grows); pricing each length afresh,
        // one shape at a time, must give the same costs and memory.
        use crate::model::transformer::{
            transformer_profile, TransformerConfig, TransformerOptions,
        };
        let config = TransformerConfig::named("llama-2-7b").unwrap();
        let options = TransformerOptions {
            gpu: "a100-80gb".into(),
            seq_len: 2048,
            micro_batch_sizes: vec![1, 4],
            efficiency: None,
            // Unfused: the attention core is what selective re-computation re-runs.
            attention: Some(crate::model::kernels::AttentionKernel::Unfused),
            expert_imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            gradients: crate::model::transformer::GradientPrecision::Bf16,
            host_us_per_kernel: crate::model::transformer::HOST_US_PER_KERNEL,
        };
        let profile = transformer_profile("llama-2-7b", &config, &options).unwrap();
        let layers = LayerCosts::new(&profile);
        let cluster = Cluster::new(&Topology::from_spec("2x8-a100-80gb").unwrap());
        let coster = StageCoster::new(&layers, &cluster, 8, 1);
        let devices = StageDevices::new(&cluster, vec![(0, 8), (1, 8)]);
        let n = layers.num_layers;
        let split = StageShape {
            tensor_parallel: 4,
            sequence_parallel: true,
            ..StageShape::PLAIN
        };
        let shapes: Vec<StageShape> = [
            Recompute::None,
            Recompute::Selective,
            Recompute::PerLayer,
            Recompute::Full,
        ]
        .into_iter()
        .flat_map(|recompute| {
            [0, 1, 2].map(|shard_level| StageShape {
                recompute,
                shard_level,
                ..split
            })
        })
        .collect();
        let mut sums = coster.empty_shaped_sums(n, &devices, &split);
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(b.abs());
        for start in (0..n).rev() {
            coster.prepend_layer(&mut sums, &devices);
            for shape in &shapes {
                let (grown, grown_memory) = coster.shaped_cost(&sums, &devices, shape, false);
                let fresh_sums = coster.shaped_sums(start, n, &devices, shape);
                let (fresh, fresh_memory) = coster.shaped_cost(&fresh_sums, &devices, shape, false);
                assert!(close(grown.fwd_ms, fresh.fwd_ms), "{start} {shape:?}");
                assert!(close(grown.bwd_ms, fresh.bwd_ms), "{start} {shape:?}");
                assert_eq!(grown.allreduce_ms, fresh.allreduce_ms, "{start} {shape:?}");
                assert_eq!(grown.memory_bytes, fresh.memory_bytes, "{start} {shape:?}");
                assert_eq!(
                    grown_memory.per_micro_batch_bytes, fresh_memory.per_micro_batch_bytes,
                    "{start} {shape:?}"
                );
            }
        }
        // The selective share is neither nothing nor the whole forward.
        let selective = &shapes[3];
        let keeps = &shapes[0];
        let (a, b) = (
            coster.shaped_cost(&sums, &devices, selective, false).0,
            coster.shaped_cost(&sums, &devices, keeps, false).0,
        );
        assert!(a.bwd_ms > b.bwd_ms && a.bwd_ms < b.bwd_ms + b.fwd_ms);
    }

    #[test]
    fn spread_experts_leave_a_gpu_its_share_and_exchange_its_tokens() {
        // Two layers; the second a mixture of 4 experts, half its 4 MB of
        // weights in them, exchanging 1 MB a sample each all-to-all.
        let mut profile = profile_of_layers(
            "moe",
            &[(1.0, 2.0, 1_000_000, 1000), (1.0, 2.0, 4_000_000, 1000)],
            1,
        );
        profile.layers[1].experts = Some(ExpertPattern {
            count: 4,
            per_token: 2,
            param_fraction: 0.5,
            all_to_all_bytes_per_sample: 1e6,
            split_gather_bytes_per_sample: 0.0,
            compute_fraction: 0.0,
            imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            routing_groups: None,
        });
        let layers = LayerCosts::new(&profile);
        let cluster = Cluster::new(&Topology::from_spec("1x8-nvlink").unwrap());
        // A micro-batch of 8: one sample a GPU.
        let coster = StageCoster::new(&layers, &cluster, 8, 1);
        let devices = StageDevices::new(&cluster, vec![(0, 8)]);
        let spread = StageShape {
            expert_parallel: 4,
            ..StageShape::PLAIN
        };
        let of = |shape: &StageShape| {
            (
                coster.stage_shaped(0, 2, &devices, shape, 1, false),
                coster.stage_memory(0, 2, &devices, shape),
            )
        };
        let ((plain, plain_memory), (cost, memory)) = (of(&StageShape::PLAIN), of(&spread));
        // A GPU holds a quarter of the experts: 5/8 of the second layer's
        // state, all of the first's.
        let second = layers.model_state_bytes(1, 2);
        assert_eq!(
            memory.model_state_bytes,
            plain_memory.model_state_bytes - 0.375 * second
        );
        // Under ZeRO-1 the optimizer's state is an eighth of every layer's
        // (the two GPUs that hold the same experts shard theirs), the
        // weights and gradients as without ZeRO-1: the spread saves 3/8
        // of the second layer's weights and gradients alone.
        let zero = |shape: StageShape| {
            let zero = StageShape {
                shard_level: 1,
                ..shape
            };
            coster.stage_memory(0, 2, &devices, &zero).model_state_bytes
        };
        let second_optimizer = 2.0 * (second - layers.model_state_bytes_sharded(1, 2, 2));
        let saved = 0.375 * (second - second_optimizer);
        assert!((zero(StageShape::PLAIN) - zero(spread) - saved).abs() < 1e-6);
        assert!(saved > 0.0 && second_optimizer > 0.0);
        // Each pass exchanges twice (dispatch, combine) one sample's 1 MB.
        let exchange = AllToAll::new(&cluster, &[0; 8], (1, 4), false);
        let pass_ms = 2.0 * exchange.ms(profile.layers[1].experts.as_ref().unwrap(), 1e6);
        assert!(pass_ms > 0.0);
        assert!((cost.fwd_ms - plain.fwd_ms - pass_ms).abs() < 1e-9);
        assert!((cost.bwd_ms - plain.bwd_ms - pass_ms).abs() < 1e-9);
        // Gradients: all of the first layer's and the second's dense half
        // over all 8 GPUs; a GPU's quarter of the experts' half over the 2
        // GPUs that hold the same experts (every 4th).
        let gradients = |l: usize| layers.gradient_bytes(l, l + 1);
        let dense = devices.collectives.ms(gradients(0) + 0.5 * gradients(1));
        let experts = strided_group(&cluster, &[0; 8], 4).ms(0.5 * gradients(1) / 4.0);
        assert!((cost.allreduce_ms - dense - experts).abs() < 1e-9);
        assert!(cost.allreduce_ms < plain.allreduce_ms);
    }

    #[test]
    fn context_parallelism_halves_each_gpus_share_and_exposes_what_the_ring_outlasts() {
        // Two layers of 1 ms forward and 2 ms backward a sample; the second
        // attends, with 40 MB of keys and values a sample and a quarter of
        // its time in the attention core.
        let mut profile = profile_of_layers(
            "long",
            &[
                (1.0, 2.0, 1_000_000, 1_000_000),
                (1.0, 2.0, 1_000_000, 1_000_000),
            ],
            1,
        );
        for (layer, kv_bytes) in profile.layers.iter_mut().zip([0.0, 40e6]) {
            layer.context = Some(crate::model::context::ContextPattern {
                sequence_length: 8,
                kv_bytes_per_sample: kv_bytes,
                attention_compute_fraction: 0.25,
            });
        }
        let layers = LayerCosts::new(&profile);
        let cluster = Cluster::new(&Topology::from_spec("1x4-pcie").unwrap());
        // A micro-batch of 2 on 4 GPUs cut 2 ways: a sample per context group.
        let coster = StageCoster::new(&layers, &cluster, 2, 1);
        let devices = StageDevices::new(&cluster, vec![(0, 4)]);
        let cut = StageShape {
            context_parallel: 2,
            ..StageShape::PLAIN
        };
        let cost = coster.stage_shaped(0, 2, &devices, &cut, 1, false);
        // The ring over GPUs {0, 1} (and {2, 3} beside it): forward, an
        // all-gather of the sample's 40 MB (half an AllReduce); backward,
        // twice that; each less the attention core's quarter of the
        // layer's half pass.
        let group = context_group(&cluster, &[0; 4], (1, 2));
        let ring_fwd = (group.of(Collective::AllGather, 40e6) - 0.25 * 0.5).max(0.0);
        let ring_bwd = (group.of(Collective::AllGather, 80e6) - 0.25 * 1.0).max(0.0);
        assert!(ring_fwd > 0.0 && ring_bwd > 0.0, "{ring_fwd} {ring_bwd}");
        assert!(
            (cost.fwd_ms - (0.5 + 0.5 + ring_fwd)).abs() < 1e-9,
            "{}",
            cost.fwd_ms
        );
        assert!(
            (cost.bwd_ms - (1.0 + 1.0 + ring_bwd)).abs() < 1e-9,
            "{}",
            cost.bwd_ms
        );
        // Gradients over all 4 GPUs, the context ranks with the replicas.
        let reduce = devices.collectives.ms(layers.gradient_bytes(0, 2));
        assert!((cost.allreduce_ms - reduce).abs() < 1e-9);
        // Half a sample's activations a GPU, weights whole.
        let two = StageDevices::new(&cluster, vec![(0, 2)]);
        let plain = coster.stage_memory(0, 2, &two, &StageShape::PLAIN);
        let memory = coster.stage_memory(0, 2, &devices, &cut);
        assert_eq!(
            memory.per_micro_batch_bytes,
            plain.per_micro_batch_bytes / 2.0
        );
        assert_eq!(memory.model_state_bytes, plain.model_state_bytes);
        // Sharded, the optimizer state over all 4.
        let zero = StageShape {
            shard_level: 1,
            ..cut
        };
        let sharded = coster.stage_memory(0, 2, &devices, &zero);
        let expected = memory.model_state_bytes - layers.model_state_bytes(0, 2)
            + layers.model_state_bytes_sharded(0, 2, 4);
        assert!((sharded.model_state_bytes - expected).abs() < 1e-6);
        // The ring's four chunks of a sample's keys and values beside the
        // backward: 4 x 20 MB.
        assert!((memory.working_bytes - plain.working_bytes - 80e6).abs() < 1e-3 * 80e6);
    }

    #[test]
    fn experts_split_fewer_ways_than_t_drop_the_gather_and_exchange_in_wider_groups() {
        // One block split 2 ways with its sequence, 4 MB of weights, 3/4 of
        // them in 4 routed experts; 1 MB a sample each all-to-all, and
        // 0.25 MB of its two 1 MB collectives the gather into the mixture.
        let mut profile = profile_of_layers("moe", &[(1.0, 2.0, 4_000_000, 1000)], 1);
        profile.layers[0].split = vec![crate::model::split::SplitPattern {
            name: "block".into(),
            divides: Vec::new(),
            fwd_allreduce_bytes_per_sample: 1e6,
            bwd_allreduce_bytes_per_sample: 1e6,
            replicated_param_fraction: 0.0,
            replicated_stored_fraction: 0.0,
            replicated_compute_fraction: 0.0,
            allreduce_calls_per_pass: 2,
            sequence_parallel: true,
            shard_compute: Vec::new(),
        }];
        profile.layers[0].experts = Some(ExpertPattern {
            count: 4,
            per_token: 2,
            param_fraction: 0.75,
            all_to_all_bytes_per_sample: 1e6,
            split_gather_bytes_per_sample: 0.25e6,
            compute_fraction: 0.6,
            imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            routing_groups: None,
        });
        let layers = LayerCosts::new(&profile);
        let cluster = Cluster::new(&Topology::from_spec("1x8-nvlink").unwrap());
        // A micro-batch of 4: one sample a replica, half of it a shard.
        let coster = StageCoster::new(&layers, &cluster, 4, 1);
        let devices = StageDevices::new(&cluster, vec![(0, 8)]);
        let shape = |e: u32, et: Option<u32>| StageShape {
            tensor_parallel: 2,
            sequence_parallel: true,
            expert_parallel: e,
            expert_tensor_parallel: et,
            ..StageShape::PLAIN
        };
        let fwd = |s: &StageShape| coster.stage_shaped(0, 1, &devices, s, 1, false).fwd_ms;
        let state = |s: &StageShape| coster.stage_memory(0, 1, &devices, s).model_state_bytes;
        let shards = consecutive_group(&cluster, &[0; 8], 2);
        let dense = fwd(&shape(1, None));
        // Without experts spread, the block's two collectives of 0.5 MB.
        let collectives = 2.0 * shards.ms(0.5e6);
        // Spread 4 ways at et = t = 2: the exchange between the same shard
        // of 4 replicas, the gather's call gone (one call of 0.75 MB left),
        // and each expert's 2 shards gathering the copies both received.
        let pattern = profile.layers[0].experts.clone().unwrap();
        let at_t = AllToAll::new(&cluster, &[0; 8], (2, 4), false);
        let expected = dense - collectives
            + 2.0 * at_t.ms(&pattern, 0.5e6)
            + shards.ms(0.75e6)
            + shards.ms(2.0 * 0.5e6);
        assert!((fwd(&shape(4, None)) - expected).abs() < 1e-9);
        // Spread 4 ways whole (et = 1): 4 consecutive GPUs exchange, and
        // nothing is gathered.
        let whole = AllToAll::new(&cluster, &[0; 8], (1, 4), false);
        let expected = dense - collectives + 2.0 * whole.ms(&pattern, 0.5e6) + shards.ms(0.75e6);
        assert!((fwd(&shape(4, Some(1))) - expected).abs() < 1e-9);
        // A GPU holds a quarter of the experts whole at et = 1, a quarter
        // of them halved at et = 2: 3/16 of the layer's state apart.
        let layer = layers.model_state_bytes(0, 1);
        let apart = state(&shape(4, Some(1))) - state(&shape(4, None));
        assert!((apart - 0.75 / 8.0 * layer).abs() < 1e-6 * layer, "{apart}");
        // A router that sends the busiest GPU 1.5 times the mean's tokens:
        // it receives half as many copies again, and runs its experts (0.6
        // of the layer's compute) half as long again.
        let mut skewed = profile.clone();
        skewed.layers[0].experts.as_mut().unwrap().imbalance = 1.5;
        let layers = LayerCosts::new(&skewed);
        let coster = StageCoster::new(&layers, &cluster, 4, 1);
        let cost = coster.stage_shaped(0, 1, &devices, &shape(4, Some(1)), 1, false);
        let shard = layers.shard(0, 2, true).unwrap();
        let compute = |pass: f64| 0.5 * 0.6 * shard.compute_factor * pass;
        let times = coster.times(0, 1);
        let expected = dense - collectives
            + 2.0 * whole.ms(&pattern, 1.5 * 0.5e6)
            + shards.ms(0.75e6)
            + compute(times.fwd(0, 1));
        assert!(
            (cost.fwd_ms - expected).abs() < 1e-9,
            "{} {expected}",
            cost.fwd_ms
        );
        // Holding 4 experts takes 0.4 of its passes more than holding one
        // (reading 4 experts' weights, not one). Spread 4 ways at et = t =
        // 2, a GPU holds one expert's half where a shard held 4 halves: all
        // of that part gone. At et = 1 it holds one expert whole, 2 halves'
        // worth: (4 - 2) / (4 - 1) of it gone.
        let mut held = profile.clone();
        for m in &mut held.layers[0].measurements {
            m.experts_held_fwd_ms = Some(0.4 * m.fwd_ms);
            m.experts_held_bwd_ms = Some(0.4 * m.bwd_ms);
        }
        let layers = LayerCosts::new(&held);
        let coster = StageCoster::new(&layers, &cluster, 4, 1);
        let fwd = |s: &StageShape| coster.stage_shaped(0, 1, &devices, s, 1, false).fwd_ms;
        let part = 0.4 * shard.compute_factor * coster.times(0, 1).fwd(0, 1);
        let expected = dense - collectives
            + 2.0 * at_t.ms(&pattern, 0.5e6)
            + shards.ms(0.75e6)
            + shards.ms(2.0 * 0.5e6)
            - part;
        assert!((fwd(&shape(4, None)) - expected).abs() < 1e-9);
        let expected = dense - collectives + 2.0 * whole.ms(&pattern, 0.5e6) + shards.ms(0.75e6)
            - 2.0 / 3.0 * part;
        assert!((fwd(&shape(4, Some(1))) - expected).abs() < 1e-9);
        // Spread 2 ways, 2 of 4 experts held: (4 - 2) / (4 - 1) of it gone.
        let pattern = held.layers[0].experts.as_ref().unwrap();
        assert!((pattern.held_dropped_share(2.0) - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(pattern.held_dropped_share(4.0), 1.0);
    }
}
