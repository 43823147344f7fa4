//! Early-backward 1F1B's iteration time computed round by round, with its
//! periodic steady state skipped over: the warm-up choice's objective
//! (`simulation/warmup.rs`), which simulates thousands of depth vectors.
//!
//! Stage i runs F_0 .. F_{K_i-1}, then round r = 0 .. M-1 runs B_r and,
//! while r + K_i < M, F_{r+K_i}; then AR and OPT. With K non-increasing,
//! every input a round needs comes from an earlier round or from the same
//! round in the order taken here (backwards last stage first, then
//! forwards first stage first), so one pass computes what `run_lists`
//! computes by sweeping its action lists, with the same operations on the
//! same numbers: the same bits.
//!
//! The recurrence from one round to the next is the same in every round of
//! the steady state (every stage runs one B and one F), a max-plus linear
//! system, which ends in a periodic regime: after some round, the state
//! (when each stage and link is next free, and the inputs sent but not yet
//! used) repeats every c rounds, shifted by a constant time. Once the state
//! repeats, every later round repeats too, so the rounds up to the tail are
//! skipped by adding that shift, measured over many periods. Only float
//! rounding separates the skipped sum from the sum one round at a time: the
//! state must repeat to `PERIOD_TOLERANCE` of its magnitude, and the result
//! agrees with the full replay to 1e-12 of it (`tests`).

use std::collections::VecDeque;

use crate::error::Result;
use crate::simulation::simulate::{replay_early_backward_ms, SimStage};

/// States kept to find the period in: it is found where it divides the
/// rounds between the state now and one of these.
const MAX_STATES_KEPT: usize = 8;

/// Steady rounds left below which nothing is skipped: the check costs
/// about as much as a round, and short runs keep the replay's own bits.
const MIN_ROUNDS_TO_SKIP: u32 = 256;

/// Most periods run out in full after the period is found (a 64th of
/// those left, at least one), to measure its shift over: the shift's
/// rounding is multiplied by the periods skipped over.
const MEASURED_PERIODS: u32 = 1024;

/// How close two states must be, relative to the times in them, to count
/// as the same: some hundreds of float roundings, far below any profile's
/// precision (1e-6 of a millisecond on an iteration of a minute is 1e-11).
const PERIOD_TOLERANCE: f64 = 1e-12;

/// Iteration time of early-backward 1F1B with warm-up depths `warmup`
/// (K_i, non-increasing, each in 1..=M) on `stages` without forced
/// re-computation, when the last task ends: the objective the planner
/// minimises. `transfer_ms[i]` moves one micro-batch between stages i and
/// i+1, either way, one at a time per direction. Equals
/// `simulate_stages(...).iteration_ms` on the same schedule: to the bit
/// below a few hundred micro-batches, and to 1e-12 of it above, where the
/// periodic steady state is skipped over. Depths that are not valid get
/// the replay's deadlock error.
pub fn iteration_ms(
    stages: &[SimStage],
    transfer_ms: &[f64],
    micro_batches: u32,
    warmup: &[u32],
) -> Result<f64> {
    Ok(iteration_ms_and_passes(stages, transfer_ms, micro_batches, warmup)?.0)
}

/// [`iteration_ms`], and the work it took: micro-batch passes (a stage's
/// F and B of one micro-batch) simulated, the skipped ones not counted.
pub(crate) fn iteration_ms_and_passes(
    stages: &[SimStage],
    transfer_ms: &[f64],
    micro_batches: u32,
    warmup: &[u32],
) -> Result<(f64, u64)> {
    let valid = warmup.len() == stages.len()
        && transfer_ms.len() + 1 == stages.len()
        && warmup.windows(2).all(|w| w[0] >= w[1])
        && warmup.iter().all(|&k| (1..=micro_batches).contains(&k));
    if !valid {
        let ms = replay_early_backward_ms(stages, transfer_ms, micro_batches, warmup)?;
        return Ok((ms, stages.len() as u64 * u64::from(micro_batches)));
    }
    let (ms, skipped) = iteration_ms_and_rounds_skipped(stages, transfer_ms, micro_batches, warmup);
    let rounds_run = u64::from(micro_batches - skipped);
    Ok((ms, stages.len() as u64 * rounds_run))
}

