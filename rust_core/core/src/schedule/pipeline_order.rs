//! Schedules whose ranks hold several stages, and whose backwards may split,
//! written as `torch.distributed.pipelining` writes them.
//!
//! A rank may hold v stages (chunks) of the model: a looped placement puts
//! stage s on rank s mod p (interleaved 1F1B), a V-shaped one puts stage s
//! on rank s for s < p and on rank 2p - 1 - s after (ZB-V, DualPipeV). A
//! backward runs whole (B), or split into its input gradient (I), which the
//! previous stage waits for, and its weight gradient (W), which nobody waits
//! for and so can fill a bubble (Zero Bubble, Qi et al., ICLR 2024).
//!
//! An action is written as torch's `_Action`: stage, computation,
//! micro-batch (`0F0`, `3I2`, `1W5`). A rank's list is one row of torch's
//! schedule CSV (`_dump_csv` / `_load_csv`, format `compute_only`), without
//! the empty slots torch pads its rows with: a rank runs its actions in
//! order, each when its inputs are there.
//!
//! The generators reproduce torch's own schedule classes (tests compare them
//! action by action), and every order is checked by a dry run that finds
//! deadlocks ([`PipelineOrder::validate`]). The same dry run with each
//! stage's costs gives the iteration, each rank's busy time and its
//! activations held over time ([`PipelineOrder::run`]).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// What an action computes, written as torch writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Computation {
    /// `F`: the stage's forward.
    Forward,
    /// `B`: the whole backward, input and weight gradients together.
    FullBackward,
    /// `I`: the backward to the stage's input, which the previous stage needs.
    BackwardInput,
    /// `W`: the backward to the stage's weights, after its `I`.
    BackwardWeight,
}

impl Computation {
    pub const ALL: [Computation; 4] = [
        Computation::Forward,
        Computation::FullBackward,
        Computation::BackwardInput,
        Computation::BackwardWeight,
    ];

    /// torch's letter for the computation (`_ComputationType.__str__`).
    pub const fn symbol(self) -> char {
        match self {
            Computation::Forward => 'F',
            Computation::FullBackward => 'B',
            Computation::BackwardInput => 'I',
            Computation::BackwardWeight => 'W',
        }
    }

    pub fn from_symbol(symbol: char) -> Option<Computation> {
        Computation::ALL.into_iter().find(|c| c.symbol() == symbol)
    }

    /// Which of a stage's three passes over a micro-batch this is: 0 the
    /// forward, 1 the backward the previous stage waits for (B or I), 2
    /// the weight gradient.
    const fn phase(self) -> usize {
        match self {
            Computation::Forward => 0,
            Computation::FullBackward | Computation::BackwardInput => 1,
            Computation::BackwardWeight => 2,
        }
    }
}

/// One action of a rank: `computation` of `stage` on `micro_batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StageAction {
    pub stage: u32,
    pub computation: Computation,
    pub micro_batch: u32,
}

impl StageAction {
    pub const fn new(stage: u32, computation: Computation, micro_batch: u32) -> StageAction {
        StageAction {
            stage,
            computation,
            micro_batch,
        }
    }
}

impl fmt::Display for StageAction {
    /// `1F3`, as torch's `_Action.__repr__` writes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}{}",
            self.stage,
            self.computation.symbol(),
            self.micro_batch
        )
    }
}

impl FromStr for StageAction {
    type Err = Error;

    /// A stage, one of `F`, `B`, `I`, `W`, a micro-batch: decimal numbers
    /// without sign or leading zeros.
    fn from_str(s: &str) -> Result<StageAction> {
        let bad = || {
            Error::invalid(format!(
                "action {s:?} is not <stage><F|B|I|W><micro-batch>, as in 0F0"
            ))
        };
        let letter_at = s.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (stage, rest) = s.split_at(letter_at);
        let mut chars = rest.chars();
        let computation = chars
            .next()
            .and_then(Computation::from_symbol)
            .ok_or_else(bad)?;
        let micro_batch = chars.as_str();
        let number = |digits: &str| {
            let canonical = !digits.is_empty()
                && digits.bytes().all(|b| b.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'));
            digits.parse::<u32>().ok().filter(|_| canonical)
        };
        Ok(StageAction::new(
            number(stage).ok_or_else(bad)?,
            computation,
            number(micro_batch).ok_or_else(bad)?,
        ))
    }
}

/// What one stage's passes take, for a dry run with times.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageCosts {
    pub forward_ms: f64,
    /// The whole backward (B).
    pub backward_ms: f64,
    /// The backward split: its input gradient (I) and weight gradient (W).
    pub backward_input_ms: f64,
    pub backward_weight_ms: f64,
    /// Sending the stage's output on, or its input's gradient back, to a
    /// stage on another rank.
    pub send_ms: f64,
    /// What one micro-batch keeps from its forward until its backward is
    /// whole.
    pub activation_bytes: f64,
}

impl StageCosts {
    /// Costs with the backward split evenly between I and W, nothing sent
    /// and nothing kept: the closed forms' setting.
    pub fn equal_passes(forward_ms: f64, backward_ms: f64) -> StageCosts {
        StageCosts {
            forward_ms,
            backward_ms,
            backward_input_ms: backward_ms / 2.0,
            backward_weight_ms: backward_ms / 2.0,
            send_ms: 0.0,
            activation_bytes: 0.0,
        }
    }

    fn of(&self, c: Computation) -> f64 {
        match c {
            Computation::Forward => self.forward_ms,
            Computation::FullBackward => self.backward_ms,
            Computation::BackwardInput => self.backward_input_ms,
            Computation::BackwardWeight => self.backward_weight_ms,
        }
    }
}

/// A pipeline order's dry run with times ([`PipelineOrder::run`]).
#[derive(Debug, Clone, PartialEq)]
pub struct OrderRun {
    /// From the first forward to the last rank's last action.
    pub iteration_ms: f64,
    /// Each rank's time computing.
    pub busy_ms: Vec<f64>,
    /// When each rank's last action ends.
    pub finish_ms: Vec<f64>,
    /// The most activation bytes each rank held at once.
    pub peak_activation_bytes: Vec<f64>,
}

impl OrderRun {
    /// The share of the ranks' time spent waiting: 1 - busy / (ranks x iteration).
    pub fn bubble_fraction(&self) -> f64 {
        let busy: f64 = self.busy_ms.iter().sum();
        1.0 - busy / (self.busy_ms.len() as f64 * self.iteration_ms)
    }
}

