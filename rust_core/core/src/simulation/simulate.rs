//! Discrete-event simulation of one training iteration of a plan.
//!
//! The analytic estimate (formula 2) ignores bubbles inside the pivot stage;
//! here every forward and backward of every micro-batch runs in the order
//! its stage's action list gives (`schedule.rs`), transfers queue on the
//! link between two stages (one queue per direction), each stage reduces
//! its gradients after its last backward and then steps its optimizer.
//! All replicas of a stage run the same list on their slices in lockstep,
//! so a stage is simulated once with the time of its largest slice.
//!
//! An asynchronous schedule (XPipe, PipeDream, SpecTrain, async) runs many
//! mini-batches without a flush; its `iteration_ms` is the steady-state
//! time of one mini-batch, measured between two updates of the first stage
//! after the pipeline has filled and before it drains. A stage that
//! re-computes (its plan's `recompute`, or `--recompute`) re-runs its whole
//! forward in the backward on the backward's own weights, as in the XPipe
//! paper's implementation; one that does not keeps the forward's
//! activations and costs the backward alone. Memory counts the weight
//! copies the schedule's rule keeps (stashed versions, cached predictions)
//! and the Adam moments XPipe's prediction keeps when the optimizer has
//! none.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::cost::overlap::GradReduceOverlap;
use crate::cost::shape::{MemoryTerms, Recompute};
use crate::cost::{Alloc, StageCost, StageCoster, StageDevices};
use crate::error::{Error, Result};
use crate::formats::format::{FileFormat, FileObject, SIMULATION};
use crate::model::profile::Profile;
use crate::plan::{plan_schedule, Plan};
use crate::schedule::pipeline_order::PipelineOrder;
use crate::schedule::{
    early_backward_actions, rank_lists, steady_state_window, Action, ActionKind, Predictor,
    Schedule, ScheduleKind, WeightRule,
};
use crate::simulation::costing::{stage_costs, with_coster, ProfileCosts};

/// One stage as the simulator sees it: times for one micro-batch slice and
/// the bytes that come and go with each micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimStage {
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    /// Of `bwd_ms`, the weight gradient, which a split backward (ZB-H1's
    /// I then W) runs apart from the input gradient.
    pub bwd_weight_ms: f64,
    pub allreduce_ms: f64,
    pub optimizer_ms: f64,
    /// Weights, gradients and optimizer state: held all the time.
    pub model_state_bytes: f64,
    /// One copy of the stage's weights (a stashed or predicted version).
    pub weight_bytes: f64,
    /// Adam's moments XPipe's prediction keeps itself, held all the time:
    /// two copies of the weights, none when the optimizer has them.
    pub own_adam_moments_bytes: f64,
    /// Kept from a micro-batch's forward to its backward.
    pub stored_bytes: f64,
    /// All that re-computation keeps per micro-batch slice: the stage's
    /// input, and on the last stage what the loss keeps.
    pub input_bytes: f64,
    /// The forward a backward re-runs under `--recompute`: all but what
    /// torch's checkpoint leaves of the last layer (`LayerCosts::rerun_ratio`).
    pub recompute_ms: f64,
    /// What a running backward needs on top of what the stage holds.
    pub working_bytes: f64,
    /// What a re-computed backward brings back: the re-run's activations,
    /// less what the loss kept (`StageMemory::rerun_bytes`).
    pub rerun_bytes: f64,
    /// What a re-computed backward needs on top of `input_bytes` at its
    /// peak (`profile::recompute_backward_bytes`).
    pub recompute_backward_bytes: f64,
    /// The gradients, part of `model_state_bytes`: made by the stage's
    /// first backward, let go after its optimizer step.
    pub gradient_bytes: f64,
    /// What the optimizer's step allocates above the model state while it runs.
    pub optimizer_step_bytes: f64,
    /// What the allocator reserves per byte it allocates (1: nothing more).
    pub allocator_reserved_factor: f64,
    pub memory_limit_bytes: f64,
    /// The stage's plan re-computes it (any `Recompute` but none): `bwd_ms` holds
    /// the forward's re-run already, and it keeps only `input_bytes`.
    pub recomputes: bool,
}

impl SimStage {
    /// What the running backward needs on top of the micro-batches in
    /// flight, and what each of those keeps: re-computing, the re-run with
    /// its working memory over the input (and the loss's kept bytes);
    /// otherwise the working memory over the stored activations.
    pub fn backward_and_kept_bytes(&self, recompute: bool) -> (f64, f64) {
        if recompute {
            (self.recompute_backward_bytes, self.input_bytes)
        } else {
            (self.working_bytes, self.stored_bytes)
        }
    }

    /// The simulated peak in its terms, as held at that instant.
    fn memory_terms(&self, peak: &HeldTerms, recompute: bool) -> MemoryTerms {
        let (_, per_micro_batch) = self.backward_and_kept_bytes(recompute || self.recomputes);
        peak.as_memory_terms(per_micro_batch, self.allocator_reserved_factor)
    }
}

impl HeldTerms {
    /// The peak in its terms, each micro-batch in flight keeping
    /// `per_micro_batch_bytes`.
    fn as_memory_terms(
        &self,
        per_micro_batch_bytes: f64,
        allocator_reserved_factor: f64,
    ) -> MemoryTerms {
        let peak = self;
        MemoryTerms {
            model_state_bytes: peak.state_bytes,
            per_micro_batch_bytes,
            micro_batches_in_flight: peak.in_flight.max(0) as u32,
            // Sums of events that came and went: rounding can leave
            // -1e-12 where nothing is held, which no file may say.
            working_bytes: peak.working_bytes.max(0.0),
            other_bytes: (peak.total()
                - peak.state_bytes
                - peak.in_flight_bytes
                - peak.working_bytes)
                .max(0.0),
            peak_bytes: peak.total(),
            allocator_reserved_factor,
        }
    }
}

/// What a stage holds at one instant, by term.
#[derive(Debug, Clone, Copy, Default)]
struct HeldTerms {
    /// Model state: without the gradients until the first backward.
    state_bytes: f64,
    in_flight: i32,
    in_flight_bytes: f64,
    working_bytes: f64,
    other_bytes: f64,
}

impl HeldTerms {
    fn add(&mut self, event: MemoryEvent) {
        match event.term {
            Term::InFlight(count) => {
                self.in_flight += count;
                self.in_flight_bytes += event.bytes;
            }
            Term::Working => self.working_bytes += event.bytes,
            Term::Gradients => self.state_bytes += event.bytes,
            Term::Other => self.other_bytes += event.bytes,
        }
    }

    fn total(&self) -> f64 {
        self.state_bytes + self.in_flight_bytes + self.working_bytes + self.other_bytes
    }
}

crate::named_enum! {
    /// What a simulated task does.
    pub enum TaskKind("a task kind") {
        Forward = "forward",
        Backward = "backward",
        /// A split backward's input gradient (I), which the stage before waits for.
        InputGradient = "input_gradient",
        /// A split backward's weight gradient (W).
        WeightGradient = "weight_gradient",
        /// Activations from stage `stage` to `stage + 1`.
        SendForward = "send_forward",
        /// Gradients from stage `stage + 1` back to `stage`.
        SendBackward = "send_backward",
        AllReduce = "all_reduce",
        OptimizerStep = "optimizer_step",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub stage: usize,
    pub kind: TaskKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u32>,
    pub start_ms: f64,
    pub end_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageTimeline {
    /// Time spent in forward and backward passes.
    pub compute_ms: f64,
    /// Share of the iteration the stage's GPUs do no forward or backward work.
    pub bubble_fraction: f64,
    pub peak_memory_bytes: f64,
    pub memory_limit_bytes: f64,
    /// Most micro-batches between their forward and their backward at once.
    pub peak_in_flight: u32,
    /// Most copies of the weights held besides the live ones (stashed or
    /// predicted versions of an asynchronous schedule); 0 when synchronous.
    #[serde(default)]
    pub peak_weight_copies: u32,
    /// (time ms, bytes) after every change of the stage's memory.
    pub memory: Vec<(f64, f64)>,
    /// What the peak is made of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_terms: Option<MemoryTerms>,
}

/// One simulated iteration, as `dapple simulate --json` writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Simulation {
    pub format: String,
    pub schema_version: u32,
    pub schedule: ScheduleKind,
    /// Every stage re-computed its forward in its backward (`--recompute`,
    /// or the plan re-computes each stage).
    pub recompute: bool,
    /// One iteration; for an asynchronous schedule, the steady-state time
    /// of one mini-batch.
    pub iteration_ms: f64,
    /// Mini-batches simulated: 1, or an asynchronous schedule's run.
    #[serde(default = "one")]
    pub mini_batches: u32,
    /// When the last task ends: `iteration_ms` for a synchronous schedule.
    /// Absent in version 1 files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span_ms: Option<f64>,
    /// One timeline a stage, or under a chunked kind one a rank, its
    /// stages (chunks) together.
    pub stages: Vec<StageTimeline>,
    pub tasks: Vec<Task>,
    /// Under a chunked kind, the rank of each stage (a task's `stage`);
    /// absent: stage s is rank s.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_ranks: Vec<u32>,
}

fn one() -> u32 {
    1
}

impl FileObject for Simulation {
    const FORMAT: FileFormat = SIMULATION;
}

impl Simulation {
    pub fn peak_memory_bytes(&self) -> f64 {
        self.stages
            .iter()
            .map(|s| s.peak_memory_bytes)
            .fold(0.0, f64::max)
    }

    /// Every stage's peak within its GPUs' memory.
    pub fn fits_memory(&self) -> bool {
        self.stages
            .iter()
            .all(|s| s.peak_memory_bytes <= s.memory_limit_bytes)
    }
}

/// What one run of the action lists leaves behind besides its end time.
#[derive(Default)]
struct Trace {
    tasks: Vec<Task>,
    /// Each rank's changes of memory.
    memory_events: Vec<Vec<MemoryEvent>>,
    /// Whether each stage holds its gradients now.
    gradients_held: Vec<bool>,
    /// Forward and backward time per rank.
    compute: Vec<f64>,
}

/// Which term of a stage's memory (`MemoryTerms`) a change belongs to.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Term {
    /// Micro-batches in flight: the count's change.
    InFlight(i32),
    /// A running backward's or optimizer step's working memory.
    Working,
    /// The gradients, part of the model state.
    Gradients,
    /// A re-computed forward's activations, weight versions.
    Other,
}

