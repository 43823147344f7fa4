//! Pipeline schedules as data: the ordered action list of each stage.
//!
//! Every replica of a stage runs the same list on its slice of each
//! micro-batch. Early-backward (DAPPLE's 1F1B, sections III-B and V-C): stage
//! i runs K_i forwards, then alternates one backward and one forward until the
//! forwards run out, then the remaining backwards. GPipe runs all forwards,
//! then all backwards in reverse order. Both end with the gradient AllReduce
//! of the stage and the optimizer step.
//!
//! The asynchronous kinds (XPipe, PipeDream's weight stashing, SpecTrain,
//! asynchronous without prediction) run one list over several mini-batches
//! without a flush: micro-batch t of the run belongs to mini-batch t / M,
//! and each stage reduces and updates (AR, OPT) after the backward of each
//! mini-batch's last micro-batch. Which weights each pass computes with is
//! read off the list (`Schedule::pass_weights`).

pub mod pipeline_order;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use crate::cost::work_limit::{
    check_passes, max_passes, set_max_passes, within_passes, MAX_PASSES, MAX_PASSES_CEILING,
};
use crate::cost::WarmupPolicy;
use crate::error::{Error, Result};
use crate::schedule::pipeline_order::{stage_ranks, Computation, PipelineOrder, StageAction};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    Forward,
    /// The whole backward: input and weight gradients.
    Backward,
    /// The backward's input gradient alone, which the stage before waits
    /// for (zero bubble's B; torch's `I`).
    InputGradient,
    /// The backward's weight gradient alone, which nobody waits for (W).
    WeightGradient,
    AllReduce,
    OptimizerStep,
}

/// One step of a stage; `micro_batch` is set for the passes (forwards,
/// backwards and their halves) only. Written `F3`, `B2`, `I2`, `W2`, `AR`,
/// `OPT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Action {
    pub kind: ActionKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u32>,
}

impl ActionKind {
    /// How the kind is written in an action (`F3`, `AR`): the only place
    /// the spelling is set, for the core and for the binding.
    pub const fn symbol(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::InputGradient => "I",
            ActionKind::WeightGradient => "W",
            ActionKind::AllReduce => "AR",
            ActionKind::OptimizerStep => "OPT",
        }
    }

    /// The kind written `symbol`, if any.
    pub fn from_symbol(symbol: &str) -> Option<ActionKind> {
        [
            ActionKind::Forward,
            ActionKind::Backward,
            ActionKind::InputGradient,
            ActionKind::WeightGradient,
            ActionKind::AllReduce,
            ActionKind::OptimizerStep,
        ]
        .into_iter()
        .find(|k| k.symbol() == symbol)
    }

    /// A forward, a backward or half of one: a pass over one micro-batch.
    pub const fn is_pass(self) -> bool {
        !matches!(self, ActionKind::AllReduce | ActionKind::OptimizerStep)
    }

    /// A pass of the backward direction (B, I or W).
    pub const fn is_backward(self) -> bool {
        matches!(
            self,
            ActionKind::Backward | ActionKind::InputGradient | ActionKind::WeightGradient
        )
    }

    /// The pass after which the micro-batch's input gradient goes to the
    /// stage before (B or I), and which waits for the one of the stage after.
    pub const fn sends_input_gradient(self) -> bool {
        matches!(self, ActionKind::Backward | ActionKind::InputGradient)
    }

    /// The pass that ends the micro-batch's backward and lets its
    /// activations go (B or W).
    pub const fn ends_backward(self) -> bool {
        matches!(self, ActionKind::Backward | ActionKind::WeightGradient)
    }
}

impl Action {
    pub const ALL_REDUCE: Action = Action::new(ActionKind::AllReduce, None);
    pub const OPTIMIZER_STEP: Action = Action::new(ActionKind::OptimizerStep, None);

    pub const fn new(kind: ActionKind, micro_batch: Option<u32>) -> Action {
        Action { kind, micro_batch }
    }

    /// A pipeline order's action as a stage's list writes it (the stage
    /// is the list's).
    pub fn of_stage_action(a: &StageAction) -> Action {
        let kind = match a.computation {
            Computation::Forward => ActionKind::Forward,
            Computation::BackwardInput => ActionKind::InputGradient,
            Computation::BackwardWeight => ActionKind::WeightGradient,
            Computation::FullBackward => ActionKind::Backward,
        };
        Action::new(kind, Some(a.micro_batch))
    }

    pub fn forward(micro_batch: u32) -> Action {
        Action::new(ActionKind::Forward, Some(micro_batch))
    }
    pub fn backward(micro_batch: u32) -> Action {
        Action::new(ActionKind::Backward, Some(micro_batch))
    }
}

impl fmt::Display for Action {
    /// A forward or backward without a micro-batch (only possible when built
    /// by hand) shows as `F?` / `B?`, which does not parse back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.symbol())?;
        match (self.kind.is_pass(), self.micro_batch) {
            (false, _) => Ok(()),
            (true, Some(m)) => write!(f, "{m}"),
            (true, None) => f.write_str("?"),
        }
    }
}

impl FromStr for Action {
    type Err = Error;

    /// Only the canonical spelling: `AR`, `OPT`, or `F`/`B`/`I`/`W`
    /// followed by a micro-batch index in decimal without sign or leading
    /// zeros.
    fn from_str(s: &str) -> Result<Action> {
        let bad = || {
            Error::invalid(format!(
                "action {s:?} is not F<n>, B<n>, I<n>, W<n>, AR or OPT"
            ))
        };
        let split = s.find(|c: char| c.is_ascii_digit()).unwrap_or(s.len());
        let (symbol, digits) = s.split_at(split);
        let kind = ActionKind::from_symbol(symbol).ok_or_else(bad)?;
        if !kind.is_pass() {
            return if digits.is_empty() {
                Ok(Action::new(kind, None))
            } else {
                Err(bad())
            };
        }
        let canonical = !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (digits == "0" || !digits.starts_with('0'));
        let m = digits.parse().ok().filter(|_| canonical).ok_or_else(bad)?;
        Ok(Action::new(kind, Some(m)))
    }
}

crate::named_enum! {
    /// How each stage orders its forwards and backwards, and which weights
    /// they compute with.
    pub enum ScheduleKind("a schedule") {
        /// DAPPLE's early backward (1F1B): K_i forwards, then one backward
        /// and one forward in turn.
        EarlyBackward1F1B = "early-backward-1f1b",
        /// All forwards, then all backwards; every micro-batch is in flight at once.
        GPipe = "gpipe",
        /// Zero Bubble's ZB-H1 (Qi et al., ICLR 2024; torch's
        /// `ScheduleInterleavedZeroBubble` with one stage per rank): 1F1B
        /// with each backward split into its input gradient, sent on at
        /// once, and its weight gradient, deferred into what would be
        /// bubbles. Each micro-batch's activations stay until its W, so
        /// every stage holds up to min(S, M) of them.
        ZeroBubbleH1 = "zb-h1",
        /// Zero Bubble's ZB-H2 (Qi et al., section 2.2;
        /// `PipelineOrder::zb_h2`, no torch class): rank r warms up with
        /// 2(S - r) - 1 forwards and fills with deferred Ws, so that at
        /// F = I = W no rank waits between its first forward and its last
        /// W; every stage holds up to min(2S - 1, M) micro-batches'
        /// activations, ZB-H1's S of them and S - 1 more.
        ZeroBubbleH2 = "zb-h2",
        /// Megatron's interleaved 1F1B (torch's `ScheduleInterleaved1F1B`):
        /// each rank holds `chunks` chunks of the model, chunk c of rank r
        /// being stage c * ranks + r, and runs 1F1B over them; the
        /// bubble is (ranks - 1) / (chunks * micro-batches) of 1F1B's.
        Interleaved1F1B = "interleaved-1f1b",
        /// torch's `ScheduleInterleavedZeroBubble`: interleaved 1F1B's
        /// looped chunks with each backward split into I and W, the Ws
        /// deferred into the waits.
        InterleavedZeroBubble = "interleaved-zero-bubble",
        /// ZB-V (torch's `ScheduleZBVZeroBubble`): two chunks a rank in a
        /// V, rank r holding stages r and 2 * ranks - 1 - r, each backward
        /// split into I and W.
        ZeroBubbleV = "zb-v",
        /// DualPipeV (DeepSeek-V3's DualPipe folded into a V; torch's
        /// `ScheduleDualPipeV`): ZB-V's two chunks a rank, at least two
        /// micro-batches a stage, its steady state a forward of one chunk
        /// overlapped with a whole backward of the other (run one after the
        /// other here), I and W split in the fill and the drain.
        DualPipeV = "dualpipev",
        /// XPipe: asynchronous 1F1B across mini-batches; each mini-batch's
        /// first micro-batch (its bellwether) predicts the weights the
        /// mini-batch should see with Adam's moments, for all its micro-batches.
        XPipe = "xpipe",
        /// PipeDream's weight stashing: asynchronous 1F1B; a forward uses the
        /// live weights, its backward the version the forward used.
        PipeDream = "pipedream",
        /// SpecTrain: XPipe's pipeline and version differences, predicting
        /// with the smoothed (momentum) gradient.
        SpecTrain = "spectrain",
        /// Asynchronous 1F1B without prediction: every pass on the live weights.
        Async = "async",
    }
}