/// Every rank's list of actions, and the rank each stage lives on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineOrder {
    pub micro_batches: u32,
    /// `stage_ranks[s]`: the rank that runs stage s.
    pub stage_ranks: Vec<u32>,
    /// `rank_actions[r]`: rank r's actions, in the order it runs them.
    pub rank_actions: Vec<Vec<StageAction>>,
    /// `overlapped[r]`: the positions k of rank r's list where actions k
    /// and k + 1, a forward and a whole backward of other micro-batches,
    /// run as one (DualPipeV; torch's `OVERLAP_F_B`, written
    /// `(0F3;3B1)OVERLAP_F_B`), ascending. Empty: none on any rank.
    pub overlapped: Vec<Vec<usize>>,
}

/// torch's name of an overlapped forward and backward (`_ComputationType`).
const OVERLAP_F_B: &str = "OVERLAP_F_B";

/// Where a stage lives: looped (stage s on rank s mod p) or V-shaped
/// (down the ranks, then back up), as torch's
/// `generate_stage_to_rank_mapping`.
pub fn stage_ranks(ranks: u32, stages: u32, v_shape: bool) -> Vec<u32> {
    (0..stages)
        .map(|s| {
            let (lap, at) = (s / ranks, s % ranks);
            if v_shape && lap % 2 == 1 {
                ranks - 1 - at
            } else {
                at
            }
        })
        .collect()
}

fn check_shape(ranks: u32, micro_batches: u32, chunks: u32) -> Result<()> {
    if ranks == 0 || micro_batches == 0 || chunks == 0 {
        return Err(Error::invalid(format!(
            "a pipeline order needs at least one rank, micro-batch and chunk, \
             got {ranks}, {micro_batches} and {chunks}"
        )));
    }
    // The work limit's unit: a stage's micro-batch (its F and its B, or
    // its I and W), as a schedule counts them.
    let passes = u64::from(ranks) * u64::from(chunks) * u64::from(micro_batches);
    if passes > crate::cost::work_limit::max_passes() {
        return Err(Error::limit(format!(
            "{ranks} ranks x {chunks} chunks x {micro_batches} micro-batches is over the limit \
             of {} passes one schedule holds; use fewer, larger micro-batches, or raise the \
             limit (--max-passes)",
            crate::cost::work_limit::max_passes()
        )));
    }
    Ok(())
}

/// Micro-batches per round of torch's interleaved schedules: the
/// micro-batches split into max(1, n / p) equal rounds.
fn micro_batches_per_round(ranks: u32, micro_batches: u32) -> Result<u32> {
    let rounds = (micro_batches / ranks).max(1);
    if !micro_batches.is_multiple_of(rounds) {
        return Err(Error::invalid(format!(
            "interleaved schedules run the micro-batches in {rounds} equal rounds \
             (micro-batches / ranks), and {micro_batches} micro-batches do not split into them"
        )));
    }
    Ok(micro_batches / rounds)
}

/// One rank of torch's interleaved 1F1B family (`_get_1f1b_rank_ops`):
/// `warmup` forwards, then a forward and a backward in turn, then the
/// remaining backwards; the chunk of each comes round every `per_round`
/// steps. With `zero_bubble_after`, backwards are `I` and each is followed
/// by the `W` of the oldest backward once that many 1F1B steps have passed
/// (torch's ZB1P), the remaining `W`s at the end.
struct InterleavedRank {
    rank: u32,
    ranks: u32,
    chunks: u32,
    micro_batches: u32,
    per_round: u32,
    warmup: u32,
    zero_bubble_after: Option<u32>,
}

impl InterleavedRank {
    fn forward_stage(&self, step: u32) -> u32 {
        (step / self.per_round % self.chunks) * self.ranks + self.rank
    }

    fn backward_stage(&self, step: u32) -> u32 {
        let chunk = self.chunks - 1 - ((step - self.warmup) / self.per_round) % self.chunks;
        chunk * self.ranks + self.rank
    }

    fn actions(&self) -> Vec<StageAction> {
        let stages = (self.chunks * self.ranks) as usize;
        let mut next = [vec![0u32; stages], vec![0u32; stages], vec![0u32; stages]];
        let mut take = |c: Computation, stage: u32| {
            let m = next[c.phase()][stage as usize];
            next[c.phase()][stage as usize] += 1;
            StageAction::new(stage, c, m)
        };
        let backward = match self.zero_bubble_after {
            Some(_) => Computation::BackwardInput,
            None => Computation::FullBackward,
        };
        let total = self.chunks * self.micro_batches;
        let mut out = Vec::new();
        let mut backward_steps = Vec::new();
        let mut weights_done = 0usize;
        for step in 0..total + self.warmup {
            if step < total {
                out.push(take(Computation::Forward, self.forward_stage(step)));
            }
            if step < self.warmup {
                continue;
            }
            out.push(take(backward, self.backward_stage(step)));
            backward_steps.push(step);
            if self
                .zero_bubble_after
                .is_some_and(|after| step - self.warmup >= after)
            {
                let stage = self.backward_stage(backward_steps[weights_done]);
                out.push(take(Computation::BackwardWeight, stage));
                weights_done += 1;
            }
        }
        if self.zero_bubble_after.is_some() {
            for &step in &backward_steps[weights_done..] {
                out.push(take(Computation::BackwardWeight, self.backward_stage(step)));
            }
        }
        out
    }
}

impl PipelineOrder {
    /// Interleaved 1F1B (Narayanan et al., 2021) over `ranks` ranks holding
    /// `chunks` looped stages each, as torch's `ScheduleInterleaved1F1B`:
    /// rank r warms up with (v - 1) x (micro-batches per round) + 2 (p - 1 - r)
    /// forwards, depth first. `chunks` = 1 is plain 1F1B.
    pub fn interleaved_1f1b(ranks: u32, micro_batches: u32, chunks: u32) -> Result<PipelineOrder> {
        Self::interleaved(ranks, micro_batches, chunks, false)
    }

    /// Interleaved zero bubble (torch's `ScheduleInterleavedZeroBubble`, the
    /// paper's ZB1P; ZB-H1 at `chunks` = 1): as interleaved 1F1B with
    /// p - 1 - r fewer warm-up forwards, each backward split into I and W,
    /// and rank r deferring its first r W's to fill the drain.
    pub fn interleaved_zero_bubble(
        ranks: u32,
        micro_batches: u32,
        chunks: u32,
    ) -> Result<PipelineOrder> {
        Self::interleaved(ranks, micro_batches, chunks, true)
    }