/// `bytes` more (or fewer) of `term` from time `t` on.
#[derive(Debug, Clone, Copy)]
struct MemoryEvent {
    t: f64,
    bytes: f64,
    term: Term,
}

/// Where the stages run: the rank of each, and the links between them.
/// Stages on one rank run one action at a time. A link carries one
/// transfer at a time from one rank to another: boundaries between stages
/// that go the same way between the same two ranks share it (an interleaved
/// order's chunk 0 -> 1 and chunk 2 -> 3 forwards, and a gradient coming
/// back the other way). A boundary within a rank costs nothing.
pub(crate) struct RankLayout {
    /// `rank_of[s]`: the rank that runs stage s.
    rank_of: Vec<usize>,
    ranks: usize,
    /// `forward_link[s]`: the link stage s's output crosses to stage
    /// s + 1, None within a rank; `backward_link[s]`: the one the gradient
    /// crosses back.
    forward_link: Vec<Option<usize>>,
    backward_link: Vec<Option<usize>>,
    links: usize,
}

impl RankLayout {
    /// Stage s on rank s: every schedule of the plan file.
    pub(crate) fn stage_a_rank(stages: usize) -> RankLayout {
        let boundaries = stages.saturating_sub(1);
        RankLayout {
            rank_of: (0..stages).collect(),
            ranks: stages,
            forward_link: (0..boundaries).map(Some).collect(),
            backward_link: (boundaries..2 * boundaries).map(Some).collect(),
            links: 2 * boundaries,
        }
    }

    /// Stage s on rank `stage_ranks[s]` (a pipeline order's), a link for
    /// each way between two ranks that consecutive stages take.
    pub(crate) fn of_stage_ranks(stage_ranks: &[u32]) -> RankLayout {
        let rank_of: Vec<usize> = stage_ranks.iter().map(|&r| r as usize).collect();
        let mut ways: Vec<(usize, usize)> = Vec::new();
        let mut link = |from: usize, to: usize| {
            (from != to).then(|| match ways.iter().position(|&w| w == (from, to)) {
                Some(link) => link,
                None => {
                    ways.push((from, to));
                    ways.len() - 1
                }
            })
        };
        let forward_link = rank_of.windows(2).map(|w| link(w[0], w[1])).collect();
        let backward_link = rank_of.windows(2).map(|w| link(w[1], w[0])).collect();
        RankLayout {
            ranks: rank_of.iter().max().map_or(0, |&r| r + 1),
            rank_of,
            forward_link,
            backward_link,
            links: ways.len(),
        }
    }
}

/// Each rank's list of actions, each of a stage.
#[derive(Clone, Copy)]
enum Lists<'l> {
    /// One list a stage, on its own rank (`RankLayout::stage_a_rank`).
    StageARank(&'l [&'l [Action]]),
    /// Rank r's list: (stage, action) in the order the rank runs them.
    OfRanks(&'l [Vec<(usize, Action)>]),
}

impl Lists<'_> {
    fn get(&self, rank: usize, i: usize) -> Option<(usize, Action)> {
        match self {
            Lists::StageARank(lists) => lists[rank].get(i).map(|&a| (rank, a)),
            Lists::OfRanks(lists) => lists[rank].get(i).copied(),
        }
    }

    fn len(&self, rank: usize) -> usize {
        match self {
            Lists::StageARank(lists) => lists[rank].len(),
            Lists::OfRanks(lists) => lists[rank].len(),
        }
    }
}

/// The state of one run of the action lists: when each rank, link and
/// input is free or ready, and how far each rank's list has run.
struct Replay<'a> {
    stages: &'a [SimStage],
    transfer_ms: &'a [f64],
    layout: &'a RankLayout,
    recompute: bool,
    /// When the input of (stage, micro-batch) is there, forward and backward.
    forward_ready: Vec<Vec<Option<f64>>>,
    backward_ready: Vec<Vec<Option<f64>>>,
    /// When each link is free.
    link_free: Vec<f64>,
    rank_free: Vec<f64>,
    /// Index of each rank's next action.
    next: Vec<usize>,
    last_end: f64,
}

impl<'a> Replay<'a> {
    fn new(
        stages: &'a [SimStage],
        transfer_ms: &'a [f64],
        layout: &'a RankLayout,
        micro_batches: u32,
        recompute: bool,
    ) -> Self {
        let (s_count, m) = (stages.len(), micro_batches as usize);
        let mut forward_ready = vec![vec![None; m]; s_count];
        // The first stage's inputs are all there at the start.
        forward_ready[0] = vec![Some(0.0); m];
        Replay {
            stages,
            transfer_ms,
            layout,
            recompute,
            forward_ready,
            backward_ready: vec![vec![None; m]; s_count],
            link_free: vec![0.0; layout.links],
            rank_free: vec![0.0; layout.ranks],
            next: vec![0; layout.ranks],
            last_end: 0.0,
        }
    }

    /// When `action` of stage `s` may start and how long it takes; `None`
    /// while its input has not arrived.
    fn ready(&self, s: usize, action: &Action) -> Option<(f64, f64)> {
        let st = &self.stages[s];
        let free = self.rank_free[self.layout.rank_of[s]];
        let mb = action.micro_batch.map(|x| x as usize);
        let (ready, duration) = match action.kind {
            ActionKind::Forward => (self.forward_ready[s][mb.unwrap()], st.fwd_ms),
            ActionKind::Backward => {
                // A simulation re-computing everything re-runs the forward
                // of stages whose own cost does not count it already.
                let extra = if self.recompute && !st.recomputes {
                    st.recompute_ms
                } else {
                    0.0
                };
                (self.backward_ready[s][mb.unwrap()], st.bwd_ms + extra)
            }
            ActionKind::InputGradient => {
                let extra = if self.recompute && !st.recomputes {
                    st.recompute_ms
                } else {
                    0.0
                };
                let input_ms = st.bwd_ms - st.bwd_weight_ms;
                (self.backward_ready[s][mb.unwrap()], input_ms + extra)
            }
            // After its I on the same stage, which the list puts first.
            ActionKind::WeightGradient => (Some(free), st.bwd_weight_ms),
            ActionKind::AllReduce => (Some(free), st.allreduce_ms),
            ActionKind::OptimizerStep => (Some(free), st.optimizer_ms),
        };
        ready.map(|r| (free.max(r), duration))
    }

    /// Run rank `rank`'s actions in order until one waits for its input;
    /// returns whether any ran.
    fn run_rank(&mut self, rank: usize, lists: Lists, mut trace: Option<&mut Trace>) -> bool {
        let mut progressed = false;
        while let Some((s, action)) = lists.get(rank, self.next[rank]) {
            let Some((start, duration)) = self.ready(s, &action) else {
                break;
            };
            let end = start + duration;
            self.rank_free[rank] = end;
            self.last_end = self.last_end.max(end);
            self.next[rank] += 1;
            progressed = true;
            if let Some(t) = trace.as_deref_mut() {
                let st = &self.stages[s];
                t.record_action(
                    (s, rank),
                    &action,
                    start,
                    duration,
                    st,
                    self.recompute || st.recomputes,
                );
            }
            match (action.kind, action.micro_batch) {
                (ActionKind::Forward, Some(mb)) => {
                    self.forward_done(s, mb, end, trace.as_deref_mut())
                }
                (ActionKind::Backward | ActionKind::InputGradient, Some(mb)) => {
                    self.backward_done(s, mb, end, trace.as_deref_mut())
                }
                _ => {}
            }
        }
        progressed
    }

    /// Stage `s` ended micro-batch `mb`'s forward at `end`: its output goes
    /// to the next stage, or the last stage's backward may start.
    fn forward_done(&mut self, s: usize, mb: u32, end: f64, trace: Option<&mut Trace>) {
        if s + 1 == self.stages.len() {
            // The last stage starts the backward as soon as its forward is done.
            self.backward_ready[s][mb as usize] = Some(end);
            return;
        }
        let Some(link) = self.layout.forward_link[s] else {
            self.forward_ready[s + 1][mb as usize] = Some(end); // the same rank
            return;
        };
        let send_start = end.max(self.link_free[link]);
        let arrive = send_start + self.transfer_ms[s];
        self.link_free[link] = arrive;
        self.forward_ready[s + 1][mb as usize] = Some(arrive);
        self.last_end = self.last_end.max(arrive);
        if let Some(t) = trace {
            t.record_send(s, TaskKind::SendForward, mb, send_start, arrive);
        }
    }

    /// Stage `s` ended micro-batch `mb`'s backward at `end`: its gradient
    /// goes to the stage before.
    fn backward_done(&mut self, s: usize, mb: u32, end: f64, trace: Option<&mut Trace>) {
        if s == 0 {
            return;
        }
        let Some(link) = self.layout.backward_link[s - 1] else {
            self.backward_ready[s - 1][mb as usize] = Some(end); // the same rank
            return;
        };
        let send_start = end.max(self.link_free[link]);
        let arrive = send_start + self.transfer_ms[s - 1];
        self.link_free[link] = arrive;
        self.backward_ready[s - 1][mb as usize] = Some(arrive);
        self.last_end = self.last_end.max(arrive);
        if let Some(t) = trace {
            t.record_send(s - 1, TaskKind::SendBackward, mb, send_start, arrive);
        }
    }
}

impl Trace {
    fn new(layout: &RankLayout) -> Self {
        Trace {
            tasks: Vec::new(),
            memory_events: vec![Vec::new(); layout.ranks],
            gradients_held: vec![false; layout.rank_of.len()],
            compute: vec![0.0; layout.ranks],
        }
    }