/// Which weights a forward or backward computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightRule {
    /// The stage's weights as they are when the pass runs.
    Live,
    /// The backward uses the version its forward used (a stored copy once
    /// the live weights have moved on).
    Stashed,
    /// The weights predicted `s` updates ahead from the live version at the
    /// mini-batch's bellwether pass, cached for its other micro-batches.
    Predicted,
}

crate::named_enum! {
    /// How a predicting schedule extrapolates a stage's weights s updates
    /// ahead (the runtime's `planner/runtime/prediction.py`).
    pub enum Predictor("a predictor") {
        /// XPipe (formulas (3), (4)): s Adam steps with the current
        /// bias-corrected moments of the mini-batch gradients.
        Adam = "adam",
        /// SpecTrain: s steps along momentum SGD's smoothed gradient.
        Momentum = "momentum",
    }
}

impl ScheduleKind {
    /// The predictor of a kind whose passes use predicted weights.
    pub fn predictor(self) -> Option<Predictor> {
        match self {
            ScheduleKind::XPipe => Some(Predictor::Adam),
            ScheduleKind::SpecTrain => Some(Predictor::Momentum),
            _ => None,
        }
    }

    /// Kinds that run several mini-batches without a flush between them.
    pub fn is_asynchronous(self) -> bool {
        !matches!(
            self,
            ScheduleKind::EarlyBackward1F1B
                | ScheduleKind::GPipe
                | ScheduleKind::ZeroBubbleH1
                | ScheduleKind::ZeroBubbleH2
        ) && !self.is_chunked()
    }

    /// The one-stage-a-rank kinds that split each backward into I and W and
    /// defer the Ws (ZB-H1, ZB-H2): a micro-batch's activations stay past
    /// its I, so a stage's memory is its order's peak, not K_i's, and only
    /// the busiest stage's own span bounds the iteration
    /// (`cost::zero_bubble_latency`).
    pub fn defers_weight_gradients(self) -> bool {
        matches!(
            self,
            ScheduleKind::ZeroBubbleH1 | ScheduleKind::ZeroBubbleH2
        )
    }

    /// The pipeline order of chunked kind `self` over `ranks` ranks of `chunks`
    /// stages each, as torch's schedule classes build it (`schedule/pipeline_order.rs`).
    pub fn chunked_order(
        self,
        ranks: u32,
        micro_batches: u32,
        chunks: u32,
    ) -> Result<PipelineOrder> {
        match self {
            ScheduleKind::Interleaved1F1B => {
                PipelineOrder::interleaved_1f1b(ranks, micro_batches, chunks)
            }
            ScheduleKind::InterleavedZeroBubble => {
                PipelineOrder::interleaved_zero_bubble(ranks, micro_batches, chunks)
            }
            fixed if fixed.fixed_chunks().is_some_and(|v| v != chunks) => Err(Error::field(
                "chunks",
                format!(
                    "value {chunks}: {self} holds {} chunks a rank",
                    fixed.fixed_chunks().unwrap_or(chunks)
                ),
            )),
            ScheduleKind::ZeroBubbleV => PipelineOrder::zbv(ranks, micro_batches),
            ScheduleKind::DualPipeV => PipelineOrder::dualpipev(ranks, micro_batches),
            other => Err(Error::field(
                "kind",
                format!(
                    "value \"{other}\" runs one stage a rank; a chunked kind is {}",
                    crate::formats::names::one_of(&ScheduleKind::names_where(
                        ScheduleKind::is_chunked
                    ))
                ),
            )),
        }
    }

    /// The names of the kinds `keep` keeps, in declaration order.
    pub fn names_where(keep: impl Fn(ScheduleKind) -> bool) -> Vec<&'static str> {
        ScheduleKind::ALL
            .into_iter()
            .filter(|&k| keep(k))
            .map(ScheduleKind::name)
            .collect()
    }

    /// The chunks a rank the kind always holds (the V kinds' two); None:
    /// any count.
    pub fn fixed_chunks(self) -> Option<u32> {
        self.is_v_shaped().then_some(2)
    }

    /// The kind a plan of chunked kind `self` records with one chunk a
    /// rank: interleaved zero bubble's order at one chunk is ZB-H1's (torch's
    /// ZB-H1 is that class at one stage a rank), so such a plan is a ZB-H1
    /// plan, which every target takes. Interleaved 1F1B at one chunk is
    /// 1F1B at warm-up policy B's depths, which a plan searched under
    /// another policy cannot record as early backward: it keeps its kind.
    pub fn at_one_chunk(self) -> ScheduleKind {
        match self {
            ScheduleKind::InterleavedZeroBubble => ScheduleKind::ZeroBubbleH1,
            other => other,
        }
    }

    /// Kinds whose ranks hold their two chunks in a V: stage s on rank s,
    /// then back up the ranks.
    pub fn is_v_shaped(self) -> bool {
        matches!(self, ScheduleKind::ZeroBubbleV | ScheduleKind::DualPipeV)
    }

    /// The rank of each of the `ranks` x `chunks` stages of chunked kind `self`.
    pub fn chunk_ranks(self, ranks: u32, chunks: u32) -> Vec<u32> {
        stage_ranks(ranks, ranks * chunks, self.is_v_shaped())
    }

    /// Kinds whose ranks may hold several stages (chunks), in a pipeline
    /// order torch builds (`search/interleave.rs`).
    pub fn is_chunked(self) -> bool {
        matches!(
            self,
            ScheduleKind::Interleaved1F1B
                | ScheduleKind::InterleavedZeroBubble
                | ScheduleKind::ZeroBubbleV
                | ScheduleKind::DualPipeV
        )
    }

    pub fn weight_rule(self) -> WeightRule {
        match self {
            _ if self.predictor().is_some() => WeightRule::Predicted,
            ScheduleKind::PipeDream => WeightRule::Stashed,
            _ => WeightRule::Live,
        }
    }
}

/// One stage's early-backward list without AR and OPT: `k` forwards, then
/// one backward and one forward in turn until the forwards run out, then the
/// remaining backwards. The only place this order is written.
pub fn early_backward_actions(k: u32, micro_batches: u32) -> Vec<Action> {
    let mut actions: Vec<Action> = (0..k).map(Action::forward).collect();
    for m in 0..micro_batches {
        actions.push(Action::backward(m));
        if m + k < micro_batches {
            actions.push(Action::forward(m + k));
        }
    }
    actions
}

/// One stage's asynchronous list over `mini_batches` mini-batches of
/// `micro_batches` each: PipeDream's 1F1B (warm-up depth S - i, the stages
/// from here, then one backward and one forward in turn) over the run's
/// micro-batches t = 0 .. N M, with AR and OPT after the backward of each
/// mini-batch's last micro-batch. The only place this order is written.
pub fn asynchronous_actions(
    stages_from_here: u32,
    micro_batches: u32,
    mini_batches: u32,
) -> Vec<Action> {
    let total = micro_batches * mini_batches;
    let mut actions = Vec::with_capacity(2 * total as usize + 2 * mini_batches as usize);
    for a in early_backward_actions(stages_from_here.min(total), total) {
        actions.push(a);
        if a.kind == ActionKind::Backward
            && a.micro_batch.is_some_and(|t| (t + 1) % micro_batches == 0)
        {
            actions.extend([Action::ALL_REDUCE, Action::OPTIMIZER_STEP]);
        }
    }
    actions
}

