//! A plan run with several chunks a rank: what its ranks would do with v
//! chunks each, in one of torch's orders (issue 28's first measure of
//! interleaving, before the search plans chunks itself).
//!
//! The plan's stages are the ranks. The model's layers are cut again into
//! p x v consecutive chunks, balanced by the layers' forward and backward
//! time on each rank (`weighted_block_partition`), chunk s on the rank the
//! order puts it on (s mod p looped, or down and back up the ranks for a
//! V) with that rank's devices and shape (tensor parallelism, replicas,
//! ZeRO, re-computation). Each chunk is costed as the plan's stages are,
//! and the ranks run the order in the simulator (`simulate_order`).

use crate::block_partition::weighted_block_partition;
use crate::cost::StageCost;
use crate::costing::{stage_costs, with_coster, ProfileCosts};
use crate::error::{Error, Result};
use crate::pipeline_order::PipelineOrder;
use crate::plan::{Plan, Stage};
use crate::profile::Profile;
use crate::simulate::{sim_stages, simulate_order, OrderSimulation};

crate::named_enum! {
    /// The orders a plan's ranks can run with several chunks each, as
    /// torch's schedule classes build them (`pipeline_order.rs`).
    pub enum ChunkedOrder("a chunked order") {
        /// `ScheduleInterleaved1F1B`: v looped chunks a rank.
        Interleaved1F1B = "interleaved-1f1b",
        /// `ScheduleInterleavedZeroBubble`: v looped chunks, each backward
        /// split into I and W.
        InterleavedZeroBubble = "interleaved-zero-bubble",
        /// `ScheduleZBVZeroBubble`: two V-shaped chunks a rank.
        ZeroBubbleV = "zb-v",
    }
}

impl ChunkedOrder {
    fn order(self, ranks: u32, micro_batches: u32, chunks: u32) -> Result<PipelineOrder> {
        match self {
            ChunkedOrder::Interleaved1F1B => {
                PipelineOrder::interleaved_1f1b(ranks, micro_batches, chunks)
            }
            ChunkedOrder::InterleavedZeroBubble => {
                PipelineOrder::interleaved_zero_bubble(ranks, micro_batches, chunks)
            }
            ChunkedOrder::ZeroBubbleV if chunks == 2 => PipelineOrder::zbv(ranks, micro_batches),
            ChunkedOrder::ZeroBubbleV => Err(Error::field(
                "chunks",
                format!("value {chunks}: zb-v holds two chunks a rank"),
            )),
        }
    }
}

/// [`simulate_interleaved`]'s result: the chunks and their run.
#[derive(Debug, Clone, PartialEq)]
pub struct Interleaved {
    /// `chunk_layers[s]`: layers start..end of chunk s, on rank
    /// `chunk_ranks[s]`.
    pub chunk_layers: Vec<(usize, usize)>,
    pub chunk_ranks: Vec<u32>,
    pub simulation: OrderSimulation,
}

/// `plan`'s ranks running `kind` with `chunks` chunks a rank; interleaved
/// 1F1B with one chunk is plain 1F1B (policy B's depths), interleaved zero
/// bubble with one is ZB-H1.
pub fn simulate_interleaved(
    plan: &Plan,
    profile: &Profile,
    kind: ChunkedOrder,
    chunks: u32,
) -> Result<Interleaved> {
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
    let order = match kind.order(ranks, plan.micro_batches, chunks) {
        Err(e) if e.field.is_none() => return Err(e.under("micro_batches")),
        order => order?,
    };
    let rank_of: Vec<usize> = order.stage_ranks.iter().map(|&r| r as usize).collect();
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
        let chunk_layers = balanced_chunks(plan, &costs, &rank_costs, &rank_of);
        let chunked = Plan {
            stages: chunk_layers
                .iter()
                .enumerate()
                .map(|(s, &(layer_start, layer_end))| Stage {
                    layer_start,
                    layer_end,
                    warmup_micro_batches: 1,
                    ..plan.stages[rank_of[s]].clone()
                })
                .collect(),
            ..plan.clone()
        };
        let on_rank: Vec<_> = rank_of.iter().map(|&r| allocs[r].clone()).collect();
        let (chunk_costs, transfers) = stage_costs(coster, &chunked, &on_rank, false);
        let stages = sim_stages(coster, &chunked, &chunk_costs, &on_rank);
        (stages, transfers, chunk_layers)
    })?;
    Ok(Interleaved {
        chunk_layers,
        chunk_ranks: order.stage_ranks.clone(),
        simulation: simulate_order(&stages, &transfers, &order)?,
    })
}

/// The layers cut into one consecutive chunk for each of `rank_of` (chunk
/// s on rank `rank_of[s]`), with the longest chunk time as short as can
/// be: a layer's time is its forward and backward on one GPU at the plan's
/// micro-batch size, and a rank runs it as many times faster as its stage
/// runs its own layers (replicas, tensor parallelism and faster GPUs count).
fn balanced_chunks(
    plan: &Plan,
    costs: &ProfileCosts,
    rank_costs: &[StageCost],
    rank_of: &[usize],
) -> Vec<(usize, usize)> {
    let t = costs.layers.times_at(plan.micro_batch_size);
    let one_gpu = |a: usize, b: usize| t.fwd(a, b) + t.bwd(a, b);
    let speeds: Vec<f64> = plan
        .stages
        .iter()
        .zip(rank_costs)
        .map(|(s, c)| one_gpu(s.layer_start, s.layer_end) / (c.fwd_ms + c.bwd_ms))
        .collect();
    let capacities: Vec<f64> = rank_of.iter().map(|&r| speeds[r]).collect();
    let work: Vec<f64> = (0..costs.layers.num_layers)
        .map(|l| one_gpu(l, l + 1))
        .collect();
    weighted_block_partition(&work, &capacities)
}
