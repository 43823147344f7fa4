//! The search's space: which micro-batch sizes, which stage GPU counts and
//! placements, and which memory rules (warm-up depths counted in a stage's
//! memory) the DP passes search. The DP (`dp.rs`) asks a [`Context`] what a
//! stage may be; the baselines ask [`micro_batch_sizes`](crate::cost::micro_batch_sizes) which sizes a
//! layout may run at.

use crate::cluster::placement::{PlacedTakes, Placement, Policy, State, Take};
use crate::cost::overlap::Overlap;
use crate::cost::shape::{uneven_split_group, Offload, Recompute, StageShape};
use crate::cost::{largest_slice, micro_batch_sizes, Cluster, StageDevices, WarmupPolicy};
use crate::error::{Error, Result};
use crate::model::profile::LayerCosts;

use crate::plan::hints::Hints;
use crate::plan::Plan;

crate::named_enum! {
    /// Which stage replications and placements the search tries.
    pub enum SearchSpace("a search space") {
        /// Full up to 16 GPUs (the paper's clusters), machine-aligned above.
        Auto = "auto",
        /// Every GPU count for every stage, all three placement policies.
        Full = "full",
        /// Stages get a divisor of a machine's GPUs or whole machines (the
        /// fewest that give their largest slice), placed fresh-first or
        /// append-first with at most two machines partly used, or spread
        /// evenly over every machine in use (scatter-first). As in the full
        /// space, a plan may leave GPUs idle.
        /// On many machines the full space has too many ways to leave
        /// machines partly used (8x8 GPUs: 8.8 million states); this plans
        /// 128 layers on 16,384 GPUs in seconds.
        MachineAligned = "machine-aligned",
    }
}

crate::named_enum! {
    /// Which stage shapes (`cost/shape.rs`) the search gives stages besides
    /// DAPPLE's replicas.
    pub enum StageShapes("a set of stage shapes") {
        /// All, where the profile says how layers split or has experts (a transformer's);
        /// else plain, DAPPLE's space: with sharding and re-computation the
        /// walk's budget runs out sooner on the paper's profiles, and
        /// AmoebaNet-36 on configurations B and C planned 6.3% and 24.5%
        /// slower (the regress suite).
        Auto = "auto",
        /// Split degrees the profile's layers allow, sharding levels and
        /// re-computation, each stage its own.
        All = "all",
        /// Replicas only: DAPPLE's space (to reproduce the paper).
        Plain = "plain",
    }
}

impl StageShapes {
    /// Whether stages are plain only: asked so, or "auto" where no layer of
    /// the profile splits or has experts.
    pub(crate) fn plain_only(self, layers: &LayerCosts) -> bool {
        match self {
            StageShapes::Plain => true,
            StageShapes::Auto => !layers.splits_any() && !layers.has_experts(0, layers.num_layers),
            StageShapes::All => false,
        }
    }
}

/// The fastest uniform plan's split degree, sequence parallelism and
/// context degree (`candidate::uniform_degree`): what the machine-aligned
/// space searches.
pub(crate) type UniformShape = (u32, bool, u32);

/// The shapes a DP run may give a stage: what the profile allows and the
/// search was asked for.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ShapeChoices {
    /// Split degrees (at least 2) some layer allows and some machine holds,
    /// ascending; empty where nothing splits.
    pub(crate) split_degrees: Vec<u32>,
    /// The sharding levels searched (`cost/sharding.rs`), ascending from 0:
    /// each that shrinks something (level 1 where the profile keeps
    /// optimizer state), up to the options' highest; level 3 re-sharded.
    pub(crate) shard_levels: Vec<u8>,
    /// Offloading the optimizer shrinks something (the profile keeps
    /// optimizer state) and some machine's host is known.
    pub(crate) offload: bool,
    pub(crate) recompute: bool,
    /// Selective re-computation: some layer has something to re-run so.
    pub(crate) selective: bool,
    /// How split stages may run their sequence where their layers allow
    /// sequence parallelism: whole (false), split (true), or either. Either
    /// may win (it divides the replicated operators by t, and gathers the
    /// products' inputs again in the backward).
    pub(crate) sequence_options: Vec<bool>,
    /// The split degrees at which some layer's pattern allows sequence
    /// parallelism (`LayerCosts::sequence_parallel_at`, asked once each).
    pub(crate) sequence_degrees: Vec<u32>,
    /// Expert degrees (at least 2) every layer with experts allows,
    /// ascending (`LayerCosts::expert_degrees`); empty where none has any.
    pub(crate) expert_degrees: Vec<u32>,
    /// Context degrees (at least 2) the layers' sequence cuts into,
    /// ascending (`LayerCosts::context_degrees`); empty where none may.
    pub(crate) context_degrees: Vec<u32>,
    /// The GPUs a data replica of a stage may take, t c, above 1 and
    /// ascending (`fill_widths`, once the degrees are final).
    pub(crate) widths: Vec<u32>,
}

