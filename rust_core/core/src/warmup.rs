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
//! deepest depths memory allows and from policies A and B within them, keep
//! the fastest, then lower one stage's depth at a time while that makes the
//! simulated iteration shorter. Pure functions on plain numbers.

use crate::cost::WarmupPolicy;
use crate::error::Result;
use crate::evaluate::evaluate;
use crate::plan::Plan;
use crate::profile::Profile;
use crate::schedule::ScheduleKind;
use crate::simulate::{early_backward_iteration_ms, sim_inputs, SimStage};

/// Deepest K_i each stage's memory allows, at most M and never deeper than
/// the stage before (so the vector itself is valid). None when some stage
/// does not fit even with one micro-batch in flight.
pub fn deepest_warmups(stages: &[SimStage], micro_batches: u32) -> Option<Vec<u32>> {
    let mut caps = Vec::with_capacity(stages.len());
    let mut previous = micro_batches;
    for s in stages {
        let room = s.memory_limit_bytes - s.model_state_bytes - s.working_bytes;
        let cap = if s.stored_bytes <= 0.0 {
            if room < 0.0 {
                return None;
            }
            micro_batches
        } else {
            let k = (room / s.stored_bytes).floor();
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
    /// Iterations simulated to find them: the work the choice cost.
    pub simulations: u64,
}

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
    let Some(deepest) = deepest_warmups(stages, micro_batches) else {
        return Ok(None);
    };
    let s_count = stages.len();
    let simulations = std::cell::Cell::new(0u64);
    let time = |k: &[u32]| {
        simulations.set(simulations.get() + 1);
        early_backward_iteration_ms(stages, transfer_ms, micro_batches, k)
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
        let (k, ms) = descend(start, &deepest, &time)?;
        if best.as_ref().is_none_or(|(bk, b)| better(ms, &k, *b, bk)) {
            best = Some((k, ms));
        }
    }
    // Then give back memory: lower each depth while the time stays the same.
    if let Some((k, ms)) = best.as_mut() {
        for i in 0..k.len() {
            let floor = k.get(i + 1).copied().unwrap_or(1);
            while k[i] > floor {
                let mut trial = k.clone();
                trial[i] -= 1;
                if !better(time(&trial)?, &trial, *ms, k) {
                    break;
                }
                *k = trial;
            }
        }
    }
    Ok(best.map(|(depths, iteration_ms)| ChosenWarmups {
        depths,
        iteration_ms,
        simulations: simulations.get(),
    }))
}

/// Is (ms, depths) better than (best_ms, best)? Faster, or as fast (to a
/// relative 1e-12, below any profile's precision) with fewer micro-batches
/// in flight in total, which holds less memory.
fn better(ms: f64, depths: &[u32], best_ms: f64, best: &[u32]) -> bool {
    let tie = (ms - best_ms).abs() <= 1e-12 * best_ms.abs();
    if tie {
        depths.iter().sum::<u32>() < best.iter().sum::<u32>()
    } else {
        ms < best_ms
    }
}

/// Most depths tried for one stage in one pass; wider ranges are sampled
/// (every depth near the current one, then spaced out).
const DEPTHS_TRIED_PER_STAGE: u32 = 16;

/// Change one stage's depth at a time to the best value its neighbours
/// allow (K_{i+1} <= K_i <= min(K_{i-1}, cap_i)) until nothing is faster.
fn descend(
    mut k: Vec<u32>,
    caps: &[u32],
    time: &impl Fn(&[u32]) -> Result<f64>,
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
                if ms < best_ms {
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
/// `choose_warmups` picks, costed, and the number of iterations simulated
/// to choose them. None when no depths fit in memory.
pub fn plan_with_chosen_warmups(plan: &Plan, profile: &Profile) -> Result<(Option<Plan>, u64)> {
    let (stages, transfers) = sim_inputs(plan, profile, true)?;
    let Some(chosen) = choose_warmups(&stages, &transfers, plan.micro_batches)? else {
        return Ok((None, 0));
    };
    let (depths, simulations) = (chosen.depths, chosen.simulations);
    let mut chosen = plan.clone();
    chosen.schedule.kind = ScheduleKind::EarlyBackward1F1B;
    chosen.schedule.warmup_policy = WarmupPolicy::Auto;
    for (stage, k) in chosen.stages.iter_mut().zip(depths) {
        stage.warmup_micro_batches = k;
    }
    chosen.estimate = Some(evaluate(&chosen, profile)?);
    Ok((Some(chosen), simulations))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Schedule;
    use crate::simulate::simulate_stages;

    fn stage(f: f64, b: f64, state: f64, stored: f64, limit: f64) -> SimStage {
        SimStage {
            fwd_ms: f,
            recompute_ms: f,
            bwd_ms: b,
            allreduce_ms: 0.0,
            optimizer_ms: 0.0,
            model_state_bytes: state,
            weight_bytes: state / 4.0,
            own_adam_moments_bytes: 0.0,
            stored_bytes: stored,
            input_bytes: 0.0,
            working_bytes: 0.0,
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
}
