//! Warm-up depth K_i chosen per stage (warm-up policy `auto`).
//!
//! Under early backward, stage i runs K_i forwards before its first
//! backward. A deeper warm-up keeps the stage busy while the gradient of its
//! oldest micro-batch makes its round trip through the later stages and
//! links, and costs K_i slices of stored activations. A schedule is valid
//! exactly when K_0 >= K_1 >= ... >= K_{S-1} (a stage waiting for more
//! forwards than the stage before sends ahead deadlocks), each in 1..=M.
//!
//! The choice is made on the simulator's own numbers: start from the
//! deepest depths memory allows and from policies A and B within them, and
//! improve each by local moves (one stage's depth to any value its
//! neighbours allow) while that makes the simulated iteration shorter.
//! The fastest is kept, each depth is lowered while the time stays (less
//! memory), and the moves are tried again from there, now also moving a
//! run of neighbouring stages one deeper or one shallower together. Pure functions on
//! plain numbers. How close to exact this is: docs/simulation.md.

use crate::cost::WarmupPolicy;
use crate::error::Result;
use crate::model::profile::Profile;
use crate::plan::Plan;
use crate::schedule::ScheduleKind;
use crate::simulation::costing::ProfileCosts;
use crate::simulation::early_backward::iteration_ms_and_passes;
use crate::simulation::evaluate::evaluate_costed;
use crate::simulation::simulate::{sim_inputs, SimStage};

/// Deepest K_i each stage's memory allows, at most M and never deeper than
/// the stage before (so the vector itself is valid). None when some stage
/// does not fit even with one micro-batch in flight.
pub fn deepest_warmups(stages: &[SimStage], micro_batches: u32) -> Option<Vec<u32>> {
    let mut caps = Vec::with_capacity(stages.len());
    let mut previous = micro_batches;
    for s in stages {
        if s.model_state_bytes + s.optimizer_step_bytes > s.memory_limit_bytes {
            return None; // the optimizer's step does not fit, whatever the depth
        }
        let (backward, per_micro_batch) = s.backward_and_kept_bytes(s.recomputes);
        let room = s.memory_limit_bytes - s.model_state_bytes - backward;
        let cap = if per_micro_batch <= 0.0 {
            if room < 0.0 {
                return None;
            }
            micro_batches
        } else {
            let k = (room / per_micro_batch).floor();
            if k < 1.0 {
                return None;
            }
            // k may exceed u32: compare as f64 before converting.
            if k >= f64::from(micro_batches) {
                micro_batches
            } else {
                k as u32
            }
        };
        previous = previous.min(cap);
        caps.push(previous);
    }
    Some(caps)
}

/// The depths `choose_warmups` settled on.
#[derive(Debug, Clone, PartialEq)]
pub struct ChosenWarmups {
    pub depths: Vec<u32>,
    pub iteration_ms: f64,
    /// Iterations simulated to find them.
    pub simulations: u64,
    /// Micro-batch passes they simulated: the work the choice cost
    /// (a long steady state is skipped over, not simulated).
    pub simulated_passes: u64,
}

/// Most micro-batch passes (stages x micro-batches, per iteration
/// simulated) one choice of depths simulates: about a second here. The
/// first iteration is always simulated; past the budget the best depths
/// found so far stand. XLNet-24's straight pipeline on 4x8 at a global
/// batch of 2,048 (31 stages of 2,048 micro-batches of one) took minutes
/// without it, for each micro-batch size.
pub const WARMUP_SIMULATED_PASSES: u64 = 1 << 26;

/// Warm-up depths (K_i per stage) that give the shortest simulated
/// iteration within memory, and that time. None when no depths fit.
///
/// A deeper warm-up is not always faster: a stage that holds back its
/// first backward delays the gradients every earlier stage waits for. So
/// the depths are improved one stage at a time, each time trying every
/// depth the neighbours allow, from several starts (the deepest depths,
/// policies A and B within them, and one micro-batch everywhere), until no
/// single change helps.
pub fn choose_warmups(
    stages: &[SimStage],
    transfer_ms: &[f64],
    micro_batches: u32,
) -> Result<Option<ChosenWarmups>> {
    choose_warmups_within(stages, transfer_ms, micro_batches, WARMUP_SIMULATED_PASSES)
}