impl ShapeChoices {
    /// DAPPLE's stages: replicas only.
    pub(crate) const PLAIN: ShapeChoices = ShapeChoices {
        split_degrees: Vec::new(),
        shard_levels: Vec::new(),
        offload: false,
        recompute: false,
        selective: false,
        sequence_options: Vec::new(),
        sequence_degrees: Vec::new(),
        expert_degrees: Vec::new(),
        context_degrees: Vec::new(),
        widths: Vec::new(),
    };

    pub(crate) fn new(
        layers: &LayerCosts,
        cluster: &Cluster,
        (space, uniform): (SearchSpace, Option<UniformShape>),
        (shapes, max_shard_level, max_context_parallel): (StageShapes, u8, u32),
    ) -> ShapeChoices {
        if shapes.plain_only(layers) {
            return ShapeChoices::PLAIN;
        }
        let splits = |t: u32| (0..layers.num_layers).any(|l| layers.shard(l, t, false).is_some());
        // In the full space (up to 16 GPUs) every degree; a split group may
        // span machines evenly. In the machine-aligned space each degree
        // more is a DP about as large as the plain one again (GPT-3 on
        // 128x8: over 200 s with four): there only the degree of the
        // fastest uniform plan (Megatron-LM's shape), inside one machine,
        // each stage splitting at it or not.
        let split_degrees = match space {
            // Beyond, the uniform candidates alone split (Llama-3-405B on
            // 2048x8: over 500 s with the one degree in the DP).
            SearchSpace::MachineAligned if cluster.num_devices() > SPLIT_SEARCH_MAX_DEVICES => {
                Vec::new()
            }
            SearchSpace::MachineAligned => {
                let per_machine = cluster.machines.iter().map(|m| m.gpus).max().unwrap_or(1);
                uniform
                    .map(|(t, _, _)| t)
                    .filter(|&t| t > 1 && t <= per_machine && splits(t))
                    .into_iter()
                    .collect()
            }
            _ => (2..=cluster.num_devices()).filter(|&t| splits(t)).collect(),
        };
        ShapeChoices {
            split_degrees,
            shard_levels: (0..=max_shard_level.min(3))
                .filter(|&level| {
                    level != 1
                        || layers.model_state_bytes_sharded(0, layers.num_layers, 2)
                            < layers.model_state_bytes(0, layers.num_layers)
                })
                .collect(),
            offload: layers.held_optimizer_state_bytes(0, layers.num_layers, 1, 1.0) > 0.0
                && cluster.has_a_host(),
            recompute: true,
            selective: layers.recomputes_selectively(),
            // The machine-aligned space, as with degrees, only the fastest
            // uniform plan's way (each is a DP as large again).
            sequence_options: match (space, uniform) {
                (SearchSpace::MachineAligned, Some((_, sequence_parallel, _))) => {
                    vec![sequence_parallel]
                }
                _ => vec![false, true],
            },
            // Filled once the hinted degrees are in (`Space::new`).
            sequence_degrees: Vec::new(),
            expert_degrees: layers.expert_degrees(),
            context_degrees: match space {
                // As with split degrees: only the fastest uniform plan's.
                SearchSpace::MachineAligned if cluster.num_devices() > SPLIT_SEARCH_MAX_DEVICES => {
                    Vec::new()
                }
                SearchSpace::MachineAligned => uniform
                    .map(|(_, _, c)| c)
                    .filter(|&c| c > 1)
                    .into_iter()
                    .collect(),
                _ => layers.context_degrees(cluster.num_devices()),
            }
            .into_iter()
            .filter(|&c| c <= max_context_parallel)
            .collect(),
            widths: Vec::new(),
        }
    }