    /// Stage `s` ran `action` for `duration` from `start` on `rank`: the
    /// task, its compute time and what it keeps or frees.
    fn record_action(
        &mut self,
        (s, rank): (usize, usize),
        action: &Action,
        start: f64,
        duration: f64,
        st: &SimStage,
        recompute: bool,
    ) {
        let end = start + duration;
        let kind = match action.kind {
            ActionKind::Forward => TaskKind::Forward,
            ActionKind::Backward => TaskKind::Backward,
            ActionKind::InputGradient => TaskKind::InputGradient,
            ActionKind::WeightGradient => TaskKind::WeightGradient,
            ActionKind::AllReduce => TaskKind::AllReduce,
            ActionKind::OptimizerStep => TaskKind::OptimizerStep,
        };
        self.tasks.push(Task {
            stage: s,
            kind,
            micro_batch: action.micro_batch,
            start_ms: start,
            end_ms: end,
        });
        let kept = st.backward_and_kept_bytes(recompute).1;
        let events = &mut self.memory_events[rank];
        let mut at = |t: f64, bytes: f64, term: Term| events.push(MemoryEvent { t, bytes, term });
        // A re-computed backward's re-run activations (and the loss's
        // moment), beyond the working memory.
        let rerun_extra = st.recompute_backward_bytes - st.working_bytes;
        match action.kind {
            ActionKind::Forward => {
                self.compute[rank] += duration;
                at(start, kept, Term::InFlight(1));
            }
            ActionKind::Backward | ActionKind::InputGradient => {
                self.compute[rank] += duration;
                at(start, st.working_bytes, Term::Working);
                at(end, -st.working_bytes, Term::Working);
                if recompute {
                    // The forward is re-run: its activations live through the backward.
                    at(start, rerun_extra, Term::Other);
                    at(end, -rerun_extra, Term::Other);
                }
                match (action.kind, recompute) {
                    (ActionKind::Backward, _) => at(end, -kept, Term::InFlight(-1)),
                    // A split backward keeps the activations from its I (re-run
                    // there, where it re-computes) until its W.
                    (_, true) => {
                        at(end, -kept, Term::InFlight(-1));
                        at(end, st.rerun_bytes, Term::Other);
                    }
                    (_, false) => {}
                }
            }
            ActionKind::WeightGradient => {
                self.compute[rank] += duration;
                at(start, st.working_bytes, Term::Working);
                at(end, -st.working_bytes, Term::Working);
                if recompute {
                    at(end, -st.rerun_bytes, Term::Other);
                } else {
                    at(end, -kept, Term::InFlight(-1));
                }
            }
            ActionKind::OptimizerStep => {
                at(start, st.optimizer_step_bytes, Term::Working);
                at(end, -st.optimizer_step_bytes, Term::Working);
            }
            ActionKind::AllReduce => {}
        }
        // The gradients: made by a stage's first backward that computes
        // weight gradients (B, or a split backward's W), let go after its
        // optimizer step (the runtime sets them to None).
        match action.kind {
            ActionKind::Backward | ActionKind::WeightGradient if !self.gradients_held[s] => {
                self.gradients_held[s] = true;
                at(end, st.gradient_bytes, Term::Gradients);
            }
            ActionKind::OptimizerStep if self.gradients_held[s] => {
                self.gradients_held[s] = false;
                at(end, -st.gradient_bytes, Term::Gradients);
            }
            _ => {}
        }
    }

    /// A transfer on the link after `stage`.
    fn record_send(&mut self, stage: usize, kind: TaskKind, mb: u32, start: f64, end: f64) {
        self.tasks.push(Task {
            stage,
            kind,
            micro_batch: Some(mb),
            start_ms: start,
            end_ms: end,
        });
    }
}

/// Run every rank's action list (AR and OPT included) against the
/// pipeline's dependencies and return when the last task ends. `trace`,
/// when given, receives every task and memory change. Lists that cannot
/// finish give the rank and the action index where they stop.
fn run_lists(
    stages: &[SimStage],
    (transfer_ms, layout): (&[f64], &RankLayout),
    lists: Lists,
    micro_batches: u32,
    recompute: bool,
    mut trace: Option<&mut Trace>,
) -> std::result::Result<f64, (usize, usize)> {
    let ranks = layout.ranks;
    let mut replay = Replay::new(stages, transfer_ms, layout, micro_batches, recompute);
    if let Some(t) = trace.as_deref_mut() {
        *t = Trace::new(layout);
    }
    // Sweeps alternate direction, so that forward inputs travel down and
    // gradients up the pipeline within one sweep each. Start times do not
    // depend on the order ranks are visited in, only on how many sweeps.
    let mut downward = true;
    loop {
        let mut progressed = false;
        for i in 0..ranks {
            let r = if downward { i } else { ranks - 1 - i };
            progressed |= replay.run_rank(r, lists, trace.as_deref_mut());
        }
        downward = !downward;
        if !progressed {
            break;
        }
    }
    match (0..ranks).find(|&r| replay.next[r] < lists.len(r)) {
        Some(r) => Err((r, replay.next[r])),
        None => Ok(replay.last_end),
    }
}

/// [`run_lists`] recording every task and memory change. The schedules
/// are validated before, so lists that cannot finish are a bug: an error
/// from `stopped(rank, action index)`, not a loop or a wrong answer.
fn run_traced(
    stages: &[SimStage],
    links: (&[f64], &RankLayout),
    lists: Lists,
    micro_batches: u32,
    recompute: bool,
    stopped: impl Fn(usize, usize) -> String,
) -> Result<(f64, Trace)> {
    let mut trace = Trace::default();
    let span_ms = run_lists(
        stages,
        links,
        lists,
        micro_batches,
        recompute,
        Some(&mut trace),
    )
    .map_err(|(r, i)| Error::invalid(stopped(r, i)))?;
    Ok((span_ms, trace))
}

/// Early backward with warm-up depths `warmup` replayed from its action
/// lists without recording tasks: its iteration time, or the deadlock
/// that stops depths that are not valid. `early_backward::iteration_ms`
/// computes the same faster, for valid depths.
pub(crate) fn replay_early_backward_ms(
    stages: &[SimStage],
    transfer_ms: &[f64],
    micro_batches: u32,
    warmup: &[u32],
) -> Result<f64> {
    let lists: Vec<Vec<Action>> = warmup
        .iter()
        .map(|&k| {
            let mut l = early_backward_actions(k, micro_batches);
            l.extend([Action::ALL_REDUCE, Action::OPTIMIZER_STEP]);
            l
        })
        .collect();
    let refs: Vec<&[Action]> = lists.iter().map(Vec::as_slice).collect();
    let layout = RankLayout::stage_a_rank(stages.len());
    let lists = Lists::StageARank(&refs);
    run_lists(
        stages,
        (transfer_ms, &layout),
        lists,
        micro_batches,
        false,
        None,
    )
    .map_err(|(s, i)| {
        Error::invalid(format!(
            "deadlock: stage {s} stops at action {i} with warm-up depths {warmup:?}"
        ))
    })
}

/// `stages` as `schedule` re-runs their forwards: an asynchronous
/// schedule's backward re-runs the whole forward on its own weights (the
/// runtime's `Replayed`), not what torch's checkpoint re-runs, so a stage
/// whose plan re-computes it also pays what the checkpoint's share left out.
pub(crate) fn rerun_as_scheduled<'s>(
    stages: &'s [SimStage],
    schedule: &Schedule,
) -> std::borrow::Cow<'s, [SimStage]> {
    if !schedule.kind.is_asynchronous() {
        return std::borrow::Cow::Borrowed(stages);
    }
    let whole = stages.iter().map(|s| SimStage {
        recompute_ms: s.fwd_ms,
        bwd_ms: if s.recomputes {
            s.bwd_ms + s.fwd_ms - s.recompute_ms
        } else {
            s.bwd_ms
        },
        ..*s
    });
    std::borrow::Cow::Owned(whole.collect())
}

/// Simulate `schedule` on stages with the given costs; `transfer_ms[i]` is
/// the time to move one micro-batch between stage i and i+1, either way.
/// `recompute`: every stage re-computes, whatever its plan says.
pub fn simulate_stages(
    stages: &[SimStage],
    transfer_ms: &[f64],
    schedule: &Schedule,
    recompute: bool,
) -> Result<Simulation> {
    schedule.validate()?;
    let stages = &*rerun_as_scheduled(stages, schedule);
    let s_count = stages.len();
    if schedule.stages.len() != s_count || transfer_ms.len() + 1 != s_count {
        return Err(Error::invalid(format!(
            "the schedule has {} stages, the plan {s_count} and {} transfers",
            schedule.stages.len(),
            transfer_ms.len()
        )));
    }
    let lists: Vec<&[Action]> = schedule
        .stages
        .iter()
        .map(|s| s.actions.as_slice())
        .collect();
    let layout = RankLayout::stage_a_rank(s_count);
    let lists = Lists::StageARank(&lists);
    let micro_batches = schedule.total_micro_batches();
    let (span_ms, trace) = run_traced(
        stages,
        (transfer_ms, &layout),
        lists,
        micro_batches,
        recompute,
        |s, i| {
            format!(
                "stage {s}: the simulation stopped at action {i} ({})",
                schedule.stages[s].actions[i]
            )
        },
    )?;
    let Trace {
        tasks,
        mut memory_events,
        compute,
        ..
    } = trace;
    let iteration_ms = mini_batch_ms(schedule, &tasks, span_ms);
    let timelines = (0..s_count)
        .map(|s| {
            let events = std::mem::take(&mut memory_events[s]);
            let (memory, at_peak, peak_copies) =
                memory_over_time(&stages[s], s, schedule, &tasks, events);
            StageTimeline {
                compute_ms: compute[s],
                bubble_fraction: bubble_fraction(compute[s], span_ms),
                peak_memory_bytes: at_peak.total(),
                memory_limit_bytes: stages[s].memory_limit_bytes,
                peak_in_flight: schedule.peak_in_flight(s),
                peak_weight_copies: peak_copies,
                memory,
                memory_terms: Some(stages[s].memory_terms(&at_peak, recompute)),
            }
        })
        .collect();
    Ok(Simulation {
        format: SIMULATION.name.into(),
        schema_version: SIMULATION.version,
        schedule: schedule.kind,
        recompute: recompute || stages.iter().all(|s| s.recomputes),
        iteration_ms,
        mini_batches: schedule.mini_batches,
        span_ms: Some(span_ms),
        stages: timelines,
        tasks,
        stage_ranks: Vec::new(),
    })
}