/// GPipe's list without AR and OPT: F0 .. F(M-1), then B(M-1) .. B0.
pub fn gpipe_actions(micro_batches: u32) -> Vec<Action> {
    (0..micro_batches)
        .map(Action::forward)
        .chain((0..micro_batches).rev().map(Action::backward))
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSchedule {
    pub stage: usize,
    pub actions: Vec<Action>,
}

impl fmt::Display for StageSchedule {
    /// `stage 0: F0 F1 B0 ... AR OPT`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stage {}:", self.stage)?;
        self.actions.iter().try_for_each(|a| write!(f, " {a}"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    pub kind: ScheduleKind,
    /// Micro-batches of one mini-batch (one global batch).
    pub micro_batches: u32,
    /// Mini-batches the lists run: 1 for the synchronous kinds, which flush
    /// after each; micro-batch t belongs to mini-batch t / `micro_batches`.
    #[serde(default = "one")]
    pub mini_batches: u32,
    /// `stages[i].stage == i`, first pipeline stage first.
    pub stages: Vec<StageSchedule>,
}

fn one() -> u32 {
    1
}

/// The weights one forward or backward of a schedule computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassWeights {
    pub action: Action,
    /// The mini-batch the pass belongs to: the version (number of updates)
    /// synchronous training would compute it with.
    pub mini_batch: u32,
    /// Updates the stage has applied when the pass runs.
    pub live_version: u32,
    /// The version the weights come from: the live one (rule `Live`), the
    /// forward's (`Stashed`), or the live one at the mini-batch's bellwether
    /// pass of the same direction (`Predicted`).
    pub base_version: u32,
    /// Updates predicted ahead of `base_version` (the version difference s
    /// of XPipe's formulas (1) and (2)): `mini_batch - base_version` under
    /// `Predicted`, 0 otherwise. It counts the updates the stage applies
    /// before the mini-batch's own, never that one.
    pub predicted_updates: u32,
}

impl fmt::Display for PassWeights {
    /// `F4@0+2`: the pass, the version its weights come from, and the
    /// updates predicted ahead of it when there are any.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.action, self.base_version)?;
        if self.predicted_updates > 0 {
            write!(f, "+{}", self.predicted_updates)?;
        }
        Ok(())
    }
}

fn check_shape(num_stages: usize, micro_batches: u32, mini_batches: u32) -> Result<()> {
    if num_stages == 0 || micro_batches == 0 || mini_batches == 0 {
        return Err(Error::invalid(format!(
            "a schedule needs at least one stage, one micro-batch and one mini-batch, \
             got {num_stages}, {micro_batches} and {mini_batches}"
        )));
    }
    let total = u64::from(micro_batches) * u64::from(mini_batches);
    check_passes(num_stages, u32::try_from(total).unwrap_or(u32::MAX))
}

/// Mini-batches an asynchronous schedule is simulated over to measure its
/// steady state: `fill` mini-batches to fill the pipeline (its warm-up
/// spans 2S - 1 micro-batch passes on the first stage), a window of at
/// least 4 (and as many as `fill`), and `fill` more so that the window
/// ends before the pipeline drains. Fewer where [`max_passes`] allows no
/// more, but never a window under one mini-batch.
pub fn steady_state_mini_batches(num_stages: usize, micro_batches: u32) -> Result<u32> {
    let m = u64::from(micro_batches.max(1));
    let fill = fill_mini_batches(num_stages, micro_batches);
    // The window runs from the update ending mini-batch `fill` to the one
    // ending mini-batch N - 1 - fill: at least 4 mini-batches apart.
    let wanted = 2 * fill + fill.max(4) + 1;
    let limit = max_passes();
    let allowed = limit / (m * num_stages.max(1) as u64);
    if allowed < 2 * fill + 2 {
        return Err(Error::limit(format!(
            "an asynchronous schedule of {num_stages} stages x {micro_batches} micro-batches needs {} \
             mini-batches to reach its steady state, over the limit of {limit} micro-batch passes \
             one simulation runs; use fewer, larger micro-batches, or raise the limit (--max-passes)",
            2 * fill + 2
        )));
    }
    Ok(wanted.min(allowed) as u32)
}

/// Mini-batches an asynchronous pipeline takes to fill: its first stage
/// warms up over 2S - 1 micro-batch passes.
fn fill_mini_batches(num_stages: usize, micro_batches: u32) -> u64 {
    (2 * num_stages.max(1) as u64 - 1).div_ceil(u64::from(micro_batches.max(1))) + 1
}

/// The mini-batches whose updates on the first stage bound the measured
/// window of a run of `mini_batches`: (first, last), after the fill and
/// before the drain as in [`steady_state_mini_batches`]; first == last when
/// the run is too short to have one.
pub fn steady_state_window(num_stages: usize, micro_batches: u32, mini_batches: u32) -> (u32, u32) {
    let fill = fill_mini_batches(num_stages, micro_batches);
    let last = mini_batches.saturating_sub(1);
    let fill = fill.min(u64::from(last / 2)) as u32;
    (fill, last - fill)
}

/// The pass a backward of micro-batch `t` of `kind` must follow and that
/// has not run (`F{t}` for B and I, `I{t}` for W), if any; an error where
/// a W follows a whole backward.
fn missing_before(
    kind: ActionKind,
    t: usize,
    fwd: &[Option<usize>],
    bwd: &[Option<usize>],
    split: &[bool],
) -> std::result::Result<Option<String>, String> {
    if kind != ActionKind::WeightGradient {
        return Ok(fwd[t].is_none().then(|| format!("F{t}")));
    }
    match (bwd[t], split[t]) {
        (None, _) => Ok(Some(format!("I{t}"))),
        (Some(j), false) => Err(format!(
            "follows action {j} (B{t}), whose backward was whole"
        )),
        (Some(_), true) => Ok(None),
    }
}

/// What `a` gives the stage before: an input gradient, B or I, is written
/// as B for the dry run of [`Schedule::validate`]; anything else as itself.
fn gradient_sent(a: Action) -> Action {
    match a.kind {
        ActionKind::InputGradient => Action::new(ActionKind::Backward, a.micro_batch),
        _ => a,
    }
}

/// Has stage `o` run `a` (F_m, or B_m for an input gradient) in the dry run?
fn ran_before(forward_ran: &[Vec<bool>], gradient_ran: &[Vec<bool>], o: usize, a: Action) -> bool {
    match (a.kind, a.micro_batch) {
        (ActionKind::Forward, Some(m)) => forward_ran[o][m as usize],
        (ActionKind::Backward, Some(m)) => gradient_ran[o][m as usize],
        _ => false,
    }
}

/// A synchronous schedule from lists without AR and OPT, validated.
fn finish(kind: ScheduleKind, micro_batches: u32, lists: Vec<Vec<Action>>) -> Result<Schedule> {
    let stages = lists
        .into_iter()
        .enumerate()
        .map(|(stage, mut actions)| {
            actions.extend([Action::ALL_REDUCE, Action::OPTIMIZER_STEP]);
            StageSchedule { stage, actions }
        })
        .collect();
    let schedule = Schedule {
        kind,
        micro_batches,
        mini_batches: 1,
        stages,
    };
    schedule.validate()?;
    Ok(schedule)
}

impl Schedule {
    /// A synchronous schedule's order, one rank per stage: its forwards and
    /// backwards. Its AR and OPT stay out: torch's pipeline schedule runs
    /// the passes of one step, and the caller reduces and steps after it.
    pub fn pipeline_order(&self) -> Result<PipelineOrder> {
        let schedule = self;
        if schedule.kind.is_asynchronous() {
            return Err(Error::incompatible(format!(
                "schedule {} is asynchronous: torch's pipeline schedules flush every step",
                schedule.kind
            )));
        }
        let rank_actions = schedule
            .stages
            .iter()
            .map(|stage| {
                let passes = stage.actions.iter().filter(|a| a.kind.is_pass());
                passes
                    .map(|a| {
                        let computation = match a.kind {
                            ActionKind::Forward => Computation::Forward,
                            ActionKind::InputGradient => Computation::BackwardInput,
                            ActionKind::WeightGradient => Computation::BackwardWeight,
                            _ => Computation::FullBackward,
                        };
                        let m = a.micro_batch.expect("a pass has a micro-batch");
                        StageAction::new(stage.stage as u32, computation, m)
                    })
                    .collect()
            })
            .collect();
        let order = PipelineOrder {
            micro_batches: schedule.micro_batches,
            stage_ranks: (0..schedule.stages.len() as u32).collect(),
            rank_actions,
            overlapped: Vec::new(),
        };
        order.validate()?;
        Ok(order)
    }

    /// Early-backward 1F1B with warm-up depth `warmup[i]` = K_i for stage i,
    /// each in 1..=M. The result is validated, so warm-ups that deadlock
    /// (a later stage warming up deeper than an earlier one, K_i < K_{i+1} < M)
    /// are an error.
    pub fn early_backward(
        num_stages: usize,
        micro_batches: u32,
        warmup: &[u32],
    ) -> Result<Schedule> {
        check_shape(num_stages, micro_batches, 1)?;
        if warmup.len() != num_stages {
            return Err(Error::invalid(format!(
                "{} warm-up depths given for {num_stages} stages",
                warmup.len()
            )));
        }
        let lists = warmup.iter().enumerate().map(|(stage, &k)| {
            if !(1..=micro_batches).contains(&k) {
                return Err(Error::invalid(format!(
                    "stage {stage}: warm-up depth {k} is not in 1..={micro_batches}"
                )));
            }
            Ok(early_backward_actions(k, micro_batches))
        });
        finish(
            ScheduleKind::EarlyBackward1F1B,
            micro_batches,
            lists.collect::<Result<_>>()?,
        )
    }

    /// Early-backward 1F1B with K_i = `policy.warmup(S - i, M)` of a fixed
    /// policy (A or B); `Auto` has no rule of its own and is an error here.
    pub fn early_backward_with_policy(
        num_stages: usize,
        micro_batches: u32,
        policy: WarmupPolicy,
    ) -> Result<Schedule> {
        let warmup: Vec<u32> = (0..num_stages)
            .map(|i| policy.warmup((num_stages - i) as u32, micro_batches))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                Error::invalid("warm-up policy auto has no fixed K_i: give each stage's depth")
            })?;
        Schedule::early_backward(num_stages, micro_batches, &warmup)
    }

    /// ZB-H1 on `num_stages` stages, one a rank: the order torch's
    /// `ScheduleInterleavedZeroBubble` builds for one chunk
    /// (`PipelineOrder::interleaved_zero_bubble`, the one place it is
    /// written), each stage's passes followed by AR and OPT.
    pub fn zero_bubble_h1(num_stages: usize, micro_batches: u32) -> Result<Schedule> {
        check_shape(num_stages, micro_batches, 1)?;
        let order = PipelineOrder::interleaved_zero_bubble(num_stages as u32, micro_batches, 1)?;
        Schedule::of_one_stage_order(ScheduleKind::ZeroBubbleH1, &order)
    }

    /// ZB-H2 on `num_stages` stages, one a rank (`PipelineOrder::zb_h2`,
    /// the one place it is written), each stage's passes followed by AR
    /// and OPT.
    pub fn zero_bubble_h2(num_stages: usize, micro_batches: u32) -> Result<Schedule> {
        check_shape(num_stages, micro_batches, 1)?;
        let order = PipelineOrder::zb_h2(num_stages as u32, micro_batches)?;
        Schedule::of_one_stage_order(ScheduleKind::ZeroBubbleH2, &order)
    }

    /// The schedule of kind `kind` that runs `order`, one stage a rank.
    fn of_one_stage_order(kind: ScheduleKind, order: &PipelineOrder) -> Result<Schedule> {
        let lists = order
            .rank_actions
            .iter()
            .map(|actions| actions.iter().map(Action::of_stage_action).collect())
            .collect();
        finish(kind, order.micro_batches, lists)
    }

    /// GPipe: F0 .. F(M-1), then B(M-1) .. B0, on every stage.
    pub fn gpipe(num_stages: usize, micro_batches: u32) -> Result<Schedule> {
        check_shape(num_stages, micro_batches, 1)?;
        let one = gpipe_actions(micro_batches);
        finish(ScheduleKind::GPipe, micro_batches, vec![one; num_stages])
    }

    /// An asynchronous kind over `mini_batches` mini-batches of
    /// `micro_batches` each (`asynchronous_actions` on every stage).
    pub fn asynchronous(
        kind: ScheduleKind,
        num_stages: usize,
        micro_batches: u32,
        mini_batches: u32,
    ) -> Result<Schedule> {
        if !kind.is_asynchronous() {
            return Err(Error::invalid(format!(
                "schedule {kind} is not asynchronous"
            )));
        }
        let limit = max_passes();
        let most = limit / (num_stages.max(1) as u64 * u64::from(micro_batches.max(1)));
        if u64::from(mini_batches) > most {
            return Err(Error::limit(format!(
                "{mini_batches} mini-batches of {num_stages} stages x {micro_batches} micro-batches \
                 are over the {limit} micro-batch passes one list holds: at most {most} \
                 mini-batches at once"
            )));
        }
        check_shape(num_stages, micro_batches, mini_batches)?;
        let stages = (0..num_stages)
            .map(|stage| StageSchedule {
                stage,
                actions: asynchronous_actions(
                    (num_stages - stage) as u32,
                    micro_batches,
                    mini_batches,
                ),
            })
            .collect();
        let schedule = Schedule {
            kind,
            micro_batches,
            mini_batches,
            stages,
        };
        schedule.validate()?;
        Ok(schedule)
    }

    /// Micro-batches the lists run: M per mini-batch.
    pub fn total_micro_batches(&self) -> u32 {
        self.micro_batches * self.mini_batches
    }

    /// The weights each forward and backward of stage `stage` computes
    /// with, in list order, read off the list: the live version counts the
    /// OPTs before the pass. Panics if `stage` is out of range; assumes a
    /// validated schedule.
    pub fn pass_weights(&self, stage: usize) -> Vec<PassWeights> {
        let rule = self.kind.weight_rule();
        let total = self.total_micro_batches() as usize;
        let mut forward_version = vec![0u32; total];
        // The live version at each mini-batch's bellwether pass, per direction.
        let mut bellwether: [Vec<Option<u32>>; 2] = [
            vec![None; self.mini_batches as usize],
            vec![None; self.mini_batches as usize],
        ];
        let mut live = 0u32;
        let mut out = Vec::with_capacity(2 * total);
        for &action in &self.stages[stage].actions {
            let Some(t) = action.micro_batch else {
                live += u32::from(action.kind == ActionKind::OptimizerStep);
                continue;
            };
            let mini_batch = t / self.micro_batches;
            let backward = action.kind.is_backward();
            let first = *bellwether[usize::from(backward)][mini_batch as usize].get_or_insert(live);
            let base_version = match (rule, backward) {
                (WeightRule::Live, _) | (WeightRule::Stashed, false) => live,
                (WeightRule::Stashed, true) => forward_version[t as usize],
                (WeightRule::Predicted, _) => first,
            };
            if !backward {
                forward_version[t as usize] = live;
            }
            let predicted_updates = match rule {
                WeightRule::Predicted => mini_batch.saturating_sub(first),
                _ => 0,
            };
            out.push(PassWeights {
                action,
                mini_batch,
                live_version: live,
                base_version,
                predicted_updates,
            });
        }
        out
    }

    /// Each stage's passes with their weights, `stage 0: F0@0 F1@0 B0@0 ...`
    /// (AR and OPT as in the action lists).
    pub fn weights_table(&self) -> String {
        (0..self.stages.len())
            .map(|stage| {
                let mut passes = self.pass_weights(stage).into_iter();
                let mut line = format!("stage {stage}:");
                for a in &self.stages[stage].actions {
                    match a.micro_batch {
                        Some(_) => line += &format!(" {}", passes.next().expect("one per pass")),
                        None => line += &format!(" {a}"),
                    }
                }
                line
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Largest number of micro-batches whose forward is done and backward not
    /// yet done on `stage` (its activations in memory). Panics if `stage` is
    /// out of range.
    pub fn peak_in_flight(&self, stage: usize) -> u32 {
        let (mut now, mut peak) = (0u32, 0u32);
        for a in &self.stages[stage].actions {
            match a.kind {
                ActionKind::Forward => now += 1,
                kind if kind.ends_backward() => now = now.saturating_sub(1),
                _ => {}
            }
            peak = peak.max(now);
        }
        peak
    }

    /// Checks each stage's list on its own (every F of the run's
    /// micro-batches exactly once, and its backward once: whole (B_t) or
    /// split (I_t, then W_t), after F_t; one AR and then one OPT
    /// per mini-batch after its last backward and before any backward of
    /// the next, nothing after the last OPT), then runs all stages together
    /// with unit durations to prove the schedule cannot deadlock under
    /// pipeline dependencies.
    pub fn validate(&self) -> Result<()> {
        check_shape(self.stages.len(), self.micro_batches, self.mini_batches)?;
        if !self.kind.is_asynchronous() && self.mini_batches > 1 {
            return Err(Error::invalid(format!(
                "schedule {} flushes after each mini-batch; it cannot run {} at once",
                self.kind, self.mini_batches
            )));
        }
        for (i, s) in self.stages.iter().enumerate() {
            if s.stage != i {
                return Err(Error::invalid(format!(
                    "stage {i} is labelled stage {}",
                    s.stage
                )));
            }
            self.validate_stage(s)
                .map_err(|msg| Error::invalid(format!("stage {i}: {msg}")))?;
        }
        self.simulate()
    }

    fn validate_stage(&self, s: &StageSchedule) -> std::result::Result<(), String> {
        let total = self.total_micro_batches();
        let (m, n_mini) = (self.micro_batches, self.mini_batches as usize);
        let (mut fwd, mut bwd) = (vec![None; total as usize], vec![None; total as usize]);
        // Where a backward is split: the position of W_t, and whether I_t
        // (rather than B_t) ran.
        let (mut weight, mut split) = (vec![None; total as usize], vec![false; total as usize]);
        // Positions of the AR and the OPT of mini-batch 0, 1, ...
        let (mut ars, mut opts): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        // "of mini-batch n" only where there are several.
        let of = |n: usize| {
            if n_mini > 1 {
                format!(" of mini-batch {n}")
            } else {
                String::new()
            }
        };
        for (i, a) in s.actions.iter().enumerate() {
            let at = |what: &str| format!("action {i} ({a}) {what}");
            if opts.len() == n_mini {
                return Err(at(&format!(
                    "comes after OPT (action {})",
                    opts[n_mini - 1]
                )));
            }
            if a.kind.is_pass() != a.micro_batch.is_some() {
                let why = if a.kind.is_pass() {
                    "has no"
                } else {
                    "must not have a"
                };
                return Err(at(&format!("{why} micro-batch")));
            }
            let slot = match (a.kind, a.micro_batch) {
                (_, Some(t)) if t >= total => {
                    return Err(at(&format!("is out of range 0..{total}")))
                }
                (ActionKind::Forward, Some(t)) => &mut fwd[t as usize],
                // B, I or W: every other pass is F.
                (kind, Some(t)) => {
                    let t = t as usize;
                    let before = missing_before(kind, t, &fwd, &bwd, &split).map_err(|e| at(&e))?;
                    if let Some(before) = before {
                        return Err(at(&format!("comes before {before}")));
                    }
                    let mini = t / m as usize;
                    if let Some(&j) = ars.get(mini) {
                        return Err(format!("action {j} (AR{}) comes before {a}", of(mini)));
                    }
                    if mini > opts.len() {
                        return Err(at(&format!("comes before the OPT{}", of(opts.len()))));
                    }
                    if kind == ActionKind::WeightGradient {
                        &mut weight[t]
                    } else {
                        split[t] = kind == ActionKind::InputGradient;
                        &mut bwd[t]
                    }
                }
                (ActionKind::AllReduce, None) => {
                    if ars.len() > opts.len() {
                        return Err(at(&format!("duplicates action {}", ars[ars.len() - 1])));
                    }
                    ars.push(i);
                    continue;
                }
                // OPT: every other action without a micro-batch is AR.
                (_, None) => {
                    if ars.len() == opts.len() {
                        let n = opts.len();
                        return Err(at(&format!("comes before the AR{}", of(n))));
                    }
                    opts.push(i);
                    continue;
                }
            };
            if let Some(j) = *slot {
                return Err(at(&format!("duplicates action {j}")));
            }
            *slot = Some(i);
        }
        let missing = |letter: &str, v: &[Option<usize>]| {
            v.iter()
                .position(Option::is_none)
                .map(|t| format!("{letter}{t} is missing"))
        };
        if let Some(msg) = missing("F", &fwd).or_else(|| missing("B", &bwd)) {
            return Err(msg);
        }
        if let Some(t) = (0..total as usize).find(|&t| split[t] && weight[t].is_none()) {
            return Err(format!("W{t} is missing (I{t} ran)"));
        }
        if ars.len() < n_mini {
            return Err(format!("AR{} is missing", of(ars.len())));
        }
        if opts.len() < n_mini {
            return Err(format!("OPT{} is missing", of(opts.len())));
        }
        Ok(())
    }

    /// Lock-step simulation: in each unit of time every stage whose next
    /// action has its input from the neighbouring stage runs it. Assumes each
    /// stage passed validate_stage.
    fn simulate(&self) -> Result<()> {
        let n = self.stages.len();
        let mut next = vec![0usize; n];
        // Which F_m and which input gradients (B_m or I_m) each stage has
        // run: all a dependency names (validate_stage bounds each m).
        let total = self.total_micro_batches() as usize;
        let mut forward_ran = vec![vec![false; total]; n];
        let mut gradient_ran = vec![vec![false; total]; n];
        let (mut ran, mut stuck) = (Vec::new(), Vec::new());
        loop {
            ran.clear();
            stuck.clear();
            for (s, st) in self.stages.iter().enumerate() {
                let Some(&a) = st.actions.get(next[s]) else {
                    continue;
                };
                // F_m needs F_m on the stage before; B_m and I_m need the
                // input gradient of m from the stage after (its B_m or I_m,
                // both recorded as B_m); W_m needs nobody.
                let from = match a.kind {
                    ActionKind::Forward if s > 0 => Some(s - 1),
                    kind if kind.sends_input_gradient() && s + 1 < n => Some(s + 1),
                    _ => None,
                };
                let needed = gradient_sent(a);
                match from {
                    // Waiting is common; it is put in words only for a deadlock.
                    Some(o) if !ran_before(&forward_ran, &gradient_ran, o, needed) => {
                        stuck.push((s, next[s], needed, o))
                    }
                    _ => ran.push((s, gradient_sent(a))),
                }
            }
            if ran.is_empty() {
                if stuck.is_empty() {
                    return Ok(());
                }
                let waits: Vec<String> = stuck
                    .iter()
                    .map(|(s, at, a, o)| {
                        let action = self.stages[*s].actions[*at];
                        format!("stage {s} waits at action {at} ({action}) for {a} on stage {o}")
                    })
                    .collect();
                return Err(Error::invalid(format!("deadlock: {}", waits.join("; "))));
            }
            for &(s, a) in &ran {
                next[s] += 1;
                match (a.kind, a.micro_batch) {
                    (ActionKind::Forward, Some(m)) => forward_ran[s][m as usize] = true,
                    (ActionKind::Backward, Some(m)) => gradient_ran[s][m as usize] = true,
                    _ => {}
                }
            }
        }
    }
}

impl fmt::Display for Schedule {
    /// One line per stage, `stage 0: F0 F1 B0 ... AR OPT`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.stages.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{s}")?;
        }
        Ok(())
    }
}