/// [`choose_warmups`] within `budget_passes` simulated passes.
fn choose_warmups_within(
    stages: &[SimStage],
    transfer_ms: &[f64],
    micro_batches: u32,
    budget_passes: u64,
) -> Result<Option<ChosenWarmups>> {
    let Some(deepest) = deepest_warmups(stages, micro_batches) else {
        return Ok(None);
    };
    let s_count = stages.len();
    if s_count == 1 {
        // One stage never waits: its backward's input is its own earlier
        // forward, so every depth runs the same tasks back to back, and
        // the shallowest holds the least memory.
        let ms = iteration_ms_and_passes(stages, transfer_ms, micro_batches, &[1])?;
        return Ok(Some(ChosenWarmups {
            depths: vec![1],
            iteration_ms: ms.0,
            simulations: 1,
            simulated_passes: ms.1,
        }));
    }
    let simulations = std::cell::Cell::new(0u64);
    let passes = std::cell::Cell::new(0u64);
    // Past the budget a trial is not simulated and never better: each
    // loop below runs out of improvements, and the best so far stands.
    let time = |k: &[u32]| {
        if simulations.get() > 0 && passes.get() >= budget_passes {
            return Ok(f64::INFINITY);
        }
        let (ms, simulated) = iteration_ms_and_passes(stages, transfer_ms, micro_batches, k)?;
        simulations.set(simulations.get() + 1);
        passes.set(passes.get() + simulated);
        Ok(ms)
    };
    // Fixed policies, clipped to what memory allows (a minimum of two
    // non-increasing sequences is non-increasing, so each stays valid).
    let clipped = |policy: WarmupPolicy| -> Vec<u32> {
        (0..s_count)
            .map(|i| {
                let fixed = policy
                    .warmup((s_count - i) as u32, micro_batches)
                    .unwrap_or(1);
                fixed.min(deepest[i])
            })
            .collect()
    };
    let starts = [
        clipped(WarmupPolicy::B),
        clipped(WarmupPolicy::A),
        deepest.clone(),
        vec![1; s_count],
    ];
    let mut best: Option<(Vec<u32>, f64)> = None;
    let mut seen: Vec<Vec<u32>> = Vec::new();
    for start in starts {
        if seen.contains(&start) {
            continue;
        }
        seen.push(start.clone());
        let (k, ms) = descend(start, &deepest, &time, false)?;
        if best.as_ref().is_none_or(|(bk, b)| better(ms, &k, *b, bk)) {
            best = Some((k, ms));
        }
    }
    // Then give back memory: lower each depth while the time stays the
    // same. A depth given back can open a faster move elsewhere, so the
    // moves are tried again from there, until neither changes anything.
    if let Some((k, ms)) = best.as_mut() {
        loop {
            give_back(k, ms, &time)?;
            let (again, again_ms) = descend(k.clone(), &deepest, &time, true)?;
            // Within the tie tolerance the depths given back stay: else the
            // two steps could undo each other for ever.
            if !better(again_ms, &again, *ms, k) {
                break;
            }
            (*k, *ms) = (again, again_ms);
        }
    }
    Ok(best.map(|(depths, iteration_ms)| ChosenWarmups {
        depths,
        iteration_ms,
        simulations: simulations.get(),
        simulated_passes: passes.get(),
    }))
}

/// Lower each depth, first stage first, while the time stays the same.
/// The step down doubles while the time stays, then halves down to one:
/// a depth of thousands that holds its time comes down in
/// tens of simulations, not thousands (a single stage's time does not
/// depend on its depth at all, and deep warm-ups far past the round trip
/// hold it too), and the depth ends where one lower changes the time, as
/// walking down one at a time would end.
fn give_back(k: &mut Vec<u32>, ms: &mut f64, time: &impl Fn(&[u32]) -> Result<f64>) -> Result<()> {
    for i in 0..k.len() {
        let floor = k.get(i + 1).copied().unwrap_or(1);
        // Steps grow until one changes the time, then halve at every try:
        // the depth where it changes is then bracketed.
        let (mut step, mut growing) = (1u32, true);
        while k[i] > floor && step > 0 {
            let mut trial = k.clone();
            trial[i] = k[i].saturating_sub(step).max(floor);
            let trial_ms = time(&trial)?;
            let stays = better(trial_ms, &trial, *ms, k);
            if stays {
                (*k, *ms) = (trial, trial_ms);
            }
            growing &= stays;
            step = if growing {
                step.saturating_mul(2)
            } else {
                step / 2
            };
        }
    }
    Ok(())
}

