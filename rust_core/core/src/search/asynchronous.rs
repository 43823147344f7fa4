//! Planning for an asynchronous schedule (`dapple plan --schedule xpipe`).
//!
//! Once an asynchronous pipeline is full it never drains, so a mini-batch
//! takes as long as its busiest stage needs for it: M forwards and M
//! backwards (and M re-run forwards where the stage re-computes), and the
//! AllReduce of its replicas. The objective is that bottleneck, simulated
//! (`schedule::steady_state_mini_batches`), within memory counted the
//! asynchronous way (activations kept, or only inputs where a stage
//! re-computes; stashed or predicted weight copies, XPipe's own moments;
//! `simulation/simulate.rs`).
//!
//! Candidates: uniform pipelines, S stages of G / S consecutive GPUs for
//! every S dividing the G GPUs (up to one layer a stage), layers split by
//! block partition so the largest per-sample stage work (a forward and a
//! backward, over its replicas) is smallest; each at every micro-batch
//! size, re-computing no stage, and re-computing exactly the stages that
//! do not fit otherwise. A stage's memory does not depend on whether the
//! others re-compute, and re-computing only adds time, so no other choice
//! of stages to re-compute can be faster and fit. The fastest candidate
//! that fits is the plan. The DP search of the
//! synchronous planner (`search/`) is not used: its objective is the
//! flushed iteration.

use crate::baselines::{fastest_that_fits, layout_at_every_size};
use crate::cluster::topology::Topology;
use crate::cost::block_partition::block_partition;
use crate::cost::shape::Recompute;
use crate::cost::{Cluster, WarmupPolicy};
use crate::error::{Error, Result};
use crate::model::profile::Profile;
use crate::plan::{Plan, PlanInputs};
use crate::schedule::{steady_state_mini_batches, ScheduleKind};
use crate::simulation::costing::ProfileCosts;
use crate::simulation::evaluate::evaluate_costed;

/// The fastest uniform pipeline that fits for asynchronous `kind`; its
/// plan names `kind` and its estimate is the steady state
/// (`evaluate::asynchronous_estimate`).
pub fn asynchronous_plan(
    kind: ScheduleKind,
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_micro_batch_size: Option<u32>,
) -> Result<Plan> {
    if !kind.is_asynchronous() {
        return Err(Error::field(
            "schedule",
            format!(
                "value \"{kind}\" is not asynchronous; the synchronous kinds are the search's own"
            ),
        ));
    }
    let min_slice = profile.min_slice(min_micro_batch_size);
    let costs = ProfileCosts::new(profile);
    let layers = &costs.layers;
    let cluster = Cluster::for_model(topology, layers)?;
    let gpus = cluster.num_devices();
    let n = layers.num_layers;
    let t = layers.times_at(min_slice);
    // A stage's work per sample, without re-computation (what most
    // stages run; one that must re-compute adds its forward).
    let work: Vec<f64> = (0..n).map(|l| t.fwd(l, l + 1) + t.bwd(l, l + 1)).collect();
    let inputs = PlanInputs::new(
        profile,
        topology,
        global_batch_size,
        min_slice,
        kind.name(),
        None,
    );
    let mut candidates = Vec::new();
    for stages in (1..=gpus.min(n as u32)).filter(|s| gpus.is_multiple_of(*s)) {
        let per_stage = gpus / stages;
        let layout: Vec<(usize, usize, Vec<u32>)> = block_partition(&work, stages as usize)
            .into_iter()
            .enumerate()
            .map(|(i, (s, e))| {
                let first = i as u32 * per_stage;
                (s, e, (first..first + per_stage).collect())
            })
            .collect();
        // A micro-batch size too fine to reach a steady state within the
        // work limit is left out, as the synchronous search leaves out
        // sizes over it.
        for plan in layout_at_every_size(&inputs, &layout, kind, WarmupPolicy::A)
            .into_iter()
            .filter(|p| steady_state_mini_batches(p.stages.len(), p.micro_batches).is_ok())
        {
            candidates.extend(recomputing_where_needed(&plan, &costs));
            candidates.push(plan);
        }
    }
    fastest_that_fits(
        candidates,
        &costs,
        WarmupPolicy::A,
        kind.name(),
        global_batch_size,
        min_slice,
    )
}

