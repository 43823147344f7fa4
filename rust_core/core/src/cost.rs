//! The analytic cost model: compute, AllReduce, stage-to-stage transfers,
//! memory, and the paper's pipeline latency (formulas 1-3).
//!
//! Everything here is a pure function of plain numbers; the search and the
//! plan evaluator both call it, so a plan costs the same however it was made.

use std::cell::RefCell;
use std::rc::Rc;

use rustc_hash::FxHashMap;

use crate::cluster::gpus::CollectiveFigures;
use crate::cluster::topology::Topology;
use crate::cost::balance::{balanced_slices, BalanceDevice};
use crate::cost::overlap::{exposed_behind_backward, Overlap};
use crate::cost::shape::StageShape;
use crate::error::{Error, Input, Result};
use crate::model::profile::{LayerCosts, TimePrefix};

pub mod all_to_all;
pub mod balance;
pub mod block_partition;
pub mod collectives;
pub mod offload;
pub mod overlap;
pub mod shape;
mod shaped;
pub mod sharding;
pub mod work_limit;
pub use collectives::{allreduce_ms, Collective, CollectiveCurve, LinkShare};
pub use shaped::ShapedSums;

/// The timed GPU types, quoted, for messages.
fn timed_names(devices: &[Option<&str>]) -> String {
    devices
        .iter()
        .map(|d| format!("{:?}", d.unwrap_or("unnamed")))
        .collect::<Vec<_>>()
        .join(", ")
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// Bytes per millisecond of one Gbit/s.
const BYTES_PER_MS_PER_GBPS: f64 = 1e9 / 8.0 / 1e3;

/// The cluster as the cost model sees it.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub machines: Vec<MachineCost>,
    pub inter_bytes_per_ms: f64,
    pub inter_latency_ms: f64,
    /// What of the network NCCL reaches.
    pub inter_share: LinkShare,
}

#[derive(Debug, Clone)]
pub struct MachineCost {
    /// Machine-group index (machines of a group are interchangeable).
    pub group: usize,
    pub gpus: u32,
    pub first_device: u32,
    pub memory_bytes: f64,
    /// Whose layer times its GPUs run at: an index into the profile's
    /// timed GPU types (`LayerCosts::devices`), 0 for the profile's own.
    pub timing: usize,
    /// Speed relative to those times: the group's `relative_speed`, or 1
    /// where its GPU type was timed itself.
    pub speed: f64,
    pub intra_bytes_per_ms: f64,
    pub intra_latency_ms: f64,
    /// What of the intra-machine link NCCL's AllReduce reaches.
    pub intra_share: LinkShare,
    /// Its GPUs' host, for offloading (None: a GPU type not in the catalog).
    pub host: Option<offload::HostCost>,
}

impl MachineCost {
    /// Whether the two machines' GPUs are alike for the cost model: the
    /// same times, speed and memory.
    pub(crate) fn same_gpus(&self, other: &MachineCost) -> bool {
        self.pace() == other.pace() && self.memory_bytes == other.memory_bytes
    }

    /// The (timing, speed) its GPUs run at.
    fn pace(&self) -> (usize, f64) {
        (self.timing, self.speed)
    }
}

/// The distinct (timing, speed) pairs of these machines, in first-seen order.
fn distinct_paces<'m>(machines: impl Iterator<Item = &'m MachineCost>) -> Vec<(usize, f64)> {
    let mut paces: Vec<(usize, f64)> = Vec::new();
    for m in machines {
        if !paces.contains(&m.pace()) {
            paces.push(m.pace());
        }
    }
    paces
}

impl Cluster {
    /// The cluster for a profile that times one GPU type: every GPU runs
    /// the profile's times over its group's `relative_speed` (1 where
    /// absent). Link costs do not depend on the profile at all.
    pub fn new(t: &Topology) -> Cluster {
        Cluster::matched(t, &[None]).expect("one timed device matches every group")
    }

    /// The cluster as the cost model sees it for `layers`' model: each
    /// group's GPUs run at the times of the GPU type of that name the
    /// profile timed, else at the profile's own device's times over the
    /// group's `relative_speed`. With several timed types, a group of
    /// another type must give its `relative_speed` (relative to the
    /// profile's own device), and every other timed type must be a group's.
    /// A GPU's memory is what its allocator may hand out: its size over the
    /// profile's `allocator_reserved_factor`.
    pub fn for_model(t: &Topology, layers: &LayerCosts) -> Result<Cluster> {
        let mut cluster = Cluster::matched(t, &layers.devices())?;
        for machine in &mut cluster.machines {
            machine.memory_bytes /= layers.allocator_reserved_factor;
        }
        Ok(cluster)
    }