    /// A layout's own split and expert degrees (`Context::layout`).
    pub(crate) fn of_layout(layout: &[(usize, usize, u32, StageShape)]) -> ShapeChoices {
        // The distinct degrees above 1 the layout's stages take, ascending.
        let degrees = |of: fn(&StageShape) -> u32| {
            let mut degrees: Vec<u32> =
                layout.iter().map(|s| of(&s.3)).filter(|&d| d > 1).collect();
            degrees.sort_unstable();
            degrees.dedup();
            degrees
        };
        ShapeChoices {
            split_degrees: degrees(|s| s.tensor_parallel),
            shard_levels: {
                let mut levels: Vec<u8> = layout.iter().map(|s| s.3.shard_level).collect();
                levels.sort_unstable();
                levels.dedup();
                levels
            },
            offload: layout.iter().any(|s| !s.3.offload.is_none()),
            recompute: layout.iter().any(|s| !s.3.recompute.is_none()),
            selective: layout.iter().any(|s| s.3.recompute == Recompute::Selective),
            // A layout's own, at each degree (`Context::sequence_options`).
            sequence_options: Vec::new(),
            sequence_degrees: Vec::new(),
            expert_degrees: degrees(|s| s.expert_parallel),
            context_degrees: degrees(|s| s.context_parallel),
            widths: Vec::new(),
        }
        .with_widths()
    }

    /// With `widths` filled from the split and context degrees.
    pub(crate) fn with_widths(mut self) -> ShapeChoices {
        let mut widths: Vec<u32> = self
            .width_pairs()
            .map(|(t, c)| t * c)
            .filter(|&w| w > 1)
            .collect();
        widths.sort_unstable();
        widths.dedup();
        self.widths = widths;
        self
    }

    /// Every (t, c) the degrees allow, (1, 1) first.
    fn width_pairs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        std::iter::once(1)
            .chain(self.split_degrees.iter().copied())
            .flat_map(move |t| {
                std::iter::once(1)
                    .chain(self.context_degrees.iter().copied())
                    .map(move |c| (t, c))
            })
    }

    /// The (t, c) whose data replicas take `width` GPUs.
    pub(crate) fn pairs_of_width(&self, width: u32) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.width_pairs().filter(move |&(t, c)| t * c == width)
    }

    /// The most GPUs one data replica of a stage may take.
    pub(crate) fn largest_degree(&self) -> u32 {
        self.widths.last().copied().unwrap_or(1)
    }
}

/// Largest cluster whose DP splits stages (at the fastest uniform degree).
pub(crate) const SPLIT_SEARCH_MAX_DEVICES: u32 = 1024;

/// Most GPUs on machines of several GPUs the full space searches at the
/// default table limit: its partly used machine patterns grow
/// combinatorially (BERT-48 on 4x8 takes 33 s and 1.9 million states; on
/// 8x8 VGG-19 passes 1 GiB of tables after 51 s, and 32x8 takes minutes to
/// fail), so beyond it the request is refused before searching. Raising
/// the limit (`--max-search-gib`) searches anyway.
pub(crate) const FULL_SPACE_MAX_SHARED_GPUS: u32 = 32;

/// Largest cluster the automatic choice searches in full. 128 layers on
/// 4x8 GPUs take 1.1 s in full when time is linear in the batch and 59 s
/// when small batches are less efficient (benchmarks/README.md).
pub(crate) const AUTO_FULL_MAX_DEVICES: u32 = 16;

impl SearchSpace {
    pub(crate) fn resolve(self, cluster: &Cluster) -> SearchSpace {
        match self {
            SearchSpace::Auto if cluster.num_devices() > AUTO_FULL_MAX_DEVICES => {
                SearchSpace::MachineAligned
            }
            SearchSpace::Auto => SearchSpace::Full,
            other => other,
        }
    }
}

/// The micro-batch sizes the search runs: the requested ones (each must
/// divide the global batch) of at least `min_slice` samples, or else every
/// size of [`micro_batch_sizes`](crate::cost::micro_batch_sizes); an error when none is left.
pub(crate) fn searched_micro_batch_sizes(
    global_batch_size: u32,
    min_slice: u32,
    requested: Option<&[u32]>,
) -> Result<Vec<u32>> {
    let gbs = global_batch_size;
    let sizes: Vec<u32> = match requested {
        Some(list) => {
            for &b in list {
                if b == 0 || !gbs.is_multiple_of(b) {
                    return Err(Error::field(
                        "micro_batch_sizes",
                        format!("value {b} does not divide the global batch size {gbs}"),
                    ));
                }
            }
            list.iter().copied().filter(|&b| b >= min_slice).collect()
        }
        // Sizes whose micro-batches alone pass the simulation limit are left
        // out; so are, later, plans whose stages times micro-batches do.
        None => micro_batch_sizes(gbs, min_slice, 1, 1),
    };
    if sizes.is_empty() {
        return Err(Error::incompatible(format!(
            "global batch size {gbs} cannot be split into micro-batches of at least {min_slice} samples \
             (the smallest profiled batch size; lower it with --min-micro-batch-size)"
        )));
    }
    Ok(sizes)
}

