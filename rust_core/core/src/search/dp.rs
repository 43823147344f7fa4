//! The dynamic program of the search (section IV-C of the paper) over
//! (layers planned, cluster state), for one micro-batch size, and the walk
//! over every layout whose bound is below a given time. What a stage may be
//! comes from the space (`space::Context`); `passes.rs` runs the DP per
//! micro-batch size, `walk.rs` runs its walk, and `candidate.rs` ranks what
//! they find by simulation.
//!
//! Pipelines are built from the last stage to the first. A partial plan is a
//! suffix of stages covering layers `j..N`; prepending a stage of layers
//! `i..j` on GPUs chosen by one of the three placement policies extends it.
//! The latency formula folds from the back with two numbers per suffix
//! (`cost::SuffixLatency`), and the memory of a stage depends only on how
//! many stages follow it (its warm-up depth K_i), so a suffix is summarised
//! by (stages, latency, steady) and suffixes reaching the same state are
//! kept only when no other one is at least as good in all three: the search
//! is exact over its space (partitions x replications x placements x
//! micro-batch sizes), which `search::tests::search_matches_brute_force`
//! checks.
//!
//! States are symmetry-reduced (`placement::State`): which identical machine
//! a stage uses is never distinguished, so 2x8 has a handful of states per
//! layer instead of 2^16; and where the neighbouring stage is whole
//! machines, how many is a number of each suffix, not part of the state
//! (`DpKey`), so states per layer grow with the machines, not their square.

use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use std::rc::Rc;

use crate::cluster::placement::{MachineUse, Placement, Policy, State, Take};
use crate::cost::shape::{Offload, Recompute, StageMemory, StageShape};
use crate::cost::{
    largest_slice, stage_memory_bytes, Alloc, Cluster, PipeStage, ShapedSums, StageCost,
    StageCoster, StageDevices, SuffixLatency, TransferShare, WarmupPolicy,
};
use crate::model::profile::LayerCosts;

use super::space::{Context, ShapeList, StageDegrees, StageGpus};

/// The memory the DP tables of one search may take, shared by its runs
/// (one per micro-batch size, in parallel): each run charges the states
/// and entries it makes as it makes them, and gives them back when it is
/// dropped. A run that would pass the limit stops, and the search fails
/// with a limit error instead of growing without bound.
pub(crate) struct MemoryBudget {
    used: AtomicU64,
    pub(crate) limit_bytes: u64,
    /// Set once some run was stopped: the largest use it saw.
    pub(crate) exceeded_at_bytes: AtomicU64,
}

impl MemoryBudget {
    pub(crate) fn new(limit_bytes: u64) -> MemoryBudget {
        MemoryBudget {
            used: AtomicU64::new(0),
            limit_bytes,
            exceeded_at_bytes: AtomicU64::new(0),
        }
    }

    pub(crate) fn exceeded(&self) -> Option<u64> {
        match self.exceeded_at_bytes.load(Ordering::Relaxed) {
            0 => None,
            bytes => Some(bytes),
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Objective {
    Latency,
    /// Smallest per-GPU memory, ignoring limits: only to explain infeasibility.
    PeakMemory,
}

pub(crate) const NO_PARENT: u32 = u32::MAX;

/// Most bisections of a seed's cap on a stage's work (`Dp::seed_rule`):
/// each halves the gap between a cap that fits and one that does not.
const SEED_BISECTIONS: u32 = 8;

/// A suffix plan: what the DP compares. Its first stage is kept apart
/// (`EntryStage`, at the same index), read only to rebuild a plan: the
/// entries are copied and compared in the innermost loops.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Entry {
    latency: SuffixLatency,
    peak_memory: f64,
    stages: u32,
    /// Machines of the neighbouring stage where the state leaves it out
    /// (`DpKey`); more is better.
    neighbour_machines: u32,
    parent: u32,
    /// The strictest memory rule of the run every stage fits under: an
    /// index into `Dp::rules`.
    class: u8,
}

/// An entry's first stage; it ends where its parent's starts (the
/// root's is a sentinel: only its `layer_start`, the layer count, is read).
#[derive(Debug, Clone, Copy)]
struct EntryStage {
    layer_start: u32,
    placement: Placement,
    /// Replicas times split degree.
    gpus: u32,
    shape: StageShape,
}

/// A DP state: the machines used, where the neighbouring stage (the one
/// the next stage placed sends to) is whole machines of one class, without
/// it, and that class; how many machines it has is then a number of each
/// suffix (`Entry::neighbour_machines`). Suffixes whose neighbours differ
/// only in that count see the same placements and the same states after
/// them, and a neighbour of more machines receives no slower, so they
/// compare as one more number instead of filling one state each (the
/// number of states per layer grows with the machines, not their square).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct DpKey {
    machines: State,
    neighbour: Option<MachineUse>,
}

impl DpKey {
    /// The key of `state`, and its neighbour's machines (0 when the state
    /// keeps its neighbour itself).
    fn of(state: State) -> (DpKey, u32) {
        match state.adjacent_whole_machines() {
            Some((rest, class, machines)) => (
                DpKey {
                    machines: rest,
                    neighbour: Some(class),
                },
                machines,
            ),
            None => (
                DpKey {
                    machines: state,
                    neighbour: None,
                },
                0,
            ),
        }
    }
}

pub(crate) struct StateData {
    key: DpKey,
    front: Vec<u32>,
}

/// A complete plan found by one DP run, as placement steps from the last
/// stage to the first.
#[derive(Clone)]
pub(crate) struct Found {
    pub(crate) value: f64,
    /// Placement steps, last stage first.
    pub(crate) stages: Vec<Step>,
}

pub(crate) struct Dp<'c, 'a> {
    ctx: &'c Context<'a>,
    coster: StageCoster<'a>,
    micro_batch: u32,
    micro_batches: u32,
    objective: Objective,
    /// The memory rules (warm-up depths counted in stage memory) this run
    /// serves at once, loosest first. Each rule's depths are at least the
    /// previous one's, so a stage that fits under rule c fits under every
    /// rule before it, and one DP run finds the best plan of each rule.
    rules: Vec<WarmupPolicy>,
    /// The best formula value found per rule, shared with other runs; none
    /// when the run has no bound to prune with.
    incumbents: Option<&'c [AtomicU64]>,
    pub(crate) states: Vec<StateData>,
    /// index[j]: state id of each cluster state whose suffix starts at layer j.
    index: Vec<FxHashMap<DpKey, u32>>,
    entries: Vec<Entry>,
    /// Each entry's first stage, by entry id.
    entry_stages: Vec<EntryStage>,
    pub(crate) stages_costed: u64,
    /// The run's work: each stage costed, and each stage put in front of
    /// one suffix (a stage meets every suffix of its state, and a state
    /// of a wide cluster can have thousands). `work_limit` bounds it.
    pub(crate) steps: u64,
    /// Lower bounds on the forward (and forward+backward) time of layers
    /// 0..j whatever stages hold them, for pruning.
    fwd_floor: Vec<f64>,
    fwd_bwd_floor: Vec<f64>,
    /// GPU-time floor of layers 0..j: whatever stages hold them, the GPUs
    /// spend at least this long on them per micro-batch (r GPUs on a stage
    /// each spend its per-slice time).
    work_floor: Vec<f64>,
    budget: Option<&'c MemoryBudget>,
    /// Bytes this run has charged to the budget.
    charged: u64,
    /// The devices of each stage shape placed so far: a stage's cost
    /// depends on how many GPUs it has on how many machines of each group,
    /// not on which machines.
    shapes: FxHashMap<Vec<(u16, u32, u32)>, Rc<StageDevices>>,
    /// The first machine of each group (groups are contiguous).
    group_first: Vec<usize>,
    /// The budget ran out: the run stopped and its results mean nothing.
    stopped: bool,
    /// Most steps this run may take (`with_work_limit`).
    work_limit: u64,
    /// The run passed `work_limit` and stopped: its results are the best
    /// complete plans it had found (real plans, not the size's best), and
    /// `floor_ms` is all that is known below them.
    pub(crate) abandoned: bool,
    /// ZeRO-1 moves less than an AllReduce (weights smaller than
    /// gradients): worth trying where memory does not bind.
    zero_saves_time: bool,
    /// The space's highest sharding level (`prepend_shapes` weighs a shape
    /// above level 1 against the level below it).
    max_shard_level: u8,
    /// `prepend_shapes`' lists, kept between calls: it runs for each
    /// degree at each layer a stage grows by, too often to allocate them.
    shape_scratch: ShapeScratch,
    /// Emptied lists of `Degree`s, to fill again (`degrees_for`,
    /// `recycle_degrees`): one is needed per stage option.
    spare_degrees: Vec<Vec<Degree>>,
}

/// The passes of the shapes a stage was prepended in so far (None:
/// skipped), and those of the ones that fit every suffix's rule.
#[derive(Default)]
struct ShapeScratch {
    passes: Vec<(StageShape, Option<[f64; 3]>)>,
    fitting: Vec<[f64; 3]>,
    /// The shapes some shape that fits every rule is no slower than.
    settled: Vec<StageShape>,
}

impl Drop for Dp<'_, '_> {
    fn drop(&mut self) {
        if let Some(b) = self.budget {
            b.used.fetch_sub(self.charged, Ordering::Relaxed);
        }
    }
}

impl<'c, 'a> Dp<'c, 'a> {
    pub(crate) fn new(
        ctx: &'c Context<'a>,
        micro_batch: u32,
        micro_batches: u32,
        objective: Objective,
        rules: Vec<WarmupPolicy>,
        incumbents: Option<&'c [AtomicU64]>,
    ) -> Self {
        debug_assert!(incumbents.is_none_or(|i| i.len() == rules.len()));
        let coster = StageCoster::new(ctx.layers, ctx.cluster, micro_batch, micro_batches)
            .overlapping(ctx.overlap);
        let n = ctx.layers.num_layers;
        let max_replicas = ctx.cluster.num_devices().min(micro_batch);
        let slices: Vec<u32> = {
            let mut v: Vec<u32> = (1..=max_replicas)
                .map(|r| largest_slice(micro_batch, r))
                .collect();
            v.dedup();
            v
        };
        // On mixed GPUs a stage may have uneven slices: its slowest
        // replica takes some size of the allowed range.
        let uneven = if ctx.cluster.is_mixed() {
            coster.uneven_floor_slices(ctx.min_slice)
        } else {
            Vec::new()
        };
        let mut fwd_floor = vec![0.0; n + 1];
        let mut fwd_bwd_floor = vec![0.0; n + 1];
        let mut work_floor = vec![0.0; n + 1];
        for l in 0..n {
            let lightest = |s| lightest_ms(&coster, l, s);
            let uneven_floor = uneven
                .iter()
                .map(|&s| lightest(s))
                .fold((f64::INFINITY, f64::INFINITY), |a, b| {
                    (a.0.min(b.0), a.1.min(b.1))
                });
            // Unevenly sliced, r replicas held for the slowest one's time
            // spend at least the sum of their own times, so at least the
            // micro-batch at the fastest time per sample (per sample, a
            // layer's time is monotone between measured sizes, so its least
            // is at one of `uneven`).
            let uneven_work = uneven
                .iter()
                .map(|&s| lightest(s).1 / f64::from(s))
                .fold(f64::INFINITY, f64::min)
                * f64::from(micro_batch);
            let w = (1..=max_replicas.max(1))
                .map(|r| f64::from(r) * lightest(largest_slice(micro_batch, r)).1)
                .fold(uneven_work, f64::min);
            work_floor[l + 1] = work_floor[l] + w;
            let (f, fb) = slices
                .iter()
                .map(|&s| lightest(s))
                .fold(uneven_floor, |a, b| (a.0.min(b.0), a.1.min(b.1)));
            // A split layer's shard computes a part of it (its
            // collectives only add); its replicas take the same slices.
            let shard = ctx
                .shapes
                .split_degrees
                .iter()
                .filter_map(|&t| ctx.layers.shard(l, t, true))
                .map(|s| s.compute_factor)
                .fold(1.0, f64::min);
            fwd_floor[l + 1] = fwd_floor[l] + f * shard;
            fwd_bwd_floor[l + 1] = fwd_bwd_floor[l] + fb * shard;
        }
        Dp {
            ctx,
            coster,
            micro_batch,
            micro_batches,
            objective,
            rules,
            incumbents,
            states: Vec::new(),
            index: vec![FxHashMap::default(); n + 1],
            entries: Vec::new(),
            entry_stages: Vec::new(),
            stages_costed: 0,
            steps: 0,
            fwd_floor,
            fwd_bwd_floor,
            work_floor,
            budget: None,
            charged: 0,
            shapes: FxHashMap::default(),
            group_first: group_firsts(ctx.cluster),
            stopped: false,
            work_limit: u64::MAX,
            abandoned: false,
            zero_saves_time: ctx.shapes.shard_levels.contains(&1)
                && ctx.layers.weights_per_gradient_byte() < 1.0,
            max_shard_level: ctx.shapes.shard_levels.iter().copied().max().unwrap_or(0),
            shape_scratch: ShapeScratch::default(),
            spare_degrees: Vec::new(),
        }
    }