/// `plan` with each stage that does not fit its GPUs' memory re-computing
/// (keeping only its input for the backward); None where every stage fits
/// already, or either plan cannot be costed (the candidate itself then
/// says why).
fn recomputing_where_needed(plan: &Plan, costs: &ProfileCosts) -> Option<Plan> {
    let estimate = evaluate_costed(plan, costs).ok()?;
    if estimate.fits_memory {
        return None;
    }
    let mut recomputing = plan.clone();
    for (stage, cost) in recomputing.stages.iter_mut().zip(&estimate.stages) {
        if cost.memory_bytes > cost.memory_limit_bytes {
            stage.shape.recompute = Recompute::Full;
        }
    }
    // A stage may not re-compute everywhere (on unlike GPUs): then there is
    // no such candidate.
    evaluate_costed(&recomputing, costs).ok()?;
    Some(recomputing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::profile::chain_profile;
    use crate::simulation::evaluate::evaluate;

    #[test]
    fn the_plan_is_the_fastest_uniform_pipeline_in_its_steady_state() {
        let profile = chain_profile(&[(1.0, 2.0); 8], 1);
        let topology = Topology::from_spec("1x4-nvlink").unwrap();
        let plan =
            asynchronous_plan(ScheduleKind::XPipe, &profile, &topology, 32, Some(1)).unwrap();
        assert_eq!(plan.schedule.kind, ScheduleKind::XPipe);
        let estimate = plan.estimate.clone().unwrap();
        assert!(estimate.fits_memory);
        // Its steady state is no slower than that of every other candidate.
        let again = evaluate(&plan, &profile).unwrap();
        assert_eq!(again.iteration_ms, estimate.iteration_ms);
        for s in [1u32, 2, 4] {
            let per = 4 / s;
            let stages: Vec<(usize, usize, Vec<u32>)> = (0..s)
                .map(|i| {
                    let l = (8 / s) as usize;
                    (
                        i as usize * l,
                        (i as usize + 1) * l,
                        (i * per..(i + 1) * per).collect(),
                    )
                })
                .collect();
            let other = crate::baselines::layout_plan(
                &profile,
                &topology,
                32,
                &stages,
                ScheduleKind::XPipe,
                WarmupPolicy::A,
                Some(1),
                "test",
            )
            .unwrap();
            assert!(plan.iteration_ms() <= other.iteration_ms(), "{s} stages");
        }
        // The bound is the busiest stage's work per mini-batch.
        assert!(estimate.latency_ms <= estimate.iteration_ms.unwrap() * (1.0 + 1e-9));
        assert!(asynchronous_plan(ScheduleKind::GPipe, &profile, &topology, 32, None).is_err());
        // Micro-batches of 1 over 8 stages are too many to reach a steady
        // state within the work limit: left out, not an error.
        let big = Topology::from_spec("1x8-nvlink").unwrap();
        let plan = asynchronous_plan(ScheduleKind::XPipe, &profile, &big, 8192, Some(1)).unwrap();
        assert!(steady_state_mini_batches(plan.stages.len(), plan.micro_batches).is_ok());
    }

    #[test]
    fn a_stage_re_computes_only_where_it_would_not_fit() {
        // Layers that keep 3 GB per sample for the backward and pass on
        // 0.1 GB, on 16 GB GPUs: the first stages, with the most
        // micro-batches in flight, keep only their inputs; the others keep
        // their activations.
        let mut profile = chain_profile(&[(1.0, 2.0); 8], 1);
        for layer in &mut profile.layers {
            layer.measurements[0].activation_bytes = 100_000_000;
            layer.measurements[0].stored_activation_bytes = Some(3_000_000_000);
        }
        let topology = Topology::from_spec("1x4-nvlink").unwrap();
        let (mut seen_recompute, mut seen_mixed) = (false, false);
        for global_batch_size in [2u32, 4, 8, 16, 32, 64] {
            let Ok(plan) = asynchronous_plan(
                ScheduleKind::PipeDream,
                &profile,
                &topology,
                global_batch_size,
                None,
            ) else {
                break;
            };
            assert!(plan.estimate.as_ref().unwrap().fits_memory);
            seen_mixed |= plan.stages.iter().any(|s| s.shape.recompute.is_none())
                && plan.stages.iter().any(|s| !s.shape.recompute.is_none());
            for i in 0..plan.stages.len() {
                if plan.stages[i].shape.recompute.is_none() {
                    continue;
                }
                seen_recompute = true;
                // Keeping its activations, that stage would not fit.
                let mut kept = plan.clone();
                kept.stages[i].shape.recompute = Recompute::None;
                let cost = &evaluate(&kept, &profile).unwrap().stages[i];
                assert!(
                    cost.memory_bytes > cost.memory_limit_bytes,
                    "{global_batch_size}"
                );
            }
        }
        assert!(seen_recompute && seen_mixed);
    }

    #[test]
    fn an_asynchronous_plan_before_version_4_re_computes_every_stage() {
        use crate::formats::format::FileObject;
        let profile = chain_profile(&[(1.0, 2.0); 8], 1);
        let topology = Topology::from_spec("1x4-nvlink").unwrap();
        let plan =
            asynchronous_plan(ScheduleKind::XPipe, &profile, &topology, 32, Some(1)).unwrap();
        assert!(plan.stages.iter().all(|s| s.shape.recompute.is_none()));
        let text = plan.to_json();
        assert_eq!(Plan::from_json(&text).unwrap().stages, plan.stages);
        let now = format!(
            "\"schema_version\": {}",
            crate::formats::format::PLAN.version
        );
        let old = text.replace(&now, "\"schema_version\": 3");
        assert_ne!(old, text);
        let read = Plan::from_json(&old).unwrap();
        assert_eq!(read.schema_version, 3);
        assert!(read.recomputes_every_stage() && !plan.recomputes_every_stage());
        // As it read then: the forward again in every backward, in the
        // estimate, the simulation and the run's layout.
        let then = evaluate(&read, &profile).unwrap().iteration_ms.unwrap();
        let now = evaluate(&plan, &profile).unwrap().iteration_ms.unwrap();
        assert!(then > now, "{then} vs {now}");
        let sim =
            crate::simulation::simulate::simulate(&read, &profile, Default::default()).unwrap();
        assert!(sim.recompute && (sim.iteration_ms - then).abs() < 1e-9 * then);
        let layout = crate::plan::layout::RunLayout::of(&read).unwrap();
        assert!(layout.stages.iter().all(|s| s.recompute));
        // Written again and read, it means the same.
        assert!(Plan::from_json(&read.to_json())
            .unwrap()
            .recomputes_every_stage());
    }
}