/// Is (ms, depths) better than (best_ms, best)? Faster, or as fast (to a
/// relative 1e-12, below any profile's precision) with fewer micro-batches
/// in flight in total, which holds less memory.
fn better(ms: f64, depths: &[u32], best_ms: f64, best: &[u32]) -> bool {
    if ties(ms, best_ms) {
        depths.iter().sum::<u32>() < best.iter().sum::<u32>()
    } else {
        ms < best_ms
    }
}

/// Are two times the same to a relative 1e-12, below any profile's
/// precision? Depths whose times differ by less differ only in the order
/// their float sums were taken.
fn ties(ms: f64, best_ms: f64) -> bool {
    (ms - best_ms).abs() <= 1e-12 * best_ms.abs()
}

/// Is `ms` faster than `best_ms` by more than a tie? The moves take only
/// such steps: a step by rounding alone could be followed by another, and
/// another, each a whole pass of simulations for nothing.
fn faster(ms: f64, best_ms: f64) -> bool {
    ms < best_ms && !ties(ms, best_ms)
}

/// Most depths tried for one stage in one pass; wider ranges are sampled
/// (every depth near the current one, then spaced out).
const DEPTHS_TRIED_PER_STAGE: u32 = 16;

/// Change one stage's depth at a time to the best value its neighbours
/// allow (K_{i+1} <= K_i <= min(K_{i-1}, cap_i)), and, with `runs`, where
/// no such change helps, move a run of neighbouring stages one deeper or
/// one shallower together (a stage's depth is bounded by its neighbours',
/// so two of them may only move as one), until nothing is faster. Runs are
/// tried from the best start only: each try of them simulates O(S^2)
/// vectors, and the search chooses depths for every candidate it ranks.
fn descend(
    mut k: Vec<u32>,
    caps: &[u32],
    time: &impl Fn(&[u32]) -> Result<f64>,
    runs: bool,
) -> Result<(Vec<u32>, f64)> {
    let mut best_ms = time(&k)?;
    loop {
        let mut improved = false;
        for i in 0..k.len() {
            let low = k.get(i + 1).copied().unwrap_or(1);
            let high = if i == 0 {
                caps[0]
            } else {
                k[i - 1].min(caps[i])
            };
            for t in depths_to_try(low, high, k[i]) {
                let mut trial = k.clone();
                trial[i] = t;
                let ms = time(&trial)?;
                if faster(ms, best_ms) {
                    (k, best_ms) = (trial, ms);
                    improved = true;
                }
            }
        }
        if !improved && runs {
            for trial in run_moves(&k, caps) {
                let ms = time(&trial)?;
                if faster(ms, best_ms) {
                    (k, best_ms) = (trial, ms);
                    improved = true;
                }
            }
        }
        if !improved {
            return Ok((k, best_ms));
        }
    }
}

/// `k` with a run of two or more neighbouring stages one deeper, or one
/// shallower, each still valid under `caps`.
fn run_moves(k: &[u32], caps: &[u32]) -> Vec<Vec<u32>> {
    let valid = |v: &[u32]| {
        v.iter().zip(caps).all(|(&d, &cap)| (1..=cap).contains(&d))
            && v.windows(2).all(|w| w[0] >= w[1])
    };
    let mut out = Vec::new();
    for start in 0..k.len() {
        for end in start + 2..=k.len() {
            for deeper in [true, false] {
                let mut trial = k.to_vec();
                for d in &mut trial[start..end] {
                    *d = if deeper { *d + 1 } else { d.saturating_sub(1) };
                }
                if valid(&trial) {
                    out.push(trial);
                }
            }
        }
    }
    out
}