    /// What a stage taking `takes` from `state` runs on, from the cache.
    fn devices(&mut self, state: &State, takes: &[Take]) -> Rc<StageDevices> {
        // A stage is a take or two: a fixed buffer spares an allocation
        // on every lookup that finds its shape.
        let mut buffer = [(0u16, 0u32, 0u32); 4];
        let mut owned = Vec::new();
        let shape: &mut [(u16, u32, u32)] = if takes.len() <= buffer.len() {
            &mut buffer[..takes.len()]
        } else {
            owned.resize(takes.len(), (0, 0, 0));
            &mut owned
        };
        for (slot, t) in shape.iter_mut().zip(takes) {
            *slot = (state.0[t.class].0.group, t.gpus, t.machines);
        }
        shape.sort_unstable();
        if let Some(d) = self.shapes.get(&*shape) {
            return Rc::clone(d);
        }
        let shape = shape.to_vec();
        let d = Rc::new(StageDevices::new(
            self.ctx.cluster,
            representative_alloc(&self.group_first, &shape),
        ));
        self.shapes.insert(shape, Rc::clone(&d));
        d
    }

    /// Charge the tables this run makes to `budget`.
    pub(crate) fn with_budget(mut self, budget: &'c MemoryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Stop the run once it has taken more than `steps` steps (the
    /// search's work limit per micro-batch size, `SearchOptions::
    /// max_search_steps`): a limit on its time, as `with_budget` is on
    /// its memory.
    pub(crate) fn with_work_limit(mut self, steps: u64) -> Self {
        self.work_limit = steps;
        self
    }

    /// No plan of this run's micro-batch size has a formula value below
    /// this, whatever its stages: one micro-batch's forward and backward
    /// through every layer, and the M passes of the busiest GPU's share of
    /// the work (`completion_floor` of the empty suffix).
    pub(crate) fn floor_ms(&self) -> f64 {
        let n = self.ctx.layers.num_layers;
        let gpus = f64::from(self.ctx.cluster.num_devices());
        let busiest = f64::from(self.micro_batches) * self.work_floor[n] / gpus;
        self.fwd_bwd_floor[n].max(busiest)
    }

    /// Charge `bytes` of new table memory; past the limit the run stops.
    fn charge(&mut self, bytes: u64) {
        if let Some(b) = self.budget {
            self.charged += bytes;
            let now = b.used.fetch_add(bytes, Ordering::Relaxed) + bytes;
            if now > b.limit_bytes {
                self.stopped = true;
                b.exceeded_at_bytes.fetch_max(now, Ordering::Relaxed);
            }
        }
    }

    /// Most GPUs one stage can use: every replica needs a slice of at
    /// least the smallest allowed size.
    fn max_replicas(&self) -> u32 {
        (self.micro_batch / self.ctx.min_slice).min(self.ctx.cluster.num_devices())
    }

    /// The largest formula value a suffix of class `class` can still be
    /// useful at: the best plan known under the loosest rule it could
    /// improve (rules 0..=class), which is the largest of those bounds.
    fn incumbent(&self, class: u8) -> f64 {
        self.incumbents.map_or(f64::INFINITY, |all| {
            all[..=usize::from(class)]
                .iter()
                .map(|a| f64::from_bits(a.load(Ordering::Relaxed)))
                .fold(f64::NEG_INFINITY, f64::max)
        })
    }

    /// The largest bound any suffix is pruned against (the largest of the
    /// rules' best values so far): above it nothing can be useful.
    fn loosest_incumbent(&self) -> f64 {
        self.incumbent((self.rules.len() - 1) as u8)
    }

    /// A complete plan of class `class` is a plan of rules 0..=class.
    fn offer_incumbent(&self, value: f64, class: u8) {
        if let Some(all) = self.incumbents {
            for a in &all[..=usize::from(class)] {
                let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    (value < f64::from_bits(old)).then_some(value.to_bits())
                });
            }
        }
    }

    /// Can a suffix with these numbers, still missing layers 0..j, end
    /// below the best complete plan its class could improve? Only strictly
    /// worse ones are cut, so ties survive and the result does not depend
    /// on thread timing. `free`: GPUs left for layers 0..j.
    #[inline]
    fn promising(&self, latency: SuffixLatency, j: usize, free: u32, class: u8) -> bool {
        if self.objective != Objective::Latency {
            return true;
        }
        self.completion_floor(latency, j, free) <= self.incumbent(class) * (1.0 + 1e-12)
    }

    /// K_i counted in the memory of a stage with `stages_from_here` stages
    /// from it to the end under rule `class`.
    fn rule_warmup(&self, class: usize, stages_from_here: u32) -> u32 {
        self.rules[class].memory_depth(stages_from_here, self.micro_batches)
    }

    /// The strictest rule, at most `ceiling`, under which `priced` (layers
    /// `start..end`) fits with `stages_from_here` stages from it on, and
    /// its memory under that rule; None when it fits under none.
    fn fitting_class(
        &self,
        priced: &Priced,
        start: usize,
        end: usize,
        stages_from_here: u32,
        ceiling: u8,
    ) -> Option<(u8, f64)> {
        (0..=ceiling).rev().find_map(|c| {
            let warmup = self.rule_warmup(usize::from(c), stages_from_here);
            let bytes = priced.bytes_at(self.ctx.layers, start, end, warmup);
            (bytes <= priced.cost.memory_limit_bytes).then_some((c, bytes))
        })
    }

    /// What layers `i..j` on `devices` cost as `shape` runs them, and their
    /// memory at any depth; for a plain shape, the cost's own memory is at
    /// `warmup` (the depth asked for first). A shape that is not plain is
    /// priced from `sums` of the stage at its degree, grown to `i` (or
    /// made, where there are none yet).
    fn price(
        &self,
        (i, j): (usize, usize),
        devices: &StageDevices,
        (shape, warmup): (&StageShape, u32),
        only_stage: bool,
        sums: &mut Option<Box<ShapedSums>>,
    ) -> Priced {
        if shape.is_plain() {
            let cost =
                self.coster
                    .stage_searched(i, j, devices, self.ctx.min_slice, warmup, only_stage);
            return Priced {
                shape: *shape,
                cost,
                memory: None,
                warmup,
            };
        }
        let sums = match sums {
            Some(sums) if sums.prices(shape) => {
                while sums.start() > i {
                    self.coster.prepend_layer(sums, devices);
                }
                sums
            }
            // None yet (a degree's shapes share their sequence parallelism).
            _ => sums.insert(Box::new(self.coster.shaped_sums(i, j, devices, shape))),
        };
        let (cost, memory) = self.coster.shaped_cost(sums, devices, shape, only_stage);
        Priced {
            shape: *shape,
            cost,
            memory: Some(memory),
            warmup,
        }
    }

    /// Ids of the states whose suffix starts at layer `j`, in creation order
    /// (ids grow as states are made, so sorting restores it).
    fn states_starting_at(&self, j: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = self.index[j].values().copied().collect();
        ids.sort_unstable();
        ids
    }

    fn state_id(&mut self, start: usize, key: &DpKey) -> u32 {
        if let Some(&id) = self.index[start].get(key) {
            return id;
        }
        // The state is kept twice (in the index and the list), with its
        // machines on the heap, plus the index's slot.
        let machines = key.machines.0.len()
            * std::mem::size_of::<(crate::cluster::placement::MachineUse, u32)>();
        self.charge(
            (std::mem::size_of::<StateData>()
                + 2 * (std::mem::size_of::<DpKey>() + machines)
                + std::mem::size_of::<u32>()
                + 16) as u64,
        );
        let id = self.states.len() as u32;
        self.index[start].insert(key.clone(), id);
        self.states.push(StateData {
            key: key.clone(),
            front: Vec::new(),
        });
        id
    }

    /// `a` is at least as good as `b` for every completion of the suffix.
    fn dominates(&self, a: &Entry, b: &Entry) -> bool {
        if a.stages > b.stages || a.class < b.class || a.neighbour_machines < b.neighbour_machines {
            return false;
        }
        // Under a hinted stage count, fewer stages is not better: the
        // suffix must end with that many.
        if self.ctx.hints.stages.is_some() && a.stages != b.stages {
            return false;
        }
        match self.objective {
            Objective::Latency => {
                a.latency.best <= b.latency.best && a.latency.steady <= b.latency.steady
            }
            Objective::PeakMemory => a.peak_memory <= b.peak_memory,
        }
    }