    fn interleaved(
        ranks: u32,
        micro_batches: u32,
        chunks: u32,
        zero_bubble: bool,
    ) -> Result<PipelineOrder> {
        check_shape(ranks, micro_batches, chunks)?;
        let per_round = micro_batches_per_round(ranks, micro_batches)?;
        let hops = if zero_bubble { 1 } else { 2 };
        let rank_actions = (0..ranks)
            .map(|rank| {
                let warmup = ((chunks - 1) * per_round + hops * (ranks - 1 - rank))
                    .min(micro_batches * chunks);
                InterleavedRank {
                    rank,
                    ranks,
                    chunks,
                    micro_batches,
                    per_round,
                    warmup,
                    zero_bubble_after: zero_bubble.then_some(rank),
                }
                .actions()
            })
            .collect();
        let order = PipelineOrder {
            micro_batches,
            stage_ranks: stage_ranks(ranks, ranks * chunks, false),
            rank_actions,
            overlapped: Vec::new(),
        };
        order.validate()?;
        Ok(order)
    }

    /// ZB-V (Qi et al., section 6; torch's `ScheduleZBVZeroBubble`): two
    /// V-shaped chunks a rank, rank r holding stages r and 2p - 1 - r.
    /// Fills the pipeline as if there were at least 2p - 1 micro-batches,
    /// then leaves out the passes of those that do not exist.
    pub fn zbv(ranks: u32, micro_batches: u32) -> Result<PipelineOrder> {
        check_shape(ranks, micro_batches, 2)?;
        let rank_actions = (0..ranks)
            .map(|rank| {
                zbv_rank(rank, ranks, micro_batches.max(2 * ranks - 1))
                    .into_iter()
                    .filter(|a| a.micro_batch < micro_batches)
                    .collect()
            })
            .collect();
        let order = PipelineOrder {
            micro_batches,
            stage_ranks: stage_ranks(ranks, 2 * ranks, true),
            rank_actions,
            overlapped: Vec::new(),
        };
        order.validate()?;
        Ok(order)
    }

    /// DualPipeV (DeepSeek-V3's DualPipe folded into a V; torch's
    /// `ScheduleDualPipeV`): two V-shaped chunks a rank, as ZB-V, with at
    /// least 2p micro-batches. In its steady state each rank runs a forward
    /// of one chunk overlapped with a whole backward of the other, so that
    /// each one's communication can hide under the other's compute; it
    /// splits backwards into I and W only where that fills the fill and
    /// the drain.
    pub fn dualpipev(ranks: u32, micro_batches: u32) -> Result<PipelineOrder> {
        check_shape(ranks, micro_batches, 2)?;
        if micro_batches < 2 * ranks {
            return Err(Error::invalid(format!(
                "DualPipeV needs at least as many micro-batches as stages: {micro_batches} \
                 micro-batches for {} stages",
                2 * ranks
            )));
        }
        let (rank_actions, overlapped) = (0..ranks)
            .map(|rank| DualPipeRank::new(rank, ranks).actions(micro_batches))
            .unzip();
        let order = PipelineOrder {
            micro_batches,
            stage_ranks: stage_ranks(ranks, 2 * ranks, true),
            rank_actions,
            overlapped,
        };
        order.validate()?;
        Ok(order)
    }

    /// ZB-H2 (Qi et al., ICLR 2024, section 2.2), one stage a rank: the
    /// zero-bubble schedule that holds up to 2p - 1 micro-batches' activations
    /// where ZB-H1 holds p. Rank r warms up with 2(p - r) - 1 forwards,
    /// then runs I, F and W so that at F = I = W every rank computes without
    /// a pause from its first forward to its last W once m >= 2p - 1 (a
    /// parallelogram: rank r busy from r to r + 3m), its Ws filling where
    /// ZB-H1's ranks wait. torch ships no class for it; the order is the
    /// paper's rule run at unit times ([`zb_h2_lists`]).
    pub fn zb_h2(ranks: u32, micro_batches: u32) -> Result<PipelineOrder> {
        check_shape(ranks, micro_batches, 1)?;
        let order = PipelineOrder {
            micro_batches,
            stage_ranks: (0..ranks).collect(),
            rank_actions: zb_h2_lists(ranks, micro_batches),
            overlapped: Vec::new(),
        };
        order.validate()?;
        Ok(order)
    }

    pub fn ranks(&self) -> usize {
        self.rank_actions.len()
    }

    pub fn stages(&self) -> usize {
        self.stage_ranks.len()
    }

    /// Each stage's forwards in its rank's list before the stage's first
    /// backward (B or I): a chunk's warm-up depth, as early backward's K_i
    /// is a stage's.
    pub fn forwards_before_first_backward(&self) -> Vec<u32> {
        let mut depth = vec![0u32; self.stages()];
        let mut backward_seen = vec![false; self.stages()];
        for a in self.rank_actions.iter().flatten() {
            let s = a.stage as usize;
            match a.computation {
                Computation::Forward if !backward_seen[s] => depth[s] += 1,
                Computation::FullBackward | Computation::BackwardInput => backward_seen[s] = true,
                _ => {}
            }
        }
        depth
    }