/// What the DP passes search: the micro-batch sizes, and one [`Context`]
/// per pass (memory rule). Under warm-up policy auto there are three
/// passes, with stage memory counted at policy A's depths, policy B's and
/// one micro-batch in flight; the last, whose rule admits every plan of the
/// space (the covering pass), gives the space's bounds.
pub(crate) struct Space<'a> {
    pub(crate) global_batch_size: u32,
    pub(crate) sizes: Vec<u32>,
    /// One per pass, the covering pass last.
    pub(crate) contexts: Vec<Context<'a>>,
    /// Pass indices, loosest memory rule first (one micro-batch, then
    /// policy A's depths, then B's): one DP run serves every pass, its
    /// entries carrying the strictest rule they fit.
    pub(crate) by_looseness: Vec<usize>,
    /// The passes' memory rules in that order (`Dp::rules`).
    pub(crate) rules: Vec<WarmupPolicy>,
}

impl<'a> Space<'a> {
    pub(crate) fn new(
        layers: &'a LayerCosts,
        cluster: &'a Cluster,
        // The space, the stage shapes and the fastest uniform plan's degree
        // and sequence parallelism.
        (space, shapes, uniform_degree): (
            SearchSpace,
            (StageShapes, u8, u32),
            Option<UniformShape>,
        ),
        (warmup_policy, overlap): (WarmupPolicy, Overlap),
        min_slice: u32,
        (global_batch_size, sizes): (u32, Vec<u32>),
        hints: &'a Hints,
    ) -> Space<'a> {
        let space = space.resolve(cluster);
        let mut shapes = ShapeChoices::new(layers, cluster, (space, uniform_degree), shapes);
        // A hinted split degree is searched whatever the space would search.
        for t in hints
            .ranges
            .iter()
            .map(|r| r.tensor_parallel)
            .filter(|&t| t > 1)
        {
            if !shapes.split_degrees.contains(&t) {
                shapes.split_degrees.push(t);
                shapes.split_degrees.sort_unstable();
            }
        }
        shapes.sequence_degrees = shapes
            .split_degrees
            .iter()
            .copied()
            .filter(|&t| layers.sequence_parallel_at(t))
            .collect();
        let shapes = shapes.with_widths();
        let passes: Vec<WarmupPolicy> = match warmup_policy {
            WarmupPolicy::Auto => vec![WarmupPolicy::A, WarmupPolicy::B, WarmupPolicy::Auto],
            fixed => vec![fixed],
        };
        let contexts: Vec<Context> = passes
            .iter()
            .map(|&policy| Context {
                layers,
                cluster,
                policy,
                overlap,
                min_slice,
                space,
                layout: None,
                shapes: shapes.clone(),
                hints,
            })
            .collect();
        let mut by_looseness: Vec<usize> = (0..contexts.len()).collect();
        by_looseness.sort_by_key(|&p| match contexts[p].policy {
            WarmupPolicy::Auto => 0,
            WarmupPolicy::A => 1,
            WarmupPolicy::B => 2,
        });
        let rules = by_looseness.iter().map(|&p| contexts[p].policy).collect();
        Space {
            global_batch_size,
            sizes,
            contexts,
            by_looseness,
            rules,
        }
    }

    /// The pass whose memory rule admits every plan of the space.
    pub(crate) fn covering_pass(&self) -> usize {
        self.contexts.len() - 1
    }

    pub(crate) fn covering(&self) -> &Context<'a> {
        &self.contexts[self.covering_pass()]
    }

    pub(crate) fn cluster(&self) -> &'a Cluster {
        self.covering().cluster
    }

    pub(crate) fn space(&self) -> SearchSpace {
        self.covering().space
    }

    /// Micro-batches of a micro-batch size.
    pub(crate) fn micro_batches(&self, micro_batch_size: u32) -> u32 {
        self.global_batch_size / micro_batch_size
    }
}

/// A GPU count a stage may have, the split degrees it may run at, and
/// where it may go (`Context::stage_options`).
pub(crate) struct StageGpus {
    pub(crate) gpus: u32,
    pub(crate) degrees: StageDegrees,
    pub(crate) places: Vec<PlacedTakes>,
}

/// Which split degrees (1: unsplit) a stage of some GPU count may run at
/// (`Context::degrees`).
pub(crate) enum StageDegrees {
    /// Every one that divides its GPUs into at most the largest number of
    /// replicas. Not listed: the DP asks for them once per GPU count of
    /// every state it expands.
    Dividing,
    /// These (in any order: `allowed_degrees` lists them ascending).
    Listed(Vec<u32>),
}