    fn matched(t: &Topology, devices: &[Option<&str>]) -> Result<Cluster> {
        let timing_of = |g: usize| -> Result<(usize, f64)> {
            let gpu = &t.machine_groups[g].gpu;
            if let Some(k) = devices
                .iter()
                .position(|&d| d == Some(gpu.gpu_type.as_str()))
            {
                return Ok((k, 1.0));
            }
            match gpu.relative_speed {
                Some(speed) => Ok((0, speed)),
                None if devices.len() == 1 => Ok((0, 1.0)),
                None => {
                    let mut e = Error::incompatible(format!(
                        "is absent and GPU type {:?} is none of those the profile timed ({}); \
                         give its speed relative to {} or time the model on it",
                        gpu.gpu_type,
                        timed_names(devices),
                        devices[0].unwrap_or("the profile's device"),
                    ));
                    e.field = Some(format!("machine_groups[{g}].gpu.relative_speed"));
                    Err(e.about(Input::Topology))
                }
            }
        };
        let timings: Vec<(usize, f64)> = (0..t.machine_groups.len())
            .map(timing_of)
            .collect::<Result<_>>()?;
        for (k, device) in devices.iter().enumerate().skip(1) {
            if !timings.iter().any(|&(used, _)| used == k) {
                let mut e = Error::incompatible(format!(
                    "value {:?} is no GPU type of topology {:?} ({}); a device no group has is a typing mistake",
                    device.unwrap_or_default(),
                    t.name,
                    t.machine_groups
                        .iter()
                        .map(|g| format!("{:?}", g.gpu.gpu_type))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
                e.field = Some(format!("other_devices[{}].device", k - 1));
                return Err(e.about(Input::Profile));
            }
        }
        // Each group's GPU type's measured collectives, looked up once.
        let collectives: Vec<Option<&'static CollectiveFigures>> = t
            .machine_groups
            .iter()
            .map(|g| {
                crate::cluster::gpus::find_gpu(&g.gpu.gpu_type)
                    .and_then(|gpu| gpu.collectives.as_ref())
            })
            .collect();
        let machines = t
            .machines()
            .into_iter()
            .map(|m| {
                let g = &t.machine_groups[m.group];
                let (timing, speed) = timings[m.group];
                MachineCost {
                    group: m.group,
                    gpus: m.gpus,
                    first_device: m.first_device,
                    memory_bytes: g.gpu.memory_bytes as f64,
                    timing,
                    speed,
                    intra_bytes_per_ms: g.intra_machine.bandwidth_gbps * BYTES_PER_MS_PER_GBPS,
                    intra_latency_ms: g.intra_machine.latency_us / 1e3,
                    intra_share: LinkShare::intra_of(collectives[m.group]),
                    host: offload::HostCost::of_gpu(&g.gpu.gpu_type),
                }
            })
            .collect();
        // The network reaches the least measured share of its machines'
        // cards; the line rate where a machine's was not measured.
        let network_shares: Option<Vec<f64>> = collectives
            .iter()
            .map(|c| c.as_ref().map(|c| c.network_share))
            .collect();
        let inter_share = match network_shares {
            Some(shares) if !shares.is_empty() => {
                LinkShare::Constant(shares.into_iter().fold(1.0, f64::min))
            }
            _ => LinkShare::Line,
        };
        Ok(Cluster {
            machines,
            inter_bytes_per_ms: t.inter_machine.bandwidth_gbps * BYTES_PER_MS_PER_GBPS,
            inter_latency_ms: t.inter_machine.latency_us / 1e3,
            inter_share,
        })
    }

    /// (machine group, GPUs) of each machine: what placement states count.
    pub fn group_and_gpus(&self) -> Vec<(usize, u32)> {
        self.machines.iter().map(|m| (m.group, m.gpus)).collect()
    }

    /// In O(1): the machines are listed in device order, so the last one's
    /// first device and GPUs give the count (the search asks it in its
    /// innermost loops: a sum over 10,000 machines took most of its time).
    pub fn num_devices(&self) -> u32 {
        debug_assert_eq!(
            self.machines.last().map_or(0, |m| m.first_device + m.gpus),
            self.machines.iter().map(|m| m.gpus).sum::<u32>()
        );
        self.machines.last().map_or(0, |m| m.first_device + m.gpus)
    }

    /// Whether GPUs differ in speed or memory.
    pub fn is_mixed(&self) -> bool {
        self.machines.windows(2).any(|w| !w[0].same_gpus(&w[1]))
    }

    /// Whether some machine's host is known: the optimizer state can be
    /// offloaded somewhere (`cost/offload.rs`).
    pub fn has_a_host(&self) -> bool {
        self.machines.iter().any(|m| m.host.is_some())
    }

    /// Index of the machine that holds GPU `device`.
    pub fn machine_of(&self, device: u32) -> Option<usize> {
        // Machines number their GPUs in order, each from the next free id.
        let i = self
            .machines
            .partition_point(|m| m.first_device + m.gpus <= device);
        self.machines
            .get(i)
            .is_some_and(|m| device >= m.first_device)
            .then_some(i)
    }

    /// GPU ids for stages given as GPUs per machine, in pipeline order:
    /// each stage takes the next free GPUs of its machines, so stage 0
    /// starts at its machines' first GPUs.
    pub fn number_devices(&self, allocs: &[Alloc]) -> Vec<Vec<u32>> {
        let mut next_free = vec![0u32; self.machines.len()];
        allocs
            .iter()
            .map(|alloc| {
                let mut devices = Vec::new();
                for &(m, c) in alloc {
                    let first = self.machines[m].first_device + next_free[m];
                    devices.extend(first..first + c);
                    next_free[m] += c;
                }
                devices
            })
            .collect()
    }

    /// The GPUs per machine of a list of GPU ids.
    pub fn alloc_of(&self, devices: &[u32]) -> crate::error::Result<Alloc> {
        let mut alloc: Alloc = Vec::new();
        for &d in devices {
            // The previous GPU's machine first (a stage lists its devices
            // machine by machine), before searching the machines.
            if let Some((last, c)) = alloc.last_mut() {
                let machine = &self.machines[*last];
                if (machine.first_device..machine.first_device + machine.gpus).contains(&d) {
                    *c += 1;
                    continue;
                }
            }
            let m = self.machine_of(d).ok_or_else(|| {
                crate::error::Error::invalid(format!(
                    "device {d} does not exist: the topology has devices 0..{}",
                    self.num_devices().saturating_sub(1)
                ))
            })?;
            match alloc.iter_mut().find(|(mm, _)| *mm == m) {
                Some((_, c)) => *c += 1,
                None => alloc.push((m, 1)),
            }
        }
        alloc.sort_unstable();
        Ok(alloc)
    }
}

/// How many GPUs of each machine a stage uses: `(machine index, gpus)`,
/// machines ascending, no zero counts.
pub type Alloc = Vec<(usize, u32)>;

pub fn alloc_size(alloc: &[(usize, u32)]) -> u32 {
    alloc.iter().map(|&(_, n)| n).sum()
}

/// What a stage's cost reads of its GPUs, worked out once per allocation.
#[derive(Debug, Clone, PartialEq)]
pub struct StageDevices {
    pub alloc: Alloc,
    pub replicas: u32,
    /// The distinct (timing, speed) pairs of its GPUs (`MachineCost`):
    /// with even slices the replicas move in lock step at the slowest.
    pub paces: Vec<(usize, f64)>,
    pub memory_limit_bytes: f64,
    /// The collectives of all its GPUs (whole layers' gradients).
    pub collectives: CollectiveCurve,
    /// Whether its GPUs differ in times, speed or memory: the search gives
    /// such a stage Whale's balanced slices (`StageCoster::searched_slices`).
    pub mixed: bool,
    /// Its GPUs' host, where an offloaded optimizer steps (`offload.rs`).
    pub host: Option<offload::HostCost>,
    /// Its expert groups, built once for each expert degree priced on it.
    pub(crate) expert_groups: shaped::ExpertGroupsMemo,
}

impl StageDevices {
    pub fn new(cluster: &Cluster, alloc: Alloc) -> StageDevices {
        let paces = distinct_paces(alloc.iter().map(|&(m, _)| &cluster.machines[m]));
        let first = alloc.first().map(|&(m, _)| &cluster.machines[m]);
        StageDevices {
            replicas: alloc_size(&alloc),
            paces,
            memory_limit_bytes: smallest_memory(cluster, &alloc),
            collectives: CollectiveCurve::new(cluster, &alloc),
            mixed: alloc
                .iter()
                .any(|&(m, _)| first.is_some_and(|f| !f.same_gpus(&cluster.machines[m]))),
            host: offload::HostCost::of_stage(cluster, &alloc),
            alloc,
            expert_groups: shaped::ExpertGroupsMemo::default(),
        }
    }

    /// The machine of each replica, in device order.
    fn replica_machines(&self) -> Vec<usize> {
        self.alloc
            .iter()
            .flat_map(|&(m, c)| std::iter::repeat_n(m, c as usize))
            .collect()
    }
}

/// One machine's part in a transfer between two stages: its GPUs on the
/// sending and on the receiving stage, for `machines` machines alike
/// (`machine` is one of them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferShare {
    pub machine: usize,
    pub senders: u32,
    pub receivers: u32,
    pub machines: u32,
}

/// Time to move a micro-batch's `bytes` of activations (or their gradients)
/// from a stage on `from` to a stage on `to`, split/concat included.
pub fn transfer_ms(
    cluster: &Cluster,
    from: &[(usize, u32)],
    to: &[(usize, u32)],
    bytes: f64,
) -> f64 {
    // Both allocations list machines ascending: walk them side by side, each
    // machine with its GPUs on either side (0 where it has none).
    let mut shares: Vec<TransferShare> = Vec::with_capacity(from.len() + to.len());
    let (mut x, mut y) = (0, 0);
    while x < from.len() || y < to.len() {
        let m = match (from.get(x), to.get(y)) {
            (Some(&(a, _)), Some(&(b, _))) => a.min(b),
            (Some(&(a, _)), None) => a,
            (None, Some(&(b, _))) => b,
            (None, None) => unreachable!(),
        };
        let gpus_on = |alloc: &[(usize, u32)], k: &mut usize| match alloc.get(*k) {
            Some(&(mm, n)) if mm == m => {
                *k += 1;
                n
            }
            _ => 0,
        };
        let (senders, receivers) = (gpus_on(from, &mut x), gpus_on(to, &mut y));
        shares.push(TransferShare {
            machine: m,
            senders,
            receivers,
            machines: 1,
        });
    }
    transfer_over(cluster, &shares, bytes)
}

/// [`transfer_ms`] given each machine's share.
///
/// Samples are laid out so that each machine keeps as much as it can
/// locally; what must change machines leaves and enters through each
/// machine's network link, the rest moves over the intra-machine link. All
/// links work in parallel, so the slowest link decides.
pub fn transfer_over(cluster: &Cluster, shares: &[TransferShare], bytes: f64) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    let total = |side: fn(&TransferShare) -> u32| -> f64 {
        shares
            .iter()
            .map(|s| f64::from(side(s)) * f64::from(s.machines))
            .sum()
    };
    let r_from = total(|s| s.senders);
    let r_to = total(|s| s.receivers);
    let mut slowest: f64 = 0.0;
    let mut crosses = false;
    for s in shares.iter().filter(|s| s.machines > 0) {
        let a = f64::from(s.senders) / r_from;
        let b = f64::from(s.receivers) / r_to;
        let local = a.min(b) * bytes;
        let leaving = (a - a.min(b)) * bytes;
        let entering = (b - a.min(b)) * bytes;
        if leaving > 0.0 || entering > 0.0 {
            crosses = true;
            slowest = slowest.max(leaving.max(entering) / cluster.inter_bytes_per_ms);
        }
        if local > 0.0 {
            let mc = &cluster.machines[s.machine];
            let per_link = local / f64::from(s.senders.min(s.receivers));
            slowest = slowest.max(per_link / mc.intra_bytes_per_ms + mc.intra_latency_ms);
        }
    }
    if crosses {
        slowest += cluster.inter_latency_ms;
    }
    slowest
}

/// Smallest GPU memory among the machines of `alloc`.
pub fn smallest_memory(cluster: &Cluster, alloc: &[(usize, u32)]) -> f64 {
    alloc
        .iter()
        .map(|&(m, _)| cluster.machines[m].memory_bytes)
        .fold(f64::INFINITY, f64::min)
}

/// How a micro-batch of `micro_batch` samples is split over `replicas`
/// devices: contiguous `[start, end)` ranges, replica j taking the j-th;
/// sizes differ by at most one sample, the larger first. The runtime splits
/// exactly so (`plan/layout.rs`); the cost model prices the largest slice.
pub fn slice_ranges(micro_batch: u32, replicas: u32) -> Vec<(u32, u32)> {
    let (size, extra) = (micro_batch / replicas, micro_batch % replicas);
    let sizes: Vec<u32> = (0..replicas).map(|j| size + u32::from(j < extra)).collect();
    ranges_of(&sizes)
}

/// Contiguous `[start, end)` ranges of slices of these sizes, in order.
pub fn ranges_of(sizes: &[u32]) -> Vec<(u32, u32)> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&size| {
            let range = (start, start + size);
            start += size;
            range
        })
        .collect()
}