/// The iteration time, and how many rounds were skipped over.
fn iteration_ms_and_rounds_skipped(
    stages: &[SimStage],
    transfer_ms: &[f64],
    micro_batches: u32,
    warmup: &[u32],
) -> (f64, u32) {
    debug_assert!(warmup.windows(2).all(|w| w[0] >= w[1]));
    debug_assert!(warmup.iter().all(|&k| (1..=micro_batches).contains(&k)));
    let mut run = Rounds::new(stages, transfer_ms, warmup);
    run.warm_up();
    let m = micro_batches;
    // Rounds in which every stage runs both a B and an F.
    let steady_end = m - warmup[0];
    // A state holds about 3 S + K_0 times: looked at every `stride` rounds,
    // it costs about as much as the rounds between.
    let n = stages.len() as u32;
    let stride = 1 + warmup[0] / n;
    let mut seen: VecDeque<(u32, f64, Vec<f64>)> = VecDeque::new();
    let mut r = 0;
    let mut skipped = None;
    while r < m {
        run.round(r, m);
        r += 1;
        if skipped.is_some() || r % stride != 0 || r + MIN_ROUNDS_TO_SKIP > steady_end {
            continue;
        }
        let (origin, state) = run.state();
        let repeat = seen
            .iter()
            .rev()
            .find(|(_, o, s)| same_shifted(&state, s, origin, *o))
            .map(|(at, _, _)| r - at);
        if let Some(period) = repeat {
            // After the same state, the same rounds, each period later.
            // The shift is measured over many periods run out in full, so
            // that its rounding, multiplied by the periods skipped, stays
            // near the replay's own.
            let left = (steady_end - r) / period;
            let measured = (left / 64).clamp(1, MEASURED_PERIODS);
            let periods = left.saturating_sub(measured);
            skipped = Some(periods * period);
            if periods == 0 {
                continue; // too few left to skip: run them
            }
            for _ in 0..measured * period {
                run.round(r, m);
                r += 1;
            }
            let shift_ms = (run.state().0 - origin) / f64::from(measured);
            run.shift(f64::from(periods) * shift_ms);
            r += periods * period;
        } else {
            if seen.len() == MAX_STATES_KEPT {
                seen.pop_front();
            }
            seen.push_back((r, origin, state));
        }
    }
    (run.finish(), skipped.unwrap_or(0))
}

/// Are two states, each relative to its own origin, the same?
fn same_shifted(a: &[f64], b: &[f64], origin_a: f64, origin_b: f64) -> bool {
    let tolerance = PERIOD_TOLERANCE * origin_a.abs().max(1.0);
    origin_a > origin_b
        && a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tolerance)
}

/// The state between rounds: when each stage and link is next free, and the
/// inputs that arrived but have not run yet.
struct Rounds<'a> {
    stages: &'a [SimStage],
    transfer_ms: &'a [f64],
    warmup: &'a [u32],
    stage_free: Vec<f64>,
    link_forward_free: Vec<f64>,
    link_backward_free: Vec<f64>,
    /// Per stage, the forward inputs that arrived and wait, oldest first
    /// (stage 0's are all there at time 0 and not kept).
    forward_arrived: Vec<VecDeque<f64>>,
    /// The last stage's forwards that ended, whose backward has not run.
    last_forward_done: VecDeque<f64>,
    last_end: f64,
}

impl<'a> Rounds<'a> {
    fn new(stages: &'a [SimStage], transfer_ms: &'a [f64], warmup: &'a [u32]) -> Self {
        let n = stages.len();
        Rounds {
            stages,
            transfer_ms,
            warmup,
            stage_free: vec![0.0; n],
            link_forward_free: vec![0.0; n.saturating_sub(1)],
            link_backward_free: vec![0.0; n.saturating_sub(1)],
            forward_arrived: vec![VecDeque::new(); n],
            last_end: 0.0,
            last_forward_done: VecDeque::new(),
        }
    }