    /// The order run with `costs[s]` for stage s: each rank runs its next
    /// action once the actions it waits for are done and their outputs
    /// have crossed to it (`send_ms` between stages on different ranks; a
    /// latency, links are not shared). A deadlock is an error naming where
    /// each rank waits.
    pub fn run(&self, costs: &[StageCosts]) -> Result<OrderRun> {
        if costs.len() != self.stages() {
            return Err(Error::invalid(format!(
                "{} stage costs given for {} stages",
                costs.len(),
                self.stages()
            )));
        }
        let stages = self.stages();
        let m = self.micro_batches as usize;
        // done[phase][s * m + mb]: when that phase of stage s on mb finished.
        let mut done = vec![vec![None::<f64>; stages * m]; 3];
        let crossing = |from: usize, to: usize, sender: usize| {
            if self.stage_ranks[from] == self.stage_ranks[to] {
                0.0
            } else {
                costs[sender].send_ms
            }
        };
        let ranks = self.ranks();
        let (mut next, mut free_at) = (vec![0usize; ranks], vec![0.0f64; ranks]);
        let (mut busy, mut held, mut peak) = (vec![0.0; ranks], vec![0.0; ranks], vec![0.0; ranks]);
        loop {
            let mut moved = false;
            for (rank, actions) in self.rank_actions.iter().enumerate() {
                while let Some(&a) = actions.get(next[rank]) {
                    let (s, mb) = (a.stage as usize, a.micro_batch as usize);
                    let ready = match a.computation {
                        Computation::Forward if s == 0 => Some(0.0),
                        Computation::Forward => {
                            done[0][(s - 1) * m + mb].map(|t| t + crossing(s - 1, s, s - 1))
                        }
                        Computation::BackwardWeight => done[1][s * m + mb],
                        _ if s + 1 == stages => done[0][s * m + mb],
                        _ => done[1][(s + 1) * m + mb].map(|t| t + crossing(s + 1, s, s)),
                    };
                    let Some(ready) = ready else { break };
                    let took = costs[s].of(a.computation);
                    let end = ready.max(free_at[rank]) + took;
                    done[a.computation.phase()][s * m + mb] = Some(end);
                    (free_at[rank], busy[rank]) = (end, busy[rank] + took);
                    // A micro-batch's activations are kept from its forward
                    // until its backward is whole (B, or W after I).
                    match a.computation {
                        Computation::Forward => {
                            held[rank] += costs[s].activation_bytes;
                            peak[rank] = f64::max(peak[rank], held[rank]);
                        }
                        Computation::FullBackward | Computation::BackwardWeight => {
                            held[rank] -= costs[s].activation_bytes;
                        }
                        Computation::BackwardInput => {}
                    }
                    next[rank] += 1;
                    moved = true;
                }
            }
            if next
                .iter()
                .zip(&self.rank_actions)
                .all(|(&n, a)| n == a.len())
            {
                return Ok(OrderRun {
                    iteration_ms: free_at.iter().copied().fold(0.0, f64::max),
                    busy_ms: busy,
                    finish_ms: free_at,
                    peak_activation_bytes: peak,
                });
            }
            if !moved {
                let waits: Vec<String> = (0..ranks)
                    .filter_map(|r| {
                        let a = self.rank_actions[r].get(next[r])?;
                        Some(format!("rank {r} at {a}"))
                    })
                    .collect();
                return Err(Error::invalid(format!(
                    "the pipeline order deadlocks: {}",
                    waits.join(", ")
                )));
            }
        }
    }

    /// Every stage runs on its own rank, each (stage, micro-batch) has one
    /// forward and either one `B` or one `I` and one `W`, and the ranks
    /// finish (a dry run, [`PipelineOrder::run`] at unit times).
    pub fn validate(&self) -> Result<()> {
        let (stages, m) = (self.stages(), self.micro_batches as usize);
        let actions: usize = self.rank_actions.iter().map(Vec::len).sum();
        // Each (stage, micro-batch) needs its passes: checked before
        // counting them, so a large count given by hand allocates nothing.
        if stages.saturating_mul(m) > actions {
            return Err(Error::invalid(format!(
                "{actions} actions cannot hold a forward for each of {stages} stages x {m} \
                 micro-batches"
            )));
        }
        self.validate_overlaps()?;
        let mut seen = vec![[0u32; 4]; stages * m];
        for (rank, actions) in self.rank_actions.iter().enumerate() {
            for a in actions {
                let owner = self.stage_ranks.get(a.stage as usize);
                if owner != Some(&(rank as u32)) || a.micro_batch as usize >= m {
                    return Err(Error::invalid(format!(
                        "rank {rank}: action {a} names a stage that is not this rank's \
                         or a micro-batch past {}",
                        self.micro_batches
                    )));
                }
                let kind = Computation::ALL
                    .iter()
                    .position(|&c| c == a.computation)
                    .expect("every computation is in ALL");
                seen[a.stage as usize * m + a.micro_batch as usize][kind] += 1;
            }
        }
        for (i, counts) in seen.iter().enumerate() {
            let [f, b, inp, w] = *counts;
            if f != 1 || !matches!((b, inp, w), (1, 0, 0) | (0, 1, 1)) {
                return Err(Error::invalid(format!(
                    "stage {} micro-batch {}: {f} forwards, {b} whole backwards, {inp} input and \
                     {w} weight backwards; each needs one forward and one B, or one I and one W",
                    i / m,
                    i % m
                )));
            }
        }
        let unit = StageCosts::equal_passes(1.0, 1.0);
        self.run(&vec![unit; self.stages()]).map(|_| ())
    }

    /// The positions of rank `rank`'s list that begin an overlapped pair.
    fn overlaps_of(&self, rank: usize) -> &[usize] {
        self.overlapped.get(rank).map_or(&[], Vec::as_slice)
    }

    /// Each rank's cells as torch writes its actions: one a cell, an
    /// overlapped pair as `(0F3;3B1)OVERLAP_F_B`.
    pub fn rank_cells(&self) -> Vec<Vec<String>> {
        (0..self.ranks())
            .map(|rank| {
                let (row, pairs) = (&self.rank_actions[rank], self.overlaps_of(rank));
                let mut cells = Vec::with_capacity(row.len());
                let mut k = 0;
                while k < row.len() {
                    if pairs.binary_search(&k).is_ok() {
                        cells.push(format!("({};{}){OVERLAP_F_B}", row[k], row[k + 1]));
                        k += 2;
                    } else {
                        cells.push(row[k].to_string());
                        k += 1;
                    }
                }
                cells
            })
            .collect()
    }

    /// Each overlapped pair is a forward and a whole backward, inside its
    /// rank's list, no two sharing an action.
    fn validate_overlaps(&self) -> Result<()> {
        if !self.overlapped.is_empty() && self.overlapped.len() != self.ranks() {
            return Err(Error::invalid(format!(
                "overlapped pairs are given for {} ranks of {}",
                self.overlapped.len(),
                self.ranks()
            )));
        }
        for (rank, pairs) in self.overlapped.iter().enumerate() {
            let row = &self.rank_actions[rank];
            let mut free_from = 0;
            for &k in pairs {
                let pair = row.get(k).zip(row.get(k + 1));
                let kinds = pair.map(|(f, b)| (f.computation, b.computation));
                if k < free_from || kinds != Some((Computation::Forward, Computation::FullBackward))
                {
                    return Err(Error::invalid(format!(
                        "rank {rank}: the overlapped pair at action {k} is not a forward and a whole \
                         backward of its own, in order"
                    )));
                }
                free_from = k + 2;
            }
        }
        Ok(())
    }

    /// torch's schedule CSV (`compute_only`): one row per rank.
    pub fn to_csv(&self) -> String {
        self.rank_cells()
            .into_iter()
            .map(|cells| cells.join(",") + "\n")
            .collect()
    }