/// Each rank's list of a pipeline order as (stage, action): its passes,
/// then each of its stages' AllReduce in the order their passes ended,
/// then their optimizer steps. What the simulator and the runtime run.
pub fn rank_lists(order: &PipelineOrder) -> Vec<Vec<(usize, Action)>> {
    order
        .rank_actions
        .iter()
        .map(|actions| {
            let mut list: Vec<(usize, Action)> = actions
                .iter()
                .map(|a| (a.stage as usize, Action::of_stage_action(a)))
                .collect();
            let mut finished: Vec<usize> = Vec::new();
            for a in actions.iter().rev() {
                if !finished.contains(&(a.stage as usize)) {
                    finished.push(a.stage as usize);
                }
            }
            finished.reverse();
            list.extend(finished.iter().map(|&s| (s, Action::ALL_REDUCE)));
            list.extend(finished.iter().map(|&s| (s, Action::OPTIMIZER_STEP)));
            list
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rank's row of torch's CSV.
    fn rows(order: &PipelineOrder) -> Vec<String> {
        order.to_csv().lines().map(str::to_string).collect()
    }

    #[test]
    fn as_a_pipeline_order_a_dapple_schedule_keeps_its_warm_up_depths_and_leaves_ar_and_opt_to_the_caller(
    ) {
        let early = Schedule::early_backward(3, 4, &[4, 2, 1]).unwrap();
        let order = early.pipeline_order().unwrap();
        assert_eq!(
            rows(&order),
            [
                "0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3",
                "1F0,1F1,1B0,1F2,1B1,1F3,1B2,1B3",
                "2F0,2B0,2F1,2B1,2F2,2B2,2F3,2B3",
            ]
        );
        let gpipe = Schedule::gpipe(2, 2).unwrap().pipeline_order().unwrap();
        assert_eq!(rows(&gpipe), ["0F0,0F1,0B1,0B0", "1F0,1F1,1B1,1B0"]);
        let xpipe = Schedule::asynchronous(crate::schedule::ScheduleKind::XPipe, 2, 2, 3).unwrap();
        let err = xpipe.pipeline_order().unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::Incompatible);
        assert!(err.to_string().contains("xpipe is asynchronous"), "{err}");
    }

    /// Non-empty lines of a literal table, trimmed.
    fn lines(text: &str) -> Vec<&str> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect()
    }

    /// A schedule from a table in Display form, not validated.
    fn table(m: u32, text: &str) -> Schedule {
        let stages = lines(text).into_iter().enumerate().map(|(stage, line)| {
            let rest = line.strip_prefix(&format!("stage {stage}:")).unwrap();
            let actions = rest
                .split_whitespace()
                .map(|t| t.parse().unwrap())
                .collect();
            StageSchedule { stage, actions }
        });
        let (kind, stages) = (ScheduleKind::EarlyBackward1F1B, stages.collect());
        Schedule {
            kind,
            micro_batches: m,
            mini_batches: 1,
            stages,
        }
    }

    fn check(s: Result<Schedule>, kind: ScheduleKind, text: &str) {
        let s = s.unwrap();
        assert_eq!(s.kind, kind);
        assert_eq!(s.stages, table(s.micro_batches, text).stages, "\n{s}");
        assert_eq!(s.to_string(), lines(text).join("\n"));
    }

    fn rejects(m: u32, text: &str, expected: &str) {
        let err = table(m, text).validate().unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::InvalidInput);
        assert_eq!(err.message, expected);
    }

    const EB: ScheduleKind = ScheduleKind::EarlyBackward1F1B;

    #[test]
    #[rustfmt::skip]
    fn literal_schedules() {
        check(Schedule::early_backward(2, 4, &[2, 1]), EB, "
            stage 0: F0 F1 B0 F2 B1 F3 B2 B3 AR OPT
            stage 1: F0 B0 F1 B1 F2 B2 F3 B3 AR OPT");
        // Policy A: K = [3, 2, 1].
        check(Schedule::early_backward_with_policy(3, 5, WarmupPolicy::A), EB, "
            stage 0: F0 F1 F2 B0 F3 B1 F4 B2 B3 B4 AR OPT
            stage 1: F0 F1 B0 F2 B1 F3 B2 F4 B3 B4 AR OPT
            stage 2: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 AR OPT");
        // Policy B: K = min(2(S - i) - 1, M) = [5, 3, 1]; stage 0 runs all
        // forwards first like GPipe, but backwards in forward order.
        check(Schedule::early_backward_with_policy(3, 5, WarmupPolicy::B), EB, "
            stage 0: F0 F1 F2 F3 F4 B0 B1 B2 B3 B4 AR OPT
            stage 1: F0 F1 F2 B0 F3 B1 F4 B2 B3 B4 AR OPT
            stage 2: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 AR OPT");
        check(Schedule::gpipe(2, 3), ScheduleKind::GPipe, "
            stage 0: F0 F1 F2 B2 B1 B0 AR OPT
            stage 1: F0 F1 F2 B2 B1 B0 AR OPT");
    }

    #[test]
    fn action_and_kind_round_trip() {
        for a in &Schedule::gpipe(1, 12).unwrap().stages[0].actions {
            assert_eq!(a.to_string().parse::<Action>().unwrap(), *a);
        }
        assert_eq!("F3".parse::<Action>().unwrap(), Action::forward(3));
        assert_eq!(Action::backward(2).to_string(), "B2");
        for bad in [
            "", "F", "B-1", "F+3", "F03", "f3", "AR0", "OPT1", "X2", "F3 ",
        ] {
            let err = bad.parse::<Action>().unwrap_err();
            assert!(err.message.contains(&format!("{bad:?}")), "{}", err.message);
        }
        for k in [ScheduleKind::EarlyBackward1F1B, ScheduleKind::GPipe] {
            assert_eq!(k.name().parse::<ScheduleKind>().unwrap(), k);
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
        let s = Schedule::early_backward(2, 2, &[2, 1]).unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), s);
    }

    #[test]
    fn generated_schedules_validate_with_peak_k_or_m() {
        for n in 1..=6 {
            for m in 1..=8 {
                for p in [WarmupPolicy::A, WarmupPolicy::B] {
                    let s = Schedule::early_backward_with_policy(n, m, p).unwrap();
                    for i in 0..n {
                        assert_eq!(Some(s.peak_in_flight(i)), p.warmup((n - i) as u32, m));
                    }
                }
                let g = Schedule::gpipe(n, m).unwrap();
                assert!((0..n).all(|i| g.peak_in_flight(i) == m));
            }
        }
        // Policy B capped at M: uncapped [7, 5, 3, 1].
        let s = Schedule::early_backward_with_policy(4, 5, WarmupPolicy::B).unwrap();
        assert_eq!(
            (0..4).map(|i| s.peak_in_flight(i)).collect::<Vec<_>>(),
            [5, 5, 3, 1]
        );
        assert_eq!(
            Schedule::early_backward(2, 4, &[2, 1])
                .unwrap()
                .peak_in_flight(0),
            2
        );
    }

    #[test]
    #[rustfmt::skip]
    fn validate_rejects_bad_stage_lists() {
        let ok = "stage 0: F0 B0 F1 B1 AR OPT";
        rejects(2, &format!("{ok}\nstage 1: F0 B0 AR OPT"), "stage 1: F1 is missing");
        for (m, text, expected) in [
            (2, "stage 0: F0 B0 F1 AR OPT",        "stage 0: B1 is missing"),
            (2, "stage 0: F0 F1 B0 B1 B1 AR OPT",  "stage 0: action 4 (B1) duplicates action 3"),
            (3, "stage 0: F0 F1 B0 B2 F2 B1 AR OPT", "stage 0: action 3 (B2) comes before F2"),
            (2, "stage 0: F0 B0 F1 AR B1 OPT",     "stage 0: action 3 (AR) comes before B1"),
            (2, "stage 0: F0 B0 F1 B1 AR AR OPT",  "stage 0: action 5 (AR) duplicates action 4"),
            (2, "stage 0: F0 B0 F1 B1 OPT AR",     "stage 0: action 4 (OPT) comes before the AR"),
            (2, "stage 0: F0 B0 F1 B1 AR OPT F0",  "stage 0: action 6 (F0) comes after OPT (action 5)"),
            (2, "stage 0: F0 B0 F1 B1 AR",         "stage 0: OPT is missing"),
            (2, "stage 0: F0 B0 F2 B1 AR OPT",     "stage 0: action 2 (F2) is out of range 0..2"),
        ] {
            rejects(m, text, expected);
        }
        let mut s = table(1, "stage 0: F0 B0 AR OPT");
        s.stages[0].actions[1].micro_batch = None;
        assert_eq!(s.validate().unwrap_err().message, "stage 0: action 1 (B?) has no micro-batch");
    }

    #[test]
    #[rustfmt::skip]
    fn validate_rejects_cross_stage_deadlock() {
        // Each list is fine alone: stage 0 wants B0 before F1, stage 1 wants F1 before B0.
        rejects(2, "
            stage 0: F0 B0 F1 B1 AR OPT
            stage 1: F0 F1 B0 B1 AR OPT",
            "deadlock: stage 0 waits at action 1 (B0) for B0 on stage 1; \
             stage 1 waits at action 1 (F1) for F1 on stage 0");
        // The generator validates: a later stage warming up deeper deadlocks.
        let err = Schedule::early_backward(3, 4, &[1, 2, 1]).unwrap_err();
        assert!(err.message.starts_with("deadlock: stage 0 waits at action 1 (B0)"), "{}", err.message);
        assert!(Schedule::early_backward(2, 4, &[2, 5]).is_err());
        assert!(Schedule::early_backward(2, 4, &[2]).is_err());
        assert!(Schedule::gpipe(0, 4).is_err());
    }

    #[test]
    fn zero_bubble_h1_as_a_table() {
        // torch's ZB1P order for one chunk (schedule/pipeline_order.rs holds it to
        // torch's class), each stage's list closed by AR and OPT.
        let zb = Schedule::zero_bubble_h1(3, 4).unwrap();
        assert_eq!(
            zb.to_string(),
            "stage 0: F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3 AR OPT\n\
             stage 1: F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3 AR OPT\n\
             stage 2: F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3 AR OPT"
        );
        // A micro-batch's activations stay until its W (as torch's
        // stage_backward_input keeps the graph for stage_backward_weight):
        // every stage holds up to S of them, where 1F1B's stage i holds S - i.
        let peaks: Vec<u32> = (0..3).map(|s| zb.peak_in_flight(s)).collect();
        assert_eq!(peaks, [3, 3, 3]);
        assert_eq!(
            rows(&zb.pipeline_order().unwrap())[2],
            "2F0,2I0,2F1,2I1,2F2,2I2,2W0,2F3,2I3,2W1,2W2,2W3"
        );
    }

    #[test]
    fn zero_bubble_h2_warms_up_to_policy_bs_depths_and_holds_up_to_2s_minus_1() {
        // The depths a plan records for ZB-H2 (`plan::warmup_depth`) are
        // its order's, for any shape; its stages hold min(2S - 1, M) once
        // M reaches S.
        use crate::cost::WarmupPolicy;
        use crate::plan::warmup_depth;
        for s in 1..=8usize {
            for m in 1..=20u32 {
                let zb = Schedule::zero_bubble_h2(s, m).unwrap();
                let order = zb.pipeline_order().unwrap();
                let depths: Vec<u32> = (0..s)
                    .map(|i| {
                        let from_here = (s - i) as u32;
                        warmup_depth(ScheduleKind::ZeroBubbleH2, WarmupPolicy::A, from_here, m)
                            .unwrap()
                    })
                    .collect();
                assert_eq!(
                    order.forwards_before_first_backward(),
                    depths,
                    "S {s} M {m}"
                );
                if m as usize >= s {
                    let most = (0..s).map(|i| zb.peak_in_flight(i)).max().unwrap();
                    assert_eq!(most, m.min(2 * s as u32 - 1), "S {s} M {m}");
                }
            }
        }
    }

    #[test]
    fn validate_rejects_a_split_backward_out_of_order() {
        let with = |first: &str| {
            let mut zb = Schedule::zero_bubble_h1(1, 2).unwrap();
            let text = format!("{first} AR OPT");
            zb.stages[0].actions = text.split(' ').map(|a| a.parse().unwrap()).collect();
            zb.validate().map_err(|e| e.to_string())
        };
        assert!(with("F0 I0 W0 F1 B1").is_ok());
        let cases = [
            ("F0 W0 I0 F1 B1", "action 1 (W0) comes before I0"),
            (
                "F0 B0 W0 F1 B1",
                "action 2 (W0) follows action 1 (B0), whose backward was whole",
            ),
            ("F0 I0 F1 B1", "W0 is missing (I0 ran)"),
            ("F0 I0 B0 W0 F1 B1", "action 2 (B0) duplicates action 1"),
            ("I0 F0 W0 F1 B1", "action 0 (I0) comes before F0"),
        ];
        for (list, why) in cases {
            let err = with(list).unwrap_err();
            assert!(err.contains(why), "{list}: {err}");
        }
        // An I waits for the stage after's I (or B) of the same micro-batch.
        let mut zb = Schedule::zero_bubble_h1(2, 1).unwrap();
        zb.stages[1].actions = ["F0", "W0", "I0", "AR", "OPT"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert!(zb
            .validate()
            .unwrap_err()
            .to_string()
            .contains("comes before I0"));
    }

    #[test]
    #[rustfmt::skip]
    fn asynchronous_schedules_as_tables() {
        // PipeDream's 1F1B over 4 mini-batches of 2: warm-up S - i, an
        // update after each mini-batch's last backward, no flush.
        let xpipe = Schedule::asynchronous(ScheduleKind::XPipe, 4, 2, 4).unwrap();
        assert_eq!(xpipe.to_string(), lines("
            stage 0: F0 F1 F2 F3 B0 F4 B1 AR OPT F5 B2 F6 B3 AR OPT F7 B4 B5 AR OPT B6 B7 AR OPT
            stage 1: F0 F1 F2 B0 F3 B1 AR OPT F4 B2 F5 B3 AR OPT F6 B4 F7 B5 AR OPT B6 B7 AR OPT
            stage 2: F0 F1 B0 F2 B1 AR OPT F3 B2 F4 B3 AR OPT F5 B4 F6 B5 AR OPT F7 B6 B7 AR OPT
            stage 3: F0 B0 F1 B1 AR OPT F2 B2 F3 B3 AR OPT F4 B4 F5 B5 AR OPT F6 B6 F7 B7 AR OPT").join("\n"));
        // The weights of each pass: `@v` the version they come from, `+s`
        // the updates predicted ahead by the mini-batch's bellwether.
        assert_eq!(xpipe.weights_table(), lines("
            stage 0: F0@0 F1@0 F2@0+1 F3@0+1 B0@0 F4@0+2 B1@0 AR OPT F5@0+2 B2@1 F6@1+2 B3@1 AR OPT F7@1+2 B4@2 B5@2 AR OPT B6@3 B7@3 AR OPT
            stage 1: F0@0 F1@0 F2@0+1 B0@0 F3@0+1 B1@0 AR OPT F4@1+1 B2@1 F5@1+1 B3@1 AR OPT F6@2+1 B4@2 F7@2+1 B5@2 AR OPT B6@3 B7@3 AR OPT
            stage 2: F0@0 F1@0 B0@0 F2@0+1 B1@0 AR OPT F3@0+1 B2@1 F4@1+1 B3@1 AR OPT F5@1+1 B4@2 F6@2+1 B5@2 AR OPT F7@2+1 B6@3 B7@3 AR OPT
            stage 3: F0@0 B0@0 F1@0 B1@0 AR OPT F2@1 B2@1 F3@1 B3@1 AR OPT F4@2 B4@2 F5@2 B5@2 AR OPT F6@3 B6@3 F7@3 B7@3 AR OPT").join("\n"));
        // Weight stashing: a backward uses its forward's version (stage 0's
        // B4 runs on version 0 though the live weights are at 2).
        let stash = Schedule::asynchronous(ScheduleKind::PipeDream, 4, 2, 3).unwrap();
        assert_eq!(stash.weights_table(), lines("
            stage 0: F0@0 F1@0 F2@0 F3@0 B0@0 F4@0 B1@0 AR OPT F5@1 B2@0 B3@0 AR OPT B4@0 B5@1 AR OPT
            stage 1: F0@0 F1@0 F2@0 B0@0 F3@0 B1@0 AR OPT F4@1 B2@0 F5@1 B3@0 AR OPT B4@1 B5@1 AR OPT
            stage 2: F0@0 F1@0 B0@0 F2@0 B1@0 AR OPT F3@1 B2@0 F4@1 B3@1 AR OPT F5@2 B4@1 B5@2 AR OPT
            stage 3: F0@0 B0@0 F1@0 B1@0 AR OPT F2@1 B2@1 F3@1 B3@1 AR OPT F4@2 B4@2 F5@2 B5@2 AR OPT").join("\n"));
        let live = Schedule::asynchronous(ScheduleKind::Async, 4, 2, 3).unwrap();
        assert_eq!(live.weights_table().lines().next().unwrap(),
            "stage 0: F0@0 F1@0 F2@0 F3@0 B0@0 F4@0 B1@0 AR OPT F5@1 B2@1 B3@1 AR OPT B4@2 B5@2 AR OPT");
    }

    /// XPipe's version differences (s of formulas (1) and (2)) of each
    /// stage's mini-batches: (forward, backward), read off the schedule.
    fn version_differences(s: &Schedule) -> Vec<Vec<(u32, u32)>> {
        (0..s.stages.len())
            .map(|stage| {
                let mut out = vec![(u32::MAX, u32::MAX); s.mini_batches as usize];
                for p in s.pass_weights(stage) {
                    let slot = &mut out[p.mini_batch as usize];
                    match p.action.kind {
                        ActionKind::Forward => slot.0 = p.predicted_updates,
                        _ => slot.1 = p.predicted_updates,
                    }
                }
                out
            })
            .collect()
    }

    #[test]
    #[rustfmt::skip]
    fn xpipe_version_differences_of_figure_1() {
        // Figure 1(a): 4 GPUs, 2 micro-batches per mini-batch.
        let a = Schedule::asynchronous(ScheduleKind::XPipe, 4, 2, 4).unwrap();
        assert_eq!(version_differences(&a), [
            vec![(0, 0), (1, 0), (2, 0), (2, 0)],
            vec![(0, 0), (1, 0), (1, 0), (1, 0)],
            vec![(0, 0), (1, 0), (1, 0), (1, 0)],
            vec![(0, 0), (0, 0), (0, 0), (0, 0)],
        ]);
        // The paper's sentence: GPU 0 runs the forward of the fifth
        // micro-batch (index 4) on the initial weights, and by its backward
        // the weights were updated twice, after the backwards of the second
        // and the fourth (indices 1 and 3).
        let gpu0 = a.pass_weights(0);
        let pass = |kind, t| gpu0.iter().find(|p| p.action == Action::new(kind, Some(t))).unwrap();
        assert_eq!(pass(ActionKind::Forward, 4).live_version, 0);
        assert_eq!(pass(ActionKind::Backward, 4).live_version, 2);
        let updated_after: Vec<String> = a.stages[0].actions.windows(2)
            .filter(|w| w[1] == Action::ALL_REDUCE)
            .map(|w| w[0].to_string())
            .take(2)
            .collect();
        assert_eq!(updated_after, ["B1", "B3"]);
        // Figure 1(b): 4 micro-batches per mini-batch.
        let b = Schedule::asynchronous(ScheduleKind::XPipe, 4, 4, 3).unwrap();
        assert_eq!(version_differences(&b), [
            vec![(0, 0), (1, 0), (1, 0)],
            vec![(0, 0), (1, 0), (1, 0)],
            vec![(0, 0), (1, 0), (1, 0)],
            vec![(0, 0), (0, 0), (0, 0)],
        ]);
    }

    #[test]
    fn xpipe_version_differences_follow_the_closed_form() {
        // s_forward(stage k, mini-batch n) = min(n, ceil((S - 1 - k) / M)),
        // s_backward = 0: the backward of mini-batch n comes after the
        // update of n - 1 on every stage.
        for n_stages in 1..=6usize {
            for m in 1..=5u32 {
                let s = Schedule::asynchronous(ScheduleKind::SpecTrain, n_stages, m, 6).unwrap();
                for (k, row) in version_differences(&s).iter().enumerate() {
                    for (n, &(fwd, bwd)) in row.iter().enumerate() {
                        let expected = (n as u32).min(((n_stages - 1 - k) as u32).div_ceil(m));
                        assert_eq!(
                            (fwd, bwd),
                            (expected, 0),
                            "S={n_stages} M={m} stage {k} mini-batch {n}"
                        );
                    }
                }
            }
        }
        // One stage: nothing to predict, every pass on the live weights.
        let one = Schedule::asynchronous(ScheduleKind::XPipe, 1, 3, 4).unwrap();
        assert!(one
            .pass_weights(0)
            .iter()
            .all(|p| p.predicted_updates == 0 && p.base_version == p.mini_batch));
    }

    #[test]
    #[rustfmt::skip]
    fn validate_rejects_bad_asynchronous_lists() {
        let asynchronous = |m: u32, n: u32, text: &str| {
            let mut s = table(m, text);
            (s.kind, s.mini_batches) = (ScheduleKind::Async, n);
            s.validate().unwrap_err().message
        };
        assert_eq!(asynchronous(1, 2, "stage 0: F0 B0 F1 B1 AR OPT AR OPT"),
            "stage 0: action 3 (B1) comes before the OPT of mini-batch 0");
        assert_eq!(asynchronous(1, 2, "stage 0: F0 F1 B0 AR OPT AR B1 OPT"),
            "stage 0: action 5 (AR of mini-batch 1) comes before B1");
        assert_eq!(asynchronous(1, 2, "stage 0: F0 B0 AR OPT F1 B1 AR"),
            "stage 0: OPT of mini-batch 1 is missing");
        assert_eq!(asynchronous(2, 2, "stage 0: F0 F1 B0 B1 AR OPT F2 B2 AR OPT"),
            "stage 0: F3 is missing");
        // Only the asynchronous kinds run several mini-batches.
        let mut s = Schedule::asynchronous(ScheduleKind::XPipe, 2, 2, 2).unwrap();
        assert!(s.validate().is_ok());
        s.kind = ScheduleKind::GPipe;
        assert_eq!(s.validate().unwrap_err().message, "schedule gpipe flushes after each mini-batch; it cannot run 2 at once");
        assert!(Schedule::asynchronous(ScheduleKind::GPipe, 2, 2, 2).is_err());
        assert!(Schedule::asynchronous(ScheduleKind::XPipe, 2, 2, 0).is_err());
        let err = Schedule::asynchronous(ScheduleKind::XPipe, 64, 4096, 2).unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::Limit);
        assert!(err.message.ends_with("at most 1 mini-batches at once"), "{}", err.message);
    }

    #[test]
    fn steady_state_runs_fit_the_work_limit() {
        // 4 stages of 2: 5 to fill, a window of 5, 5 to drain, and the update ending it.
        assert_eq!(steady_state_mini_batches(4, 2).unwrap(), 2 * 5 + 5 + 1);
        assert_eq!(steady_state_window(4, 2, 16), (5, 10));
        // The window is at least 4 mini-batches.
        assert_eq!(steady_state_mini_batches(1, 1).unwrap(), 2 * 2 + 4 + 1);
        assert_eq!(steady_state_window(1, 1, 9), (2, 6));
        // Near the limit the window shrinks, never below one mini-batch.
        assert_eq!(steady_state_mini_batches(3, 12_483).unwrap(), 7);
        assert_eq!(steady_state_window(3, 12_483, 7), (2, 4));
        assert!(steady_state_mini_batches(64, 4096).is_err());
    }
}