/// The divisors of `n`, ascending, in O(sqrt n) steps (a global batch of
/// 10^9 has 100; counting to it took seconds).
pub fn divisors(n: u32) -> Vec<u32> {
    let (mut small, mut large) = (Vec::new(), Vec::new());
    let mut d = 1u32;
    while u64::from(d) * u64::from(d) <= u64::from(n) {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// The micro-batch sizes a layout of `stages` stages, the widest on
/// `widest_stage_gpus` GPUs, can run the global batch at, ascending: the
/// divisors of the global batch that give each GPU at least `min_slice`
/// samples, and whose stages times micro-batches stay within the
/// simulation's limit (`schedule::MAX_PASSES`). The search asks it for a
/// stage of one GPU (each plan's own stages are checked when it is built);
/// the baselines for their fixed layout.
pub(crate) fn micro_batch_sizes(
    global_batch_size: u32,
    min_slice: u32,
    widest_stage_gpus: u32,
    stages: usize,
) -> Vec<u32> {
    divisors(global_batch_size)
        .into_iter()
        .filter(|&b| smallest_slice(b, widest_stage_gpus) >= min_slice)
        .filter(|b| crate::cost::work_limit::within_passes(stages, global_batch_size / b))
        .collect()
}

/// Samples of the largest of the `slice_ranges`.
pub fn largest_slice(micro_batch: u32, replicas: u32) -> u32 {
    micro_batch.div_ceil(replicas)
}

/// Samples of the smallest of the `slice_ranges`.
pub fn smallest_slice(micro_batch: u32, replicas: u32) -> u32 {
    micro_batch / replicas
}

crate::named_enum! {
    /// Warm-up depth K_i of early-backward scheduling (section V-C).
    pub enum WarmupPolicy("a warm-up policy") {
        /// K_i chosen per stage by the planner (`warmup::choose_warmups`): the
        /// depths that simulate fastest within each stage's memory. A plan
        /// records them; any non-increasing K_0 >= K_1 >= ... in 1..=M is valid.
        Auto = "auto",
        /// K_i = min(S - i, M).
        A = "A" | "a",
        /// K_i = min(2(S - i) - 1, M).
        B = "B" | "b",
    }
}

impl WarmupPolicy {
    /// K_i of a fixed policy; None for `Auto`, whose depths are searched.
    /// `stages_from_here` = S - i, counting stage i itself.
    pub fn warmup(self, stages_from_here: u32, micro_batches: u32) -> Option<u32> {
        let k = match self {
            WarmupPolicy::A => stages_from_here,
            WarmupPolicy::B => (2 * stages_from_here).saturating_sub(1),
            WarmupPolicy::Auto => return None,
        };
        Some(k.min(micro_batches).max(1))
    }

    /// K_i the search counts in a stage's memory: the fixed policy's, or
    /// one micro-batch (the least any plan holds) under `Auto`, whose
    /// depths are chosen after the layout.
    pub fn memory_depth(self, stages_from_here: u32, micro_batches: u32) -> u32 {
        self.warmup(stages_from_here, micro_batches).unwrap_or(1)
    }
}

/// Per-device memory of a stage at its peak, as the allocator counts it:
/// weights, gradients and optimizer state of its layers, what `warmup`
/// micro-batch slices in flight keep (activations, autocast's weight
/// copies), and what the running backward needs on top; or the optimizer's
/// step where that is larger (`LayerCosts::optimizer_step_peak_bytes`).
pub fn stage_memory_bytes(
    layers: &LayerCosts,
    start: usize,
    end: usize,
    slice: u32,
    warmup: u32,
) -> f64 {
    let backward = layers.model_state_bytes(start, end)
        + f64::from(warmup) * layers.in_flight_bytes(start, end, slice)
        + layers.backward_working_bytes(start, end, slice);
    backward.max(layers.optimizer_step_peak_bytes(start, end))
}

/// AllReduce time left exposed after the backward pass of the last
/// micro-batch, when gradient buckets are reduced as soon as their layers'
/// backward is done (data parallelism with overlap, section VI-C;
/// `overlap::exposed_behind_backward`).
///
/// `bwd_ms_of_layer(l)` is the backward time of layer l for one slice.
pub fn exposed_allreduce_with_overlap(
    cluster: &Cluster,
    alloc: &[(usize, u32)],
    layers: &LayerCosts,
    start: usize,
    end: usize,
    bwd_ms_of_layer: impl Fn(usize) -> f64,
) -> f64 {
    exposed_behind_backward(
        (start..end)
            .rev()
            .map(|l| (bwd_ms_of_layer(l), layers.gradient_bytes(l, l + 1))),
        |bucket| allreduce_ms(cluster, alloc, bucket),
    )
}

/// One stage of the pipeline as the latency formula sees it: a computation
/// stage, or the communication between two of them (AllReduce 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipeStage {
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    /// AllReduce time that is not hidden behind computation.
    pub allreduce_ms: f64,
    /// Time the stage is busy per micro-batch in the steady phase: F + B
    /// for a computation stage, one transfer for a link (links are full
    /// duplex, activations and gradients move at once). This keeps the
    /// formula a lower bound of the simulated iteration.
    pub steady_ms: f64,
}

impl PipeStage {
    /// The communication stage between two computation stages: activations
    /// forward, their gradients backward, the same bytes each way.
    pub fn transfer(ms: f64) -> PipeStage {
        PipeStage {
            fwd_ms: ms,
            bwd_ms: ms,
            allreduce_ms: 0.0,
            steady_ms: ms,
        }
    }

    /// A computation stage.
    pub fn compute(fwd_ms: f64, bwd_ms: f64, allreduce_ms: f64) -> PipeStage {
        PipeStage {
            fwd_ms,
            bwd_ms,
            allreduce_ms,
            steady_ms: fwd_ms + bwd_ms,
        }
    }
}

/// Pipeline latency and its decomposition.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latency {
    pub latency_ms: f64,
    pub warmup_ms: f64,
    pub steady_ms: f64,
    pub ending_ms: f64,
    /// Index (into the pipe-stage list, communication stages included) of
    /// the pivot that makes formula (1)-(2) largest.
    pub pivot: usize,
    /// Pivot chosen by the paper's Algorithm 1 and the latency formula (1)
    /// gives with it, as printed in the paper.
    pub paper_pivot: usize,
    pub paper_latency_ms: f64,
}

/// Formula (1)-(2) of the paper for a pivot stage `q`, with the ending
/// phase over the stages up to the pivot:
///   Tw = sum_{s<=q} F_s,  Ts = (M-1) steady_q  (F_q + B_q for computation,
///   one transfer for a full-duplex link, where the paper counts two),
///   Te = max_{s<=q} (AR_s + sum_{a=s..q} B_a).
/// Stages after the pivot are covered when they are themselves the pivot.
fn phases_at(stages: &[PipeStage], m: f64, q: usize) -> (f64, f64, f64) {
    let tw: f64 = stages[..=q].iter().map(|s| s.fwd_ms).sum();
    let ts = (m - 1.0) * stages[q].steady_ms;
    let mut te: f64 = 0.0;
    let mut back = 0.0;
    for s in (0..=q).rev() {
        back += stages[s].bwd_ms;
        te = te.max(stages[s].allreduce_ms + back);
    }
    (tw, ts, te)
}

/// Algorithm 1: walk from the last stage to the first and move the pivot to
/// stage s when its bubble-free steady phase is longer than the current
/// pivot's plus the work between them.
pub fn paper_pivot(stages: &[PipeStage], micro_batches: u32) -> usize {
    let m1 = f64::from(micro_batches) - 1.0;
    let mut q = stages.len() - 1;
    for s in (0..stages.len().saturating_sub(1)).rev() {
        let l1 = m1 * (stages[s].fwd_ms + stages[s].bwd_ms);
        let mut l2 = m1 * (stages[q].fwd_ms + stages[q].bwd_ms);
        for between in &stages[s + 1..q] {
            l2 += between.fwd_ms + between.bwd_ms;
        }
        if l1 > l2 {
            q = s;
        }
    }
    q
}

/// Formula (1) exactly as printed, for comparison with the paper: stages
/// after the pivot enter the ending phase as AR_s - sum_{a=Q..s} B_a.
fn paper_formula(stages: &[PipeStage], m: f64, q: usize) -> f64 {
    let (tw, ts, te_before) = phases_at(stages, m, q);
    let mut te = te_before;
    let mut back = 0.0;
    for (s, stage) in stages.iter().enumerate().skip(q) {
        back += stage.bwd_ms;
        if s > q {
            te = te.max(stage.allreduce_ms - back);
        }
    }
    tw + ts + te
}

/// Pipeline latency of one training iteration.
///
/// Formula (2) holds for any choice of pivot as a lower bound on the
/// iteration time (every stage needs its warm-up, its M forward and backward
/// passes and the ending after them), so we take the pivot that makes it
/// largest. When the paper's Algorithm 1 picks the same pivot, which is the
/// common case, the two agree exactly; both are reported.
pub fn pipeline_latency(stages: &[PipeStage], micro_batches: u32) -> Latency {
    assert!(!stages.is_empty(), "a pipeline has at least one stage");
    let m = f64::from(micro_batches);
    let mut best: Option<(usize, (f64, f64, f64))> = None;
    for q in 0..stages.len() {
        let p = phases_at(stages, m, q);
        let total = p.0 + p.1 + p.2;
        if best.is_none_or(|(_, b)| total > b.0 + b.1 + b.2) {
            best = Some((q, p));
        }
    }
    let (pivot, phases) = best.expect("at least one stage");
    let paper_q = paper_pivot(stages, micro_batches);
    Latency::of(pivot, phases, paper_q, paper_formula(stages, m, paper_q))
}