    /// A pipeline order from torch's CSV: one row per rank, a cell per
    /// action, empty cells (torch's idle slots) skipped. The rank of each
    /// stage is read off the rows; the order is validated.
    pub fn from_csv(text: &str, micro_batches: u32) -> Result<PipelineOrder> {
        let (mut rank_actions, mut overlapped) = (Vec::new(), Vec::new());
        for (row, line) in text.lines().enumerate() {
            let (mut actions, mut pairs) = (Vec::new(), Vec::new());
            for cell in line.split(',').map(str::trim).filter(|c| !c.is_empty()) {
                let parsed = match overlapped_pair(cell) {
                    Some(pair) => {
                        pairs.push(actions.len());
                        pair.map(|(f, b)| vec![f, b])
                    }
                    None => cell.parse().map(|a| vec![a]),
                };
                actions.extend(parsed.map_err(|e: Error| e.under(&format!("row {row}")))?);
            }
            rank_actions.push(actions);
            overlapped.push(pairs);
        }
        if overlapped.iter().all(Vec::is_empty) {
            overlapped.clear();
        }
        let stages = rank_actions
            .iter()
            .flatten()
            .map(|a| a.stage as usize + 1)
            .max()
            .unwrap_or(0);
        let actions: usize = rank_actions.iter().map(Vec::len).sum();
        if stages > actions {
            return Err(Error::invalid(format!(
                "stage {} is past the {actions} actions the rows hold: every stage needs actions",
                stages - 1
            )));
        }
        let mut stage_ranks = vec![u32::MAX; stages];
        for (rank, actions) in rank_actions.iter().enumerate() {
            for a in actions {
                stage_ranks[a.stage as usize] = rank as u32;
            }
        }
        if let Some(s) = stage_ranks.iter().position(|&r| r == u32::MAX) {
            return Err(Error::invalid(format!("stage {s} has no actions")));
        }
        let order = PipelineOrder {
            micro_batches,
            stage_ranks,
            rank_actions,
            overlapped,
        };
        order.validate()?;
        Ok(order)
    }
}

/// The two actions of a cell written `(0F3;3B1)OVERLAP_F_B`, or None for a
/// cell of another form.
fn overlapped_pair(cell: &str) -> Option<Result<(StageAction, StageAction)>> {
    let inner = cell
        .strip_prefix('(')?
        .strip_suffix(OVERLAP_F_B)?
        .strip_suffix(')')?;
    let bad = || {
        Error::invalid(format!(
            "cell {cell:?} is not an overlapped forward and whole backward, as in (0F3;3B1){OVERLAP_F_B}"
        ))
    };
    Some((|| {
        let (f, b) = inner.split_once(';').ok_or_else(bad)?;
        let (f, b): (StageAction, StageAction) = (f.parse()?, b.parse()?);
        let kinds = (f.computation, b.computation);
        if kinds != (Computation::Forward, Computation::FullBackward) {
            return Err(bad());
        }
        Ok((f, b))
    })())
}

/// One rank of DualPipeV, as torch's
/// `ScheduleDualPipeV._calculate_single_rank_operations`: its actions and
/// the positions of its overlapped pairs.
struct DualPipeRank {
    rank: u32,
    ranks: u32,
    /// The rank's two stages: going down the ranks, and back up.
    stage: [u32; 2],
    /// Passes begun per chunk: forwards, and backwards (I or B).
    forwards: [u32; 2],
    backwards: [u32; 2],
    /// (chunk, micro-batch) of each I whose W is still to run, oldest first.
    pending_weights: std::collections::VecDeque<(usize, u32)>,
    actions: Vec<StageAction>,
    overlapped: Vec<usize>,
}

impl DualPipeRank {
    fn new(rank: u32, ranks: u32) -> DualPipeRank {
        DualPipeRank {
            rank,
            ranks,
            stage: [rank, 2 * ranks - 1 - rank],
            forwards: [0; 2],
            backwards: [0; 2],
            pending_weights: Default::default(),
            actions: Vec::new(),
            overlapped: Vec::new(),
        }
    }

    fn forward(&mut self, chunk: usize) {
        let mb = self.forwards[chunk];
        self.forwards[chunk] += 1;
        self.actions.push(StageAction::new(
            self.stage[chunk],
            Computation::Forward,
            mb,
        ));
    }

    /// A whole backward (B), or its input half (I) with the W queued.
    fn backward(&mut self, chunk: usize, split: bool) {
        let mb = self.backwards[chunk];
        self.backwards[chunk] += 1;
        let computation = if split {
            self.pending_weights.push_back((chunk, mb));
            Computation::BackwardInput
        } else {
            Computation::FullBackward
        };
        self.actions
            .push(StageAction::new(self.stage[chunk], computation, mb));
    }

    /// The oldest queued W, if any.
    fn weight(&mut self) {
        if let Some((chunk, mb)) = self.pending_weights.pop_front() {
            self.actions.push(StageAction::new(
                self.stage[chunk],
                Computation::BackwardWeight,
                mb,
            ));
        }
    }

    /// A forward of `chunk` overlapped with a whole backward of the other.
    fn overlapped_pair(&mut self, chunk: usize) {
        self.overlapped.push(self.actions.len());
        self.forward(chunk);
        self.backward(1 - chunk, false);
    }

    fn actions(mut self, micro_batches: u32) -> (Vec<StageAction>, Vec<usize>) {
        let (r, p) = (self.rank, self.ranks);
        // 1. Forwards of the down chunk, 2 (p - r - 1).
        for _ in 0..2 * (p - r - 1) {
            self.forward(0);
        }
        // 2. Down and up forwards in turn.
        for _ in 0..=r {
            self.forward(0);
            self.forward(1);
        }
        // 3. Zero bubble on the up chunk: I, the oldest W, a forward.
        for _ in 0..p - r - 1 {
            self.backward(1, true);
            self.weight();
            self.forward(1);
        }
        // 4. The steady state: each chunk's forward overlapped with the
        // other's backward (the last rank's first pair is not overlapped).
        for i in 0..micro_batches - 2 * p + r + 1 {
            if i == 0 && r == p - 1 {
                self.forward(0);
                self.backward(1, false);
            } else {
                self.overlapped_pair(0);
            }
            self.overlapped_pair(1);
        }
        // 5. The up chunk's backward, then an up forward with a down backward.
        for _ in 0..p - r - 1 {
            self.backward(1, false);
            self.overlapped_pair(1);
        }
        // 6. Backwards of both chunks, split from half-way on (odd ranks
        // split the up chunk's first).
        let mut split = false;
        let half = r.div_ceil(2); // torch's (r + 1) // 2: half of the r + 1 steps
        for i in 0..=r {
            split |= i == half && r % 2 == 1;
            self.backward(1, split);
            split |= i == half && r % 2 == 0;
            self.backward(0, split);
        }
        // 7. A W and a down backward in turn; 8. the W's left.
        for _ in 0..p - r - 1 {
            self.weight();
            self.backward(0, split);
        }
        for _ in 0..=r {
            self.weight();
        }
        (self.actions, self.overlapped)
    }
}