/// Depths in low..=high other than `current`: all of them when few, else
/// those within a few of `current` and a spread over the range.
fn depths_to_try(low: u32, high: u32, current: u32) -> Vec<u32> {
    let mut out: Vec<u32> = if high - low < DEPTHS_TRIED_PER_STAGE {
        (low..=high).collect()
    } else {
        let near =
            (current.saturating_sub(4).max(low)..=(current + 4).min(high)).collect::<Vec<_>>();
        let step = (high - low) / (DEPTHS_TRIED_PER_STAGE - 8);
        near.into_iter()
            .chain((low..=high).step_by(step.max(1) as usize))
            .chain([high])
            .collect()
    };
    out.sort_unstable();
    out.dedup();
    out.retain(|&t| t != current);
    out
}

/// `plan` run as early backward under warm-up policy auto, with the depths
/// `choose_warmups` picks, costed, and the micro-batch passes simulated
/// to choose them. None when no depths fit in memory.
pub fn plan_with_chosen_warmups(plan: &Plan, profile: &Profile) -> Result<(Option<Plan>, u64)> {
    plan_with_chosen_warmups_below(plan, &ProfileCosts::new(profile), f64::INFINITY)
}

/// [`plan_with_chosen_warmups`], where only a plan faster than `below_ms`
/// is wanted: None, without the plan's full simulation, when its depths
/// simulate no faster.
pub(crate) fn plan_with_chosen_warmups_below(
    plan: &Plan,
    costs: &ProfileCosts,
    below_ms: f64,
) -> Result<(Option<Plan>, u64)> {
    let (stages, transfers) = sim_inputs(plan, costs)?;
    let Some(chosen) = choose_warmups(&stages, &transfers, plan.micro_batches)? else {
        return Ok((None, 0));
    };
    let simulated_passes = chosen.simulated_passes;
    if chosen.iteration_ms >= below_ms {
        return Ok((None, simulated_passes));
    }
    let mut costed = plan.clone();
    costed.schedule.kind = ScheduleKind::EarlyBackward1F1B;
    costed.schedule.warmup_policy = WarmupPolicy::Auto;
    for (stage, k) in costed.stages.iter_mut().zip(chosen.depths) {
        stage.warmup_micro_batches = k;
    }
    costed.estimate = Some(evaluate_costed(&costed, costs)?);
    Ok((Some(costed), simulated_passes))
}

/// Every valid depth vector that fits in memory (K_i at most stage i's
/// deepest, [`deepest_warmups`], and at most K_{i-1}), simulated: the
/// fastest, its time and how many there were. A check of
/// [`choose_warmups`], which searches locally (docs/simulation.md), where
/// the vectors are few enough: None where there are more than
/// `max_vectors` (counted before any is simulated) or none fits.
pub fn fastest_valid_warmups(
    plan: &Plan,
    profile: &Profile,
    max_vectors: u64,
) -> Result<Option<ExhaustiveWarmups>> {
    let (stages, transfers) = sim_inputs(plan, &ProfileCosts::new(profile))?;
    fastest_of_every_vector(&stages, &transfers, plan.micro_batches, max_vectors)
}

/// [`fastest_valid_warmups`] of a pipeline's stages and links.
pub fn fastest_of_every_vector(
    stages: &[SimStage],
    transfer_ms: &[f64],
    micro_batches: u32,
    max_vectors: u64,
) -> Result<Option<ExhaustiveWarmups>> {
    let Some(caps) = deepest_warmups(stages, micro_batches) else {
        return Ok(None);
    };
    let vectors = valid_vector_count(&caps);
    if vectors > max_vectors {
        return Ok(None);
    }
    let mut best = ExhaustiveWarmups {
        depths: Vec::new(),
        iteration_ms: f64::INFINITY,
        vectors,
    };
    // Depth first: the vector so far, each next depth at most its cap and
    // the last one's.
    let mut depths = vec![0u32; caps.len()];
    let mut stack = vec![(0usize, caps[0])];
    while let Some((i, k)) = stack.pop() {
        depths[i] = k;
        if k > 1 {
            stack.push((i, k - 1));
        }
        if i + 1 < caps.len() {
            stack.push((i + 1, caps[i + 1].min(k)));
            continue;
        }
        let (ms, _) = iteration_ms_and_passes(stages, transfer_ms, micro_batches, &depths)?;
        if ms < best.iteration_ms {
            (best.depths, best.iteration_ms) = (depths.clone(), ms);
        }
    }
    Ok(Some(best))
}