/// What a DP run may build: the model's layers on the cluster, under one
/// memory rule, in one search space.
pub(crate) struct Context<'a> {
    pub(crate) layers: &'a LayerCosts,
    pub(crate) cluster: &'a Cluster,
    pub(crate) policy: WarmupPolicy,
    /// What the runtime hides behind computation: how every stage is priced.
    pub(crate) overlap: Overlap,
    pub(crate) min_slice: u32,
    pub(crate) space: SearchSpace,
    /// Where set, only this layout: stages (layer_start, layer_end, GPUs,
    /// shape), placed anew (`candidate::best_placement_of`).
    pub(crate) layout: Option<&'a [(usize, usize, u32, StageShape)]>,
    pub(crate) shapes: ShapeChoices,
    /// The user's constraints (`plan/hints.rs`): where stages may start, their
    /// split degrees and their count.
    pub(crate) hints: &'a Hints,
}

/// Most partly used machines a stage placed inside one machine may leave
/// in the machine-aligned space (an even scatter may use every machine).
pub(crate) const MAX_PARTLY_USED_MACHINES: u32 = 2;

impl Context<'_> {
    /// Layers a stage of `replicas` GPUs ending at layer `j` may start at,
    /// with `free` GPUs left before it. A stage that takes every GPU left is
    /// the first one; any other may be first too, leaving GPUs idle, in
    /// either space: over a slow network fewer GPUs can be faster (4x8:
    /// AmoebaNet-18 on 24 GPUs simulates 1163.0 ms, on all 32 1173.4).
    pub(crate) fn starts(&self, replicas: u32, free: u32, j: usize) -> std::ops::Range<usize> {
        if let Some(layout) = self.layout {
            // The layout's stage ending at j, with its GPU count, or none.
            return match layout
                .iter()
                .find(|&&(_, end, r, _)| end == j && r == replicas)
            {
                Some(&(start, _, _, _)) => start..start + 1,
                None => 0..0,
            };
        }
        let Some(lowest) = self.hints.lowest_start(j) else {
            return 0..0; // inside a hinted range
        };
        if replicas == free {
            lowest..1
        } else {
            lowest..j
        }
    }

    /// K_i the DP counts in a stage's memory under this context's policy.
    pub(crate) fn memory_warmup(&self, stages_from_here: u32, micro_batches: u32) -> u32 {
        self.policy.memory_depth(stages_from_here, micro_batches)
    }

    /// The GPU counts a stage may have from `state` with micro-batches of
    /// `micro_batch` samples, ascending, each with the split degrees it may
    /// run at (1: unsplit) and where it may go. In the full space, every
    /// count and degree whose replicas take at least the smallest slice
    /// (`max_replicas` of them at most). In the machine-aligned space, a
    /// divisor of a machine's GPUs or whole machines, and for each degree,
    /// of the counts that can be placed, the fewest that give each largest
    /// slice (more replicas at the same slice compute no faster); and every
    /// GPU left (the first stage) at every degree.
    pub(crate) fn stage_options(
        &self,
        state: &State,
        max_replicas: u32,
        micro_batch: u32,
    ) -> Vec<StageGpus> {
        let free = state.free();
        let most = free.min(max_replicas * self.shapes.largest_degree());
        let runs_at_all = |gpus: u32| {
            self.allowed_degrees(&StageDegrees::Dividing, gpus, max_replicas)
                .next()
                .is_some()
        };
        let option = |gpus: u32, degrees: StageDegrees, places: Vec<PlacedTakes>| StageGpus {
            gpus,
            degrees,
            places,
        };
        match self.space {
            SearchSpace::MachineAligned => {
                let per_machine = state
                    .0
                    .iter()
                    .map(|(m, _)| u32::from(m.capacity))
                    .max()
                    .unwrap_or(1);
                let counts: Vec<u32> = (1..per_machine)
                    .filter(|d| per_machine.is_multiple_of(*d))
                    .chain((per_machine..=most).step_by(per_machine as usize))
                    .filter(|&r| r <= most && r != free)
                    .collect();
                let mut options: Vec<StageGpus> = Vec::new();
                for t in std::iter::once(1).chain(self.shapes.widths.iter().copied()) {
                    let mut last_slice = u32::MAX;
                    for &gpus in counts
                        .iter()
                        .filter(|&&g| g.is_multiple_of(t) && g / t <= max_replicas)
                    {
                        let slice = largest_slice(micro_batch, gpus / t);
                        // More GPUs at the same slice compute no faster,
                        // unless a hint asks for that many.
                        if slice == last_slice && !self.hints.fixes_gpus(gpus, t) {
                            continue;
                        }
                        let at = match options.iter().position(|o| o.gpus == gpus) {
                            Some(at) => at,
                            None => {
                                let places = self.placements(state, gpus);
                                if places.is_empty() {
                                    continue;
                                }
                                options.push(option(
                                    gpus,
                                    StageDegrees::Listed(Vec::new()),
                                    places,
                                ));
                                options.len() - 1
                            }
                        };
                        if let StageDegrees::Listed(degrees) = &mut options[at].degrees {
                            degrees.push(t);
                        }
                        last_slice = slice;
                    }
                }
                options.sort_by_key(|o| o.gpus);
                if free <= most && runs_at_all(free) {
                    options.push(option(
                        free,
                        StageDegrees::Dividing,
                        self.placements(state, free),
                    ));
                }
                options
            }
            _ => (1..=most)
                .filter(|&gpus| runs_at_all(gpus))
                .map(|gpus| option(gpus, StageDegrees::Dividing, self.placements(state, gpus)))
                .collect(),
        }
    }

    /// The split degrees of `degrees` (1: unsplit) a stage of `gpus` GPUs
    /// may run at, ascending; `Dividing`: those that divide its GPUs into at
    /// most `max_replicas` replicas.
    pub(crate) fn allowed_degrees<'s>(
        &'s self,
        degrees: &'s StageDegrees,
        gpus: u32,
        max_replicas: u32,
    ) -> impl Iterator<Item = u32> + 's {
        std::iter::once(1)
            .chain(self.shapes.widths.iter().copied())
            .filter(move |&t| match degrees {
                StageDegrees::Dividing => gpus.is_multiple_of(t) && gpus / t <= max_replicas,
                StageDegrees::Listed(listed) => listed.contains(&t),
            })
    }

    /// Whether a stage on `devices` can split `t` ways: on alike GPUs,
    /// into even split groups (`plan::check`).
    pub(crate) fn splits_evenly(&self, devices: &StageDevices, t: u32) -> bool {
        t == 1 || (!devices.mixed && uneven_split_group(&devices.alloc, t).is_none())
    }

    /// Whether layer `layer` may be in a stage of `gpus` GPUs split `t`
    /// ways (as `plan::check` requires): a layer with sharding patterns
    /// has one `t` splits; one without runs whole, on slices of at least
    /// the smallest.
    pub(crate) fn layer_runs_at(
        &self,
        layer: usize,
        (t, c): (u32, u32),
        gpus: u32,
        max_replicas: u32,
    ) -> bool {
        if t == 1 && c == 1 {
            return true;
        }
        if !self.layers.context_runs_at(layer, c) {
            return false;
        }
        if t == 1 || self.layers.split_patterns(layer).is_empty() {
            gpus / c <= max_replicas
        } else {
            self.layers.shard(layer, t, false).is_some()
        }
    }

    /// Whether a stage split `t` ways runs its sequence whole, split, or
    /// either (each priced as a degree of its own): split where the
    /// profile's patterns at `t` allow it and the search was asked for it;
    /// a layout's own at `t`. Asked for every stage option: no allocation.
    pub(crate) fn sequence_options(&self, t: u32, mixed: bool) -> impl Iterator<Item = bool> + '_ {
        [false, true]
            .into_iter()
            .filter(move |&split| match self.layout {
                Some(layout) => layout
                    .iter()
                    .any(|s| s.3.tensor_parallel == t && s.3.sequence_parallel == split),
                None if !mixed && self.shapes.sequence_degrees.contains(&t) => {
                    self.shapes.sequence_options.contains(&split)
                }
                None => !split,
            })
    }

    /// The expert degrees, with expert tensor degrees (None: t), a stage
    /// of `gpus` GPUs split `t` ways may take: 1, and on alike GPUs each
    /// degree every layer with experts allows that divides its replicas;
    /// under sequence parallelism, also each expert split fewer ways than
    /// t, where the expert groups divide the stage's GPUs (each priced
    /// with sums of its own).
    pub(crate) fn expert_options(
        &self,
        (t, sequence_parallel, c): (u32, bool, u32),
        gpus: u32,
        mixed: bool,
    ) -> impl Iterator<Item = (u32, Option<u32>)> + '_ {
        let replicas = gpus / t.max(1);
        // Not beside context parallelism (not modelled together yet).
        let degrees = self
            .shapes
            .expert_degrees
            .iter()
            .copied()
            .filter(move |_| !mixed && c == 1);
        let at_t = degrees
            .clone()
            .filter(move |&e| replicas.is_multiple_of(e))
            .map(|e| (e, None));
        let below_t = degrees.flat_map(move |e| {
            (1..t)
                .filter(move |&et| {
                    sequence_parallel && t.is_multiple_of(et) && gpus.is_multiple_of(e * et)
                })
                .map(move |et| (e, Some(et)))
        });
        std::iter::once((1, None)).chain(at_t).chain(below_t)
    }

    /// Whether `shape` spreads the experts of a stage of layers `i..j`
    /// that has none: the same stage at e = 1, which `plan::check` refuses.
    pub(crate) fn spreads_no_experts(&self, shape: &StageShape, (i, j): (usize, usize)) -> bool {
        shape.expert_parallel > 1 && !self.layers.has_experts(i, j)
    }

    /// Whether `shape` splits the experts of a layer of `i..j` fewer ways
    /// than the layer whose shards hold the same tokens (not split along
    /// the sequence), which `plan::check` refuses for this stage and
    /// every longer one.
    pub(crate) fn splits_experts_of_a_whole_sequence(
        &self,
        shape: &StageShape,
        (i, j): (usize, usize),
    ) -> bool {
        let t = shape.tensor_parallel;
        shape.expert_tensor_degree() < t
            && (i..j).any(|l| {
                self.layers.experts(l).is_some()
                    && self
                        .layers
                        .shard(l, t, true)
                        .is_some_and(|s| s.input_factor >= 1.0)
            })
    }

    /// The shapes a stage split `t` ways, with expert degree `e` (each
    /// expert split `et` ways), over `gpus` GPUs may take, the plain one
    /// (at `t`, `e` and `et`) first: then
    /// sharding over more than one GPU and re-computation, each where
    /// it applies. Stages on mixed GPUs stay plain (`plan::check`).
    pub(crate) fn shapes_at(
        &self,
        (t, sequence_parallel, e, et, c): (u32, bool, u32, Option<u32>, u32),
        gpus: u32,
        mixed: bool,
    ) -> ShapeList {
        let base = StageShape {
            tensor_parallel: t,
            sequence_parallel,
            expert_parallel: e,
            expert_tensor_parallel: et,
            context_parallel: c,
            ..StageShape::PLAIN
        };
        let mut list = ShapeList::at(base);
        if let Some(layout) = self.layout {
            // The layout's own shapes, for its stages of that many GPUs.
            for &(_, _, g, shape) in layout {
                if g == gpus
                    && shape.tensor_parallel == t
                    && shape.sequence_parallel == sequence_parallel
                    && shape.expert_parallel == e
                    && shape.expert_tensor_parallel == et
                    && shape.context_parallel == c
                {
                    list.push_unique(shape);
                }
            }
            return list;
        }
        if mixed {
            list.push_unique(base);
            return list;
        }
        let recompute: &[Recompute] = match (self.shapes.recompute, self.shapes.selective) {
            (true, true) => &Recompute::ALL,
            (true, false) => &[Recompute::None, Recompute::Full, Recompute::PerLayer],
            (false, _) => &[Recompute::None],
        };
        let offload: &[Offload] = if self.shapes.offload {
            &Offload::ALL
        } else {
            &[Offload::None]
        };
        // Each offloaded shape after the one that steps on its GPUs, which
        // the search weighs it against (`dp.rs`).
        // Sharding levels in order, each after the one it is weighed
        // against (`dp.rs`); level 3 keeping its weights after the forward
        // is never faster than level 2 and holds as much (`cost/sharding.rs`).
        let levels: &[u8] = if gpus > 1 && !self.shapes.shard_levels.is_empty() {
            &self.shapes.shard_levels
        } else {
            &[0]
        };
        for &recompute in recompute {
            // Whole layers shard over all the stage's GPUs, split ones over its replicas.
            for &shard_level in levels {
                for &offload in offload {
                    list.push_unique(StageShape {
                        recompute,
                        shard_level,
                        reshard_after_forward: shard_level == 3,
                        offload,
                        ..base
                    });
                }
            }
        }
        list
    }

    /// The GPU counts of [`Context::stage_options`] alone.
    pub(crate) fn replica_counts(
        &self,
        state: &State,
        max_replicas: u32,
        micro_batch: u32,
    ) -> Vec<u32> {
        self.stage_options(state, max_replicas, micro_batch)
            .into_iter()
            .map(|o| o.gpus)
            .collect()
    }

    /// Where a stage of `replicas` GPUs may go from `state`. The stage
    /// that takes every free GPU (the first one) is always allowed.
    pub(crate) fn placements(&self, state: &State, replicas: u32) -> Vec<PlacedTakes> {
        match self.space {
            SearchSpace::MachineAligned if replicas != state.free() => {
                let mut out = state.aligned_placements(replicas, MAX_PARTLY_USED_MACHINES);
                if let Some(takes) = state.even_scatter(replicas) {
                    // Never one of those: it touches at least two machines
                    // partly, or several fresh ones below their size.
                    out.push((Placement::of(Policy::ScatterFirst), takes));
                }
                out
            }
            _ => state.placements(replicas),
        }
    }

    /// The GPUs `placement` gave when the search ran.
    pub(crate) fn replay(&self, state: &State, replicas: u32, placement: Placement) -> Vec<Take> {
        self.placements(state, replicas)
            .into_iter()
            .find(|(p, _)| *p == placement)
            .map(|(_, c)| c)
            .expect("replaying a placement the search made")
    }
}