/// One rank of ZB-V over `n` micro-batches (n >= 2p - 1), as torch's
/// `ScheduleZBVZeroBubble._calculate_single_rank_operations`.
/// ZB-H2's lists: the ranks run at unit times (F = I = W, nothing
/// sent), each taking, of the passes it can start soonest, an I before an
/// F before a W, and an F only while fewer than 2p - 1 of its micro-batches
/// wait for their W. The only place ZB-H2's order is written.
fn zb_h2_lists(ranks: u32, micro_batches: u32) -> Vec<Vec<StageAction>> {
    use Computation::{BackwardInput as I, BackwardWeight as W, Forward as F};
    let (p, m) = (ranks as usize, micro_batches);
    let in_flight_cap = 2 * ranks - 1;
    // When each stage's F and I of each micro-batch end, in unit steps.
    let mut f_end: Vec<Vec<u64>> = vec![Vec::new(); p];
    let mut i_end: Vec<Vec<u64>> = vec![Vec::new(); p];
    let (mut w_done, mut free_at) = (vec![0u32; p], vec![0u64; p]);
    let mut lists = vec![Vec::new(); p];
    // A stage's next pass: when it can start, and which.
    let next_pass = |s: usize, f_end: &[Vec<u64>], i_end: &[Vec<u64>], w: u32, free: u64| {
        let (f, i) = (f_end[s].len() as u32, i_end[s].len() as u32);
        let forward = if f == m || f - w >= in_flight_cap {
            None
        } else if s == 0 {
            Some(free)
        } else {
            f_end[s - 1].get(f as usize).map(|&t| t.max(free))
        };
        let input = if i == f {
            None
        } else if s + 1 == p {
            Some(f_end[s][i as usize].max(free))
        } else {
            i_end[s + 1].get(i as usize).map(|&t| t.max(free))
        };
        let weight = (w < i).then_some(free);
        // The first of the soonest: I, then F, then W.
        [(input, I), (forward, F), (weight, W)]
            .into_iter()
            .filter_map(|(start, c)| start.map(|t| (t, c)))
            .min_by_key(|&(t, _)| t)
    };
    // The ranks' next passes, soonest first (ties: the lower rank); an
    // entry older than its rank's latest is skipped.
    let mut version = vec![0u64; p];
    let mut soonest = std::collections::BinaryHeap::new();
    for s in 0..p {
        if let Some((t, c)) = next_pass(s, &f_end, &i_end, 0, 0) {
            soonest.push(std::cmp::Reverse((t, s, 0u64, c.phase())));
        }
    }
    while let Some(std::cmp::Reverse((start, s, seen, phase))) = soonest.pop() {
        if seen != version[s] {
            continue;
        }
        let c = [F, I, W][phase];
        let end = start + 1;
        let micro_batch = match c {
            F => f_end[s].len(),
            I => i_end[s].len(),
            _ => w_done[s] as usize,
        };
        match c {
            F => f_end[s].push(end),
            I => i_end[s].push(end),
            _ => w_done[s] += 1,
        }
        free_at[s] = end;
        lists[s].push(StageAction::new(s as u32, c, micro_batch as u32));
        // Only this stage's and its neighbours' next passes can change.
        for n in s.saturating_sub(1)..(s + 2).min(p) {
            version[n] += 1;
            if let Some((t, c)) = next_pass(n, &f_end, &i_end, w_done[n], free_at[n]) {
                soonest.push(std::cmp::Reverse((t, n, version[n], c.phase())));
            }
        }
    }
    lists
}