    #[inline(always)]
    fn insert(&mut self, state: u32, entry: Entry, stage: EntryStage) {
        let front = &self.states[state as usize].front;
        if front
            .iter()
            .any(|&e| self.dominates(&self.entries[e as usize], &entry))
        {
            return;
        }
        let keep: Vec<u32> = front
            .iter()
            .copied()
            .filter(|&e| !self.dominates(&entry, &self.entries[e as usize]))
            .collect();
        self.charge(
            (std::mem::size_of::<Entry>()
                + std::mem::size_of::<EntryStage>()
                + std::mem::size_of::<u32>()) as u64,
        );
        let id = self.entries.len() as u32;
        self.entries.push(entry);
        self.entry_stages.push(stage);
        let front = &mut self.states[state as usize].front;
        *front = keep;
        front.push(id);
    }

    /// The best plan under each rule (`rules[c]`), if any fits.
    pub(crate) fn run(&mut self) -> Vec<Option<Found>> {
        let n = self.ctx.layers.num_layers;
        let machines = self.ctx.cluster.group_and_gpus();
        let root_state = self.state_id(n, &DpKey::of(State::empty(&machines)).0);
        let root = Entry {
            latency: SuffixLatency::EMPTY,
            peak_memory: 0.0,
            stages: 0,
            neighbour_machines: 0,
            parent: NO_PARENT,
            class: (self.rules.len() - 1) as u8,
        };
        self.entries.push(root);
        self.entry_stages.push(EntryStage {
            layer_start: n as u32,
            placement: Placement::of(Policy::FreshFirst),
            gpus: 0,
            shape: StageShape::PLAIN,
        });
        self.states[root_state as usize].front.push(0);
        let max_replicas = self.max_replicas();
        'layers: for j in (1..=n).rev() {
            for sid in self.states_starting_at(j) {
                if self.stopped {
                    return self.rules.iter().map(|_| None).collect();
                }
                self.abandoned |= self.steps > self.work_limit;
                if self.abandoned {
                    // The complete plans found so far (one stage over
                    // every layer is among the first) stay candidates.
                    break 'layers;
                }
                self.expand_state(sid, j, max_replicas);
            }
        }
        let finals: Vec<u32> = self
            .states_starting_at(0)
            .iter()
            .flat_map(|&s| self.states[s as usize].front.clone())
            .collect();
        (0..self.rules.len())
            .map(|class| {
                let best = finals
                    .iter()
                    .copied()
                    .filter(|&e| usize::from(self.entries[e as usize].class) >= class)
                    .min_by(|&a, &b| {
                        let (ea, eb) = (&self.entries[a as usize], &self.entries[b as usize]);
                        self.value(ea)
                            .total_cmp(&self.value(eb))
                            .then(ea.stages.cmp(&eb.stages))
                    })?;
                Some(self.found(best))
            })
            .collect()
    }

    /// For rule `class`: the best complete plan of each stage count other
    /// than that of the rule's best plan, best first.
    pub(crate) fn other_stage_counts(&self, class: usize) -> Vec<Found> {
        let mut best_per_count: Vec<Option<u32>> = Vec::new();
        for s in self.states_starting_at(0) {
            for &e in &self.states[s as usize].front {
                let entry = &self.entries[e as usize];
                if usize::from(entry.class) < class {
                    continue;
                }
                let count = entry.stages as usize;
                if best_per_count.len() <= count {
                    best_per_count.resize(count + 1, None);
                }
                let slot = &mut best_per_count[count];
                if slot.is_none_or(|b| self.value(entry) < self.value(&self.entries[b as usize])) {
                    *slot = Some(e);
                }
            }
        }
        let mut found: Vec<Found> = best_per_count
            .into_iter()
            .flatten()
            .map(|e| self.found(e))
            .collect();
        found.sort_by(|a, b| {
            a.value
                .total_cmp(&b.value)
                .then(a.stages.len().cmp(&b.stages.len()))
        });
        found.into_iter().skip(1).collect()
    }

    /// The plan ending in entry `best`, as placement steps.
    fn found(&self, best: u32) -> Found {
        let value = self.value(&self.entries[best as usize]);
        let mut stages = Vec::new();
        let mut cur = best;
        while self.entries[cur as usize].parent != NO_PARENT {
            let parent = self.entries[cur as usize].parent;
            let stage = self.entry_stages[cur as usize];
            stages.push(Step {
                layer_start: stage.layer_start as usize,
                layer_end: self.entry_stages[parent as usize].layer_start as usize,
                placement: stage.placement,
                gpus: stage.gpus,
                shape: stage.shape,
            });
            cur = parent;
        }
        stages.reverse(); // last pipeline stage first, the order they were placed
        Found { value, stages }
    }

    fn value(&self, e: &Entry) -> f64 {
        match self.objective {
            Objective::Latency => e.latency.best,
            Objective::PeakMemory => e.peak_memory,
        }
    }

    /// Cost a few simple plans so that pruning has a bound from the start:
    /// for each k, k stages of G/k GPUs each (fresh-first), cut under each
    /// memory rule (`seed_plan`). Only plans of the search space: a bound
    /// from outside it could prune every plan inside it.
    pub(crate) fn seed_bounds(&mut self) {
        if self.objective != Objective::Latency
            || self.ctx.layout.is_some()
            || !self.ctx.hints.is_empty()
            || self.incumbents.is_none()
        {
            // The seeds are plans of the whole space, not of a fixed
            // layout nor of the space the hints leave.
            return;
        }
        let n = self.ctx.layers.num_layers;
        let g = self.ctx.cluster.num_devices();
        let max_replicas = self.max_replicas();
        let empty = State::empty(&self.ctx.cluster.group_and_gpus());
        let counts = self
            .ctx
            .replica_counts(&empty, max_replicas, self.micro_batch);
        for k in (1..=g.min(n as u32)).filter(|k| g.is_multiple_of(*k)) {
            let r = g / k;
            // Only GPU counts of the search space (the whole cluster, for
            // one stage, always is).
            if r > max_replicas || (k > 1 && !counts.contains(&r)) {
                continue;
            }
            let seed = (&empty, k, r);
            // A stricter rule fits no plan where a looser one fits none.
            for class in 0..self.rules.len() as u8 {
                if !self.seed_rule(seed, class) {
                    break;
                }
            }
        }
    }

    /// Offer a few plans of up to `k` stages of `r` GPUs under rule
    /// `class`: each stage its share of the work (`seed_plan` without a
    /// cap), then, where memory made some stage longer than its share, the
    /// smallest cap on a stage's work that a cut fits under, found by
    /// bisection. False where no such plan fits the rule (the cut that
    /// fills each stage as far as memory allows, the loosest cap, does not).
    fn seed_rule(&mut self, (empty, k, r): (&State, u32, u32), class: u8) -> bool {
        let seed = (empty, k, r);
        let slice = largest_slice(self.micro_batch, r);
        let total = self
            .coster
            .fastest_ms(0, self.ctx.layers.num_layers, slice)
            .1;
        let shared = self.seed_plan(seed, class, None);
        let Some((value, longest)) = shared.or_else(|| self.seed_plan(seed, class, Some(total)))
        else {
            return false;
        };
        self.offer_incumbent(value, class);
        let (mut fits, mut fails) = (longest, total / f64::from(k));
        for _ in 0..SEED_BISECTIONS {
            // Within 1% of an even cut: close enough to the best bound.
            if fits <= 1.01 * fails {
                break;
            }
            let cap = 0.5 * (fits + fails);
            match self.seed_plan(seed, class, Some(cap)) {
                Some((value, most)) => {
                    self.offer_incumbent(value, class);
                    fits = most;
                }
                None => fails = cap,
            }
        }
        true
    }

    /// The formula value of up to `k` stages of `r` GPUs each that fit under
    /// rule `class`, and their largest work, cut from the last stage back:
    /// each stage takes layers while one more fits at its depth and keeps
    /// its work within `cap`, or, without one, until it has its share of
    /// the work left (that work over the stages left). None where the
    /// layers do not fit in `k` such stages.
    fn seed_plan(
        &mut self,
        (empty, k, r): (&State, u32, u32),
        class: u8,
        cap: Option<f64>,
    ) -> Option<(f64, f64)> {
        let slice = largest_slice(self.micro_batch, r);
        let work = |dp: &Self, a: usize, b: usize| dp.coster.fastest_ms(a, b, slice).1;
        let mut state = empty.clone();
        let mut latency = SuffixLatency::EMPTY;
        let mut most = 0.0f64;
        let mut end = self.ctx.layers.num_layers;
        for stages_from_here in 1..=k {
            if end == 0 {
                break;
            }
            let (_, takes) = self.ctx.placements(&state, r).into_iter().next()?;
            let devices = self.devices(&state, &takes);
            let stages_left = k - stages_from_here + 1;
            // Without a cap, a stage grows to an even share of the work
            // left; the first stage takes all of it.
            let share = work(self, 0, end) / f64::from(stages_left);
            let longer = |dp: &Self, start: usize| match cap {
                Some(cap) => work(dp, start - 1, end) <= cap,
                None => stages_left == 1 || work(dp, start, end) < share,
            };
            let mut start = end - 1;
            // The stage's spread shapes and its sums at their expert degree,
            // the sums grown as it takes layers.
            let spread = self.spread_shapes(&devices);
            let mut sums = None;
            let mut fitting = self.seed_stage(
                (start, end),
                (&devices, spread.as_ref()),
                stages_from_here,
                class,
                &mut sums,
            )?;
            while start > 0 && longer(self, start) {
                match self.seed_stage(
                    (start - 1, end),
                    (&devices, spread.as_ref()),
                    stages_from_here,
                    class,
                    &mut sums,
                ) {
                    Some(cost) => (start, fitting) = (start - 1, cost),
                    None => break,
                }
            }
            if stages_from_here > 1 {
                // Not the last stage: it sends to the one placed before.
                let shares = transfer_shares(&self.group_first, &state, &takes);
                let t = self.coster.transfer_over(end, &shares);
                latency = latency.prepend(PipeStage::transfer(t), self.micro_batches);
            }
            latency = latency.prepend(fitting.as_pipe_stage(), self.micro_batches);
            most = most.max(work(self, start, end));
            state = state.taken(&takes);
            end = start;
        }
        (end == 0).then_some((latency.best, most))
    }

    /// The shapes a seed stage on `devices` tries its experts in: spread
    /// over the most of its replicas the space allows (sharding,
    /// re-computation and offloading varied at that degree). None where the
    /// space spreads no experts there (every dense profile).
    fn spread_shapes(&self, devices: &StageDevices) -> Option<ShapeList> {
        let gpus = devices.replicas;
        let e = self
            .ctx
            .expert_options((1, false, 1), gpus, devices.mixed)
            .filter(|&(e, et)| e > 1 && et.is_none())
            .map(|(e, _)| e)
            .max()?;
        Some(self.ctx.shapes_at((1, false, e, None, 1), gpus, false))
    }

    /// Layers `i..j` on `devices`, where they fit under rule `class` with
    /// `stages_from_here` stages from it on: as a plain stage, or, where
    /// they hold experts, in whichever of the `spread` shapes
    /// (`spread_shapes`) fits and runs its micro-batches soonest.
    /// Spreading can shrink a block of many experts fiftyfold
    /// (`lightest_ms`), so plain seeds alone bound such a search so loosely
    /// that it stops at its step limit before finding the plans that do.
    /// `sums`: the stage's at the spread degree, kept while it grows to the
    /// front.
    fn seed_stage(
        &self,
        (i, j): (usize, usize),
        (devices, spread): (&StageDevices, Option<&ShapeList>),
        stages_from_here: u32,
        class: u8,
        sums: &mut Option<Box<ShapedSums>>,
    ) -> Option<StageCost> {
        let only_stage = i == 0 && j == self.ctx.layers.num_layers;
        let warmup = self.rule_warmup(usize::from(class), stages_from_here);
        let fitting = |priced: Priced| {
            let fits = self.fitting_class(&priced, i, j, stages_from_here, class);
            fits.is_some_and(|(c, _)| c == class).then_some(priced.cost)
        };
        let plain = self.price(
            (i, j),
            devices,
            (&StageShape::PLAIN, warmup),
            only_stage,
            &mut None,
        );
        let mut best = fitting(plain);
        if let Some(shapes) = spread.filter(|_| self.ctx.layers.has_experts(i, j)) {
            let micro_batches = f64::from(self.micro_batches);
            let soonest =
                |cost: &StageCost| micro_batches * (cost.fwd_ms + cost.bwd_ms) + cost.tail_ms();
            for shape in shapes.iter() {
                let priced = self.price((i, j), devices, (&shape, warmup), only_stage, sums);
                if let Some(cost) = fitting(priced) {
                    if best.as_ref().is_none_or(|b| soonest(&cost) < soonest(b)) {
                        best = Some(cost);
                    }
                }
            }
        }
        best
    }

    /// Prepend every possible stage to every suffix of state `sid` (which
    /// starts at layer `j`). Work that does not depend on the suffix (the
    /// placement, the transfer, the stage cost for a given warm-up depth)
    /// is done once per state, not once per suffix.
    fn expand_state(&mut self, sid: u32, j: usize, max_replicas: u32) {
        let Some(suffixes) = self.live_suffixes(sid, j) else {
            return;
        };
        let mut options = self.stage_options_before(&suffixes, max_replicas);
        for option in &mut options {
            // One state of a wide cluster can hold millions of stages:
            // the work limit is checked per option, not only per state.
            if self.steps > self.work_limit {
                self.abandoned = true;
                return;
            }
            self.grow_stage(option, &suffixes);
        }
    }

    /// The suffixes of state `sid` (starting at layer `j`) that could still
    /// end below the bound, fewest stages first; None when there are none.
    fn live_suffixes(&self, sid: u32, j: usize) -> Option<Suffixes> {
        let DpKey {
            machines: used,
            neighbour,
        } = self.states[sid as usize].key.clone();
        let free = used.free();
        let mut entries: Vec<(u32, Entry)> = self.states[sid as usize]
            .front
            .iter()
            .map(|&e| (e, self.entries[e as usize]))
            .filter(|(_, e)| self.promising(e.latency, j, free, e.class))
            .collect();
        if entries.is_empty() {
            return None;
        }
        entries.sort_by_key(|(_, e)| e.stages);
        // The neighbour's machine counts among the suffixes, where the
        // state's key leaves them out; a stage's transfer is priced once
        // per count.
        let mut neighbour_counts: Vec<u32> =
            entries.iter().map(|(_, e)| e.neighbour_machines).collect();
        neighbour_counts.sort_unstable();
        neighbour_counts.dedup();
        Some(Suffixes {
            start: j,
            used,
            neighbour,
            free,
            entries,
            neighbour_counts,
        })
    }

    /// Every GPU count and placement a stage ending where `suffixes` start
    /// may have, with the layers it may start at; starts that no bound
    /// could let through are dropped before placing or costing.
    fn stage_options_before(&mut self, suffixes: &Suffixes, max_replicas: u32) -> Vec<StageOption> {
        let (used, free, j) = (&suffixes.used, suffixes.free, suffixes.start);
        let is_root = suffixes.entries[0].1.stages == 0;
        let m = f64::from(self.micro_batches);
        let prune_above = self.loosest_incumbent() * (1.0 + 1e-12);
        let mut options: Vec<StageOption> = Vec::new();
        for StageGpus {
            gpus: r,
            degrees: allowed,
            places,
        } in self.ctx.stage_options(used, max_replicas, self.micro_batch)
        {
            // Where the stage may start: a stage that takes every GPU left
            // is the first one; any other may be too, leaving the rest idle
            // (a plan need not use every GPU: over a slow network fewer GPUs
            // can be faster).
            let starts = self.ctx.starts(r, free, j);
            let (first, stop) = (starts.start, starts.end);
            // The layers in front of the stage keep some GPU busy for at
            // least M * work_floor[i] / (GPUs left) (a term of the
            // completion floor), which grows with i: drop the starts where
            // that alone is above every bound, before placing or costing.
            let left = free - r;
            let end = if self.objective == Objective::Latency && left > 0 && first < stop {
                let floor_above = f64::from(left) * prune_above / m;
                first + self.work_floor[first..stop].partition_point(|&w| w <= floor_above)
            } else {
                stop
            };
            if first >= end {
                continue;
            }
            for (placement, takes) in places {
                let devices = self.devices(used, &takes);
                // Layers `end..j` are in every stage grown from here.
                let degrees = self.degrees_for(&allowed, r, &devices, end..j);
                if degrees.is_empty() {
                    self.recycle_degrees(degrees);
                    continue;
                }
                let shares = if is_root {
                    Vec::new()
                } else {
                    transfer_shares(&self.group_first, used, &takes)
                };
                let (next_key, next_neighbour_machines) = DpKey::of(used.taken(&takes));
                options.push(StageOption {
                    gpus: r,
                    degrees,
                    placement,
                    devices,
                    next_key,
                    next_neighbour_machines,
                    shares,
                    transfer_ms: vec![None; suffixes.neighbour_counts.len()],
                    first,
                    end,
                });
            }
        }
        options
    }

    /// Grow the new stage `i..j` of `option` one layer at a time, from
    /// `i = end - 1` down, prepending it to every suffix, at each split
    /// degree the option allows. Its time and memory only grow, so once it
    /// alone is slower than the best plan known or does not fit at a
    /// degree, no larger stage will at that degree; nor once its layers
    /// cannot run at it.
    fn grow_stage(&mut self, option: &mut StageOption, suffixes: &Suffixes) {
        let max_replicas = self.max_replicas();
        let mut growing = std::mem::take(&mut option.degrees);
        for i in (option.first..option.end).rev() {
            // Time does not depend on the warm-up depth, memory is
            // checked per rule when prepended: cost the stage once.
            let only_stage = i == 0 && suffixes.entries[0].1.stages == 0;
            // In place and in order (`retain_mut` costs more, per layer).
            let mut k = 0;
            while k < growing.len() {
                let degree = &mut growing[k];
                if self
                    .ctx
                    .layer_runs_at(i, (degree.t, degree.c), option.gpus, max_replicas)
                    && self.prepend_shapes(option, i, degree, only_stage, suffixes)
                {
                    k += 1;
                } else {
                    growing.remove(k);
                }
            }
            if growing.is_empty() {
                break;
            }
        }
        self.recycle_degrees(growing);
    }

    /// The split degrees of `degrees` at which a stage of `gpus` GPUs on
    /// `devices` splits evenly and can hold layers `always` (those every
    /// stage grown from here holds), and which the hints allow for a stage
    /// ending where `always` ends, each with its shapes.
    /// A list from `spare_degrees`, which `recycle_degrees` fills.
    fn degrees_for(
        &mut self,
        degrees: &StageDegrees,
        gpus: u32,
        devices: &StageDevices,
        always: std::ops::Range<usize>,
    ) -> Vec<Degree> {
        let max_replicas = self.max_replicas();
        let mut list = self.spare_degrees.pop().unwrap_or_default();
        // Each width t c of a data replica, at each (t, c) it is made of.
        for width in self.ctx.allowed_degrees(degrees, gpus, max_replicas) {
            // Every layer runs whole at t = c = 1 (`layer_runs_at`): no
            // need to scan `always`.
            if width > 1 && !self.ctx.splits_evenly(devices, width) {
                continue;
            }
            for (t, c) in self.ctx.shapes.pairs_of_width(width) {
                if !self.ctx.hints.admits_degree(always.end, t, gpus)
                    || width > 1
                        // At t = t c, `splits_evenly(devices, width)` above said so.
                        && !((t == width || self.ctx.splits_evenly(devices, t))
                            && always
                                .clone()
                                .all(|l| self.ctx.layer_runs_at(l, (t, c), gpus, max_replicas)))
                {
                    continue;
                }
                // Each way of running the sequence is a degree of its own,
                // with sums of its own.
                // So is each expert degree.
                for sequence_parallel in self.ctx.sequence_options(t, devices.mixed) {
                    let experts =
                        self.ctx
                            .expert_options((t, sequence_parallel, c), gpus, devices.mixed);
                    for (e, et) in experts {
                        let shapes = self.ctx.shapes_at(
                            (t, sequence_parallel, e, et, c),
                            gpus,
                            devices.mixed,
                        );
                        if !shapes.is_empty() {
                            list.push(Degree {
                                t,
                                c,
                                shapes,
                                sums: None,
                            });
                        }
                    }
                }
            }
        }
        list
    }

    /// Keep `list`'s allocation for the next `degrees_for`.
    fn recycle_degrees(&mut self, mut list: Vec<Degree>) {
        list.clear();
        self.spare_degrees.push(list);
    }

    /// Prepend the stage `i..j` of `option`, split `t` ways, in each shape
    /// that could be of use: the plain one, then ZeRO-1 and re-computation
    /// unless a shape already prepended fits every suffix under that
    /// suffix's own rule and is no slower in any pass (then any plan the
    /// other makes, that one makes no slower). Re-computation's passes are
    /// its counterpart's with the forward again in the backward, and
    /// ZeRO-1's, where weights are no smaller than gradients, at least the
    /// plain shape's: so they are known, or bounded, before pricing. A
    /// sharding level above 1 is weighed only where the level below it
    /// may not fit (`lower_sharding_level`).
    /// Returns whether a longer stage at `t` could still be of use.
    fn prepend_shapes(
        &mut self,
        option: &mut StageOption,
        i: usize,
        degree: &mut Degree,
        only_stage: bool,
        suffixes: &Suffixes,
    ) -> bool {
        let j = suffixes.start;
        let (shapes, sums) = (&degree.shapes, &mut degree.sums);
        if self.ctx.spreads_no_experts(&shapes.get(0), (i, j)) {
            // A longer stage may have some.
            return true;
        }
        if self
            .ctx
            .splits_experts_of_a_whole_sequence(&shapes.get(0), (i, j))
        {
            return false;
        }
        // The memory asked for first: under the strictest rule the suffix of
        // fewest stages allows (`fitting_class`).
        let first = &suffixes.entries[0].1;
        let warmup = self.rule_warmup(usize::from(first.class), first.stages + 1);
        if shapes.len() == 1 {
            let only = &shapes.get(0);
            // Nothing to weigh it against (DAPPLE's space, mixed GPUs).
            let priced = self.price((i, j), &option.devices, (only, warmup), only_stage, sums);
            self.stages_costed += 1;
            return self
                .prepend_stage(option, i, &priced, suffixes)
                .longer_may_help;
        }
        let mut longer_may_help = false;
        let ShapeScratch {
            mut passes,
            mut fitting,
            mut settled,
        } = std::mem::take(&mut self.shape_scratch);
        passes.clear();
        fitting.clear();
        settled.clear();
        let no_faster = |v: &[f64; 3], u: &[f64; 3]| (0..3).all(|k| u[k] <= v[k]);
        // Whether an offloaded shape's twin (the one before it, stepping on
        // its GPUs) leaves it no room to fit.
        let mut twin_rules_out = false;
        for shape in shapes.iter() {
            let shape = &shape;
            if shape.offload.is_none() {
                twin_rules_out = false;
            } else if twin_rules_out {
                passes.push((*shape, None));
                continue;
            }
            let predicted = predicted_times(shape, &passes, self.zero_saves_time);
            // No use: its counterpart was none (it is no faster), a shape
            // that fits every rule is no slower, or it shards above level 1
            // where the level below it fits (`cost/sharding.rs`: no faster).
            let no_use = matches!(predicted, Some(None))
                || self.objective == Objective::Latency
                    && (lower_sharding_level(shape).is_some_and(|l| settled.contains(&l))
                        || predicted
                            .flatten()
                            .is_some_and(|v| fitting.iter().any(|u| no_faster(&v, u))));
            if no_use {
                passes.push((*shape, None));
                settle(&mut settled, shape, self.max_shard_level);
                continue;
            }
            let priced = self.price((i, j), &option.devices, (shape, warmup), only_stage, sums);
            self.stages_costed += 1;
            if shape.offload.is_none() {
                twin_rules_out = priced.offloading_cannot_fit();
            }
            let c = &priced.cost;
            let times = [c.fwd_ms, c.bwd_ms, c.tail_ms()];
            if self.objective == Objective::Latency && fitting.iter().any(|u| no_faster(&times, u))
            {
                passes.push((*shape, None));
                settle(&mut settled, shape, self.max_shard_level);
                continue;
            }
            let prepended = self.prepend_stage(option, i, &priced, suffixes);
            longer_may_help |= prepended.longer_may_help;
            if prepended.fits_every_rule {
                fitting.push(times);
                settle(&mut settled, shape, self.max_shard_level);
            }
            passes.push((*shape, Some(times)));
        }
        self.shape_scratch = ShapeScratch {
            passes,
            fitting,
            settled,
        };
        longer_may_help
    }

    /// Prepend the stage `i..j` on `option`'s GPUs, priced as `priced`, to
    /// every suffix it fits in front of and could lead below the bound.
    #[inline(always)]
    fn prepend_stage(
        &mut self,
        option: &mut StageOption,
        i: usize,
        priced: &Priced,
        suffixes: &Suffixes,
    ) -> Prepended {
        let j = suffixes.start;
        let m = f64::from(self.micro_batches);
        let loosest_bound = self.loosest_incumbent();
        let cost = &priced.cost;
        let mut next: Option<u32> = None;
        let mut fits_every_rule = true;
        let stop = |k: usize, fits_every_rule: bool| Prepended {
            longer_may_help: k != 0,
            fits_every_rule,
        };
        // The costing, and each suffix below.
        self.steps += 1;
        for (k, &(eid, entry)) in suffixes.entries.iter().enumerate() {
            self.steps += 1;
            let stages = entry.stages + 1;
            if !self
                .ctx
                .hints
                .admits_stage_count(stages, i, suffixes.free - option.gpus)
            {
                continue;
            }
            let (class, memory_bytes) = match self.fitting_class(priced, i, j, stages, entry.class)
            {
                Some(fits) => fits,
                // Peak memory ignores limits (to explain infeasibility).
                None if self.objective == Objective::PeakMemory => {
                    let warmup = self.rule_warmup(0, stages);
                    (0, priced.bytes_at(self.ctx.layers, i, j, warmup))
                }
                // Not even under the loosest rule. More stages behind means
                // more micro-batches in flight: the remaining suffixes need
                // more memory.
                None => return stop(k, false),
            };
            fits_every_rule &= class == entry.class;
            if self.objective == Objective::Latency {
                let slowest = m * (cost.fwd_ms + cost.bwd_ms);
                // A shape no faster is as slow against every bound.
                if slowest > loosest_bound * (1.0 + 1e-12) {
                    return stop(k, fits_every_rule);
                }
                if slowest > self.incumbent(class) * (1.0 + 1e-12) {
                    continue;
                }
            }
            let mut latency = entry.latency;
            if entry.stages > 0 {
                let t = self.transfer_to_suffix(option, suffixes, entry.neighbour_machines);
                latency = latency.prepend(PipeStage::transfer(t), self.micro_batches);
            }
            latency = latency.prepend(cost.as_pipe_stage(), self.micro_batches);
            if !self.promising(latency, i, suffixes.free - option.gpus, class) {
                continue;
            }
            if i == 0 && self.objective == Objective::Latency {
                self.offer_incumbent(latency.best, class);
            }
            let target = match next {
                Some(t) => t,
                None => *next.insert(self.state_id(i, &option.next_key)),
            };
            self.insert(
                target,
                Entry {
                    latency,
                    peak_memory: entry.peak_memory.max(memory_bytes),
                    stages,
                    neighbour_machines: option.next_neighbour_machines,
                    parent: eid,
                    class,
                },
                EntryStage {
                    layer_start: i as u32,
                    placement: option.placement,
                    gpus: option.gpus,
                    shape: priced.shape,
                },
            );
        }
        Prepended {
            longer_may_help: true,
            fits_every_rule,
        }
    }

    /// The time of the transfer from `option`'s stage to a suffix whose
    /// neighbouring stage is `neighbour_machines` whole machines (where the
    /// state leaves it out), priced once per count.
    #[inline(always)]
    fn transfer_to_suffix(
        &self,
        option: &mut StageOption,
        suffixes: &Suffixes,
        neighbour_machines: u32,
    ) -> f64 {
        let w = suffixes
            .neighbour_counts
            .binary_search(&neighbour_machines)
            .expect("every suffix's count is listed");
        if let Some(ms) = option.transfer_ms[w] {
            return ms;
        }
        let ms = self.price_transfer(option, suffixes, neighbour_machines);
        option.transfer_ms[w] = Some(ms);
        ms
    }

    /// [`Dp::transfer_to_suffix`] the first time: out of line, as most
    /// calls find it priced.
    #[inline(never)]
    fn price_transfer(
        &self,
        option: &StageOption,
        suffixes: &Suffixes,
        neighbour_machines: u32,
    ) -> f64 {
        let mut shares = option.shares.clone();
        if let Some(class) = suffixes.neighbour {
            // The neighbour, left out of the used: whole machines,
            // apart from the new stage's.
            shares.push(TransferShare {
                machine: self.group_first[usize::from(class.group)],
                senders: 0,
                receivers: u32::from(class.capacity),
                machines: neighbour_machines,
            });
        }
        self.coster.transfer_over(suffixes.start, &shares)
    }
}