/// [`fastest_valid_warmups`]' result.
#[derive(Debug, Clone, PartialEq)]
pub struct ExhaustiveWarmups {
    pub depths: Vec<u32>,
    pub iteration_ms: f64,
    /// Valid vectors that fit, every one simulated.
    pub vectors: u64,
}

/// Non-increasing vectors with K_i in 1..=caps[i] (saturating).
fn valid_vector_count(caps: &[u32]) -> u64 {
    // ending[k - 1]: vectors of the stages so far whose last depth is k.
    let mut ending: Vec<u64> = vec![1; caps.first().map_or(0, |&c| c as usize)];
    for &cap in &caps[1.min(caps.len())..] {
        let mut next = vec![0u64; cap as usize];
        // Depth k follows any last depth >= k: a suffix sum.
        let mut at_least = ending
            .iter()
            .skip(cap as usize)
            .fold(0u64, |a, &n| a.saturating_add(n));
        for k in (1..=cap as usize).rev() {
            at_least = at_least.saturating_add(ending.get(k - 1).copied().unwrap_or(0));
            next[k - 1] = at_least;
        }
        ending = next;
    }
    ending.iter().fold(0u64, |a, &n| a.saturating_add(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Schedule;
    use crate::simulation::early_backward::iteration_ms as early_backward_iteration_ms;
    use crate::simulation::simulate::simulate_stages;

    fn stage(f: f64, b: f64, state: f64, stored: f64, limit: f64) -> SimStage {
        SimStage {
            fwd_ms: f,
            recompute_ms: f,
            bwd_ms: b,
            bwd_weight_ms: b / 2.0,
            allreduce_ms: 0.0,
            optimizer_ms: 0.0,
            model_state_bytes: state,
            weight_bytes: state / 4.0,
            own_adam_moments_bytes: 0.0,
            stored_bytes: stored,
            input_bytes: 0.0,
            working_bytes: 0.0,
            rerun_bytes: stored,
            recompute_backward_bytes: stored,
            gradient_bytes: 0.0,
            optimizer_step_bytes: 0.0,
            allocator_reserved_factor: 1.0,
            memory_limit_bytes: limit,
            recomputes: false,
        }
    }

    #[test]
    fn deepest_depths_follow_memory_and_never_grow() {
        // Room for 5, 2 and 9 slices; M = 8.
        let stages = [
            stage(1.0, 1.0, 10.0, 10.0, 60.0),
            stage(1.0, 1.0, 0.0, 10.0, 29.0),
            stage(1.0, 1.0, 0.0, 10.0, 95.0),
        ];
        assert_eq!(deepest_warmups(&stages, 8), Some(vec![5, 2, 2]));
        assert_eq!(deepest_warmups(&stages, 1), Some(vec![1, 1, 1]));
        // No room for one slice: nothing fits.
        let tight = [stage(1.0, 1.0, 95.0, 10.0, 100.0)];
        assert_eq!(deepest_warmups(&tight, 4), None);
        // Nothing stored: any depth fits while the weights do.
        let free = [stage(1.0, 1.0, 10.0, 0.0, 100.0)];
        assert_eq!(deepest_warmups(&free, 4), Some(vec![4]));
    }

    #[test]
    fn equal_times_keep_the_shallower_warmup() {
        // Free links and equal stages: policy A's depths already leave no
        // bubble, so deeper ones only cost memory.
        let stages = vec![stage(1.0, 2.0, 0.0, 1.0, 1e9); 3];
        let c = choose_warmups(&stages, &[0.0, 0.0], 8).unwrap().unwrap();
        let policy_a = early_backward_iteration_ms(&stages, &[0.0, 0.0], 8, &[3, 2, 1]).unwrap();
        assert_eq!(c.iteration_ms, policy_a);
        assert!(c.depths.iter().sum::<u32>() <= 6, "{:?}", c.depths);
    }

    #[test]
    fn one_stage_keeps_one_micro_batch_in_flight_at_the_time_of_any_depth() {
        // Memory for every micro-batch: any depth is valid and none is
        // faster, so the choice is one micro-batch, simulated once.
        let stages = vec![stage(1.0, 2.0, 0.0, 1.0, 1e9)];
        let m = 5_000;
        let c = choose_warmups(&stages, &[], m).unwrap().unwrap();
        assert_eq!((c.depths.clone(), c.simulations), (vec![1], 1));
        for k in [1, 2, 77, m] {
            let ms = early_backward_iteration_ms(&stages, &[], m, &[k]).unwrap();
            assert!((ms - c.iteration_ms).abs() <= 1e-12 * ms, "{k}: {ms} {c:?}");
        }
    }

    #[test]
    fn a_depth_is_given_back_in_logarithmic_steps_to_where_the_time_changes() {
        // The time stays while stage 0 is 37 deep or more and stage 1 is
        // 5 or more, and is worse below either.
        let calls = std::cell::Cell::new(0u32);
        let time = |k: &[u32]| {
            calls.set(calls.get() + 1);
            let stays = k[0] >= 37 && k.get(1).is_none_or(|&k1| k1 >= 5);
            Ok(if stays { 10.0 } else { 11.0 })
        };
        let (mut k, mut ms) = (vec![100_000], 10.0);
        give_back(&mut k, &mut ms, &time).unwrap();
        assert_eq!((k, ms), (vec![37], 10.0));
        assert!(calls.get() <= 2 * 17 + 2, "{} simulations", calls.get());
        // Stage 0 comes down no lower than stage 1, then stage 1 comes down.
        let (mut k, mut ms) = (vec![64, 40], 10.0);
        give_back(&mut k, &mut ms, &time).unwrap();
        assert_eq!(k, vec![40, 5]);
    }

    #[test]
    fn the_moves_take_no_step_that_only_rounding_makes_faster() {
        // Each deeper depth 1e-15 faster: a tie, so the start stands after
        // one sweep; a step of 1e-9 is taken.
        let calls = std::cell::Cell::new(0u32);
        let time = |k: &[u32]| {
            calls.set(calls.get() + 1);
            Ok(1.0 - 1e-15 * f64::from(k[0]))
        };
        let (k, _) = descend(vec![1], &[200], &time, false).unwrap();
        assert_eq!(k, vec![1]);
        assert!(
            calls.get() <= 1 + DEPTHS_TRIED_PER_STAGE + 1,
            "{}",
            calls.get()
        );
        let faster = |k: &[u32]| Ok(1.0 - 1e-9 * f64::from(k[0]));
        assert_eq!(
            descend(vec![1], &[200], &faster, false).unwrap().0,
            vec![200]
        );
    }

    #[test]
    fn a_slow_link_wants_a_deeper_warmup_than_policy_a() {
        // Two equal stages, a link as slow as a forward: under policy A
        // (K = [2, 1]) stage 0 waits for each gradient's round trip.
        let stages = vec![stage(1.0, 2.0, 0.0, 1.0, 1e9); 2];
        let link = [1.0];
        let m = 8;
        let policy_a = early_backward_iteration_ms(&stages, &link, m, &[2, 1]).unwrap();
        let c = choose_warmups(&stages, &link, m).unwrap().unwrap();
        let (k, ms) = (c.depths, c.iteration_ms);
        assert!(ms < policy_a, "{k:?}: {ms} vs policy A {policy_a}");
        assert!(k[0] > 2, "{k:?}");
        // The chosen depths are what the full simulator runs.
        let full = simulate_stages(
            &stages,
            &link,
            &Schedule::early_backward(2, m, &k).unwrap(),
            false,
        )
        .unwrap();
        assert_eq!(full.iteration_ms, ms);
        // With memory for two slices only, stage 0 is held to K = 2.
        let tight = vec![stage(1.0, 2.0, 0.0, 1.0, 2.5); 2];
        let k = choose_warmups(&tight, &link, m).unwrap().unwrap().depths;
        assert_eq!(k[0], 2, "{k:?}");
    }

    #[test]
    fn the_choice_stops_at_its_budget_with_the_best_depths_so_far() {
        // A link three forwards long: the choice beats policy B's depths
        // (its first start) only by simulating more.
        let stages = vec![stage(1.0, 2.0, 0.0, 1.0, 1e9); 2];
        let (link, m) = ([3.0], 8);
        let passes = 2 * u64::from(m);
        let free = choose_warmups_within(&stages, &link, m, u64::MAX)
            .unwrap()
            .unwrap();
        // One iteration's passes: the first start alone, simulated once.
        let one = choose_warmups_within(&stages, &link, m, passes)
            .unwrap()
            .unwrap();
        assert_eq!(one.simulations, 1);
        assert_eq!(one.depths, vec![3, 1], "policy B: K_i = 2(S-i)-1");
        let b = early_backward_iteration_ms(&stages, &link, m, &[3, 1]).unwrap();
        assert_eq!(one.iteration_ms, b);
        // Budgets in between: never more simulations than they pay for,
        // and never slower than a smaller budget's choice.
        let mut previous = one.iteration_ms;
        for iterations in [2, 4, 8, 16, 64] {
            let c = choose_warmups_within(&stages, &link, m, iterations * passes)
                .unwrap()
                .unwrap();
            assert!(
                c.simulations <= iterations,
                "{iterations}: {}",
                c.simulations
            );
            assert!(c.iteration_ms <= previous, "{iterations}: {c:?}");
            assert!(c.iteration_ms >= free.iteration_ms, "{iterations}: {c:?}");
            previous = c.iteration_ms;
        }
        assert!(
            free.iteration_ms < b,
            "the unbounded choice improves on its start"
        );
    }

    /// Every valid depth vector under `caps`: non-increasing, K_i in 1..=caps[i].
    fn every_vector(caps: &[u32]) -> Vec<Vec<u32>> {
        let Some((&cap, rest)) = caps.split_first() else {
            return vec![vec![]];
        };
        let tails = every_vector(rest);
        (1..=cap)
            .flat_map(|k| {
                tails
                    .iter()
                    .filter(move |t| t.first().is_none_or(|&next| next <= k))
                    .map(move |t| [vec![k], t.clone()].concat())
            })
            .collect()
    }

    #[test]
    fn on_small_pipelines_the_choice_is_the_fastest_valid_vector() {
        // Random pipelines of 2 to 5 stages and 2 to 10 micro-batches,
        // unequal stages and links, memory for 1 to 10 micro-batches:
        // the chosen depths against every valid vector.
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(28);
        let (mut checked, mut vectors) = (0, 0);
        for _ in 0..400 {
            let (s, m) = (rng.gen_range(2..=5), rng.gen_range(2..=10));
            let stages: Vec<SimStage> = (0..s)
                .map(|_| {
                    let f = rng.gen_range(0.2..3.0);
                    stage(
                        f,
                        f * rng.gen_range(1.0..3.0),
                        0.0,
                        1.0,
                        rng.gen_range(1.0..11.0),
                    )
                })
                .collect();
            let links: Vec<f64> = (1..s).map(|_| rng.gen_range(0.0..2.0)).collect();
            let Some(caps) = deepest_warmups(&stages, m) else {
                continue;
            };
            let chosen = choose_warmups(&stages, &links, m).unwrap().unwrap();
            let all = every_vector(&caps);
            let fastest = all
                .iter()
                .map(|k| early_backward_iteration_ms(&stages, &links, m, k).unwrap())
                .fold(f64::INFINITY, f64::min);
            // The enumeration Table V's check uses finds the same, over as
            // many vectors.
            let exhaustive = fastest_of_every_vector(&stages, &links, m, u64::MAX);
            let exhaustive = exhaustive.unwrap().unwrap();
            assert_eq!(exhaustive.vectors, all.len() as u64);
            assert_eq!(exhaustive.iteration_ms, fastest);
            let too_many = fastest_of_every_vector(&stages, &links, m, all.len() as u64 - 1);
            assert_eq!(too_many.unwrap(), None);
            assert!(
                chosen.iteration_ms <= fastest * (1.0 + 1e-12),
                "{caps:?} {links:?}: chose {:?} at {} ms, {fastest} ms exists",
                chosen.depths,
                chosen.iteration_ms
            );
            (checked, vectors) = (checked + 1, vectors + all.len());
        }
        assert!(checked > 300 && vectors > 10_000, "{checked} {vectors}");
    }
}