impl Latency {
    /// The latency at `pivot` of its phases (Tw, Ts, Te), with the paper's
    /// own pivot and value beside it.
    fn of(
        pivot: usize,
        (tw, ts, te): (f64, f64, f64),
        paper_pivot: usize,
        paper_latency_ms: f64,
    ) -> Self {
        Latency {
            latency_ms: tw + ts + te,
            warmup_ms: tw,
            steady_ms: ts,
            ending_ms: te,
            pivot,
            paper_pivot,
            paper_latency_ms,
        }
    }
}

/// A lower bound of a ZB-H1 iteration on the same positions, in formula
/// (2)'s terms. Formula (2)'s ending runs whole backwards back from the
/// pivot, but a zero-bubble pivot may run its last input gradient before
/// weight gradients it deferred, so only the pivot's own span is certain:
/// the first micro-batch's forwards up to it (Tw), its M forwards and
/// backwards (Ts, the first M - 1; Te, the last backward and its
/// AllReduce). The paper's pivot and formula do not apply: they are this
/// bound's.
pub fn zero_bubble_latency(stages: &[PipeStage], micro_batches: u32) -> Latency {
    assert!(!stages.is_empty(), "a pipeline has at least one stage");
    let m = f64::from(micro_batches);
    let phases = |q: usize| {
        let tw: f64 = stages[..=q].iter().map(|s| s.fwd_ms).sum();
        let ts = (m - 1.0) * stages[q].steady_ms;
        let te = stages[q].steady_ms - stages[q].fwd_ms + stages[q].allreduce_ms;
        (tw, ts, te)
    };
    let total = |p: (f64, f64, f64)| p.0 + p.1 + p.2;
    let pivot = (0..stages.len())
        .max_by(|&a, &b| total(phases(a)).total_cmp(&total(phases(b))))
        .expect("at least one stage");
    let at_pivot = phases(pivot);
    Latency::of(pivot, at_pivot, pivot, total(at_pivot))
}

/// The latency formula folded from the last stage to the first, as the
/// search builds pipelines. `best` is the latency of the suffix as a whole
/// pipeline started at its first stage; `steady` is
/// max_q (sum_{t<=a<=q} (F_a + B_a) + (M - 1) steady_q) over the suffix.
/// An empty suffix is `(-inf, -inf)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SuffixLatency {
    pub best: f64,
    pub steady: f64,
}

impl SuffixLatency {
    pub const EMPTY: SuffixLatency = SuffixLatency {
        best: f64::NEG_INFINITY,
        steady: f64::NEG_INFINITY,
    };

    /// Put `stage` in front of the suffix.
    pub fn prepend(self, stage: PipeStage, micro_batches: u32) -> SuffixLatency {
        let fb = stage.fwd_ms + stage.bwd_ms;
        let steady = fb + (f64::from(micro_batches) - 1.0) * stage.steady_ms;
        let steady = steady.max(fb + self.steady);
        let best = (self.best + stage.fwd_ms).max(stage.allreduce_ms + steady);
        SuffixLatency { best, steady }
    }
}

/// Everything needed to cost stages for one micro-batch size: the layer
/// times at every slice size a stage can see, prefix-summed.
pub struct StageCoster<'a> {
    pub layers: &'a LayerCosts,
    pub cluster: &'a Cluster,
    pub micro_batch: u32,
    pub micro_batches: u32,
    /// The slice sizes an evenly split stage can have (`largest_slice` of
    /// the micro-batch over 1.. replicas), ascending, and the prefix sums at
    /// each for every timing the cluster's GPUs run at: one entry per
    /// distinct slice, not per sample count, so a micro-batch of 2^27
    /// samples costs a few entries, not gigabytes.
    slices: Vec<u32>,
    times: Vec<Vec<Rc<TimePrefix>>>,
    /// Prefix sums at the other slice sizes uneven slices use, made on
    /// first use: (timing, slice) -> times.
    uneven: RefCell<FxHashMap<(usize, u32), Rc<TimePrefix>>>,
    /// The distinct (timing, speed) pairs of the cluster's GPUs.
    cluster_paces: Vec<(usize, f64)>,
    /// What the runtime hides behind computation (`cost/overlap.rs`).
    pub overlap: Overlap,
}

/// One replica's pace: its times (at its slice) and its GPU's speed.
#[derive(Clone, Copy)]
struct Pace<'t> {
    times: &'t TimePrefix,
    speed: f64,
}

impl Pace<'_> {
    fn fwd(&self, start: usize, end: usize) -> f64 {
        self.times.fwd(start, end) / self.speed
    }
    fn bwd(&self, start: usize, end: usize) -> f64 {
        self.times.bwd(start, end) / self.speed
    }
}

/// The cost of one computation stage on its devices: what the search
/// prices, and what a plan's estimate records per stage
/// (`estimate.stages[i]`, with the simulated `bubble_ms`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageCost {
    /// One micro-batch slice through the stage, on its slowest GPU.
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    /// Full AllReduce time of the stage's gradients.
    pub allreduce_ms: f64,
    /// Part of it that is not hidden behind backward computation (equals
    /// allreduce_ms except for data parallelism, which overlaps it).
    pub exposed_allreduce_ms: f64,
    /// An optimizer step offloaded to the host (`offload.rs`): gradients
    /// out, the CPU's Adam, weights back; 0 for a step on the GPU (which
    /// the simulator times from the profile's `optimizer_step_ms`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offloaded_step_ms: f64,
    /// Offloaded: what one GPU's host keeps for it (master weights and
    /// optimizer state), and the host's memory a GPU; 0 and 0 otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_memory_bytes: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host_memory_limit_bytes: f64,
    /// Per GPU: weights, gradients, optimizer state and the stored
    /// activations of K_i slices.
    pub memory_bytes: f64,
    /// Memory of the stage's smallest GPU.
    pub memory_limit_bytes: f64,
    /// Samples per replica of a micro-batch: with even slices the largest;
    /// with a stage's own `slices`, those of the device with the least room
    /// (the one `memory_bytes` is of).
    pub slice_size: u32,
    /// Simulated time the stage's GPUs do no forward or backward work; set
    /// where a plan is simulated, not by the cost model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_ms: Option<f64>,
}

impl StageCost {
    pub fn fits(&self) -> bool {
        self.memory_bytes <= self.memory_limit_bytes && self.fits_host()
    }

    /// Whether its host holds what it offloads (nothing always fits).
    pub fn fits_host(&self) -> bool {
        self.host_memory_bytes <= self.host_memory_limit_bytes
    }

    /// What the stage does after its last backward: the exposed gradient
    /// reduction, then an offloaded step.
    pub fn tail_ms(&self) -> f64 {
        self.exposed_allreduce_ms + self.offloaded_step_ms
    }

    pub fn as_pipe_stage(&self) -> PipeStage {
        PipeStage::compute(self.fwd_ms, self.bwd_ms, self.tail_ms())
    }
}