/// The suffixes of one DP state, being extended by a stage in front.
struct Suffixes {
    /// The layer they start at: the new stage ends there.
    start: usize,
    /// The GPUs they use, less the neighbour where the state's key leaves
    /// it out.
    used: State,
    neighbour: Option<MachineUse>,
    free: u32,
    /// (entry id, entry), fewest stages first.
    entries: Vec<(u32, Entry)>,
    /// The distinct `neighbour_machines` of the entries, ascending.
    neighbour_counts: Vec<u32>,
}

/// A split degree a stage is being grown at: the shapes it may take there
/// (`Context::shapes_at`), and its sums once a shape that is not plain was
/// priced (grown with the stage after that).
struct Degree {
    /// The split and context degrees.
    t: u32,
    c: u32,
    shapes: ShapeList,
    /// Boxed: a degree is listed for every stage option, its sums made
    /// only for the shapes that are not plain.
    sums: Option<Box<ShapedSums>>,
}

/// What prepending one shape of a stage found.
struct Prepended {
    /// Whether a longer stage could still be of use: not when the stage
    /// does not fit, or is alone slower than every bound, in front of the
    /// suffix of fewest stages.
    longer_may_help: bool,
    /// It fits under the rule of every suffix it was weighed against (no
    /// shape holding less memory could fit a stricter one).
    fits_every_rule: bool,
}