/// The shapes a stage may take at one split degree, in the order they are
/// priced. They share the degree's split, sequence, expert and context
/// fields (`base`) and differ in sharding level (five, counting level 3
/// both ways), re-computation and offloading, so each is kept as those
/// four bytes in a fixed array: the DP lists them once per stage option,
/// too often to allocate each time, and copies the list as it goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShapeList {
    base: StageShape,
    variants: [Variant; ShapeList::CAPACITY],
    len: usize,
}

/// What tells apart the shapes of one degree.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Variant {
    shard_level: u8,
    reshard_after_forward: bool,
    recompute: Recompute,
    offload: Offload,
}

impl Variant {
    const OF_PLAIN: Variant = Variant {
        shard_level: 0,
        reshard_after_forward: false,
        recompute: Recompute::None,
        offload: Offload::None,
    };
}

impl ShapeList {
    const CAPACITY: usize = 5 * Recompute::ALL.len() * Offload::ALL.len();

    /// An empty list of shapes at `base`'s degree.
    fn at(base: StageShape) -> ShapeList {
        ShapeList {
            base,
            variants: [Variant::OF_PLAIN; ShapeList::CAPACITY],
            len: 0,
        }
    }

    /// Adds `shape` (at the list's degree) unless it is listed already.
    fn push_unique(&mut self, shape: StageShape) {
        let variant = Variant {
            shard_level: shape.shard_level,
            reshard_after_forward: shape.reshard_after_forward,
            recompute: shape.recompute,
            offload: shape.offload,
        };
        debug_assert!(
            self.with(variant) == shape,
            "a stage shape of another degree"
        );
        if !self.variants[..self.len].contains(&variant) {
            debug_assert!(self.len < Self::CAPACITY, "a stage shape of another kind");
            self.variants[self.len] = variant;
            self.len += 1;
        }
    }

