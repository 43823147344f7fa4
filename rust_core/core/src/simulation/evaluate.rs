//! Costing a checked plan: `evaluate` costs any plan, including one written by hand or by another
//! planner, with the same model the search uses, so plans can be compared
//! on equal terms.

use crate::cost::shape::MemoryTerms;
use crate::cost::{
    pipeline_latency, zero_bubble_latency, Alloc, Latency, PipeStage, StageCost, StageCoster,
};
use crate::error::Result;
use crate::model::profile::Profile;
use crate::plan::{
    plan_schedule, Estimate, PipelinePosition, Plan, PositionKind, TransferEstimate,
};
use crate::simulation::costing::{stage_costs, with_coster, ProfileCosts};
use crate::simulation::simulate::{
    rerun_as_scheduled, sim_stages, simulate_order, simulate_stages, OrderSimulation, SimStage,
    StageTimeline,
};

/// Check that `plan` can run `profile` on its topology and cost it.
pub fn evaluate(plan: &Plan, profile: &Profile) -> Result<Estimate> {
    evaluate_costed(plan, &ProfileCosts::new(profile))
}

/// [`evaluate`] with what the profile gives every plan derived once.
pub(crate) fn evaluate_costed(plan: &Plan, costs: &ProfileCosts) -> Result<Estimate> {
    with_coster(plan, costs, |coster, allocs, _| {
        estimate_stages(coster, plan, allocs)
    })
}

/// [`evaluate`] without the simulation (`iteration_ms` None): formula (2),
/// the bound a search candidate is ranked by before it is simulated.
pub(crate) fn bound_estimate(plan: &Plan, costs: &ProfileCosts) -> Result<Estimate> {
    with_coster(plan, costs, |coster, allocs, _| {
        bound_estimate_stages(coster, plan, allocs)
    })
}

/// Cost a plan whose stages have already been checked: formula (2) and
/// its terms, and the simulated iteration of the plan's own schedule.
pub(crate) fn estimate_stages(coster: &StageCoster, plan: &Plan, allocs: &[Alloc]) -> Estimate {
    estimate_stages_simulated(coster, plan, allocs, true)
}

/// [`estimate_stages`] without the simulation (`iteration_ms` None):
/// formula (2), a bound, is all a search candidate needs until it is
/// costed, and under warm-up policy auto it is simulated only then, with
/// the depths chosen for it.
pub(crate) fn bound_estimate_stages(
    coster: &StageCoster,
    plan: &Plan,
    allocs: &[Alloc],
) -> Estimate {
    estimate_stages_simulated(coster, plan, allocs, false)
}

fn estimate_stages_simulated(
    coster: &StageCoster,
    plan: &Plan,
    allocs: &[Alloc],
    simulated: bool,
) -> Estimate {
    let (costs, transfers_ms) = stage_costs(coster, plan, allocs, plan.stages.len() == 1);
    let mut pipe: Vec<PipeStage> = Vec::new();
    let mut stages = Vec::new();
    let mut transfers = Vec::new();
    for (i, (s, c)) in plan.stages.iter().zip(&costs).enumerate() {
        if i > 0 {
            let t = transfers_ms[i - 1];
            let bytes = coster.layers.cut_bytes_per_sample(s.layer_start)
                * f64::from(plan.micro_batch_size);
            transfers.push(TransferEstimate {
                bytes,
                fwd_ms: t,
                bwd_ms: t,
            });
            pipe.push(PipeStage::transfer(t));
        }
        pipe.push(c.as_pipe_stage());
        stages.push(*c);
    }
    let sim_stages = sim_stages(coster, plan, &costs, allocs);
    if plan.schedule.kind.is_asynchronous() {
        return asynchronous_estimate(coster, plan, stages, transfers, &sim_stages, &transfers_ms);
    }
    if plan.schedule.kind.is_chunked() {
        let simulation = simulated.then(|| {
            plan.chunked_order()
                .and_then(|order| simulate_order(&sim_stages, &transfers_ms, &order))
        });
        let simulation = match simulation {
            Some(Err(e)) => unreachable!("a checked plan simulates: {e}"),
            other => other.map(Result::unwrap),
        };
        return chunked_estimate(coster, plan, stages, transfers, simulation.as_ref());
    }
    let lat = match plan.schedule.kind {
        kind if kind.defers_weight_gradients() => zero_bubble_latency(&pipe, plan.micro_batches),
        _ => pipeline_latency(&pipe, plan.micro_batches),
    };
    // A checked plan's own schedule always builds and runs.
    let simulation = simulated.then(|| {
        plan_schedule(plan, None)
            .and_then(|schedule| simulate_stages(&sim_stages, &transfers_ms, &schedule, false))
    });
    let iteration_ms = match &simulation {
        None => None,
        Some(Ok(sim)) => {
            for (st, timeline) in stages.iter_mut().zip(&sim.stages) {
                st.bubble_ms = Some(sim.iteration_ms - timeline.compute_ms);
                if plan.schedule.kind.defers_weight_gradients() {
                    // Each micro-batch's activations stay until its W, past
                    // the K_i the cost model's memory counts.
                    st.memory_bytes = timeline.peak_memory_bytes;
                }
            }
            Some(sim.iteration_ms)
        }
        Some(Err(e)) => unreachable!("a checked plan simulates: {e}"),
    };
    let memory = match &simulation {
        Some(Ok(sim)) => memory_terms(&sim.stages),
        _ => Vec::new(),
    };
    let parts = Parts {
        stages,
        transfers,
        memory,
    };
    assemble(coster, plan, lat, iteration_ms, parts)
}