    /// Stage i runs its next forward (its input has arrived).
    fn forward(&mut self, i: usize) {
        let ready = if i == 0 {
            0.0
        } else {
            self.forward_arrived[i].pop_front().expect("sent before")
        };
        let start = self.stage_free[i].max(ready);
        let end = start + self.stages[i].fwd_ms;
        self.stage_free[i] = end;
        self.last_end = self.last_end.max(end);
        if i + 1 == self.stages.len() {
            self.last_forward_done.push_back(end);
        } else {
            let arrive = end.max(self.link_forward_free[i]) + self.transfer_ms[i];
            self.link_forward_free[i] = arrive;
            self.forward_arrived[i + 1].push_back(arrive);
            self.last_end = self.last_end.max(arrive);
        }
    }

    /// Each stage's K_i forwards, first stage first.
    fn warm_up(&mut self) {
        for i in 0..self.stages.len() {
            for _ in 0..self.warmup[i] {
                self.forward(i);
            }
        }
    }

    /// Round r: B_r from the last stage to the first, each sending its
    /// gradient up; then each stage's F_{r+K_i} where there is one.
    fn round(&mut self, r: u32, micro_batches: u32) {
        let n = self.stages.len();
        let mut ready = self.last_forward_done.pop_front().expect("ran before");
        for i in (0..n).rev() {
            let start = self.stage_free[i].max(ready);
            let end = start + self.stages[i].bwd_ms;
            self.stage_free[i] = end;
            self.last_end = self.last_end.max(end);
            if i > 0 {
                let arrive = end.max(self.link_backward_free[i - 1]) + self.transfer_ms[i - 1];
                self.link_backward_free[i - 1] = arrive;
                self.last_end = self.last_end.max(arrive);
                ready = arrive;
            }
        }
        for i in 0..n {
            if r + self.warmup[i] < micro_batches {
                self.forward(i);
            }
        }
    }

    /// Every time in the state, relative to stage 0's, and that origin.
    fn state(&self) -> (f64, Vec<f64>) {
        let origin = self.stage_free[0];
        let times = self
            .stage_free
            .iter()
            .chain(&self.link_forward_free)
            .chain(&self.link_backward_free)
            .chain(self.forward_arrived.iter().flatten())
            .chain(&self.last_forward_done)
            .chain([&self.last_end]);
        (origin, times.map(|t| t - origin).collect())
    }

    /// Every time in the state `shift_ms` later: the rounds skipped.
    fn shift(&mut self, shift_ms: f64) {
        let times = self
            .stage_free
            .iter_mut()
            .chain(&mut self.link_forward_free)
            .chain(&mut self.link_backward_free)
            .chain(self.forward_arrived.iter_mut().flatten())
            .chain(&mut self.last_forward_done)
            .chain([&mut self.last_end]);
        for t in times {
            *t += shift_ms;
        }
    }