/// A stage's cost as the search prices it, with its memory at any depth.
struct Priced {
    shape: StageShape,
    /// For a plain shape, its memory is at `warmup` micro-batches in
    /// flight; for another, at one (read `memory` instead).
    cost: StageCost,
    /// None for a plain shape: its memory is `stage_memory_bytes` of its
    /// slice, from the profile's range sums.
    memory: Option<StageMemory>,
    /// The depth of a plain shape's `cost.memory_bytes`.
    warmup: u32,
}

impl Priced {
    /// Whether the same shape with its optimizer offloaded could not fit
    /// either (`StageMemory::offloaded_floor_bytes`; a plain shape's
    /// memory is not summed so, and rules nothing out).
    fn offloading_cannot_fit(&self) -> bool {
        self.memory
            .is_some_and(|m| m.offloaded_floor_bytes() > self.cost.memory_limit_bytes)
    }

    /// Its GPUs' memory with `warmup` micro-batches in flight; infinite
    /// where its host cannot hold what it offloads (it fits nowhere).
    fn bytes_at(&self, layers: &LayerCosts, start: usize, end: usize, warmup: u32) -> f64 {
        if !self.cost.fits_host() {
            return f64::INFINITY;
        }
        match &self.memory {
            Some(memory) => memory.at(warmup),
            None if warmup == self.warmup => self.cost.memory_bytes,
            None => stage_memory_bytes(layers, start, end, self.cost.slice_size, warmup),
        }
    }
}

