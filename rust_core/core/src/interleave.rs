//! A plan run as interleaved 1F1B: what its ranks would do with v chunks
//! each (issue 28's first measure of interleaving, before the search plans
//! chunks itself).
//!
//! The plan's stages are the ranks. The model's layers are cut again into
//! p x v consecutive chunks, balanced by the layers' forward and backward
//! time (`block_partition`), chunk s on rank s mod p with that rank's
//! devices and shape (tensor parallelism, replicas, ZeRO, re-computation).
//! Each chunk is costed as the plan's stages are, and the ranks run torch's
//! `ScheduleInterleaved1F1B` order in the simulator (`simulate_order`).

use crate::block_partition::weighted_block_partition;
use crate::cost::StageCost;
use crate::costing::{stage_costs, with_coster, ProfileCosts};
use crate::error::{Error, Result};
use crate::pipeline_order::PipelineOrder;
use crate::plan::{Plan, Stage};
use crate::profile::Profile;
use crate::simulate::{sim_stages, simulate_order, OrderSimulation};

/// [`simulate_interleaved`]'s result: the chunks and their run.
#[derive(Debug, Clone, PartialEq)]
pub struct Interleaved {
    /// `chunk_layers[s]`: layers start..end of chunk s, on rank s mod p.
    pub chunk_layers: Vec<(usize, usize)>,
    pub simulation: OrderSimulation,
}

/// `plan` as interleaved 1F1B with `chunks` chunks a rank; `chunks` = 1 is
/// plain 1F1B (policy B's depths) on the plan's own stages.
pub fn simulate_interleaved(plan: &Plan, profile: &Profile, chunks: u32) -> Result<Interleaved> {
    if plan.schedule.kind.is_asynchronous() {
        return Err(Error::field(
            "schedule.kind",
            format!(
                "value \"{}\" is asynchronous; interleaving runs a synchronous pipeline",
                plan.schedule.kind
            ),
        ));
    }
    if chunks == 0 {
        return Err(Error::field(
            "chunks",
            "value 0: a rank holds at least one chunk",
        ));
    }
    let ranks = plan.stages.len() as u32;
    let order = PipelineOrder::interleaved_1f1b(ranks, plan.micro_batches, chunks)
        .map_err(|e| e.under("micro_batches"))?;
    let costs = ProfileCosts::new(profile);
    let parts = (ranks * chunks) as usize;
    let n = costs.layers.num_layers;
    if parts > n {
        return Err(Error::field(
            "chunks",
            format!(
                "value {chunks} on {ranks} rank{} needs {parts} layers; the model has {n}",
                if ranks == 1 { "" } else { "s" }
            ),
        ));
    }
    // The plan is checked as it is (its ranks' devices apart); each chunk
    // is then costed on its rank's devices, as a stage of its own.
    let (stages, transfers, chunk_layers) = with_coster(plan, &costs, |coster, allocs, _| {
        let (rank_costs, _) = stage_costs(coster, plan, allocs, false);
        let chunk_layers = balanced_chunks(plan, &costs, &rank_costs, parts);
        let chunked = Plan {
            stages: chunk_layers
                .iter()
                .enumerate()
                .map(|(s, &(layer_start, layer_end))| Stage {
                    layer_start,
                    layer_end,
                    warmup_micro_batches: 1,
                    ..plan.stages[s % allocs.len()].clone()
                })
                .collect(),
            ..plan.clone()
        };
        let on_rank: Vec<_> = (0..parts)
            .map(|s| allocs[s % allocs.len()].clone())
            .collect();
        let (chunk_costs, transfers) = stage_costs(coster, &chunked, &on_rank, false);
        let stages = sim_stages(coster, &chunked, &chunk_costs, &on_rank);
        (stages, transfers, chunk_layers)
    })?;
    Ok(Interleaved {
        chunk_layers,
        simulation: simulate_order(&stages, &transfers, &order)?,
    })
}

/// The layers cut into `parts` consecutive chunks, chunk s on rank
/// s mod p, with the longest chunk time as short as can be: a layer's
/// time is its forward and backward on one GPU at the plan's micro-batch
/// size, and a rank runs it as many times faster as its stage runs its
/// own layers (replicas, tensor parallelism and faster GPUs count).
fn balanced_chunks(
    plan: &Plan,
    costs: &ProfileCosts,
    rank_costs: &[StageCost],
    parts: usize,
) -> Vec<(usize, usize)> {
    let t = costs.layers.times_at(plan.micro_batch_size);
    let one_gpu = |a: usize, b: usize| t.fwd(a, b) + t.bwd(a, b);
    let speeds: Vec<f64> = plan
        .stages
        .iter()
        .zip(rank_costs)
        .map(|(s, c)| one_gpu(s.layer_start, s.layer_end) / (c.fwd_ms + c.bwd_ms))
        .collect();
    let capacities: Vec<f64> = (0..parts).map(|s| speeds[s % speeds.len()]).collect();
    let work: Vec<f64> = (0..costs.layers.num_layers)
        .map(|l| one_gpu(l, l + 1))
        .collect();
    weighted_block_partition(&work, &capacities)
}