    /// AR and OPT on every stage; when the last task ends.
    fn finish(mut self) -> f64 {
        for (free, st) in self.stage_free.iter_mut().zip(self.stages) {
            *free = *free + st.allreduce_ms + st.optimizer_ms;
            self.last_end = self.last_end.max(*free);
        }
        self.last_end
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::schedule::Schedule;
    use crate::simulation::simulate::simulate_stages;

    fn stage(rng: &mut StdRng) -> SimStage {
        // Times on a coarse grid make ties, and so periods, common; some
        // stages get times off the grid.
        let time = |rng: &mut StdRng| {
            if rng.gen_bool(0.7) {
                f64::from(rng.gen_range(1..8u32)) * 0.5
            } else {
                rng.gen_range(0.1..4.0)
            }
        };
        SimStage {
            fwd_ms: time(rng),
            recompute_ms: 0.0,
            bwd_ms: time(rng),
            bwd_weight_ms: 0.0,
            allreduce_ms: rng.gen_range(0.0..3.0),
            optimizer_ms: rng.gen_range(0.0..1.0),
            model_state_bytes: 0.0,
            weight_bytes: 0.0,
            own_adam_moments_bytes: 0.0,
            stored_bytes: 1.0,
            input_bytes: 0.0,
            working_bytes: 0.0,
            rerun_bytes: 0.0,
            recompute_backward_bytes: 0.0,
            gradient_bytes: 0.0,
            optimizer_step_bytes: 0.0,
            allocator_reserved_factor: 1.0,
            memory_limit_bytes: 1e12,
            recomputes: false,
        }
    }

    /// Random non-increasing depths in 1..=min(m, 3 S).
    fn depths(rng: &mut StdRng, n: usize, m: u32) -> Vec<u32> {
        let mut k: Vec<u32> = (0..n)
            .map(|_| rng.gen_range(1..=m.min(3 * n as u32)))
            .collect();
        k.sort_unstable_by(|a, b| b.cmp(a));
        k
    }

    fn replayed_ms(stages: &[SimStage], links: &[f64], m: u32, k: &[u32]) -> f64 {
        let schedule = Schedule::early_backward(stages.len(), m, k).unwrap();
        simulate_stages(stages, links, &schedule, false)
            .unwrap()
            .iteration_ms
    }

    #[test]
    fn the_rounds_give_the_replays_bits_where_nothing_is_skipped() {
        let mut rng = StdRng::seed_from_u64(28);
        for _ in 0..300 {
            let n = rng.gen_range(1..=6);
            let m = rng.gen_range(1..=40);
            let stages: Vec<SimStage> = (0..n).map(|_| stage(&mut rng)).collect();
            let links: Vec<f64> = (1..n).map(|_| rng.gen_range(0.0..2.0)).collect();
            let k = depths(&mut rng, n, m);
            let (ms, skipped) = iteration_ms_and_rounds_skipped(&stages, &links, m, &k);
            assert_eq!(skipped, 0);
            assert_eq!(
                ms,
                replayed_ms(&stages, &links, m, &k),
                "S={n} M={m} K={k:?}"
            );
        }
    }

    #[test]
    fn deep_warm_ups_look_for_the_period_less_often_and_agree() {
        // Stride 1 + K_0 / S: a period found far back may leave no whole
        // period of the steady state to skip.
        let mut rng = StdRng::seed_from_u64(30);
        for m in [300, 700, 1500, 4000] {
            for k0 in [m / 8, m / 3, m / 2, m - 300, m - 1] {
                let stages: Vec<SimStage> = (0..2).map(|_| stage(&mut rng)).collect();
                let links = [rng.gen_range(0.0..2.0)];
                let k = [k0.max(1), rng.gen_range(1..=k0.max(1))];
                let (ms, _) = iteration_ms_and_rounds_skipped(&stages, &links, m, &k);
                let replayed = replayed_ms(&stages, &links, m, &k);
                assert!(
                    (ms - replayed).abs() <= 1e-12 * replayed,
                    "M={m} K={k:?}: {ms} against {replayed}"
                );
            }
        }
    }

    #[test]
    fn skipping_the_periodic_rounds_agrees_with_the_replay() {
        let mut rng = StdRng::seed_from_u64(29);
        let mut skips = 0;
        for case in 0..60 {
            let n = rng.gen_range(1..=6);
            let m = rng.gen_range(600..=3000);
            let stages: Vec<SimStage> = (0..n).map(|_| stage(&mut rng)).collect();
            let links: Vec<f64> = (1..n).map(|_| rng.gen_range(0.0..2.0)).collect();
            let k = depths(&mut rng, n, m);
            let (ms, skipped) = iteration_ms_and_rounds_skipped(&stages, &links, m, &k);
            let replayed = replayed_ms(&stages, &links, m, &k);
            assert!(
                (ms - replayed).abs() <= 1e-12 * replayed,
                "case {case}: S={n} M={m} K={k:?}: {ms} against {replayed}"
            );
            skips += u32::from(skipped > m / 2);
        }
        // Most runs reach their period early and skip most rounds.
        assert!(skips >= 45, "only {skips} of 60 runs skipped most rounds");
    }
}