fn zbv_rank(rank: u32, ranks: u32, n: u32) -> Vec<StageAction> {
    use Computation::{BackwardInput as I, BackwardWeight as W, Forward as F};
    let (down, up) = (rank, 2 * ranks - 1 - rank);
    let mut out = Vec::new();
    // Forwards and backwards begun on each chunk: [down, up].
    let (mut f, mut b) = ([0u32; 2], [0u32; 2]);
    let push = |out: &mut Vec<StageAction>, count: &mut [u32; 2], chunk: usize, c| {
        out.push(StageAction::new([down, up][chunk], c, count[chunk]));
        count[chunk] += 1;
    };
    for _ in 0..2 * (ranks - rank) - 1 {
        push(&mut out, &mut f, 0, F);
    }
    for _ in 0..rank {
        push(&mut out, &mut f, 1, F);
        push(&mut out, &mut f, 0, F);
    }
    for _ in 0..ranks - rank {
        push(&mut out, &mut f, 1, F);
        out.push(StageAction::new(up, I, b[1]));
        push(&mut out, &mut b, 1, W);
    }
    while f[1] < f[0] || f[0] < n {
        if f[0] < n {
            push(&mut out, &mut f, 0, F);
        }
        out.push(StageAction::new(down, I, b[0]));
        push(&mut out, &mut b, 0, W);
        push(&mut out, &mut f, 1, F);
        out.push(StageAction::new(up, I, b[1]));
        push(&mut out, &mut b, 1, W);
    }
    // The drain: W's lag their I's from here.
    let mut w = b;
    for _ in 0..rank {
        push(&mut out, &mut b, 0, I);
        push(&mut out, &mut b, 1, I);
    }
    for _ in 0..ranks - rank {
        push(&mut out, &mut b, 0, I);
        push(&mut out, &mut w, 0, W);
    }
    while w[1] < b[1] {
        push(&mut out, &mut w, 1, W);
    }
    while w[0] < b[0] {
        push(&mut out, &mut w, 0, W);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(order: &PipelineOrder) -> Vec<String> {
        order
            .rank_actions
            .iter()
            .map(|r| {
                r.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    }

    #[test]
    fn actions_print_and_parse_as_torch_writes_them() {
        for text in ["0F0", "12I3", "1W0", "3B15"] {
            assert_eq!(text.parse::<StageAction>().unwrap().to_string(), text);
        }
        for bad in [
            "", "F0", "0F", "0X1", "01F1", "0F01", "-1F0", "0F0 ", "0UNSHARD",
        ] {
            assert!(bad.parse::<StageAction>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn interleaved_1f1b_on_two_ranks_two_chunks_four_micro_batches() {
        // Rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; two rounds of
        // 2 micro-batches; rank 0 warms up with 1 x 2 + 2 x 1 = 4 forwards.
        let order = PipelineOrder::interleaved_1f1b(2, 4, 2).unwrap();
        assert_eq!(
            rows(&order),
            [
                "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
                "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
            ]
        );
    }

    #[test]
    fn one_chunk_interleaved_1f1b_is_dapples_early_backward_at_policy_b() {
        // torch warms rank r up with 2 (p - 1 - r) forwards and then runs
        // one more before its first backward: K = 2 (p - r) - 1, DAPPLE's B.
        use crate::cost::WarmupPolicy;
        use crate::schedule::{early_backward_actions, ActionKind};
        let (ranks, micro_batches) = (4, 8);
        let order = PipelineOrder::interleaved_1f1b(ranks, micro_batches, 1).unwrap();
        for (rank, actions) in order.rank_actions.iter().enumerate() {
            let k = WarmupPolicy::B
                .warmup(ranks - rank as u32, micro_batches)
                .unwrap();
            let dapple: Vec<(char, u32)> = early_backward_actions(k, micro_batches)
                .iter()
                .map(|a| {
                    let c = if a.kind == ActionKind::Forward {
                        'F'
                    } else {
                        'B'
                    };
                    (c, a.micro_batch.unwrap())
                })
                .collect();
            let torch: Vec<(char, u32)> = actions
                .iter()
                .map(|a| (a.computation.symbol(), a.micro_batch))
                .collect();
            assert_eq!(torch, dapple, "rank {rank}");
        }
    }

    #[test]
    fn zero_bubble_h1_on_three_ranks() {
        let order = PipelineOrder::interleaved_zero_bubble(3, 4, 1).unwrap();
        assert_eq!(
            rows(&order),
            [
                "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
                "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
                "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3",
            ]
        );
    }

    #[test]
    fn zero_bubble_h2_on_four_ranks_eight_micro_batches() {
        // Rank r warms up with 2(p - r) - 1 forwards (7, 5, 3, 1); each
        // rank's Ws fill where ZB-H1's ranks wait.
        let order = PipelineOrder::zb_h2(4, 8).unwrap();
        assert_eq!(
            rows(&order),
            [
                "0F0 0F1 0F2 0F3 0F4 0F5 0F6 0I0 0W0 0I1 0F7 0I2 0W1 0I3 0W2 0I4 0W3 0I5 0W4 \
                 0I6 0W5 0W6 0I7 0W7",
                "1F0 1F1 1F2 1F3 1F4 1I0 1F5 1I1 1F6 1I2 1W0 1I3 1F7 1I4 1W1 1I5 1W2 1I6 1W3 \
                 1W4 1I7 1W5 1W6 1W7",
                "2F0 2F1 2F2 2I0 2F3 2I1 2F4 2I2 2F5 2I3 2F6 2I4 2W0 2I5 2F7 2I6 2W1 2W2 2I7 \
                 2W3 2W4 2W5 2W6 2W7",
                "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3F4 3I4 3F5 3I5 3F6 3I6 3W0 3F7 3I7 3W1 3W2 \
                 3W3 3W4 3W5 3W6 3W7",
            ]
        );
        assert_eq!(order.forwards_before_first_backward(), [7, 5, 3, 1]);
    }

    #[test]
    fn zero_bubble_h2_never_waits_between_its_first_forward_and_last_w() {
        // At F = I = W and m >= 2p - 1 rank r computes from r to r + 3m
        // without a pause (the bubble the paper gives ZB-H2 at equal passes
        // is 0), and holds at most 2p - 1 micro-batches' activations, where
        // ZB-H1 holds p. The iteration, 3m + p - 1, is the last stage's
        // fill and its work: ZB-H1's too, whose ranks wait p - 1 each.
        let costs = StageCosts {
            activation_bytes: 1.0,
            ..StageCosts::equal_passes(1.0, 2.0)
        };
        for p in 1..=6u32 {
            for m in (2 * p - 1)..=(2 * p + 6) {
                let order = PipelineOrder::zb_h2(p, m).unwrap();
                let run = order.run(&vec![costs; p as usize]).unwrap();
                assert_eq!(run.iteration_ms, f64::from(3 * m + p - 1), "p {p} m {m}");
                // Rank r's first forward cannot start before r.
                for r in 0..p as usize {
                    assert_eq!(run.busy_ms[r], f64::from(3 * m));
                    assert_eq!(run.finish_ms[r], f64::from(r as u32 + 3 * m), "p {p} m {m}");
                }
                let most = run
                    .peak_activation_bytes
                    .iter()
                    .copied()
                    .fold(0.0, f64::max);
                assert_eq!(most, f64::from(2 * p - 1), "p {p} m {m}");
            }
        }
    }

    #[test]
    fn zbv_on_two_ranks() {
        // Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
        let order = PipelineOrder::zbv(2, 4).unwrap();
        assert_eq!(order.stage_ranks, [0, 1, 1, 0]);
        assert_eq!(
            rows(&order),
            [
                "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 \
                 0I2 0W2 0I3 0W3",
                "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 \
                 2I3 1I3 1W2 2W3 1W3",
            ]
        );
    }

    #[test]
    fn dualpipev_on_two_ranks_four_micro_batches_as_torch_prints_it() {
        // torch 2.9's ScheduleDualPipeV for 2 ranks and 4 micro-batches:
        // rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
        let order = PipelineOrder::dualpipev(2, 4).unwrap();
        let rows: Vec<String> = order.rank_cells().iter().map(|r| r.join(" ")).collect();
        assert_eq!(
            rows,
            [
                "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)OVERLAP_F_B (3F2;0B0)OVERLAP_F_B 3B2 \
                 (3F3;0B1)OVERLAP_F_B 3B3 0I2 0W2 0I3 0W3",
                "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B \
                 (2F3;1B1)OVERLAP_F_B 2B2 1B2 2I3 1I3 2W3 1W3",
            ]
        );
        assert_eq!(order.stage_ranks, [0, 1, 1, 0]);
        // The CSV round-trips, overlapped pairs included.
        assert_eq!(PipelineOrder::from_csv(&order.to_csv(), 4).unwrap(), order);
        // Fewer micro-batches than stages is refused, as torch refuses it.
        assert!(PipelineOrder::dualpipev(2, 3).is_err());
        // A pair that is not a forward and a whole backward is refused.
        for bad in [
            "(0F0;3I0)OVERLAP_F_B",
            "(0F0)OVERLAP_F_B",
            "(0F0;3B0)OVERLAP",
        ] {
            assert!(PipelineOrder::from_csv(bad, 1).is_err(), "{bad}");
        }
    }

    #[test]
    fn dualpipev_idles_as_zbv_on_equal_passes() {
        // F = 1, I = W = 1 (B = 2) on every chunk: each rank waits p - 1,
        // as in ZB-V; the overlapped pairs' gain (one's communication under
        // the other's compute) is outside a dry run whose sends take no
        // rank's time.
        for p in [2u32, 3, 4, 8] {
            for m in [2 * p, 2 * p + 1, 4 * p] {
                let costs = vec![StageCosts::equal_passes(1.0, 2.0); 2 * p as usize];
                let run = PipelineOrder::dualpipev(p, m).unwrap().run(&costs).unwrap();
                assert!(run
                    .busy_ms
                    .iter()
                    .all(|b| run.iteration_ms - b == f64::from(p - 1)));
                assert_eq!(run.busy_ms[0], f64::from(6 * m));
                let zbv = PipelineOrder::zbv(p, m).unwrap().run(&costs).unwrap();
                assert_eq!(run.iteration_ms, zbv.iteration_ms, "p {p} m {m}");
            }
        }
    }

    #[test]
    fn the_dry_run_finds_a_deadlock_and_names_where_each_rank_waits() {
        let mut order = PipelineOrder::interleaved_1f1b(2, 2, 1).unwrap();
        // The last rank's backward before its own forward: it waits for
        // itself, and rank 0 for its backward.
        order.rank_actions[1].swap(0, 1);
        let err = order.validate().unwrap_err().to_string();
        assert!(
            err.ends_with("deadlocks: rank 0 at 0B0, rank 1 at 1B0"),
            "{err}"
        );
    }

    #[test]
    fn incomplete_or_misplaced_actions_are_refused() {
        let mut order = PipelineOrder::interleaved_1f1b(2, 2, 1).unwrap();
        order.rank_actions[0].pop();
        assert!(order
            .validate()
            .unwrap_err()
            .to_string()
            .contains("stage 0 micro-batch 1"));
        let mut order = PipelineOrder::interleaved_1f1b(2, 2, 1).unwrap();
        let a = order.rank_actions[0].remove(0);
        order.rank_actions[1].insert(0, a);
        assert!(order
            .validate()
            .unwrap_err()
            .to_string()
            .contains("rank 1: action 0F0"));
    }

    #[test]
    fn csv_round_trips_and_skips_torchs_empty_slots() {
        let order = PipelineOrder::zbv(3, 6).unwrap();
        assert_eq!(PipelineOrder::from_csv(&order.to_csv(), 6).unwrap(), order);
        let padded = ",".to_string() + &order.to_csv().replace(',', ",,");
        assert_eq!(PipelineOrder::from_csv(&padded, 6).unwrap(), order);
        let err = PipelineOrder::from_csv("0F0,0X0\n", 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("row 0") && err.contains("0X0"), "{err}");
        // Huge stage or micro-batch numbers are refused before anything
        // is sized by them.
        let err = PipelineOrder::from_csv("4000000000F0\n", 1).unwrap_err();
        assert!(
            err.to_string().contains("stage 4000000000 is past"),
            "{err}"
        );
        let err = PipelineOrder::from_csv(&order.to_csv(), u32::MAX).unwrap_err();
        assert!(err.to_string().contains("cannot hold"), "{err}");
    }

    /// The bubble fraction of `order` with every rank's share of a
    /// micro-batch taking F = 1 and B = 2 (I = W = 1), split over its chunks.
    fn bubble(order: &PipelineOrder, chunks: u32) -> f64 {
        let v = f64::from(chunks);
        let costs = StageCosts::equal_passes(1.0 / v, 2.0 / v);
        order
            .run(&vec![costs; order.stages()])
            .unwrap()
            .bubble_fraction()
    }

    #[test]
    fn interleaving_divides_the_bubble_by_the_chunks() {
        // The iteration is (m + (p - 1) / v) x 3: of the ranks' time,
        // (p - 1) / (v m + p - 1) waits, i.e. (p - 1) / (v m) of the work.
        let (p, m) = (4u32, 8u32);
        for v in [1u32, 2, 4] {
            let order = PipelineOrder::interleaved_1f1b(p, m, v).unwrap();
            let closed = f64::from(p - 1) / f64::from(v * m + p - 1);
            assert!((bubble(&order, v) - closed).abs() < 1e-9, "v {v}");
        }
    }

    #[test]
    fn zero_bubble_h1_waits_a_third_of_1f1b_when_f_i_and_w_are_equal() {
        // Qi et al., section 3: 1F1B's bubble is (p - 1)(F + B), ZB-H1's
        // (p - 1)(F + I - W); with F = I = W that is a third.
        let (p, m) = (4u32, 8u32);
        let waits = |order: &PipelineOrder| {
            let run = order.run(&[StageCosts::equal_passes(1.0, 2.0); 4]).unwrap();
            f64::from(p) * run.iteration_ms - run.busy_ms.iter().sum::<f64>()
        };
        let one_f_one_b = waits(&PipelineOrder::interleaved_1f1b(p, m, 1).unwrap());
        let zb_h1 = waits(&PipelineOrder::interleaved_zero_bubble(p, m, 1).unwrap());
        assert_eq!(one_f_one_b, f64::from(p * (p - 1)) * 3.0);
        assert_eq!(zb_h1, f64::from(p * (p - 1)));
    }

    #[test]
    fn a_dry_run_charges_sends_between_ranks_only_and_holds_activations_until_w() {
        // ZB-V on 2 ranks, one micro-batch, every pass 1 ms, 0.5 ms a send:
        // stages 1 and 2 share rank 1, 3 and 0 rank 0, so only 0 -> 1 and
        // 2 -> 3 send (and their gradients back). Rank 0: 0F0 3F0 3I0 3W0
        // 0I0 0W0; rank 1: 1F0 2F0 2I0 2W0 1I0 1W0.
        let order = PipelineOrder::zbv(2, 1).unwrap();
        let costs = StageCosts {
            send_ms: 0.5,
            activation_bytes: 10.0,
            ..StageCosts::equal_passes(1.0, 2.0)
        };
        let run = order.run(&[costs; 4]).unwrap();
        // Four F's and four I's in a chain, four sends, and two W's on
        // the way: 2W0 runs before 1I0 on rank 1, and 0W0 ends the run.
        assert_eq!(run.iteration_ms, 4.0 + 4.0 + 4.0 * 0.5 + 2.0);
        assert_eq!(run.busy_ms, [6.0, 6.0]);
        assert_eq!(run.peak_activation_bytes, [20.0, 20.0]);
    }
}