/// One GPU count and placement for the stage in front of a state's
/// suffixes, with what it costs whatever its layers.
struct StageOption {
    gpus: u32,
    /// The split degrees it may run at, each with its shapes.
    degrees: Vec<Degree>,
    placement: Placement,
    devices: Rc<StageDevices>,
    next_key: DpKey,
    next_neighbour_machines: u32,
    /// Each class's share of the transfer to the neighbour, and the
    /// transfer's time for each of `Suffixes::neighbour_counts` once priced.
    shares: Vec<TransferShare>,
    transfer_ms: Vec<Option<f64>>,
    /// Where the stage may start: `first..end`.
    first: usize,
    end: usize,
}

/// One placement step of a layout being built from the back: a stage's
/// layers, GPUs, how they are placed and its shape. Replayed from the empty
/// cluster in order, steps give the machines (`concrete_allocs`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Step {
    pub(crate) layer_start: usize,
    pub(crate) layer_end: usize,
    pub(crate) placement: Placement,
    pub(crate) gpus: u32,
    pub(crate) shape: StageShape,
}

/// Depth-first enumeration of every layout whose formula (2) value is
/// below a bound that only falls (`LayoutWalk::bound`). Each complete
/// layout goes to `visit`, which returns the new bound (the best simulated
/// time so far). Stops early, incomplete (`complete` false), when
/// `nodes_left` or `work_left` runs out.
pub(crate) struct LayoutWalk<'w, F: FnMut(&[Step], f64) -> f64> {
    pub(crate) bound: f64,
    pub(crate) nodes_left: u64,
    /// Simulated tasks the costing of complete layouts may still take
    /// (choosing one layout's warm-up depths simulates it many times).
    pub(crate) work_left: &'w std::cell::Cell<u64>,
    pub(crate) complete: bool,
    pub(crate) visit: &'w mut F,
}

impl Dp<'_, '_> {
    /// Walk every layout of this micro-batch size whose bound is below
    /// `walk.bound`; `walk.complete` says whether it finished within budget.
    pub(crate) fn walk_layouts<F: FnMut(&[Step], f64) -> f64>(&mut self, walk: &mut LayoutWalk<F>) {
        let n = self.ctx.layers.num_layers;
        let machines = self.ctx.cluster.group_and_gpus();
        let max_replicas = self.max_replicas();
        let empty = WalkSuffix {
            start: n,
            state: State::empty(&machines),
            latency: SuffixLatency::EMPTY,
            stages: 0,
        };
        self.walk_from(&empty, max_replicas, &mut Vec::new(), walk);
    }

    /// Smallest formula value any completion of this suffix (still missing
    /// layers 0..j, with `free` GPUs left) can have.
    fn completion_floor(&self, latency: SuffixLatency, j: usize, free: u32) -> f64 {
        let mut floor =
            (latency.best + self.fwd_floor[j]).max(latency.steady + self.fwd_bwd_floor[j]);
        if j > 0 && free > 0 {
            // Some stage of the prefix does at least its share of the work
            // M times, and formula (2) is at least M (F_q + B_q) for each q.
            floor = floor.max(f64::from(self.micro_batches) * self.work_floor[j] / f64::from(free));
        }
        floor
    }

    /// Extend `suffix` by every stage that could lead below the bound, most
    /// promising first, so that fast plans are found early and lower the
    /// bound for the rest.
    fn walk_from<F: FnMut(&[Step], f64) -> f64>(
        &mut self,
        suffix: &WalkSuffix,
        max_replicas: u32,
        steps: &mut Vec<Step>,
        walk: &mut LayoutWalk<F>,
    ) {
        let Some(mut children) = self.walk_children(suffix, max_replicas, walk) else {
            return;
        };
        // Stable: equal floors keep the order they were made in.
        children.sort_by(|a, b| a.floor.total_cmp(&b.floor));
        for c in children {
            if !walk.complete {
                return;
            }
            if c.floor >= walk.bound {
                break; // sorted: no later child is below the bound either
            }
            steps.push(c.step);
            if c.suffix.start == 0 {
                if walk.work_left.get() == 0 {
                    walk.complete = false;
                    steps.pop();
                    return;
                }
                walk.bound = (walk.visit)(steps, c.suffix.latency.best).min(walk.bound);
            } else {
                self.walk_from(&c.suffix, max_replicas, steps, walk);
            }
            steps.pop();
        }
    }

    /// Every stage in front of `suffix` whose completion floor is below the
    /// walk's bound, in the order they were made. None when the walk's node
    /// budget ran out (`walk.complete` is then false).
    fn walk_children<F: FnMut(&[Step], f64) -> f64>(
        &mut self,
        suffix: &WalkSuffix,
        max_replicas: u32,
        walk: &mut LayoutWalk<F>,
    ) -> Option<Vec<WalkChild>> {
        let (j, state) = (suffix.start, &suffix.state);
        let free = state.free();
        let mut children: Vec<WalkChild> = Vec::new();
        for StageGpus {
            gpus: r,
            degrees: allowed,
            places,
        } in self
            .ctx
            .stage_options(state, max_replicas, self.micro_batch)
        {
            for (placement, takes) in places {
                let devices = self.devices(state, &takes);
                let transfer = (suffix.stages > 0).then(|| {
                    let shares = transfer_shares(&self.group_first, state, &takes);
                    self.coster.transfer_over(j, &shares)
                });
                let stage = WalkStage {
                    gpus: r,
                    placement,
                    devices,
                    transfer,
                    next: state.taken(&takes),
                };
                let starts = self.ctx.starts(r, free, j);
                // Layers from the last start to `j` are in every stage.
                let mut degrees = self.degrees_for(&allowed, r, &stage.devices, starts.end..j);
                for i in starts.rev() {
                    // In place and in order, as `grow_stage` does.
                    let mut k = 0;
                    while k < degrees.len() {
                        let degree = &mut degrees[k];
                        if !self
                            .ctx
                            .layer_runs_at(i, (degree.t, degree.c), r, max_replicas)
                        {
                            degrees.remove(k);
                            continue;
                        }
                        if walk.nodes_left == 0 {
                            walk.complete = false;
                            return None;
                        }
                        walk.nodes_left -= 1;
                        if self.walk_shapes(suffix, &stage, i, degree, walk.bound, &mut children) {
                            k += 1;
                        } else {
                            degrees.remove(k);
                        }
                    }
                    if degrees.is_empty() {
                        break;
                    }
                }
                self.recycle_degrees(degrees);
            }
        }
        Some(children)
    }

    /// The walk's children of `stage` on layers `i..` in front of `suffix`,
    /// split `t` ways, one per shape that fits and could lead below `bound`:
    /// the plain shape, and the others where the plain one does not fit
    /// with every micro-batch in flight (the deepest warm-up any plan can
    /// choose) or where ZeRO-1 can be faster. Returns whether a longer stage
    /// at `t` could still be of use (a longer one is no faster and no smaller).
    fn walk_shapes(
        &mut self,
        suffix: &WalkSuffix,
        stage: &WalkStage,
        i: usize,
        degree: &mut Degree,
        bound: f64,
        children: &mut Vec<WalkChild>,
    ) -> bool {
        let j = suffix.start;
        let m = f64::from(self.micro_batches);
        let warmup = self
            .ctx
            .memory_warmup(suffix.stages + 1, self.micro_batches);
        let only_stage = i == 0 && suffix.stages == 0;
        if self.ctx.spreads_no_experts(&degree.shapes.get(0), (i, j)) {
            // A longer stage may have some.
            return true;
        }
        if self
            .ctx
            .splits_experts_of_a_whole_sequence(&degree.shapes.get(0), (i, j))
        {
            return false;
        }
        let mut longer_may_help = false;
        let mut base_fits_deepest = false;
        // Whether an offloaded shape's twin (the one before it, stepping on
        // its GPUs) fits, and is faster, or leaves it no room to fit.
        let mut twin_decides = false;
        for (k, shape) in degree.shapes.iter().enumerate() {
            let shape = &shape;
            if shape.offload.is_none() {
                twin_decides = false;
            } else if twin_decides {
                continue;
            }
            let may_be_faster =
                shape.recompute.is_none() && shape.offload.is_none() && self.zero_saves_time;
            if k > 0 && base_fits_deepest && !may_be_faster {
                continue;
            }
            let priced = self.price(
                (i, j),
                &stage.devices,
                (shape, warmup),
                only_stage,
                &mut degree.sums,
            );
            self.stages_costed += 1;
            let limit = priced.cost.memory_limit_bytes;
            if k == 0 && degree.shapes.len() > 1 {
                base_fits_deepest =
                    priced.bytes_at(self.ctx.layers, i, j, self.micro_batches) <= limit;
            }
            let cost = &priced.cost;
            let fits = priced.bytes_at(self.ctx.layers, i, j, warmup) <= limit;
            if shape.offload.is_none() {
                twin_decides = fits || priced.offloading_cannot_fit();
            }
            if !fits || m * (cost.fwd_ms + cost.bwd_ms) >= bound {
                continue;
            }
            longer_may_help = true;
            let mut l = suffix.latency;
            if let Some(transfer_ms) = stage.transfer {
                l = l.prepend(PipeStage::transfer(transfer_ms), self.micro_batches);
            }
            l = l.prepend(cost.as_pipe_stage(), self.micro_batches);
            let free = stage_free(suffix, stage);
            let floor = self.completion_floor(l, i, free);
            if floor < bound
                && self
                    .ctx
                    .hints
                    .admits_stage_count(suffix.stages + 1, i, free)
            {
                children.push(WalkChild {
                    floor,
                    step: Step {
                        layer_start: i,
                        layer_end: j,
                        placement: stage.placement,
                        gpus: stage.gpus,
                        shape: *shape,
                    },
                    suffix: WalkSuffix {
                        start: i,
                        state: stage.next.clone(),
                        latency: l,
                        stages: suffix.stages + 1,
                    },
                });
            }
        }
        longer_may_help
    }
}

/// Keep `shape` among the shapes a higher sharding level is weighed against
/// (`prepend_shapes`), where the space has a level above it.
fn settle(settled: &mut Vec<StageShape>, shape: &StageShape, max_shard_level: u8) {
    if shape.shard_level >= 1 && shape.shard_level < max_shard_level {
        settled.push(*shape);
    }
}

/// The shape one sharding level below `shape`'s, for levels 2 and 3
/// (level 3 is weighed against level 2 whether or not it re-shards).
fn lower_sharding_level(shape: &StageShape) -> Option<StageShape> {
    (shape.shard_level >= 2).then(|| StageShape {
        shard_level: shape.shard_level - 1,
        reshard_after_forward: false,
        ..*shape
    })
}