/// A pipeline order run on its stages: the iteration, and each rank's
/// timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct OrderSimulation {
    /// From the first forward to the end of the last optimizer step.
    pub iteration_ms: f64,
    /// `ranks[r]`: what rank r computed, held and waited, its stages together.
    pub ranks: Vec<StageTimeline>,
    /// Every task; a task's `stage` is the order's stage (a chunk of its rank).
    pub tasks: Vec<Task>,
}

/// `order` run on `stages` (one a stage of the order, chunks of their
/// rank's model) with `transfer_ms[s]` between stages s and s + 1 where
/// they are on different ranks: the simulator of the plan's schedules
/// (`simulate_stages`) with several stages a rank. A rank runs one action
/// at a time, in its list's order; stages joining the same two ranks share
/// their link, one transfer each way at a time. After its last pass a
/// rank runs each of its stages' AllReduce, first the stage whose passes
/// ended first, then their optimizer steps: no AllReduce overlaps another
/// stage's backward. An overlapped forward and backward (DualPipeV's) runs
/// one after the other. Memory is each rank's, its stages' together.
pub fn simulate_order(
    stages: &[SimStage],
    transfer_ms: &[f64],
    order: &PipelineOrder,
) -> Result<OrderSimulation> {
    order.validate()?;
    if order.stages() != stages.len() || transfer_ms.len() + 1 != stages.len() {
        return Err(Error::invalid(format!(
            "the pipeline order has {} stages, the costs {} and {} transfers",
            order.stages(),
            stages.len(),
            transfer_ms.len()
        )));
    }
    let layout = RankLayout::of_stage_ranks(&order.stage_ranks);
    let lists = rank_lists(order);
    let (span_ms, trace) = run_traced(
        stages,
        (transfer_ms, &layout),
        Lists::OfRanks(&lists),
        order.micro_batches,
        false,
        |r, i| format!("rank {r}: the simulation stopped at action {i}"),
    )?;
    let Trace {
        tasks,
        mut memory_events,
        compute,
        ..
    } = trace;
    let ranks = (0..layout.ranks)
        .map(|r| {
            let on_rank: Vec<&SimStage> = (0..stages.len())
                .filter(|&s| layout.rank_of[s] == r)
                .map(|s| &stages[s])
                .collect();
            let held_throughout = HeldTerms {
                // The gradients come with each stage's first backward.
                state_bytes: on_rank
                    .iter()
                    .map(|st| st.model_state_bytes - st.gradient_bytes)
                    .sum(),
                ..HeldTerms::default()
            };
            let mut events = std::mem::take(&mut memory_events[r]);
            sort_in_time_order(&mut events);
            let most_in_flight = most_in_flight(&events);
            let (memory, at_peak) = memory_steps(held_throughout, events);
            // Stages differ in what a micro-batch keeps: the peak's mean.
            let per_micro_batch = if at_peak.in_flight > 0 {
                at_peak.in_flight_bytes / f64::from(at_peak.in_flight)
            } else {
                0.0
            };
            let allocator = on_rank
                .iter()
                .map(|st| st.allocator_reserved_factor)
                .fold(1.0, f64::max);
            StageTimeline {
                compute_ms: compute[r],
                bubble_fraction: bubble_fraction(compute[r], span_ms),
                peak_memory_bytes: at_peak.total(),
                memory_limit_bytes: on_rank
                    .iter()
                    .map(|st| st.memory_limit_bytes)
                    .fold(f64::INFINITY, f64::min),
                peak_in_flight: most_in_flight,
                peak_weight_copies: 0,
                memory,
                memory_terms: Some(at_peak.as_memory_terms(per_micro_batch, allocator)),
            }
        })
        .collect();
    Ok(OrderSimulation {
        iteration_ms: span_ms,
        ranks,
        tasks,
    })
}

/// The share of `span_ms` a rank (or stage) computed nothing.
fn bubble_fraction(compute_ms: f64, span_ms: f64) -> f64 {
    if span_ms > 0.0 {
        1.0 - compute_ms / span_ms
    } else {
        0.0
    }
}

/// The most micro-batches between a forward and their backward at once.
fn most_in_flight(events: &[MemoryEvent]) -> u32 {
    let (mut now, mut most) = (0i32, 0i32);
    for e in events {
        if let Term::InFlight(change) = e.term {
            now += change;
            most = most.max(now);
        }
    }
    most.max(0) as u32
}

/// Stage `s`'s memory over time from its recorded changes and the weight
/// copies its schedule makes: (time, bytes) steps, what it held by term at
/// its peak, and the most weight copies at once.
fn memory_over_time(
    st: &SimStage,
    s: usize,
    schedule: &Schedule,
    tasks: &[Task],
    mut events: Vec<MemoryEvent>,
) -> (Vec<(f64, f64)>, HeldTerms, u32) {
    let mut copy_events = weight_copy_events(schedule, s, tasks);
    copy_events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut peak_copies, mut now_copies) = (0u32, 0i64);
    let mut copies: Vec<MemoryEvent> = copy_events
        .iter()
        .map(|&(t, d)| {
            now_copies += d;
            peak_copies = peak_copies.max(now_copies as u32);
            MemoryEvent {
                t,
                bytes: d as f64 * st.weight_bytes,
                term: Term::Other,
            }
        })
        .collect();
    sort_in_time_order(&mut events);
    sort_in_time_order(&mut copies);
    let events = merge_in_time_order(events, copies);
    let held_throughout = HeldTerms {
        // The gradients come with the first backward.
        state_bytes: st.model_state_bytes - st.gradient_bytes,
        // XPipe's own moments, held all the time.
        other_bytes: if schedule.kind.predictor() == Some(Predictor::Adam) {
            st.own_adam_moments_bytes
        } else {
            0.0
        },
        ..HeldTerms::default()
    };
    let (memory, at_peak) = memory_steps(held_throughout, events);
    (memory, at_peak, peak_copies)
}

/// (time, bytes) after each of `events` (in time order) from what is held
/// at the start, and what was held by term at the peak.
fn memory_steps(start: HeldTerms, events: Vec<MemoryEvent>) -> (Vec<(f64, f64)>, HeldTerms) {
    let (mut now, mut at_peak) = (start, start);
    let mut bytes = now.total();
    let mut memory = Vec::with_capacity(events.len() + 1);
    memory.push((0.0, bytes));
    for event in events {
        bytes += event.bytes;
        now.add(event);
        if now.total() > at_peak.total() {
            at_peak = now;
        }
        memory.push((event.t, bytes));
    }
    (memory, at_peak)
}

/// Memory events by time, and at one instant frees first (memory freed
/// then can be reused then); a stable sort. A stage runs one action at a
/// time and records its events as it goes, so they come in time order
/// already, and only each instant's few need sorting: a full sort of a
/// long run's millions of events was a fifth of a large `compare`.
fn sort_in_time_order(events: &mut [MemoryEvent]) {
    if !events.windows(2).all(|w| w[0].t.total_cmp(&w[1].t).is_le()) {
        events.sort_by(in_time_order);
        return;
    }
    for instant in events.chunk_by_mut(|a, b| a.t.total_cmp(&b.t).is_eq()) {
        instant.sort_by(in_time_order);
    }
}

fn in_time_order(a: &MemoryEvent, b: &MemoryEvent) -> std::cmp::Ordering {
    a.t.total_cmp(&b.t).then(a.bytes.total_cmp(&b.bytes))
}

/// Two lists each in time order as one, `first`'s before `then`'s where
/// they tie: what a stable sort of the two one after the other gives.
fn merge_in_time_order(first: Vec<MemoryEvent>, then: Vec<MemoryEvent>) -> Vec<MemoryEvent> {
    if then.is_empty() {
        return first;
    }
    let mut merged = Vec::with_capacity(first.len() + then.len());
    let (mut a, mut b) = (first.into_iter().peekable(), then.into_iter().peekable());
    while let (Some(x), Some(y)) = (a.peek(), b.peek()) {
        let next = if in_time_order(y, x).is_lt() {
            b.next()
        } else {
            a.next()
        };
        merged.extend(next);
    }
    merged.extend(a.chain(b));
    merged
}

/// The time of one mini-batch: the whole span for one, otherwise the mean
/// gap between the first stage's updates inside the steady-state window
/// (`schedule::steady_state_window`), or over the whole run where it is
/// too short to have one.
fn mini_batch_ms(schedule: &Schedule, tasks: &[Task], span_ms: f64) -> f64 {
    let n = schedule.mini_batches;
    if n <= 1 {
        return span_ms;
    }
    let updates: Vec<f64> = tasks
        .iter()
        .filter(|t| t.stage == 0 && t.kind == TaskKind::OptimizerStep)
        .map(|t| t.end_ms)
        .collect();
    let (first, last) = steady_state_window(schedule.stages.len(), schedule.micro_batches, n);
    if last > first {
        (updates[last as usize] - updates[first as usize]) / f64::from(last - first)
    } else {
        span_ms / f64::from(n)
    }
}