/// Each stage's peak memory in its terms, as the simulation has them.
fn memory_terms(timelines: &[StageTimeline]) -> Vec<MemoryTerms> {
    timelines.iter().filter_map(|t| t.memory_terms).collect()
}

/// The estimate of a plan with an asynchronous schedule: its simulated
/// steady state (`iteration_ms`, time per mini-batch) and the bound it
/// cannot beat, the busiest stage or link per mini-batch (every forward,
/// backward and, where the stage re-computes, re-run forward, and the
/// AllReduce; or every transfer one way), in `latency_ms` and `steady_ms`,
/// with no warm-up or ending (the pipeline never drains). Memory is the
/// simulation's: activations kept (or only inputs, where a stage
/// re-computes), weight copies, XPipe's own moments.
fn asynchronous_estimate(
    coster: &StageCoster,
    plan: &Plan,
    mut stages: Vec<StageCost>,
    transfers: Vec<TransferEstimate>,
    sim_stages: &[SimStage],
    transfers_ms: &[f64],
) -> Estimate {
    let m = f64::from(plan.micro_batches);
    let schedule = match plan_schedule(plan, None) {
        Ok(schedule) => schedule,
        Err(e) => unreachable!("a checked plan has a schedule: {e}"),
    };
    let recompute = plan.recomputes_every_stage();
    let sim = match simulate_stages(sim_stages, transfers_ms, &schedule, recompute) {
        Ok(sim) => sim,
        Err(e) => unreachable!("a checked plan simulates: {e}"),
    };
    let scheduled = rerun_as_scheduled(sim_stages, &schedule);
    // Pipe positions as formula (2) numbers them: stage i at 2i, the link
    // after it at 2i + 1.
    let mut busiest = (0.0f64, 0usize);
    for (i, ((st, timeline), run)) in stages
        .iter_mut()
        .zip(&sim.stages)
        .zip(scheduled.iter())
        .enumerate()
    {
        let rerun = if recompute && !run.recomputes {
            run.recompute_ms
        } else {
            0.0
        };
        let compute = m * (run.fwd_ms + run.bwd_ms + rerun);
        let work = compute + st.tail_ms();
        st.memory_bytes = timeline.peak_memory_bytes;
        st.bubble_ms = Some((sim.iteration_ms - compute).max(0.0));
        if work > busiest.0 {
            busiest = (work, 2 * i);
        }
    }
    for (i, t) in transfers_ms.iter().enumerate() {
        if m * t > busiest.0 {
            busiest = (m * t, 2 * i + 1);
        }
    }
    let parts = Parts {
        stages,
        transfers,
        memory: memory_terms(&sim.stages),
    };
    assemble(
        coster,
        plan,
        busiest_only(busiest),
        Some(sim.iteration_ms),
        parts,
    )
}