/// The times `shape` is no faster than, from its counterpart among the
/// shapes weighed before it at one degree (`passes`: each with its times,
/// or None where it was no use): None where it has none weighed yet,
/// Some(None) where its counterpart was no use. Re-computing, the same
/// shape keeping its activations, plus a forward (selective: a part of
/// it); ZeRO-1 where it moves no less, the shape without it; offloaded,
/// the same shape stepping on its GPUs, its step adding to its tail.
fn predicted_times(
    shape: &StageShape,
    passes: &[(StageShape, Option<[f64; 3]>)],
    zero_saves_time: bool,
) -> Option<Option<[f64; 3]>> {
    let counterpart = passes
        .iter()
        .find(|(s, _)| {
            if !shape.offload.is_none() {
                *s == StageShape {
                    offload: Offload::None,
                    ..*shape
                }
            } else if shape.recompute.is_none() {
                shape.shard_level == 1 && !zero_saves_time && s.shard_level == 0
            } else {
                s.recompute.is_none()
                    && s.shard_level == shape.shard_level
                    && s.reshard_after_forward == shape.reshard_after_forward
            }
        })
        .map(|&(_, p)| p)?;
    Some(counterpart.map(|[f, b, a]| {
        if shape.offload.is_none()
            && !shape.recompute.is_none()
            && shape.recompute != Recompute::Selective
        {
            [f, b + f, a]
        } else {
            [f, b, a]
        }
    }))
}

/// The least forward, and forward and backward, that layer `l` takes at
/// slices of `slice` on any GPU type and in any shape: its fastest times
/// less the part that grows with the routed experts a GPU holds, which
/// spreading them shrinks towards nothing (`cost/shaped.rs`). Bounds
/// built on the times alone were no bounds where holding experts weighs:
/// they pruned the plans that spread them.
fn lightest_ms(coster: &StageCoster, l: usize, slice: u32) -> (f64, f64) {
    let (f, fb) = coster.fastest_ms(l, l + 1, slice);
    let (held_fwd, held_bwd) = coster.layers.experts_held_shares(l, slice);
    if held_fwd == 0.0 && held_bwd == 0.0 {
        return (f, fb); // bit for bit the layer's times, as before
    }
    let fwd = f * (1.0 - held_fwd);
    (fwd, fwd + (fb - f) * (1.0 - held_bwd))
}

/// GPUs left in front of `stage` once it is placed before `suffix`.
fn stage_free(suffix: &WalkSuffix, stage: &WalkStage) -> u32 {
    suffix.state.free() - stage.gpus
}

/// A GPU count and placement the walk puts in front of a suffix.
struct WalkStage {
    gpus: u32,
    placement: Placement,
    devices: Rc<StageDevices>,
    /// To the suffix's first stage, where it has one.
    transfer: Option<f64>,
    /// The GPUs used once it is placed.
    next: State,
}

/// A suffix the walk extends: layers `start..` in `stages` stages, at
/// `latency`, on the GPUs `state` has used.
struct WalkSuffix {
    start: usize,
    state: State,
    latency: SuffixLatency,
    stages: u32,
}

/// A stage the walk may put in front of a suffix: the suffix it makes can
/// complete no faster than `floor`.
struct WalkChild {
    floor: f64,
    step: Step,
    suffix: WalkSuffix,
}

/// The first machine of each group, by group index (groups are
/// contiguous in device order).
fn group_firsts(cluster: &Cluster) -> Vec<usize> {
    let mut first: Vec<usize> = Vec::new();
    for (m, mc) in cluster.machines.iter().enumerate() {
        if first.len() <= mc.group {
            first.resize(mc.group + 1, m);
        }
    }
    first
}

/// Machines standing for a stage shape ((group, GPUs each, machines),
/// sorted): the first free ones of each group, in device order. Machines of
/// a group cost alike, so any would do.
fn representative_alloc(group_first: &[usize], shape: &[(u16, u32, u32)]) -> Alloc {
    let mut next_of_group = group_first.to_vec();
    let mut alloc: Alloc = Vec::with_capacity(shape.iter().map(|s| s.2 as usize).sum());
    for &(group, gpus, machines) in shape {
        let next = &mut next_of_group[usize::from(group)];
        for m in *next..*next + machines as usize {
            alloc.push((m, gpus));
        }
        *next += machines as usize;
    }
    alloc.sort_unstable();
    alloc
}

/// Each machine class's share of the transfer from a stage taking `takes`
/// from `state` to the stage placed before it (the state's adjacent GPUs).
fn transfer_shares(group_first: &[usize], state: &State, takes: &[Take]) -> Vec<TransferShare> {
    let mut shares = Vec::with_capacity(state.0.len() + takes.len());
    for (c, &(m, count)) in state.0.iter().enumerate() {
        let machine = group_first[usize::from(m.group)];
        let receivers = u32::from(m.adjacent);
        let mut taken = 0;
        for t in takes.iter().filter(|t| t.class == c) {
            shares.push(TransferShare {
                machine,
                senders: t.gpus,
                receivers,
                machines: t.machines,
            });
            taken += t.machines;
        }
        if receivers > 0 && taken < count {
            shares.push(TransferShare {
                machine,
                senders: 0,
                receivers,
                machines: count - taken,
            });
        }
    }
    shares
}