impl<'a> StageCoster<'a> {
    pub fn new(
        layers: &'a LayerCosts,
        cluster: &'a Cluster,
        micro_batch: u32,
        micro_batches: u32,
    ) -> Self {
        let max_replicas = cluster.num_devices().min(micro_batch).max(1);
        let mut slices: Vec<u32> = (1..=max_replicas)
            .map(|r| largest_slice(micro_batch, r))
            .collect();
        slices.sort_unstable();
        slices.dedup();
        let cluster_paces = distinct_paces(cluster.machines.iter());
        let timings = layers.devices().len();
        let used = |t: usize| t == 0 || cluster_paces.iter().any(|&(used, _)| used == t);
        let times = (0..timings)
            .map(|t| {
                if used(t) {
                    slices
                        .iter()
                        .map(|&s| Rc::new(layers.times_on(t, s)))
                        .collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        StageCoster {
            layers,
            cluster,
            micro_batch,
            micro_batches,
            slices,
            times,
            uneven: RefCell::new(FxHashMap::default()),
            cluster_paces,
            overlap: Overlap::default(),
        }
    }

    /// The coster of a runtime that hides what `overlap` says.
    pub fn overlapping(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// Times on `timing` at an even slice size.
    fn times(&self, timing: usize, slice: u32) -> &TimePrefix {
        let at = self
            .slices
            .binary_search(&slice)
            .expect("every slice size is precomputed");
        &self.times[timing][at]
    }

    /// Times on `timing` at any slice size (cached).
    pub(crate) fn any_times(&self, timing: usize, slice: u32) -> Rc<TimePrefix> {
        if let Ok(at) = self.slices.binary_search(&slice) {
            if let Some(t) = self.times[timing].get(at) {
                return Rc::clone(t);
            }
        }
        self.uneven
            .borrow_mut()
            .entry((timing, slice))
            .or_insert_with(|| Rc::new(self.layers.times_on(timing, slice)))
            .clone()
    }

    /// Cost of layers `start..end` on `alloc` with `warmup` micro-batches in
    /// flight, every replica taking an even slice. `only_stage`: the stage
    /// is the whole model (data parallelism), whose AllReduce overlaps the
    /// last backward pass under every overlap but "none"; any stage's does
    /// under "every-stage" (`self.overlap`).
    pub fn stage(
        &self,
        start: usize,
        end: usize,
        alloc: &[(usize, u32)],
        warmup: u32,
        only_stage: bool,
    ) -> StageCost {
        let devices = StageDevices::new(self.cluster, alloc.to_vec());
        self.stage_on(start, end, &devices, warmup, only_stage)
    }

    /// [`StageCoster::stage`] on devices already summarised: the replicas
    /// move in lock step at the pace of the GPU type slowest on these
    /// layers.
    pub fn stage_on(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        warmup: u32,
        only_stage: bool,
    ) -> StageCost {
        let slice = largest_slice(self.micro_batch, devices.replicas);
        let memory = (slice, devices.memory_limit_bytes, warmup);
        self.with_paces(devices, slice, |paces| {
            self.priced(start, end, devices, paces, only_stage, memory)
        })
    }

    /// `priced(paces)`, the paces of `devices`' replicas at `slice` samples.
    fn with_paces<R>(
        &self,
        devices: &StageDevices,
        slice: u32,
        priced: impl FnOnce(&[Pace]) -> R,
    ) -> R {
        let pace = |&(timing, speed): &(usize, f64)| Pace {
            times: self.times(timing, slice),
            speed,
        };
        match devices.paces.as_slice() {
            // GPUs of one kind (the search's hot path): no list to build.
            [one] => priced(&[pace(one)]),
            many => priced(&many.iter().map(pace).collect::<Vec<Pace>>()),
        }
    }

    /// The AllReduce of plain layers `start..end` on `devices` (more than
    /// one replica) left exposed behind their backward, the slowest
    /// replica's at `slice` samples: a gradient bucket is ready when every
    /// replica has passed its layers.
    pub(crate) fn exposed_plain_allreduce(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        slice: u32,
    ) -> f64 {
        self.with_paces(devices, slice, |paces| {
            self.exposed_behind_paces(start, end, devices, paces)
        })
    }

    fn exposed_behind_paces(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        paces: &[Pace],
    ) -> f64 {
        let slowest = |ms: &dyn Fn(&Pace) -> f64| paces.iter().map(ms).fold(0.0, f64::max);
        exposed_allreduce_with_overlap(self.cluster, &devices.alloc, self.layers, start, end, |l| {
            match paces {
                [one] => one.bwd(l, l + 1),
                // Backward runs from the last layer down: the slowest
                // replica's time to get through layer l, less through l + 1.
                _ => slowest(&|p| p.bwd(l, end)) - slowest(&|p| p.bwd(l + 1, end)),
            }
        })
    }

    /// The slices the search gives layers `start..end` on `devices`: none
    /// (the even split) on GPUs alike; on mixed GPUs Whale's balanced
    /// slices with one micro-batch in flight, the least any plan holds, or
    /// the even split when no balanced one fits. A plan keeps these slices
    /// whatever its warm-up depths; memory then caps the depths
    /// (`warmup::deepest_warmups`).
    pub fn searched_slices(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        min_slice: u32,
    ) -> Option<Vec<u32>> {
        if !devices.mixed {
            return None;
        }
        self.balanced_slices(start, end, &devices.replica_machines(), 1, min_slice)
    }

    /// Whale's Algorithm 1 (`cost/balance.rs`) for layers `start..end` on the
    /// GPUs of these machines (one entry per replica) with `warmup`
    /// micro-batches in flight. A GPU's speed is its rate on these layers
    /// at the even slice, relative to the profile's own device; None when
    /// no split fits.
    pub fn balanced_slices(
        &self,
        start: usize,
        end: usize,
        replica_machines: &[usize],
        warmup: u32,
        min_slice: u32,
    ) -> Option<Vec<u32>> {
        // Whatever the slices, each GPU steps the optimizer over the whole
        // stage (`stage_memory_bytes`' other moment).
        let step_peak = self.layers.optimizer_step_peak_bytes(start, end);
        if replica_machines
            .iter()
            .any(|&m| step_peak > self.cluster.machines[m].memory_bytes)
        {
            return None;
        }
        let even = largest_slice(self.micro_batch, replica_machines.len() as u32);
        // stage_memory_bytes, as fixed bytes and bytes per sample of the slice.
        let fixed_bytes = self.layers.model_state_bytes(start, end)
            + f64::from(warmup) * self.layers.weight_copy_bytes(start, end);
        let bytes_per_sample = f64::from(warmup) * self.layers.stored_bytes_per_sample(start, end)
            + self.layers.backward_working_bytes(start, end, 1);
        // Replicas come machine by machine: each machine's speed once.
        let mut last: Option<(usize, f64)> = None;
        let devices: Vec<BalanceDevice> = replica_machines
            .iter()
            .map(|&m| {
                let speed = match last {
                    Some((seen, speed)) if seen == m => speed,
                    _ => self.speed_on(m, start, end, even),
                };
                last = Some((m, speed));
                BalanceDevice {
                    speed,
                    memory_bytes: self.cluster.machines[m].memory_bytes,
                    fixed_bytes,
                    bytes_per_sample,
                }
            })
            .collect();
        balanced_slices(&devices, self.micro_batch, min_slice).ok()
    }

    /// How fast machine `machine`'s GPUs run layers `start..end` at `batch`
    /// samples, relative to the profile's own device: the group's relative
    /// speed, times how much faster its own timed type runs these layers
    /// (per-layer ratios may differ between types). Exactly the relative
    /// speed where the GPU runs the profile's own times.
    pub fn speed_on(&self, machine: usize, start: usize, end: usize, batch: u32) -> f64 {
        let machine = &self.cluster.machines[machine];
        if machine.timing == 0 {
            return machine.speed;
        }
        let ms = |timing: usize| {
            let t = self.any_times(timing, batch);
            t.fwd(start, end) + t.bwd(start, end)
        };
        let (own, reference) = (ms(machine.timing), ms(0));
        if own > 0.0 && reference > 0.0 {
            machine.speed * reference / own
        } else {
            machine.speed
        }
    }

    /// The search's cost of layers `start..end` on `devices`, with
    /// `searched_slices` and `warmup` micro-batches in flight.
    pub fn stage_searched(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        min_slice: u32,
        warmup: u32,
        only_stage: bool,
    ) -> StageCost {
        if !devices.mixed {
            return self.stage_on(start, end, devices, warmup, only_stage);
        }
        let machines = devices.replica_machines();
        match self.balanced_slices(start, end, &machines, 1, min_slice) {
            Some(slices) => {
                self.sliced_on(start, end, devices, &machines, &slices, warmup, only_stage)
            }
            None => self.stage_on(start, end, devices, warmup, only_stage),
        }
    }

    /// [`StageCoster::stage`] with device `devices[j]` taking `slices[j]`
    /// samples of each micro-batch (uneven slices on mixed GPUs).
    pub fn stage_sliced(
        &self,
        start: usize,
        end: usize,
        devices: &[u32],
        slices: &[u32],
        warmup: u32,
        only_stage: bool,
    ) -> StageCost {
        let alloc = self.cluster.alloc_of(devices).expect("checked devices");
        let stage = StageDevices::new(self.cluster, alloc);
        let machines: Vec<usize> = devices
            .iter()
            .map(|&d| self.cluster.machine_of(d).expect("checked device"))
            .collect();
        self.sliced_on(start, end, &stage, &machines, slices, warmup, only_stage)
    }

    /// Uneven slices on the GPUs of `machines` (one entry per replica).
    /// Each replica computes its own slice at its own GPU's times; the
    /// stage is as fast as its slowest replica (the next stage needs every
    /// slice), so its times are the slowest replica's. Its memory is that
    /// of the replica with the least room per sample of its slice, which
    /// is the first to run out however many micro-batches are in flight
    /// (every replica holds the same model state).
    #[allow(clippy::too_many_arguments)]
    fn sliced_on(
        &self,
        start: usize,
        end: usize,
        stage: &StageDevices,
        machines: &[usize],
        slices: &[u32],
        warmup: u32,
        only_stage: bool,
    ) -> StageCost {
        let machine = |j: usize| &self.cluster.machines[machines[j]];
        let times: Vec<Rc<TimePrefix>> = (0..machines.len())
            .map(|j| self.any_times(machine(j).timing, slices[j]))
            .collect();
        let paces: Vec<Pace> = (0..machines.len())
            .map(|j| Pace {
                times: &times[j],
                speed: machine(j).speed,
            })
            .collect();
        let state = self.layers.model_state_bytes(start, end);
        let room_per_sample = |j: usize| (machine(j).memory_bytes - state) / f64::from(slices[j]);
        let tightest = (0..machines.len())
            .min_by(|&a, &b| room_per_sample(a).total_cmp(&room_per_sample(b)))
            .expect("a stage has devices");
        self.priced(
            start,
            end,
            stage,
            &paces,
            only_stage,
            (slices[tightest], machine(tightest).memory_bytes, warmup),
        )
    }

    /// The cost of layers `start..end` on `devices` whose replicas run at
    /// `paces`, with the memory of `(slice, limit, warmup)`: the device with
    /// the least room holds `warmup` slices of `slice` samples in `limit`
    /// bytes. The next stage needs every replica's slice, so the forward
    /// takes the slowest replica's forward and the backward the slowest
    /// backward (with per-type times these may be two replicas); a gradient
    /// bucket is ready when every replica has passed its layers.
    fn priced(
        &self,
        start: usize,
        end: usize,
        devices: &StageDevices,
        paces: &[Pace],
        only_stage: bool,
        (slice, limit, warmup): (u32, f64, u32),
    ) -> StageCost {
        let slowest = |ms: &dyn Fn(&Pace) -> f64| paces.iter().map(ms).fold(0.0, f64::max);
        let allreduce = devices
            .collectives
            .ms(self.layers.gradient_bytes(start, end));
        let hides = self
            .overlap
            .hides_grad_reduce(only_stage, &StageShape::PLAIN);
        let exposed = if hides && devices.replicas > 1 {
            self.exposed_behind_paces(start, end, devices, paces)
        } else {
            allreduce
        };
        StageCost {
            fwd_ms: slowest(&|p| p.fwd(start, end)),
            bwd_ms: slowest(&|p| p.bwd(start, end)),
            allreduce_ms: allreduce,
            exposed_allreduce_ms: exposed,
            offloaded_step_ms: 0.0,
            host_memory_bytes: 0.0,
            host_memory_limit_bytes: 0.0,
            memory_bytes: stage_memory_bytes(self.layers, start, end, slice, warmup),
            memory_limit_bytes: limit,
            slice_size: slice,
            bubble_ms: None,
        }
    }

    /// Activation (forward) or gradient (backward) transfer across the cut
    /// before layer `position`, for one micro-batch.
    pub fn transfer(&self, position: usize, from: &[(usize, u32)], to: &[(usize, u32)]) -> f64 {
        transfer_ms(self.cluster, from, to, self.cut_bytes(position))
    }

    /// [`StageCoster::transfer`] given each machine's share.
    pub fn transfer_over(&self, position: usize, shares: &[TransferShare]) -> f64 {
        transfer_over(self.cluster, shares, self.cut_bytes(position))
    }

    /// Bytes of one micro-batch crossing the cut before layer `position`.
    fn cut_bytes(&self, position: usize) -> f64 {
        self.layers.cut_bytes_per_sample(position) * f64::from(self.micro_batch)
    }

    /// Forward, and forward plus backward, time of layers `start..end` at
    /// `slice` samples on the GPU of the cluster fastest at them: lower
    /// bounds for any stage holding those layers whose slowest replica
    /// takes `slice` samples.
    pub fn fastest_ms(&self, start: usize, end: usize, slice: u32) -> (f64, f64) {
        self.cluster_paces
            .iter()
            .map(|&(timing, speed)| {
                let t = self.any_times(timing, slice);
                let f = t.fwd(start, end) / speed;
                (f, f + t.bwd(start, end) / speed)
            })
            .fold((f64::INFINITY, f64::INFINITY), |a, b| {
                (a.0.min(b.0), a.1.min(b.1))
            })
    }

    /// The slice sizes in `min_slice..=micro_batch` at which some layer's
    /// time on some GPU type is smallest over that range: its ends and
    /// the measured sizes between (times are linear between those). The
    /// slowest replica of unevenly sliced stages takes one of the range.
    pub fn uneven_floor_slices(&self, min_slice: u32) -> Vec<u32> {
        let top = self.micro_batch.max(min_slice);
        let mut sizes = vec![min_slice, top];
        for timing in 0..self.layers.devices().len() {
            sizes.extend(
                self.layers
                    .measured_batch_sizes(timing)
                    .iter()
                    .copied()
                    .filter(|&b| b > min_slice && b < top),
            );
        }
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// Time of all micro-batches one after another on one GPU of the
    /// profiled type: the reference for speedups.
    pub fn single_device_ms(&self) -> f64 {
        let t = self.layers.times_at(self.micro_batch);
        let n = self.layers.num_layers;
        f64::from(self.micro_batches) * (t.fwd(0, n) + t.bwd(0, n))
    }
}

#[cfg(test)]
mod tests {
    /// Two machines of 2 GPUs: the second group's GPUs at `speed` and
    /// `memory` bytes.
    fn mixed(speed: f64, memory: u64) -> Topology {
        let mut t = crate::cluster::topology::with_one_slow_machine("2x2-nvlink", speed);
        t.machine_groups[1].gpu.memory_bytes = memory;
        t
    }

    #[test]
    fn a_stage_hides_its_reduction_as_far_as_its_runtime_does() {
        use crate::cost::overlap::{GradReduceOverlap, Overlap};
        use crate::cost::shape::StageShape;
        // Four layers of 40 MiB of weights (a DDP bucket each), 1 ms
        // forward and 2 ms backward a sample; micro-batches of 4 on one GPU
        // of each of two machines: slices of 2, backward 4 ms a layer.
        let mib = 1u64 << 20;
        let p =
            crate::model::profile::profile_of_layers("overlap", &[(1.0, 2.0, 40 * mib, 100); 4], 1);
        let layers = LayerCosts::new(&p);
        let t = Topology::from_spec("2x2-nvlink").unwrap();
        let cluster = Cluster::new(&t);
        let alloc = [(0, 1), (1, 1)];
        let of = |grad_reduce, param_gather| {
            StageCoster::new(&layers, &cluster, 4, 4).overlapping(Overlap {
                grad_reduce,
                param_gather,
            })
        };
        // A pipelined stage: DAPPLE's model reduces after the backward.
        let dapple = of(GradReduceOverlap::DataParallel, false).stage(0, 4, &alloc, 1, false);
        assert_eq!(dapple.exposed_allreduce_ms, dapple.allreduce_ms);
        // Every stage: bucket k's reduction (r ms) starts once the backward
        // has passed it (at 4k ms) and the one before is done.
        let every = of(GradReduceOverlap::EveryStage, false).stage(0, 4, &alloc, 1, false);
        let r = allreduce_ms(&cluster, &alloc, (40 * mib) as f64);
        assert_eq!(every.allreduce_ms, dapple.allreduce_ms);
        let ends_at = f64::max(4.0 + 4.0 * r, 16.0 + r);
        assert!((every.exposed_allreduce_ms - (ends_at - 16.0)).abs() < 1e-9);
        assert!(every.exposed_allreduce_ms < every.allreduce_ms);
        // None: not even a plan of one stage hides it.
        let none = of(GradReduceOverlap::None, false).stage(0, 4, &alloc, 1, true);
        assert_eq!(none.exposed_allreduce_ms, none.allreduce_ms);
        // ZeRO-1: the reduce-scatter behind the backward, and the weights'
        // all-gather behind the next forward only where the runtime says so.
        let zero = StageShape {
            shard_level: 1,
            ..StageShape::PLAIN
        };
        let devices = StageDevices::new(&cluster, alloc.to_vec());
        let shaped = |grad_reduce, param_gather| {
            of(grad_reduce, param_gather).stage_shaped(0, 4, &devices, &zero, 1, false)
        };
        let after = shaped(GradReduceOverlap::DataParallel, false);
        let behind_backward = shaped(GradReduceOverlap::EveryStage, false);
        let behind_both = shaped(GradReduceOverlap::EveryStage, true);
        assert_eq!(after.exposed_allreduce_ms, after.allreduce_ms);
        assert!(behind_backward.exposed_allreduce_ms < after.exposed_allreduce_ms);
        assert!(behind_both.exposed_allreduce_ms < behind_backward.exposed_allreduce_ms);
        assert!(behind_both.exposed_allreduce_ms > 0.0);
        assert_eq!(behind_both.allreduce_ms, after.allreduce_ms);
    }

    #[test]
    fn each_sharding_level_moves_its_collectives_when_its_rule_says() {
        use crate::cost::overlap::{GradReduceOverlap, Overlap};
        use crate::cost::shape::StageShape;
        // The four 40 MiB layers of the overlap test on one GPU of each of
        // two machines; fp32 gradients, so that a reduce-scatter and an
        // all-gather each take half the AllReduce's r.
        let mib = 1u64 << 20;
        let p =
            crate::model::profile::profile_of_layers("sharded", &[(1.0, 2.0, 40 * mib, 100); 4], 1);
        let layers = LayerCosts::new(&p);
        let cluster = Cluster::new(&Topology::from_spec("2x2-nvlink").unwrap());
        let alloc = [(0, 1), (1, 1)];
        let devices = StageDevices::new(&cluster, alloc.to_vec());
        let r = allreduce_ms(&cluster, &alloc, (160 * mib) as f64);
        let at = |overlap: Overlap, shard_level, reshard_after_forward| {
            let shape = StageShape {
                shard_level,
                reshard_after_forward,
                ..StageShape::PLAIN
            };
            StageCoster::new(&layers, &cluster, 4, 4)
                .overlapping(overlap)
                .stage_shaped(0, 4, &devices, &shape, 1, false)
        };
        let hidden_nowhere = Overlap {
            grad_reduce: GradReduceOverlap::None,
            param_gather: false,
        };
        let of = |level, reshard| at(hidden_nowhere, level, reshard);
        let one = of(1, false);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // ZeRO-1: both after the last backward, once an iteration.
        assert!(close(one.allreduce_ms, r) && close(one.exposed_allreduce_ms, r));
        // ZeRO-2: each micro-batch's backward reduce-scatters its gradients;
        // the all-gather stays after the step.
        let two = of(2, false);
        assert!(close(two.bwd_ms - one.bwd_ms, r / 2.0) && close(two.fwd_ms, one.fwd_ms));
        assert!(close(two.allreduce_ms, r / 2.0));
        // ZeRO-3 re-sharded: a gather before each forward and each
        // backward, the reduce-scatter after it; nothing after the step.
        let three = of(3, true);
        assert!(close(three.fwd_ms - one.fwd_ms, r / 2.0));
        assert!(close(three.bwd_ms - one.bwd_ms, r));
        assert_eq!(three.allreduce_ms, 0.0);
        // Kept after the forward: the backward's gather is gone.
        let kept = of(3, false);
        assert!(close(kept.fwd_ms - one.fwd_ms, r / 2.0));
        assert!(close(kept.bwd_ms - one.bwd_ms, r / 2.0));
        // Where the runtime overlaps them (FSDP's prefetch, its reduce-scatter
        // behind the backward), each micro-batch waits for less, but for the
        // first layer's weights at least.
        let everywhere = Overlap {
            grad_reduce: GradReduceOverlap::EveryStage,
            param_gather: true,
        };
        let hidden = at(everywhere, 3, true);
        assert!(hidden.fwd_ms < three.fwd_ms && hidden.bwd_ms < three.bwd_ms);
        assert!(
            hidden.fwd_ms - one.fwd_ms >= r / 8.0 - 1e-9,
            "{}",
            hidden.fwd_ms
        );
    }

    #[test]
    fn each_gpu_is_on_the_machine_that_numbers_it() {
        // Machines of 1 to 4 GPUs in unequal groups: every id on its machine,
        // the first id past the last GPU on none.
        let mut t = Topology::from_spec("3x4-nvlink").unwrap();
        let mut second = t.machine_groups[0].clone();
        (second.machines, second.gpus_per_machine) = (5, 1);
        let mut third = second.clone();
        (third.machines, third.gpus_per_machine) = (2, 3);
        t.machine_groups.extend([second, third]);
        let cluster = Cluster::new(&t);
        let mut expected = Vec::new();
        for (m, machine) in cluster.machines.iter().enumerate() {
            expected.extend(std::iter::repeat_n(Some(m), machine.gpus as usize));
        }
        expected.push(None);
        let found: Vec<Option<usize>> = (0..=cluster.num_devices())
            .map(|d| cluster.machine_of(d))
            .collect();
        assert_eq!(found, expected);
        assert_eq!(cluster.num_devices(), 12 + 5 + 6);
    }

    #[test]
    fn a_stage_memory_counts_each_term() {
        use crate::model::profile::ParameterState;
        let mut p = crate::model::profile::profile_with_memory_terms();
        let memory = |p: &crate::model::profile::Profile| {
            stage_memory_bytes(&LayerCosts::new(p), 0, 2, 2, 3)
        };
        // Adam under autocast: fp32 weights 4, gradients 4, moments 8 bytes
        // a parameter = 4 per parameter byte: 16,000. Each of 3 micro-batch
        // slices of 2 samples keeps (100 + 200) x 2 of activations and the
        // 1,500 of copies; the running backward needs max(20, 10) x 2.
        p.parameter_state = ParameterState::autocast("adam");
        assert_eq!(memory(&p), 16_000.0 + 3.0 * (600.0 + 1_500.0) + 40.0);
        // Without a parameter state the same: fp32 with Adam's two slots.
        p.parameter_state = None;
        assert_eq!(memory(&p), 16_000.0 + 3.0 * 2_100.0 + 40.0);
        // SGD with momentum: one slot, 12 bytes a parameter; plain SGD 8.
        p.parameter_state = ParameterState::autocast("sgd-momentum");
        assert_eq!(memory(&p), 12_000.0 + 6_300.0 + 40.0);
        p.parameter_state = ParameterState::autocast("sgd");
        assert_eq!(memory(&p), 8_000.0 + 6_300.0 + 40.0);
        // A run with another optimizer (`dapple calibrate`) takes its state.
        p.optimizer = "sgd".into();
        assert_eq!(memory(&p.with_optimizer("adam")), 16_000.0 + 6_300.0 + 40.0);
        // Megatron's mixed precision: bf16 weights and gradients, fp32
        // master weights and moments, 16 bytes per 2-byte parameter.
        p.parameter_state = Some(ParameterState {
            weight_bytes: 2.0,
            gradient_bytes: 2.0,
            master_weight_bytes: 4.0,
            optimizer_bytes: 8.0,
        });
        assert_eq!(memory(&p), 32_000.0 + 6_300.0 + 40.0);
        // The allocator's reserve: a 16 GiB GPU hands out 16 GiB / 1.25.
        p.allocator_reserved_factor = Some(1.25);
        let t = crate::cluster::topology::Topology::from_spec("1x1-v100").unwrap();
        let cluster = Cluster::for_model(&t, &LayerCosts::new(&p)).unwrap();
        let gpu = t.machine_groups[0].gpu.memory_bytes as f64;
        assert_eq!(cluster.machines[0].memory_bytes, gpu / 1.25);
        p.allocator_reserved_factor = Some(0.9);
        assert_eq!(
            p.validate().unwrap_err().field.as_deref(),
            Some("allocator_reserved_factor")
        );
    }

    #[test]
    fn even_slices_given_cost_what_the_even_split_costs() {
        let p = crate::model::profile::chain_profile(&[(1.0, 2.0), (3.0, 4.0), (2.0, 2.0)], 1);
        let layers = LayerCosts::new(&p);
        let t = Topology::from_spec("1x4-nvlink").unwrap();
        let cluster = Cluster::new(&t);
        let coster = StageCoster::new(&layers, &cluster, 8, 4);
        let even = coster.stage(0, 3, &[(0, 4)], 2, false);
        let given = coster.stage_sliced(0, 3, &[0, 1, 2, 3], &[2, 2, 2, 2], 2, false);
        assert_eq!(even, given);
    }

    #[test]
    fn uneven_slices_follow_each_replica_speed_and_memory() {
        // Time linear in the batch: 1 ms forward and 2 ms backward per sample.
        let p = crate::model::profile::chain_profile(&[(1.0, 2.0)], 1);
        let layers = LayerCosts::new(&p);
        let t = mixed(0.5, 16 << 30);
        let cluster = Cluster::new(&t);
        let coster = StageCoster::new(&layers, &cluster, 12, 1);
        // Devices 0, 1 at speed 1; 2, 3 at speed 0.5. Even: 3 samples each,
        // the slow ones take 3 / 0.5 = 6 ms forward. Balanced 4, 4, 2, 2:
        // every replica 4 ms.
        let even = coster.stage_sliced(0, 1, &[0, 1, 2, 3], &[3, 3, 3, 3], 1, false);
        let balanced = coster.stage_sliced(0, 1, &[0, 1, 2, 3], &[4, 4, 2, 2], 1, false);
        assert_eq!((even.fwd_ms, even.bwd_ms), (6.0, 12.0));
        assert_eq!((balanced.fwd_ms, balanced.bwd_ms), (4.0, 8.0));
        // The lock-step cost of the even split is the slowest GPU at the largest slice.
        assert_eq!(coster.stage(0, 1, &[(0, 2), (1, 2)], 1, false).fwd_ms, 6.0);
        // Memory: the fuller device is a fast one (4 samples, same limits).
        assert_eq!(balanced.slice_size, 4);
        let small = mixed(0.5, 1 << 20);
        let cluster = Cluster::new(&small);
        let coster = StageCoster::new(&layers, &cluster, 12, 1);
        let tight = coster.stage_sliced(0, 1, &[0, 1, 2, 3], &[4, 4, 2, 2], 1, false);
        assert_eq!(
            (tight.slice_size, tight.memory_limit_bytes),
            (2, f64::from(1 << 20))
        );
    }

    /// Two layers timed on the profile's own V100 (1 ms forward, 2 ms
    /// backward per sample each) and on a "P100" that is 3x slower on layer
    /// 0 and as fast on layer 1: per-layer ratios of its own.
    fn two_types() -> (crate::model::profile::Profile, Topology) {
        use crate::model::profile::{DeviceTimes, LayerTimes, TimeMeasurement};
        let mut p = crate::model::profile::chain_profile(&[(1.0, 2.0), (1.0, 2.0)], 1);
        p.device = Some("V100".into());
        p.other_devices = vec![DeviceTimes {
            device: "P100".into(),
            source: None,
            layers: [3.0, 1.0]
                .iter()
                .enumerate()
                .map(|(i, &slower)| LayerTimes {
                    name: format!("l{i}"),
                    measurements: vec![TimeMeasurement {
                        batch_size: 1,
                        fwd_ms: slower,
                        bwd_ms: 2.0 * slower,
                    }],
                })
                .collect(),
        }];
        p.validate().unwrap();
        let mut t = mixed(1.0, 16 << 30);
        t.machine_groups[0].gpu.gpu_type = "V100".into();
        t.machine_groups[1].gpu.gpu_type = "P100".into();
        t.machine_groups[1].gpu.relative_speed = None;
        (p, t)
    }

    #[test]
    fn each_gpu_type_runs_its_own_measured_times() {
        let (p, t) = two_types();
        let layers = LayerCosts::new(&p);
        let cluster = Cluster::for_model(&t, &layers).unwrap();
        assert_eq!(
            cluster
                .machines
                .iter()
                .map(|m| (m.timing, m.speed))
                .collect::<Vec<_>>(),
            vec![(0, 1.0), (1, 1.0)]
        );
        let coster = StageCoster::new(&layers, &cluster, 4, 1);
        // Two samples a replica.
        let on = |alloc: &[(usize, u32)], start, end| {
            let c = coster.stage(start, end, alloc, 1, false);
            (c.fwd_ms, c.bwd_ms)
        };
        assert_eq!(on(&[(0, 2)], 0, 1), (2.0, 4.0));
        assert_eq!(on(&[(1, 2)], 0, 1), (6.0, 12.0));
        assert_eq!(on(&[(1, 2)], 1, 2), (2.0, 4.0));
        // Both types, even slices: the P100 sets the pace (6 + 2 ms
        // forward against the V100's 2 + 2).
        assert_eq!(on(&[(0, 1), (1, 1)], 0, 2), (8.0, 16.0));
        // The search balances by each type's speed on the stage's layers:
        // on layer 0 the V100s are 3x as fast, on layer 1 equally fast.
        let devices = StageDevices::new(&cluster, vec![(0, 2), (1, 2)]);
        let coster = StageCoster::new(&layers, &cluster, 16, 1);
        assert_eq!(
            coster.searched_slices(0, 1, &devices, 1),
            Some(vec![6, 6, 2, 2])
        );
        assert_eq!(
            coster.searched_slices(1, 2, &devices, 1),
            Some(vec![4, 4, 4, 4])
        );
        let balanced = coster.stage_searched(0, 1, &devices, 1, 1, false);
        assert_eq!((balanced.fwd_ms, balanced.bwd_ms), (6.0, 12.0));
        // GPUs alike keep the even split.
        let alike = StageDevices::new(&cluster, vec![(1, 2)]);
        assert_eq!(coster.searched_slices(0, 2, &alike, 1), None);
    }

    #[test]
    fn forward_and_backward_wait_each_for_their_slowest_replica() {
        use crate::model::profile::{DeviceTimes, LayerTimes, TimeMeasurement};
        // Per sample: the V100 runs forward 3, backward 1; the P100
        // forward 1, backward 3.5. Together the stage's forward waits for
        // the V100 and its backward for the P100.
        let (mut p, t) = two_types();
        p.layers.truncate(1);
        p.layers[0].measurements[0].fwd_ms = 3.0;
        p.layers[0].measurements[0].bwd_ms = 1.0;
        p.other_devices = vec![DeviceTimes {
            device: "P100".into(),
            source: None,
            layers: vec![LayerTimes {
                name: "l0".into(),
                measurements: vec![TimeMeasurement {
                    batch_size: 1,
                    fwd_ms: 1.0,
                    bwd_ms: 3.5,
                }],
            }],
        }];
        let layers = LayerCosts::new(&p);
        let cluster = Cluster::for_model(&t, &layers).unwrap();
        let coster = StageCoster::new(&layers, &cluster, 2, 1);
        let even = coster.stage(0, 1, &[(0, 1), (1, 1)], 1, false);
        assert_eq!((even.fwd_ms, even.bwd_ms), (3.0, 3.5));
        let sliced = coster.stage_sliced(0, 1, &[0, 2], &[1, 1], 1, false);
        assert_eq!((sliced.fwd_ms, sliced.bwd_ms), (3.0, 3.5));
    }

    #[test]
    fn gpu_types_the_profile_and_topology_do_not_share_are_named() {
        let (p, mut t) = two_types();
        // A group of a third type with no speed: which times would it run?
        t.machine_groups[1].gpu.gpu_type = "K80".into();
        let e = Cluster::for_model(&t, &LayerCosts::new(&p)).unwrap_err();
        assert_eq!(e.kind, crate::ErrorKind::Incompatible);
        assert_eq!(
            e.field.as_deref(),
            Some("machine_groups[1].gpu.relative_speed")
        );
        assert!(
            e.message.contains("\"K80\"") && e.message.contains("\"P100\""),
            "{e}"
        );
        // With a speed it runs the profile's own times, but then the P100
        // times belong to no group: most likely a typing mistake.
        t.machine_groups[1].gpu.relative_speed = Some(0.5);
        let e = Cluster::for_model(&t, &LayerCosts::new(&p)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("other_devices[0].device"));
        assert!(e.message.contains("\"P100\""), "{e}");
        // A profile of one type runs any group at its relative speed, 1
        // where absent, as before.
        let one = crate::model::profile::chain_profile(&[(1.0, 2.0)], 1);
        t.machine_groups[1].gpu.relative_speed = None;
        let cluster = Cluster::for_model(&t, &LayerCosts::new(&one)).unwrap();
        assert!(cluster
            .machines
            .iter()
            .all(|m| (m.timing, m.speed) == (0, 1.0)));
    }

    #[test]
    fn slices_are_contiguous_larger_first_and_priced_by_their_extremes() {
        assert_eq!(slice_ranges(5, 3), vec![(0, 2), (2, 4), (4, 5)]);
        assert_eq!(slice_ranges(4, 4), vec![(0, 1), (1, 2), (2, 3), (3, 4)]);
        for micro_batch in 1..40 {
            for replicas in 1..=micro_batch {
                let ranges = slice_ranges(micro_batch, replicas);
                assert_eq!(ranges[0].0, 0);
                assert_eq!(ranges[ranges.len() - 1].1, micro_batch);
                assert!(ranges.windows(2).all(|w| w[0].1 == w[1].0));
                let sizes: Vec<u32> = ranges.iter().map(|(a, b)| b - a).collect();
                assert!(sizes.windows(2).all(|w| w[0] >= w[1]));
                assert_eq!(sizes[0], largest_slice(micro_batch, replicas));
                assert_eq!(
                    sizes[sizes.len() - 1],
                    smallest_slice(micro_batch, replicas)
                );
            }
        }
    }

    use super::*;
    use crate::cluster::topology::Topology;

    fn st(f: f64, b: f64, ar: f64) -> PipeStage {
        PipeStage::compute(f, b, ar)
    }

    #[test]
    fn straight_pipeline_of_equal_stages() {
        // S equal stages, free links: (M + S - 1)(F + B) for 1F1B.
        let stages = vec![st(1.0, 2.0, 0.0); 4];
        let l = pipeline_latency(&stages, 8);
        assert_eq!(l.latency_ms, (8.0 + 4.0 - 1.0) * 3.0);
        assert_eq!(l.pivot, 3);
        assert_eq!(l.paper_pivot, 3);
        assert_eq!(l.paper_latency_ms, l.latency_ms);
    }

    #[test]
    fn folding_from_the_back_matches_the_formula() {
        let stages = vec![
            st(1.0, 2.0, 5.0),
            PipeStage::transfer(0.5),
            st(3.0, 1.0, 7.0),
            PipeStage::transfer(2.2),
            st(2.0, 2.5, 1.0),
        ];
        for m in [1, 2, 5, 9] {
            let mut s = SuffixLatency::EMPTY;
            for stage in stages.iter().rev() {
                s = s.prepend(*stage, m);
            }
            let l = pipeline_latency(&stages, m);
            assert!(
                (s.best - l.latency_ms).abs() < 1e-9,
                "m={m}: {} vs {}",
                s.best,
                l.latency_ms
            );
        }
    }

    #[test]
    fn algorithm_one_moves_the_pivot_to_a_heavy_early_stage() {
        let stages = vec![st(5.0, 10.0, 0.0), st(0.1, 0.1, 0.0), st(1.0, 2.0, 0.0)];
        assert_eq!(paper_pivot(&stages, 8), 0);
        assert_eq!(pipeline_latency(&stages, 8).pivot, 0);
    }

    #[test]
    fn transfer_uses_the_slowest_link() {
        let t = Topology::from_spec("2x8-nvlink-25gbps").unwrap();
        let c = Cluster::new(&t);
        let mb = 1e6;
        // Same machine, 1 -> 1: NVLink.
        let same = transfer_ms(&c, &[(0, 1)], &[(0, 1)], mb);
        assert!(same < 0.02);
        // Across machines, 8 -> 8: all of it through one 25 Gbps link.
        let across = transfer_ms(&c, &[(0, 8)], &[(1, 8)], mb);
        assert!((across - (mb / 3.125e6 + 0.02)).abs() < 1e-9, "{across}");
        // Scattered 4+4 -> 4+4 keeps everything local.
        let local = transfer_ms(&c, &[(0, 4), (1, 4)], &[(0, 4), (1, 4)], mb);
        assert!(local < across / 10.0);
    }

    #[test]
    fn warmup_policies() {
        assert_eq!(WarmupPolicy::A.warmup(3, 16), Some(3));
        assert_eq!(WarmupPolicy::B.warmup(3, 16), Some(5));
        assert_eq!(WarmupPolicy::B.warmup(3, 4), Some(4));
        assert_eq!(WarmupPolicy::A.warmup(1, 16), Some(1));
        assert_eq!(WarmupPolicy::Auto.warmup(1, 16), None);
        for p in WarmupPolicy::ALL {
            assert_eq!(WarmupPolicy::parse(p.name()).unwrap(), p);
        }
        assert_eq!(WarmupPolicy::parse("b").unwrap(), WarmupPolicy::B);
        assert!(WarmupPolicy::parse("C").is_err());
    }
}