/// (time, +1 / -1) whenever stage `stage` starts or stops holding a copy of
/// its weights besides the live ones, under the schedule's weight rule:
/// a stashed version from the update that moves the live weights past it
/// to the end of the last backward that uses it; a predicted version from
/// the start of the mini-batch's bellwether pass to the end of its last
/// pass in that direction (none when nothing is predicted ahead).
fn weight_copy_events(schedule: &Schedule, stage: usize, tasks: &[Task]) -> Vec<(f64, i64)> {
    let rule = schedule.kind.weight_rule();
    if rule == WeightRule::Live {
        return Vec::new();
    }
    let total = schedule.total_micro_batches() as usize;
    let (mut start, mut end) = (vec![[0.0f64; 2]; total], vec![[0.0f64; 2]; total]);
    let mut update_end = Vec::with_capacity(schedule.mini_batches as usize);
    for t in tasks.iter().filter(|t| t.stage == stage) {
        match (t.kind, t.micro_batch) {
            (TaskKind::Forward, Some(m)) => {
                (start[m as usize][0], end[m as usize][0]) = (t.start_ms, t.end_ms)
            }
            (TaskKind::Backward, Some(m)) => {
                (start[m as usize][1], end[m as usize][1]) = (t.start_ms, t.end_ms)
            }
            (TaskKind::OptimizerStep, _) => update_end.push(t.end_ms),
            _ => {}
        }
    }
    let mut events = Vec::new();
    let passes = schedule.pass_weights(stage);
    match rule {
        WeightRule::Stashed => {
            // Version v is copied when update v + 1 moves the live weights on,
            // if a backward still needs it then.
            let mut last_use = vec![f64::NEG_INFINITY; schedule.mini_batches as usize];
            for p in passes
                .iter()
                .filter(|p| p.action.kind == ActionKind::Backward)
            {
                let t = p.action.micro_batch.unwrap_or(0) as usize;
                let v = p.base_version as usize;
                last_use[v] = last_use[v].max(end[t][1]);
            }
            for (v, &used_until) in last_use.iter().enumerate() {
                if let Some(&moved) = update_end.get(v) {
                    if used_until > moved {
                        events.extend([(moved, 1), (used_until, -1)]);
                    }
                }
            }
        }
        WeightRule::Predicted => {
            // One cache per (mini-batch, direction) predicted ahead.
            let mut span: std::collections::BTreeMap<(u32, usize), (f64, f64)> = Default::default();
            for p in passes.iter().filter(|p| p.predicted_updates > 0) {
                let t = p.action.micro_batch.unwrap_or(0) as usize;
                let dir = usize::from(p.action.kind == ActionKind::Backward);
                let e = span
                    .entry((p.mini_batch, dir))
                    .or_insert((start[t][dir], end[t][dir]));
                e.0 = e.0.min(start[t][dir]);
                e.1 = e.1.max(end[t][dir]);
            }
            for (from, to) in span.into_values() {
                events.extend([(from, 1), (to, -1)]);
            }
        }
        WeightRule::Live => {}
    }
    events
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulationOptions {
    /// None: the plan's own schedule.
    pub schedule: Option<ScheduleKind>,
    /// Every stage re-computes, whatever the plan says of each.
    pub recompute: bool,
    /// Hide the gradient reductions the plan's runtime hides
    /// (`schedule.overlap`), as the estimate does; false: none (data
    /// parallelism without overlap).
    pub overlap_allreduce: bool,
}

impl Default for SimulationOptions {
    fn default() -> Self {
        SimulationOptions {
            schedule: None,
            recompute: false,
            overlap_allreduce: true,
        }
    }
}

/// One GPU's optimizer step in stage `s`: offloaded, the host's (its
/// cost's `offloaded_step_ms`); else over the weights it holds (a shard's
/// under split), its share of them when sharded, at the stage's slowest
/// GPU's relative speed.
fn optimizer_ms(
    coster: &StageCoster,
    s: &crate::plan::Stage,
    alloc: &Alloc,
    (cost, memory): (&StageCost, Option<&crate::cost::shape::StageMemory>),
) -> f64 {
    let layers = coster.layers;
    let shape = &s.shape;
    if !shape.offload.is_none() {
        return cost.offloaded_step_ms;
    }
    let weights = memory.map_or_else(
        || layers.param_bytes(s.layer_start, s.layer_end),
        |m| m.weight_bytes,
    );
    let sharers = if shape.shards_optimizer() {
        shape.weight_replicas(s.devices.len() as u32).max(1)
    } else {
        1
    };
    let speed = alloc
        .iter()
        .map(|&(m, _)| coster.cluster.machines[m].speed)
        .fold(f64::INFINITY, f64::min);
    layers.optimizer_step_ms(weights) / f64::from(sharers) / speed
}

/// The simulator's view of a checked plan's stages, from their costs.
pub(crate) fn sim_stages(
    coster: &StageCoster,
    plan: &Plan,
    costs: &[StageCost],
    allocs: &[Alloc],
) -> Vec<SimStage> {
    let layers = coster.layers;
    plan.stages
        .iter()
        .zip(costs)
        .zip(allocs)
        .map(|((s, c), alloc)| {
            let (start, end) = (s.layer_start, s.layer_end);
            let shape = &s.shape;
            let memory = (!shape.is_plain()).then(|| {
                coster.stage_memory(
                    start,
                    end,
                    &StageDevices::new(coster.cluster, alloc.clone()),
                    shape,
                )
            });
            let slice = f64::from(c.slice_size);
            let times = coster.any_times(0, c.slice_size);
            let recomputes = !shape.recompute.is_none();
            // What the stage's backward re-runs (for `--recompute` on a
            // stage that keeps everything: the whole forward, as torch's
            // checkpoint runs it).
            let recompute_ms = c.fwd_ms
                * if recomputes {
                    shape.recompute
                } else {
                    Recompute::Full
                }
                .rerun_ratio(layers, &times, (start, end), c.slice_size);
            // The weight gradient's share of the backward without its re-run.
            let plain_bwd_ms = c.bwd_ms - if recomputes { recompute_ms } else { 0.0 };
            SimStage {
                fwd_ms: c.fwd_ms,
                bwd_ms: c.bwd_ms,
                bwd_weight_ms: plain_bwd_ms
                    * layers.weight_gradient_ratio(&times, start, end, c.slice_size),
                allreduce_ms: c.exposed_allreduce_ms,
                optimizer_ms: optimizer_ms(coster, s, alloc, (c, memory.as_ref())),
                model_state_bytes: memory.map_or_else(
                    || layers.model_state_bytes(start, end),
                    |m| m.model_state_bytes,
                ),
                weight_bytes: memory
                    .map_or_else(|| layers.param_bytes(start, end), |m| m.weight_bytes),
                own_adam_moments_bytes: if layers.keeps_adam_moments {
                    0.0
                } else {
                    2.0 * layers.param_bytes(start, end)
                },
                stored_bytes: memory.map_or_else(
                    || layers.in_flight_bytes(start, end, c.slice_size),
                    |m| m.stored_bytes,
                ),
                working_bytes: memory.map_or_else(
                    || layers.backward_working_bytes(start, end, c.slice_size),
                    |m| m.working_bytes,
                ),
                rerun_bytes: memory.map_or_else(
                    || layers.rerun_bytes(start, end, c.slice_size),
                    |m| m.rerun_bytes,
                ),
                recompute_backward_bytes: memory.map_or_else(
                    || layers.recompute_backward_bytes(start, end, c.slice_size),
                    |m| m.recompute_backward_bytes,
                ),
                gradient_bytes: memory
                    .map_or_else(|| layers.gradient_bytes(start, end), |m| m.gradient_bytes),
                optimizer_step_bytes: memory.map_or_else(
                    || layers.optimizer_step_bytes(layers.param_bytes(start, end)),
                    |m| m.optimizer_step_bytes,
                ),
                allocator_reserved_factor: layers.allocator_reserved_factor,
                input_bytes: memory.map_or_else(
                    || slice * layers.recompute_kept_bytes_per_sample(start, end),
                    |m| m.input_bytes,
                ),
                recompute_ms,
                memory_limit_bytes: c.memory_limit_bytes,
                recomputes,
            }
        })
        .collect()
}

/// Check `plan` against `profile` and cost it for the simulator: its stages
/// and the transfer between each pair, each stage's gradient reduction
/// hidden as far as its runtime hides it (`schedule.overlap`).
pub(crate) fn sim_inputs(plan: &Plan, costs: &ProfileCosts) -> Result<(Vec<SimStage>, Vec<f64>)> {
    with_coster(plan, costs, |coster, allocs, _| {
        let (costs, transfers) = stage_costs(coster, plan, allocs, plan.stages.len() == 1);
        (sim_stages(coster, plan, &costs, allocs), transfers)
    })
}

/// `plan`, or where `opts` hides no gradient reduction, the plan as a
/// runtime that hides none runs it.
fn as_simulated<'p>(plan: &'p Plan, opts: &SimulationOptions) -> Cow<'p, Plan> {
    if opts.overlap_allreduce {
        return Cow::Borrowed(plan);
    }
    let mut hiding_none = plan.clone();
    hiding_none.schedule.overlap.grad_reduce = GradReduceOverlap::None;
    Cow::Owned(hiding_none)
}

/// Simulate a plan with the same stage costs the estimate uses.
pub fn simulate(plan: &Plan, profile: &Profile, opts: SimulationOptions) -> Result<Simulation> {
    let plan = as_simulated(plan, &opts);
    let plan = plan.as_ref();
    if plan.schedule.kind.is_chunked() {
        return simulate_chunked_plan(plan, &ProfileCosts::new(profile), opts);
    }
    let (stages, transfers) = sim_inputs(plan, &ProfileCosts::new(profile))?;
    let schedule = plan_schedule(plan, opts.schedule)?;
    let recompute = opts.recompute || plan.recomputes_every_stage();
    simulate_stages(&stages, &transfers, &schedule, recompute)
}

/// A chunked plan's ranks running its order, each stage costed on its
/// rank's devices.
pub(crate) fn simulate_chunked(plan: &Plan, costs: &ProfileCosts) -> Result<OrderSimulation> {
    let (stages, transfers) = sim_inputs(plan, costs)?;
    simulate_order(&stages, &transfers, &plan.chunked_order()?)
}