/// Turn placement steps into concrete device ids: replay them from the
/// empty cluster while tracking which real machines each class holds, then
/// number machines of a group and GPUs of a machine in pipeline order, so
/// stage 0 starts at device 0.
pub(crate) fn concrete_allocs(
    cluster: &Cluster,
    steps: &[Step],
    replay: impl Fn(&State, u32, Placement) -> Vec<Take>,
) -> Vec<Alloc> {
    let (mut state, mut class_machines) = State::with_machines(&cluster.group_and_gpus());
    let mut per_stage: Vec<Alloc> = Vec::new();
    for step in steps {
        let takes = replay(&state, step.gpus, step.placement);
        let (after, next, given) = state.take_machines(&class_machines, &takes);
        let mut alloc: Alloc = takes
            .iter()
            .zip(&given)
            .flat_map(|(t, machines)| machines.iter().map(move |&m| (m, t.gpus)))
            .collect();
        alloc.sort_unstable();
        per_stage.push(alloc);
        (state, class_machines) = (after, next);
    }
    per_stage.reverse(); // pipeline order
                         // Relabel machines within each group by first use in pipeline order.
    let groups: Vec<usize> = cluster.machines.iter().map(|m| m.group).collect();
    let mut relabel: Vec<Option<usize>> = vec![None; groups.len()];
    let mut next_in_group: HashMap<usize, usize> = HashMap::new();
    for alloc in &per_stage {
        for &(m, _) in alloc {
            if relabel[m].is_none() {
                let g = groups[m];
                let first_of_group = groups.iter().position(|&x| x == g).unwrap();
                let k = next_in_group.entry(g).or_insert(0);
                relabel[m] = Some(first_of_group + *k);
                *k += 1;
            }
        }
    }
    per_stage
        .into_iter()
        .map(|a| {
            let mut v: Alloc = a
                .into_iter()
                .map(|(m, c)| (relabel[m].expect("used machine"), c))
                .collect();
            v.sort_unstable();
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    //! Small literal cases, worked out by hand. Layers store no activations,
    //! so transfers cost nothing and memory is the model state alone
    //! (weights, gradients and Adam's two slots: 4x the parameters). One
    //! stage of fwd+bwd time T_q per micro-batch, M micro-batches:
    //! formula (2) is M T_1 alone; for two stages, front to back,
    //! max(M T_1, T_1 + M T_2).
    use super::*;
    use crate::cluster::topology::Topology;
    use crate::model::profile::{chain_profile, LayerCosts, Measurement, Profile};
    use crate::search::space::{SearchSpace, Space, StageShapes};

    /// Layers of (fwd_ms, bwd_ms, param_bytes), measured at batch sizes 1
    /// and 2 (twice the time), with no activations.
    fn chain(layers: &[(f64, f64, u64)]) -> Profile {
        let times: Vec<(f64, f64)> = layers.iter().map(|&(f, b, _)| (f, b)).collect();
        let mut profile = chain_profile(&times, 1);
        for (layer, &(f, b, params)) in profile.layers.iter_mut().zip(layers) {
            layer.param_bytes = params;
            layer.measurements = [1, 2]
                .map(|batch| Measurement {
                    backward_working_bytes: None,
                    recompute_fwd_ms: None,
                    selective_stored_bytes: None,
                    selective_recompute_ms: None,
                    experts_held_fwd_ms: None,
                    experts_held_bwd_ms: None,
                    bwd_weight_ms: None,
                    loss_stored_bytes: None,
                    batch_size: batch,
                    fwd_ms: f * f64::from(batch),
                    bwd_ms: b * f64::from(batch),
                    activation_bytes: 0,
                    stored_activation_bytes: None,
                })
                .to_vec();
        }
        profile.validate().unwrap();
        profile
    }

    /// A plan as its stages front to back: (layer_start, layer_end, GPUs).
    type Stages = Vec<(usize, usize, u32)>;

    fn front_to_back(found: &Found) -> Stages {
        found
            .stages
            .iter()
            .rev()
            .map(|s| (s.layer_start, s.layer_end, s.gpus))
            .collect()
    }

    /// What one DP run over `profile` on `spec` (GPUs of `memory_bytes`,
    /// where given) finds with micro-batches of `b` samples, `m` of them,
    /// under policy A's memory rule: the best plan (value and stages), the
    /// best of each other stage count, and the states it made.
    struct Outcome {
        best: Option<(f64, Stages)>,
        others: Vec<(f64, Stages)>,
        states: usize,
    }

    /// `f` on the context of the full space over `profile` on `spec`
    /// (GPUs of `memory_bytes`, where given) under policy A's memory rule.
    fn in_space<R>(
        profile: &Profile,
        spec: &str,
        memory_bytes: Option<u64>,
        f: impl FnOnce(&Context) -> R,
    ) -> R {
        let layers = LayerCosts::new(profile);
        let mut topology = Topology::from_spec(spec).unwrap();
        if let Some(bytes) = memory_bytes {
            topology.machine_groups[0].gpu.memory_bytes = bytes;
        }
        let cluster = Cluster::for_model(&topology, &layers).unwrap();
        let policy = WarmupPolicy::A;
        // DAPPLE's stages: these cases are worked out for replicas alone.
        let space = Space::new(
            &layers,
            &cluster,
            (SearchSpace::Full, (StageShapes::Plain, 0, 1), None),
            (policy, crate::cost::overlap::Overlap::default()),
            1,
            (1, vec![1]),
            &crate::plan::hints::NO_HINTS,
        );
        f(space.covering())
    }

    fn run_dp(profile: &Profile, spec: &str, memory_bytes: Option<u64>, b: u32, m: u32) -> Outcome {
        in_space(profile, spec, memory_bytes, |ctx| {
            let mut dp = Dp::new(ctx, b, m, Objective::Latency, vec![ctx.policy], None);
            let best = dp.run().pop().flatten();
            Outcome {
                best: best.map(|f| (f.value, front_to_back(&f))),
                others: dp
                    .other_stage_counts(0)
                    .iter()
                    .map(|f| (f.value, front_to_back(f)))
                    .collect(),
                states: dp.states.len(),
            }
        })
    }

    /// Two layers whose passes are 90% holding their 8 experts (as Whale's
    /// M6-MoE stand-ins' blocks are): held whole, each GPU's pass is 10
    /// times what it is with the experts spread one a GPU.
    fn mostly_holding_experts() -> Profile {
        use crate::model::experts::{ExpertPattern, TokenDispatcher};
        let mut profile = chain(&[(1.0, 2.0, 1000), (1.0, 2.0, 1000)]);
        for layer in &mut profile.layers {
            layer.experts = Some(ExpertPattern {
                count: 8,
                per_token: 2,
                param_fraction: 0.9,
                all_to_all_bytes_per_sample: 0.0,
                split_gather_bytes_per_sample: 0.0,
                compute_fraction: 0.9,
                imbalance: 1.0,
                dispatcher: TokenDispatcher::AllToAll,
                routing_groups: None,
            });
            for m in &mut layer.measurements {
                m.experts_held_fwd_ms = Some(0.9 * m.fwd_ms);
                m.experts_held_bwd_ms = Some(0.9 * m.bwd_ms);
            }
        }
        profile
    }

    /// `mostly_holding_experts`, 8 samples on one machine of 8 GPUs.
    fn on_eight_gpus<T>(profile: &Profile, run: impl FnOnce(&Context) -> T) -> T {
        let layers = LayerCosts::new(profile);
        let topology = Topology::from_spec("1x8-nvlink").unwrap();
        let cluster = Cluster::for_model(&topology, &layers).unwrap();
        let space = Space::new(
            &layers,
            &cluster,
            (SearchSpace::Full, (StageShapes::All, 0, 1), None),
            (WarmupPolicy::A, crate::cost::overlap::Overlap::default()),
            1,
            (8, vec![8]),
            &crate::plan::hints::NO_HINTS,
        );
        run(space.covering())
    }

    #[test]
    fn the_floors_count_the_experts_a_stage_may_spread() {
        // The best plan spreads the experts; no plan of the size may be
        // below its floor, so the floor must count them spread.
        on_eight_gpus(&mostly_holding_experts(), |ctx| {
            let mut dp = Dp::new(ctx, 8, 1, Objective::Latency, vec![ctx.policy], None);
            let best = dp.run().pop().flatten().unwrap();
            let spread = best.stages.iter().all(|s| s.shape.expert_parallel == 8);
            assert!(spread, "{:?}", best.stages);
            assert!(
                dp.floor_ms() <= best.value,
                "{} {}",
                dp.floor_ms(),
                best.value
            );
            // Each layer's pass, held whole: 3 ms a sample; spread: 10% of it.
            assert!(best.value < 0.5 * 2.0 * 3.0, "{}", best.value);
        });
    }

    #[test]
    fn the_seeds_spread_the_experts_a_stage_holds() {
        // The plans costed before the search bound it: with the experts
        // held whole they are ten times the best plan, which spreads them,
        // and prune nothing; spread, the seed is the best plan itself.
        on_eight_gpus(&mostly_holding_experts(), |ctx| {
            let best = Dp::new(ctx, 8, 1, Objective::Latency, vec![ctx.policy], None)
                .run()
                .pop()
                .flatten()
                .unwrap();
            let bound = [AtomicU64::new(f64::INFINITY.to_bits())];
            let mut dp = Dp::new(
                ctx,
                8,
                1,
                Objective::Latency,
                vec![ctx.policy],
                Some(&bound),
            );
            dp.seed_bounds();
            let seeded = dp.incumbent(0);
            assert!(
                seeded >= best.value * (1.0 - 1e-12),
                "{seeded} {}",
                best.value
            );
            assert!(
                seeded <= best.value * (1.0 + 1e-9),
                "{seeded} {}",
                best.value
            );
        });
    }

    #[test]
    fn three_layers_on_two_gpus_literal_cases() {
        // One sample per micro-batch, so each stage has one GPU. Plans: one
        // stage (M x 12), or a cut after layer 1 or 2. States: the empty
        // cluster, one GPU used with the suffix at each of layers 2, 1, 0,
        // and both used at layer 0.
        // Cut after 2: max(4x6, 6 + 4x6) = 30; after 1: max(4x3, 3 + 4x9) = 39.
        // With a heavy first layer: after 1, max(4x6, 6 + 4x6) = 30; after
        // 2, max(4x9, 9 + 4x3) = 36. More micro-batches: the slower stage
        // dominates, 8x6 + 6 = 54. One micro-batch: a pipeline gains
        // nothing (every plan takes 6) and ties go to fewer stages; of the
        // two tied cuts, the suffix made first is kept (an equal one does
        // not displace it): suffixes are extended from the last layer back,
        // so the one starting at layer 2.
        type Case = ([(f64, f64); 3], u32, f64, Stages, Vec<(f64, Stages)>);
        #[rustfmt::skip]
        let cases: [Case; 4] = [
            // layers (fwd, bwd)              M  best  its stages, front to back  other stage counts
            ([(1.0, 2.0), (1.0, 2.0), (2.0, 4.0)], 4, 30.0, vec![(0, 2, 1), (2, 3, 1)], vec![(48.0, vec![(0, 3, 1)])]),
            ([(2.0, 4.0), (1.0, 2.0), (1.0, 2.0)], 4, 30.0, vec![(0, 1, 1), (1, 3, 1)], vec![(48.0, vec![(0, 3, 1)])]),
            ([(1.0, 2.0), (1.0, 2.0), (2.0, 4.0)], 8, 54.0, vec![(0, 2, 1), (2, 3, 1)], vec![(96.0, vec![(0, 3, 1)])]),
            ([(1.0, 1.0), (1.0, 1.0), (1.0, 1.0)], 1, 6.0, vec![(0, 3, 1)], vec![(6.0, vec![(0, 2, 1), (2, 3, 1)])]),
        ];
        for (k, (times, m, value, stages, others)) in cases.into_iter().enumerate() {
            let profile = chain(&times.map(|(f, b)| (f, b, 1000)));
            let out = run_dp(&profile, "1x2-nvlink", None, 1, m);
            assert_eq!(out.best, Some((value, stages)), "case {k}");
            assert_eq!(out.others, others, "case {k}");
            assert_eq!(out.states, 5, "case {k}");
        }
    }

    #[test]
    fn replicas_split_a_micro_batch() {
        // Two samples per micro-batch, M = 2, layers of 1 + 1 ms a sample.
        // One stage on both GPUs (a sample each, no parameters to
        // AllReduce): 2 x 4 = 8; on one GPU: 2 x 8 = 16; two stages of one
        // GPU: max(2 x 4, 4 + 2 x 4) = 12.
        let profile = chain(&[(1.0, 1.0, 0), (1.0, 1.0, 0)]);
        let out = run_dp(&profile, "1x2-nvlink", None, 2, 2);
        assert_eq!(out.best, Some((8.0, vec![(0, 2, 2)])));
        assert_eq!(out.others, vec![(12.0, vec![(0, 1, 1), (1, 2, 1)])]);
        // From the empty cluster: a stage on 1 GPU ending at layer 2 and
        // starting at 1 or 0, one on both GPUs starting at 0; then from one
        // GPU used at layer 1, a stage on the other.
        assert_eq!(out.states, 5);
    }

    #[test]
    fn stages_that_do_not_fit_in_memory_are_never_built() {
        // Model state 4x the parameters: layers of 16, 4 and 4 kB.
        let profile = chain(&[(1.0, 2.0, 4000), (1.0, 2.0, 1000), (2.0, 4.0, 1000)]);
        // 18 kB GPUs: layers 0-1 (20 kB) cannot share one, so the cut
        // after layer 2 (30 ms) is out and the cut after 1 (39 ms) wins.
        let out = run_dp(&profile, "1x2-nvlink", Some(18_000), 1, 4);
        assert_eq!(out.best, Some((39.0, vec![(0, 1, 1), (1, 3, 1)])));
        assert!(out.others.is_empty(), "{:?}", out.others);
        // 15 kB GPUs: layer 0 alone does not fit anywhere.
        let out = run_dp(&profile, "1x2-nvlink", Some(15_000), 1, 4);
        assert_eq!(out.best, None);
    }

    /// The layouts a walk of micro-batches of 1 sample, 4 of them, visits
    /// below `bound`, in order, with each one's value.
    fn walk_all(ctx: &Context, bound: f64, lowers: bool) -> Vec<(f64, Stages)> {
        let mut dp = Dp::new(ctx, 1, 4, Objective::Latency, vec![ctx.policy], None);
        let mut seen = Vec::new();
        let mut visit = |steps: &[Step], value: f64| {
            let found = Found {
                value,
                stages: steps.to_vec(),
            };
            seen.push((value, front_to_back(&found)));
            if lowers {
                value
            } else {
                f64::INFINITY
            }
        };
        let work_left = std::cell::Cell::new(u64::MAX);
        let mut walk = LayoutWalk {
            bound,
            nodes_left: 1000,
            work_left: &work_left,
            complete: true,
            visit: &mut visit,
        };
        dp.walk_layouts(&mut walk);
        assert!(walk.complete);
        seen
    }

    #[test]
    fn the_walk_visits_the_layouts_below_its_bound_best_first() {
        let profile = chain(&[(1.0, 2.0, 1000), (1.0, 2.0, 1000), (2.0, 4.0, 1000)]);
        // `lowers`: the visit returns the layout's value as the new bound
        // (as if it simulated at its bound), else infinity.
        let walk = |bound: f64, lowers: bool| -> Vec<(f64, Stages)> {
            in_space(&profile, "1x2-nvlink", None, |ctx| {
                walk_all(ctx, bound, lowers)
            })
        };
        let cut_after_2 = (30.0, vec![(0, 2, 1), (2, 3, 1)]);
        let cut_after_1 = (39.0, vec![(0, 1, 1), (1, 3, 1)]);
        let one_stage = (48.0, vec![(0, 3, 1)]);
        assert_eq!(
            walk(f64::INFINITY, false),
            vec![cut_after_2.clone(), cut_after_1.clone(), one_stage]
        );
        assert_eq!(walk(40.0, false), vec![cut_after_2.clone(), cut_after_1]);
        // The first layout visited lowers the bound below every other.
        assert_eq!(walk(f64::INFINITY, true), vec![cut_after_2]);
    }
}