    fn with(&self, v: Variant) -> StageShape {
        StageShape {
            shard_level: v.shard_level,
            reshard_after_forward: v.reshard_after_forward,
            recompute: v.recompute,
            offload: v.offload,
            ..self.base
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Shape `k`, in pricing order.
    pub(crate) fn get(&self, k: usize) -> StageShape {
        self.with(self.variants[..self.len][k])
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = StageShape> + '_ {
        self.variants[..self.len].iter().map(|&v| self.with(v))
    }
}

/// A plan's stages as (layer_start, layer_end, GPUs, shape), front to back:
/// what a layout's DP run (`Context::layout`) and the hints read.
pub(crate) fn layout_of(plan: &Plan) -> Vec<(usize, usize, u32, StageShape)> {
    plan.stages
        .iter()
        .map(|s| (s.layer_start, s.layer_end, s.devices.len() as u32, s.shape))
        .collect()
}

/// Whether a whole plan keeps to the hints (`Hints::admits_layout`).
pub(crate) fn hints_admit(hints: &Hints, plan: &Plan) -> bool {
    hints.admits_layout(&layout_of(plan), plan.micro_batches)
}

#[cfg(test)]
mod tests {
    use crate::cost::divisors;

    #[test]
    fn divisors_are_every_divisor_ascending() {
        for n in 1..=2000u32 {
            let naive: Vec<u32> = (1..=n).filter(|d| n.is_multiple_of(*d)).collect();
            assert_eq!(divisors(n), naive, "{n}");
        }
        // 10^9 = 2^9 x 5^9: 10 x 10 divisors; and the largest u32.
        assert_eq!(divisors(1_000_000_000).len(), 100);
        assert_eq!(
            divisors(u32::MAX),
            vec![
                1,
                3,
                5,
                15,
                17,
                51,
                85,
                255,
                257,
                771,
                1285,
                3855,
                4369,
                13107,
                21845,
                65535,
                65537,
                196611,
                327685,
                983055,
                1114129,
                3342387,
                5570645,
                16711935,
                16843009,
                50529027,
                84215045,
                252645135,
                286331153,
                858993459,
                1431655765,
                u32::MAX
            ]
        );
    }
}