/// [`simulate`] of a plan of a chunked kind: its ranks run its order
/// (`simulate_order`), one timeline a rank.
fn simulate_chunked_plan(
    plan: &Plan,
    costs: &ProfileCosts,
    opts: SimulationOptions,
) -> Result<Simulation> {
    let own = plan.schedule.kind;
    if opts.schedule.is_some_and(|k| k != own) || opts.recompute {
        return Err(Error::incompatible(format!(
            "the plan's ranks hold several stages each ({own}): it runs its own order, each \
             stage re-computing as the plan says"
        )));
    }
    let sim = simulate_chunked(plan, costs)?;
    Ok(Simulation {
        format: SIMULATION.name.into(),
        schema_version: SIMULATION.version,
        schedule: own,
        recompute: plan.stages.iter().all(|s| !s.shape.recompute.is_none()),
        iteration_ms: sim.iteration_ms,
        mini_batches: 1,
        span_ms: Some(sim.iteration_ms),
        stages: sim.ranks,
        tasks: sim.tasks,
        stage_ranks: plan.stage_ranks(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::WarmupPolicy;
    use crate::schedule::pipeline_order::StageCosts;

    #[test]
    fn memory_events_come_out_as_a_stable_sort_of_both_lists_would_give() {
        // Events in time order with ties (as a stage records them), or out
        // of order; both lists through the shortcut against one stable sort
        // of the two, one after the other: the same events, in the same order.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let events = |n: usize, ordered: bool, rng: &mut rand::rngs::StdRng| {
            let mut t = 0.0;
            (0..n)
                .map(|i| {
                    t = if ordered {
                        t + f64::from(rng.gen_range(0..2u8))
                    } else {
                        rng.gen_range(0..6) as f64
                    };
                    let bytes = [-0.0, 0.0, 1.0, -1.0, 2.0][rng.gen_range(0..5)];
                    MemoryEvent {
                        t,
                        bytes,
                        term: Term::InFlight(i as i32),
                    }
                })
                .collect::<Vec<_>>()
        };
        for case in 0..500 {
            let mut stage = events(rng.gen_range(0..40), case % 3 != 0, &mut rng);
            let mut copies = events(rng.gen_range(0..8), true, &mut rng);
            let mut expected: Vec<MemoryEvent> = stage.iter().chain(&copies).copied().collect();
            expected.sort_by(in_time_order);
            sort_in_time_order(&mut stage);
            sort_in_time_order(&mut copies);
            let got = merge_in_time_order(stage, copies);
            let key = |e: &MemoryEvent| (e.t.to_bits(), e.bytes.to_bits(), e.term);
            assert_eq!(
                got.iter().map(key).collect::<Vec<_>>(),
                expected.iter().map(key).collect::<Vec<_>>(),
                "case {case}"
            );
        }
    }

    fn equal_stages(n: usize, f: f64, b: f64) -> Vec<SimStage> {
        vec![
            SimStage {
                fwd_ms: f,
                recompute_ms: f,
                bwd_ms: b,
                bwd_weight_ms: b / 2.0,
                allreduce_ms: 0.0,
                optimizer_ms: 0.0,
                model_state_bytes: 100.0,
                weight_bytes: 40.0,
                own_adam_moments_bytes: 0.0,
                stored_bytes: 10.0,
                input_bytes: 1.0,
                working_bytes: 0.0,
                rerun_bytes: 10.0,
                recompute_backward_bytes: 10.0,
                gradient_bytes: 0.0,
                optimizer_step_bytes: 0.0,
                allocator_reserved_factor: 1.0,
                memory_limit_bytes: 1e9,
                recomputes: false,
            };
            n
        ]
    }

    /// The orders with several stages a rank, as torch generates them.
    fn orders(p: u32, m: u32) -> Vec<(String, PipelineOrder)> {
        let mut out = Vec::new();
        for v in 1..=3 {
            let i = PipelineOrder::interleaved_1f1b(p, m, v);
            let z = PipelineOrder::interleaved_zero_bubble(p, m, v);
            out.extend(
                i.ok()
                    .map(|o| (format!("interleaved 1F1B p={p} m={m} v={v}"), o)),
            );
            out.extend(
                z.ok()
                    .map(|o| (format!("interleaved zero bubble p={p} m={m} v={v}"), o)),
            );
        }
        out.extend(
            PipelineOrder::zbv(p, m)
                .ok()
                .map(|o| (format!("ZB-V p={p} m={m}"), o)),
        );
        out.extend(
            PipelineOrder::dualpipev(p, m)
                .ok()
                .map(|o| (format!("DualPipeV p={p} m={m}"), o)),
        );
        out
    }

    #[test]
    fn one_chunk_a_rank_simulates_as_the_plans_schedules_do() {
        // With one chunk a rank, torch's 1F1B is early backward at policy
        // B and its zero bubble order is ZB-H1: the same iteration, busy
        // time and memory peak through either door, links and AllReduce
        // included.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut compared = 0;
        for _ in 0..40 {
            let (p, m) = (rng.gen_range(2..=5usize), rng.gen_range(1..=12u32));
            let stages: Vec<SimStage> = (0..p)
                .map(|_| {
                    let f = rng.gen_range(0.5..2.0);
                    SimStage {
                        allreduce_ms: rng.gen_range(0.0..1.0),
                        optimizer_ms: rng.gen_range(0.0..0.5),
                        stored_bytes: rng.gen_range(1.0..5.0),
                        working_bytes: rng.gen_range(0.0..2.0),
                        ..equal_stages(1, f, f * rng.gen_range(1.5..2.5))[0]
                    }
                })
                .collect();
            let links: Vec<f64> = (1..p).map(|_| rng.gen_range(0.0..1.0)).collect();
            let pairs = [
                (
                    PipelineOrder::interleaved_1f1b(p as u32, m, 1),
                    Schedule::early_backward_with_policy(p, m, WarmupPolicy::B),
                ),
                (
                    PipelineOrder::interleaved_zero_bubble(p as u32, m, 1),
                    Schedule::zero_bubble_h1(p, m),
                ),
            ];
            for (order, schedule) in pairs {
                let (Ok(order), Ok(schedule)) = (order, schedule) else {
                    continue; // a micro-batch count torch's rounds do not split
                };
                let a = simulate_order(&stages, &links, &order).unwrap();
                let b = simulate_stages(&stages, &links, &schedule, false).unwrap();
                assert_eq!(a.iteration_ms, b.iteration_ms, "{schedule}");
                let peaks = |t: &[StageTimeline]| {
                    t.iter()
                        .map(|x| (x.compute_ms, x.peak_memory_bytes))
                        .collect::<Vec<_>>()
                };
                assert_eq!(peaks(&a.ranks), peaks(&b.stages), "{schedule}");
                compared += 1;
            }
        }
        assert!(compared >= 60, "{compared}");
    }

    #[test]
    fn an_order_simulates_as_its_own_dry_run_where_links_are_free() {
        // Unequal stages, no state, no working memory, nothing sent: the
        // simulator's time and activation peak are the dry run's, to the bit.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut checked = 0;
        for (p, m) in [(2, 4), (3, 6), (4, 8), (4, 12), (2, 9)] {
            for (name, order) in orders(p, m) {
                let stages: Vec<SimStage> = (0..order.stages())
                    .map(|_| {
                        let f = rng.gen_range(0.5..2.0);
                        let b = f * rng.gen_range(1.5..2.5);
                        SimStage {
                            bwd_weight_ms: b * rng.gen_range(0.3..0.6),
                            stored_bytes: rng.gen_range(1.0..5.0),
                            model_state_bytes: 0.0,
                            ..equal_stages(1, f, b)[0]
                        }
                    })
                    .collect();
                let costs: Vec<StageCosts> = stages
                    .iter()
                    .map(|st| StageCosts {
                        forward_ms: st.fwd_ms,
                        backward_ms: st.bwd_ms,
                        backward_input_ms: st.bwd_ms - st.bwd_weight_ms,
                        backward_weight_ms: st.bwd_weight_ms,
                        send_ms: 0.0,
                        activation_bytes: st.stored_bytes,
                    })
                    .collect();
                let zero = vec![0.0; stages.len() - 1];
                let sim = simulate_order(&stages, &zero, &order).unwrap();
                let dry = order.run(&costs).unwrap();
                assert_eq!(sim.iteration_ms, dry.iteration_ms, "{name}");
                let busy: Vec<f64> = sim.ranks.iter().map(|r| r.compute_ms).collect();
                assert_eq!(busy, dry.busy_ms, "{name}");
                let peaks: Vec<f64> = sim.ranks.iter().map(|r| r.peak_memory_bytes).collect();
                assert_eq!(peaks, dry.peak_activation_bytes, "{name}");
                checked += 1;
            }
        }
        assert!(checked >= 30, "{checked}");
    }

    #[test]
    fn interleaving_cuts_the_wait_to_its_closed_form() {
        // A rank's share of a micro-batch takes F = 1 and B = 2, cut into v
        // equal chunks; free links: 1F1B's (m + p - 1)(F + B) becomes
        // (m + (p - 1) / v)(F + B), the bubble (p - 1) / (v m) of the work.
        for (p, m) in [(2u32, 4u32), (4, 8), (4, 16)] {
            for v in [1u32, 2, 4] {
                let order = PipelineOrder::interleaved_1f1b(p, m, v).unwrap();
                let chunk = 1.0 / f64::from(v);
                let stages = equal_stages((p * v) as usize, chunk, 2.0 * chunk);
                let zero = vec![0.0; stages.len() - 1];
                let sim = simulate_order(&stages, &zero, &order).unwrap();
                let expected = (f64::from(m) + f64::from(p - 1) / f64::from(v)) * 3.0;
                assert!(
                    (sim.iteration_ms - expected).abs() < 1e-9,
                    "p={p} m={m} v={v}: {}",
                    sim.iteration_ms
                );
            }
        }
    }

    #[test]
    fn stages_going_the_same_way_between_two_ranks_share_a_link() {
        // Two ranks, two chunks each: chunk 0 -> 1 and 2 -> 3 go from rank
        // 0 to rank 1, chunk 1 -> 2 the other way, with the gradients of
        // 0 <- 1 and 2 <- 3.
        let looped = RankLayout::of_stage_ranks(&[0, 1, 0, 1]);
        assert_eq!(looped.forward_link, vec![Some(0), Some(1), Some(0)]);
        assert_eq!(looped.backward_link, vec![Some(1), Some(0), Some(1)]);
        assert_eq!((looped.ranks, looped.links), (2, 2));
        // A V: the turn at the last rank stays on it.
        let v = RankLayout::of_stage_ranks(&[0, 1, 1, 0]);
        assert_eq!(v.forward_link, vec![Some(0), None, Some(1)]);
        // A slow link: sharing it can only delay the dry run, which does
        // not share.
        let order = PipelineOrder::interleaved_1f1b(2, 4, 2).unwrap();
        let stages = equal_stages(4, 1.0, 2.0);
        let sim = simulate_order(&stages, &[1.5; 3], &order).unwrap();
        let cost = StageCosts {
            send_ms: 1.5,
            ..StageCosts::equal_passes(1.0, 2.0)
        };
        let dry = order.run(&[cost; 4]).unwrap();
        assert!(
            sim.iteration_ms >= dry.iteration_ms,
            "{} {}",
            sim.iteration_ms,
            dry.iteration_ms
        );
    }

    #[test]
    fn each_chunk_reduces_and_steps_after_the_ranks_last_pass() {
        // The AllReduce and optimizer step of both chunks of a rank run
        // after its passes, the chunk that finished first first.
        let order = PipelineOrder::interleaved_1f1b(2, 4, 2).unwrap();
        let stages: Vec<SimStage> = equal_stages(4, 1.0, 2.0)
            .into_iter()
            .map(|st| SimStage {
                allreduce_ms: 0.5,
                optimizer_ms: 0.25,
                ..st
            })
            .collect();
        let sim = simulate_order(&stages, &[0.0; 3], &order).unwrap();
        let free = simulate_order(&equal_stages(4, 1.0, 2.0), &[0.0; 3], &order).unwrap();
        // The last rank to finish adds its two chunks' 0.75 each.
        assert_eq!(sim.iteration_ms, free.iteration_ms + 1.5);
        let on_rank_0: Vec<(usize, TaskKind)> = sim
            .tasks
            .iter()
            .filter(|t| {
                matches!(t.kind, TaskKind::AllReduce | TaskKind::OptimizerStep) && t.stage % 2 == 0
            })
            .map(|t| (t.stage, t.kind))
            .collect();
        use TaskKind::{AllReduce as Ar, OptimizerStep as Opt};
        assert_eq!(on_rank_0, vec![(2, Ar), (0, Ar), (2, Opt), (0, Opt)]);
    }

    #[test]
    fn straight_pipeline_matches_the_closed_form() {
        // S equal stages, free links: (M + S - 1)(t_f + t_b), for both schedules.
        for s in 1..=5 {
            for m in 1..=9u32 {
                let stages = equal_stages(s, 1.0, 2.0);
                let zero = vec![0.0; s - 1];
                let eb = Schedule::early_backward_with_policy(s, m, WarmupPolicy::A).unwrap();
                let gp = Schedule::gpipe(s, m).unwrap();
                let expected = (f64::from(m) + s as f64 - 1.0) * 3.0;
                let a = simulate_stages(&stages, &zero, &eb, false).unwrap();
                let b = simulate_stages(&stages, &zero, &gp, false).unwrap();
                assert_eq!(a.iteration_ms, expected, "1F1B S={s} M={m}");
                assert_eq!(b.iteration_ms, expected, "GPipe S={s} M={m}");
            }
        }
    }

    #[test]
    fn early_backward_keeps_activation_memory_flat_and_gpipe_grows_with_m() {
        // Table VI's trend: 1F1B holds K_i micro-batches, GPipe all M.
        let s = 2;
        let stages = equal_stages(s, 1.0, 2.0);
        for m in [2u32, 4, 8, 16] {
            let eb = simulate_stages(
                &stages,
                &[0.0],
                &Schedule::early_backward_with_policy(s, m, WarmupPolicy::A).unwrap(),
                false,
            )
            .unwrap();
            let gp =
                simulate_stages(&stages, &[0.0], &Schedule::gpipe(s, m).unwrap(), false).unwrap();
            assert_eq!(eb.stages[0].peak_memory_bytes, 100.0 + 2.0 * 10.0);
            assert_eq!(gp.stages[0].peak_memory_bytes, 100.0 + f64::from(m) * 10.0);
            assert_eq!(eb.stages[0].peak_in_flight, 2);
            assert_eq!(gp.stages[0].peak_in_flight, m);
        }
    }

    #[test]
    fn gradients_live_from_the_first_backward_to_the_optimizer_step() {
        // One stage: 100 bytes of model state, 30 of them gradients;
        // micro-batches keep 10 bytes, a backward needs 7 more.
        let mut stages = equal_stages(1, 1.0, 2.0);
        stages[0].working_bytes = 7.0;
        stages[0].gradient_bytes = 30.0;
        let peak = |stages: &[SimStage], schedule: &Schedule| {
            let sim = simulate_stages(stages, &[], schedule, false).unwrap();
            (
                sim.stages[0].peak_memory_bytes,
                sim.stages[0].memory_terms.unwrap(),
            )
        };
        // GPipe, 2 micro-batches: the first backward starts with both in
        // flight and no gradients (70 + 20 + 7 = 97); the second with one
        // and all of them (100 + 10 + 7 = 117).
        let gpipe = Schedule::gpipe(1, 2).unwrap();
        let (bytes, terms) = peak(&stages, &gpipe);
        assert_eq!(bytes, 117.0);
        assert_eq!(
            (
                terms.model_state_bytes,
                terms.micro_batches_in_flight,
                terms.working_bytes
            ),
            (100.0, 1, 7.0)
        );
        // With 5 bytes of gradients the first is the larger: 95 + 20 + 7.
        stages[0].gradient_bytes = 5.0;
        let (bytes, terms) = peak(&stages, &gpipe);
        assert_eq!(bytes, 122.0);
        assert_eq!(
            (
                terms.model_state_bytes,
                terms.micro_batches_in_flight,
                terms.other_bytes
            ),
            (95.0, 2, 0.0)
        );
        // One micro-batch: its backward never sees the gradients.
        let (bytes, _) = peak(&stages, &Schedule::gpipe(1, 1).unwrap());
        assert_eq!(bytes, 95.0 + 10.0 + 7.0);
        // The optimizer's step (1 ms) needs 50 over the whole model state:
        // its moment is the peak, in the working term.
        stages[0].optimizer_step_bytes = 50.0;
        stages[0].optimizer_ms = 1.0;
        let (bytes, terms) = peak(&stages, &gpipe);
        assert_eq!(bytes, 150.0);
        assert_eq!(
            (
                terms.model_state_bytes,
                terms.micro_batches_in_flight,
                terms.working_bytes
            ),
            (100.0, 0, 50.0)
        );
        // After the step the gradients are gone, and so is everything else.
        let sim = simulate_stages(&stages, &[], &gpipe, false).unwrap();
        assert_eq!(sim.stages[0].memory.last().unwrap().1, 95.0);
    }

    #[test]
    fn a_running_backward_needs_its_working_memory_on_top() {
        // Early backward on 2 stages holds 2 micro-batches (10 bytes each)
        // on stage 0; each backward needs 7 bytes more while it runs,
        // after which its micro-batch's 10 go.
        let mut stages = equal_stages(2, 1.0, 2.0);
        for s in &mut stages {
            s.working_bytes = 7.0;
            // No loss: the re-run's 10 with the backward's 7 on them.
            s.recompute_backward_bytes = 17.0;
        }
        let eb = Schedule::early_backward_with_policy(2, 4, WarmupPolicy::A).unwrap();
        let sim = simulate_stages(&stages, &[0.0], &eb, false).unwrap();
        assert_eq!(sim.stages[0].peak_memory_bytes, 100.0 + 2.0 * 10.0 + 7.0);
        assert_eq!(
            sim.stages[0].memory_terms,
            Some(MemoryTerms {
                model_state_bytes: 100.0,
                per_micro_batch_bytes: 10.0,
                micro_batches_in_flight: 2,
                working_bytes: 7.0,
                other_bytes: 0.0,
                peak_bytes: 127.0,
                allocator_reserved_factor: 1.0,
            })
        );
        // Re-computing: the inputs of 4 micro-batches (1 byte each, GPipe),
        // one re-run forward's 10 and the backward's 7.
        let gp = Schedule::gpipe(2, 4).unwrap();
        let rc = simulate_stages(&stages, &[0.0], &gp, true).unwrap();
        assert_eq!(rc.stages[0].peak_memory_bytes, 100.0 + 4.0 + 10.0 + 7.0);
        // In terms: 4 inputs in flight, the re-run forward's 10 as other.
        let terms = rc.stages[0].memory_terms.unwrap();
        assert_eq!(
            (terms.per_micro_batch_bytes, terms.micro_batches_in_flight),
            (1.0, 4)
        );
        assert_eq!((terms.other_bytes, terms.peak_bytes), (10.0, 121.0));
        // After the iteration nothing is left of either.
        let last = |s: &StageTimeline| s.memory.last().unwrap().1;
        assert_eq!((last(&sim.stages[0]), last(&rc.stages[0])), (100.0, 100.0));
    }

    #[test]
    fn a_recomputed_backward_reruns_what_the_checkpoint_reruns() {
        // One stage, one micro-batch: forward 1, backward 2, and under
        // --recompute the backward re-runs 0.25 of the forward (torch's
        // checkpoint left the last layer's tail).
        let mut stages = equal_stages(1, 1.0, 2.0);
        stages[0].recompute_ms = 0.25;
        let gp = Schedule::gpipe(1, 1).unwrap();
        let sim = simulate_stages(&stages, &[], &gp, true).unwrap();
        assert_eq!(sim.iteration_ms, 1.0 + 2.0 + 0.25);
        assert_eq!(
            simulate_stages(&stages, &[], &gp, false)
                .unwrap()
                .iteration_ms,
            3.0
        );
    }

    #[test]
    fn recompute_trades_time_for_memory() {
        let stages = equal_stages(2, 1.0, 2.0);
        let sched = Schedule::gpipe(2, 8).unwrap();
        let plain = simulate_stages(&stages, &[0.0], &sched, false).unwrap();
        let rc = simulate_stages(&stages, &[0.0], &sched, true).unwrap();
        assert!(rc.iteration_ms > plain.iteration_ms);
        // 8 inputs of 1 byte kept, plus one re-computed micro-batch at a time.
        assert_eq!(rc.stages[0].peak_memory_bytes, 100.0 + 8.0 + 10.0);
        assert!(rc.peak_memory_bytes() < plain.peak_memory_bytes());
    }

    #[test]
    fn slow_links_and_allreduce_lengthen_the_iteration() {
        let mut stages = equal_stages(2, 1.0, 2.0);
        let base =
            simulate_stages(&stages, &[0.0], &Schedule::gpipe(2, 4).unwrap(), false).unwrap();
        let linked =
            simulate_stages(&stages, &[0.5], &Schedule::gpipe(2, 4).unwrap(), false).unwrap();
        // The first forward and the last backward each wait for one transfer.
        assert_eq!(linked.iteration_ms, base.iteration_ms + 1.0);
        stages[0].allreduce_ms = 7.0;
        let reduced =
            simulate_stages(&stages, &[0.0], &Schedule::gpipe(2, 4).unwrap(), false).unwrap();
        assert_eq!(reduced.iteration_ms, base.iteration_ms + 7.0);
        let ar = reduced
            .tasks
            .iter()
            .find(|t| t.kind == TaskKind::AllReduce && t.stage == 0)
            .unwrap();
        let last_b = reduced
            .tasks
            .iter()
            .filter(|t| t.kind == TaskKind::Backward && t.stage == 0)
            .map(|t| t.end_ms)
            .fold(0.0, f64::max);
        assert_eq!(ar.start_ms, last_b);
    }

    #[test]
    fn zero_bubble_h1_waits_a_third_of_1f1b_and_agrees_with_the_order_dry_run() {
        // F = I = W = 1 on equal stages with free links: 1F1B (policy A)
        // takes (M + S - 1) x 3; ZB-H1 fills two thirds of each stage's
        // wait with deferred weight gradients: 3M + (S - 1).
        for s in 1..=5usize {
            for m in [s as u32, 2 * s as u32, 8] {
                let stages = equal_stages(s, 1.0, 2.0);
                let links = vec![0.0; s - 1];
                let one_f_one_b =
                    Schedule::early_backward_with_policy(s, m, WarmupPolicy::A).unwrap();
                let zb = Schedule::zero_bubble_h1(s, m).unwrap();
                let base = simulate_stages(&stages, &links, &one_f_one_b, false).unwrap();
                let sim = simulate_stages(&stages, &links, &zb, false).unwrap();
                let (s_f, m_f) = (s as f64, f64::from(m));
                assert!((base.iteration_ms - 3.0 * (m_f + s_f - 1.0)).abs() < 1e-9);
                assert!(
                    (sim.iteration_ms - (3.0 * m_f + s_f - 1.0)).abs() < 1e-9,
                    "S={s} M={m}: {}",
                    sim.iteration_ms
                );
                // The order's own dry run gives the same iteration.
                let order = zb.pipeline_order().unwrap();
                let costs =
                    vec![crate::schedule::pipeline_order::StageCosts::equal_passes(1.0, 2.0); s];
                let run = order.run(&costs).unwrap();
                assert!((run.iteration_ms - sim.iteration_ms).abs() < 1e-9);
                // Its tasks: an I and a W per micro-batch on every stage.
                let count = |kind| sim.tasks.iter().filter(|t| t.kind == kind).count();
                assert_eq!(count(TaskKind::InputGradient), s * m as usize);
                assert_eq!(count(TaskKind::WeightGradient), s * m as usize);
                assert_eq!(count(TaskKind::Backward), 0);
                // Activations live until W: every stage holds up to
                // min(S, M) micro-batches, 1F1B's stage i min(S - i, M).
                for (i, (a, b)) in sim.stages.iter().zip(&base.stages).enumerate() {
                    assert_eq!(a.peak_in_flight, (s as u32).min(m), "stage {i}");
                    assert_eq!(b.peak_in_flight, (s as u32 - i as u32).min(m));
                }
            }
        }
    }

    #[test]
    fn bubbles_are_the_idle_share() {
        let stages = equal_stages(4, 1.0, 1.0);
        let sim = simulate_stages(
            &stages,
            &[0.0; 3],
            &Schedule::early_backward_with_policy(4, 4, WarmupPolicy::A).unwrap(),
            false,
        )
        .unwrap();
        // (M + S - 1) = 7 slots of 2 ms, 4 of them busy on every stage.
        for st in &sim.stages {
            assert!((st.bubble_fraction - 3.0 / 7.0).abs() < 1e-12);
        }
    }

    fn asynchronous_run(
        kind: ScheduleKind,
        stages: &[SimStage],
        m: u32,
        recompute: bool,
    ) -> Simulation {
        let s = stages.len();
        let n = crate::schedule::steady_state_mini_batches(s, m).unwrap();
        let schedule = Schedule::asynchronous(kind, s, m, n).unwrap();
        simulate_stages(stages, &vec![0.0; s - 1], &schedule, recompute).unwrap()
    }

    /// With re-computation, as the XPipe paper runs it.
    fn asynchronous(kind: ScheduleKind, stages: &[SimStage], m: u32) -> Simulation {
        asynchronous_run(kind, stages, m, true)
    }

    #[test]
    fn asynchronous_steady_state_is_the_busiest_stage() {
        // Equal stages, free links: once full, every stage runs each
        // micro-batch's forward and backward (and with re-computation the
        // forward again), then its AllReduce and update, for every M: no
        // bubble per mini-batch, where GPipe pays (S - 1) passes of each.
        for kind in [
            ScheduleKind::XPipe,
            ScheduleKind::PipeDream,
            ScheduleKind::SpecTrain,
            ScheduleKind::Async,
        ] {
            for s in 1..=5 {
                for m in 1..=6u32 {
                    let mut stages = equal_stages(s, 1.0, 2.0);
                    for st in &mut stages {
                        (st.allreduce_ms, st.optimizer_ms) = (0.5, 0.25);
                    }
                    for (recompute, passes_ms) in [(true, 1.0 + 1.0 + 2.0), (false, 1.0 + 2.0)] {
                        let sim = asynchronous_run(kind, &stages, m, recompute);
                        assert_eq!(sim.recompute, recompute);
                        let expected = f64::from(m) * passes_ms + 0.75;
                        assert!(
                            (sim.iteration_ms - expected).abs() < 1e-9,
                            "{kind} S={s} M={m} recompute={recompute}: {}",
                            sim.iteration_ms
                        );
                        assert!(
                            sim.span_ms.unwrap()
                                > sim.iteration_ms * f64::from(sim.mini_batches - 1)
                        );
                    }
                }
            }
        }
        // The slowest stage sets the pace.
        let mut stages = equal_stages(3, 1.0, 2.0);
        stages[1].bwd_ms = 5.0;
        assert_eq!(
            asynchronous(ScheduleKind::XPipe, &stages, 4).iteration_ms,
            4.0 * 7.0
        );
    }

    #[test]
    fn an_asynchronous_stage_re_computes_as_its_plan_says() {
        // Stage 1's plan re-computes it: its cost holds torch's checkpoint
        // re-run (0.25 of the forward), but an asynchronous backward re-runs
        // the whole forward, so it paces the pipeline at 1 + 1 + 2 per
        // micro-batch; the others keep their activations.
        let mut stages = equal_stages(3, 1.0, 2.0);
        stages[1].recomputes = true;
        stages[1].recompute_ms = 0.25;
        stages[1].bwd_ms = 2.0 + 0.25;
        let sim = asynchronous_run(ScheduleKind::PipeDream, &stages, 2, false);
        assert!(!sim.recompute);
        assert!(
            (sim.iteration_ms - 2.0 * 4.0).abs() < 1e-9,
            "{}",
            sim.iteration_ms
        );
        // Per micro-batch in flight, stage 1 holds its input (1 byte), the
        // others what their layers store (10 bytes).
        let per: Vec<f64> = sim
            .stages
            .iter()
            .map(|t| t.memory_terms.unwrap().per_micro_batch_bytes)
            .collect();
        assert_eq!(per, [10.0, 1.0, 10.0]);
        // Every stage re-computing: the simulation says so.
        for st in &mut stages {
            st.recomputes = true;
        }
        assert!(asynchronous_run(ScheduleKind::PipeDream, &stages, 2, false).recompute);
    }

    #[test]
    fn asynchronous_memory_counts_weight_copies() {
        // 4 stages of 40-byte weights, one micro-batch per mini-batch:
        // PipeDream stashes a version per later stage still to return
        // (S - 1 - k on stage k); XPipe caches one prediction where it
        // predicts; without prediction nothing is copied.
        let stages = equal_stages(4, 1.0, 2.0);
        let copies = |kind, m| {
            let sim = asynchronous(kind, &stages, m);
            let live = asynchronous(ScheduleKind::Async, &stages, m);
            // The copies add to the peak, though not always all of them
            // (XPipe's cache lives during forwards, the re-computed
            // activations during backwards).
            for (a, b) in sim.stages.iter().zip(&live.stages) {
                let extra = a.peak_memory_bytes - b.peak_memory_bytes;
                assert!(extra <= f64::from(a.peak_weight_copies) * 40.0, "{kind}");
                assert_eq!(extra > 0.0, a.peak_weight_copies > 0, "{kind}");
            }
            sim.stages
                .iter()
                .map(|st| st.peak_weight_copies)
                .collect::<Vec<_>>()
        };
        assert_eq!(copies(ScheduleKind::PipeDream, 1), [3, 2, 1, 0]);
        assert_eq!(copies(ScheduleKind::PipeDream, 2), [2, 1, 1, 0]);
        assert_eq!(copies(ScheduleKind::XPipe, 1), [1, 1, 1, 0]);
        assert_eq!(copies(ScheduleKind::XPipe, 4), [1, 1, 1, 0]);
        assert_eq!(copies(ScheduleKind::Async, 2), [0, 0, 0, 0]);
        let sync =
            simulate_stages(&stages, &[0.0; 3], &Schedule::gpipe(4, 2).unwrap(), false).unwrap();
        assert!(sync.stages.iter().all(|st| st.peak_weight_copies == 0));
        assert_eq!(
            (sync.mini_batches, sync.span_ms),
            (1, Some(sync.iteration_ms))
        );
    }
}