/// The estimate of a plan of a chunked kind: its order simulated, each
/// rank's chunks together (`simulation`; None for the bound alone), and
/// the bound no order beats, the busiest rank's forwards and backwards of
/// every micro-batch and its exposed AllReduces, in `latency_ms` and
/// `steady_ms`. A stage's memory is its rank's, all of whose chunks its
/// GPUs hold: the simulated peak, or without a simulation the chunks'
/// estimates added up.
fn chunked_estimate(
    coster: &StageCoster,
    plan: &Plan,
    mut stages: Vec<StageCost>,
    transfers: Vec<TransferEstimate>,
    simulation: Option<&OrderSimulation>,
) -> Estimate {
    let m = f64::from(plan.micro_batches);
    let stage_ranks: Vec<usize> = plan.stage_ranks().iter().map(|&r| r as usize).collect();
    let mut work = vec![0.0f64; plan.ranks()];
    let mut held = vec![0.0f64; plan.ranks()];
    for (st, &r) in stages.iter().zip(&stage_ranks) {
        work[r] += m * (st.fwd_ms + st.bwd_ms) + st.tail_ms();
        held[r] += st.memory_bytes;
    }
    let busiest = (0..work.len()).fold(0, |b, r| if work[r] > work[b] { r } else { b });
    let first_stage_of_busiest = stage_ranks.iter().position(|&r| r == busiest).unwrap_or(0);
    for (st, &r) in stages.iter_mut().zip(&stage_ranks) {
        st.memory_bytes = held[r];
        if let Some(sim) = simulation {
            st.bubble_ms = Some(sim.iteration_ms - sim.ranks[r].compute_ms);
            st.memory_bytes = sim.ranks[r].peak_memory_bytes;
        }
    }
    let memory = match simulation {
        Some(sim) => stage_ranks
            .iter()
            .filter_map(|&r| sim.ranks[r].memory_terms)
            .collect(),
        None => Vec::new(),
    };
    let bound = busiest_only((work[busiest], 2 * first_stage_of_busiest));
    let parts = Parts {
        stages,
        transfers,
        memory,
    };
    assemble(
        coster,
        plan,
        bound,
        simulation.map(|sim| sim.iteration_ms),
        parts,
    )
}

/// What an estimate holds a row of per stage or transfer.
struct Parts {
    stages: Vec<StageCost>,
    transfers: Vec<TransferEstimate>,
    memory: Vec<MemoryTerms>,
}

/// The bound of a pipeline that never drains or whose order formula (2)
/// does not describe: the busiest stage or link's work (ms) at its pipe
/// position, with no warm-up or ending.
fn busiest_only((work_ms, pipe_index): (f64, usize)) -> Latency {
    Latency {
        latency_ms: work_ms,
        warmup_ms: 0.0,
        steady_ms: work_ms,
        ending_ms: 0.0,
        pivot: pipe_index,
        paper_pivot: pipe_index,
        paper_latency_ms: work_ms,
    }
}

/// The estimate of `plan` from its bound `lat`, its simulated iteration
/// (the headline where there is one) and its per-stage parts.
fn assemble(
    coster: &StageCoster,
    plan: &Plan,
    lat: Latency,
    iteration_ms: Option<f64>,
    parts: Parts,
) -> Estimate {
    let headline = iteration_ms.unwrap_or(lat.latency_ms);
    let single = coster.single_device_ms();
    let (peak, fits) = peak_and_fit(&parts.stages);
    Estimate {
        iteration_ms,
        latency_ms: lat.latency_ms,
        warmup_ms: lat.warmup_ms,
        steady_ms: lat.steady_ms,
        ending_ms: lat.ending_ms,
        pivot: position(lat.pivot),
        paper_pivot: position(lat.paper_pivot),
        paper_latency_ms: lat.paper_latency_ms,
        single_device_ms: single,
        speedup: single / headline,
        samples_per_second: f64::from(plan.inputs.global_batch_size) / headline * 1e3,
        mfu: mfu(coster, plan, headline),
        peak_memory_bytes: peak,
        fits_memory: fits,
        stages: parts.stages,
        transfers: parts.transfers,
        memory: parts.memory,
    }
}

/// Model FLOPs of an iteration of `iteration_ms` over the topology's peak,
/// where the profile counts its FLOPs and the catalog knows every GPU.
fn mfu(coster: &StageCoster, plan: &Plan, iteration_ms: f64) -> Option<f64> {
    let flops = coster.layers.model_flops_per_sample? * f64::from(plan.inputs.global_batch_size);
    let peak = plan.inputs.topology.peak_flops()?;
    Some(flops / (peak * iteration_ms / 1e3))
}

/// The largest stage memory, and whether every stage fits its GPU.
fn peak_and_fit(stages: &[StageCost]) -> (f64, bool) {
    let peak = stages.iter().map(|s| s.memory_bytes).fold(0.0, f64::max);
    let fits = stages.iter().all(StageCost::fits);
    (peak, fits)
}

/// Pipe-stage index (computation and communication interleaved) to a
/// position users can read.
fn position(pipe_index: usize) -> PipelinePosition {
    PipelinePosition {
        kind: if pipe_index.is_multiple_of(2) {
            PositionKind::Stage
        } else {
            PositionKind::Transfer
        },
        index: pipe_index / 2,
    }
}
