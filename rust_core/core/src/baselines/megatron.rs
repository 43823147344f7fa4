//! Megatron-LM's shape as a baseline (`dapple compare`'s `megatron` row):
//! one split degree t for the whole model, p pipeline stages of equally many
//! blocks (the layers before the first block with the first stage, those
//! after the last with the last; where p does not divide the blocks,
//! stages 1, 2, ... take one more each), d data-parallel replicas, 1F1B, every GPU
//! used. GPUs are numbered as Megatron ranks them: the t shards of a
//! replica next to each other, then the replicas of a stage, then the
//! stages. Every uniform (t, p, d) that the model allows, each with every
//! context degree c its sequence cuts into (t c p d GPUs, Megatron-LM's
//! `--context-parallel-size`), is tried at every
//! micro-batch size, with and without ZeRO-1 and full re-computation; the
//! fastest that fits is the baseline.
//!
//! The search's candidates add Whale's collocated split (section 5.1.3 of
//! the Whale paper): one stage on every GPU, the layers that split sharded
//! over all of them, the others data parallel (`uniform_plans`).

use crate::cluster::topology::Topology;
use crate::cost::shape::{Recompute, StageShape};
use crate::cost::{divisors, WarmupPolicy};
use crate::error::{Error, Result};
use crate::model::profile::{LayerCosts, Profile, BLOCK_KIND};
use crate::plan::{Plan, PlanInputs, ScheduleChoice, Stage};
use crate::schedule::ScheduleKind;

/// The split degrees the model allows on machines of `gpus_per_machine`:
/// 1, and each divisor of a machine's GPUs that every splittable layer can
/// split at (Megatron keeps a replica's shards on one machine).
fn split_degrees(layers: &LayerCosts, gpus_per_machine: u32) -> Vec<u32> {
    (1..=gpus_per_machine)
        .filter(|&t| gpus_per_machine.is_multiple_of(t))
        .filter(|&t| t == 1 || splits_at(layers, t))
        .collect()
}

/// Whether some layer splits and every layer that can split can at `t`.
fn splits_at(layers: &LayerCosts, t: u32) -> bool {
    let splittable: Vec<usize> = (0..layers.num_layers)
        .filter(|&l| !layers.split_patterns(l).is_empty())
        .collect();
    !splittable.is_empty()
        && splittable
            .iter()
            .all(|&l| layers.shard(l, t, false).is_some())
}

/// Layer ranges of `p` stages of as equally many blocks as can be: where
/// `p` does not divide the blocks, stages 1, 2, ... take one more each, as
/// many as the remainder, so the first (with the embedding) and the last
/// (with the LM head) keep fewer, as Megatron's uneven first and last
/// stages do. None for more stages than blocks.
fn equal_stages(profile: &Profile, p: usize) -> Option<Vec<(usize, usize)>> {
    let blocks: Vec<usize> = (0..profile.layers.len())
        .filter(|&l| profile.layers[l].kind.as_deref() == Some(BLOCK_KIND))
        .collect();
    // A model without marked blocks: every layer is one.
    let blocks: Vec<usize> = if blocks.is_empty() {
        (0..profile.layers.len()).collect()
    } else {
        blocks
    };
    if p == 0 || p > blocks.len() {
        return None;
    }
    let (per, extra) = (blocks.len() / p, blocks.len() % p);
    // Blocks before stage k: k x per, and one more for each of stages 1..=extra before k.
    let first_block = |k: usize| k * per + k.saturating_sub(1).min(extra);
    let bounds: Vec<usize> = (0..=p)
        .map(|k| match k {
            0 => 0,
            k if k == p => profile.layers.len(),
            k => blocks[first_block(k)],
        })
        .collect();
    Some(bounds.windows(2).map(|w| (w[0], w[1])).collect())
}

/// The GPUs of the topology's smallest machine.
fn gpus_per_machine(topology: &Topology) -> u32 {
    topology
        .machine_groups
        .iter()
        .map(|g| g.gpus_per_machine)
        .min()
        .unwrap_or(1)
}

/// Whether every machine is alike (GPU type, memory, speed and count):
/// Megatron's shapes assume so, and so does the cost of a shaped stage.
fn machines_alike(topology: &Topology) -> bool {
    let first = &topology.machine_groups[0];
    topology
        .machine_groups
        .iter()
        .all(|g| g.gpu == first.gpu && g.gpus_per_machine == first.gpus_per_machine)
}

/// Every uniform Megatron plan of `profile` on `topology` (not costed);
/// a cluster whose machines differ has none.
pub fn megatron_plans(
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_slice: u32,
) -> Result<Vec<Plan>> {
    if !machines_alike(topology) {
        return Err(Error::incompatible(
            "megatron needs machines alike (one GPU type, as many GPUs each); this topology mixes them",
        ));
    }
    let degrees = split_degrees(&LayerCosts::new(profile), gpus_per_machine(topology));
    Ok(shaped_plans(
        profile,
        topology,
        global_batch_size,
        min_slice,
        &degrees,
    ))
}

/// What offered a uniform plan: Megatron-LM's shape, or Whale's collocated
/// split (every GPU one stage, the layers that split sharded over all).
pub const MEGATRON: &str = "megatron";
pub const WHALE_COLLOCATED: &str = "whale-collocated-split";

/// Megatron's plans, and Whale's collocated split where the cluster is
/// larger than a machine: the search's uniform candidates, each with what
/// offered it.
pub fn uniform_plans(
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_slice: u32,
) -> Vec<(Plan, &'static str)> {
    if !machines_alike(topology) {
        return Vec::new();
    }
    let layers = LayerCosts::new(profile);
    let per_machine = gpus_per_machine(topology);
    let megatron = shaped_plans(
        profile,
        topology,
        global_batch_size,
        min_slice,
        &split_degrees(&layers, per_machine),
    );
    let mut plans: Vec<(Plan, &'static str)> =
        megatron.into_iter().map(|p| (p, MEGATRON)).collect();
    let gpus = topology.num_devices();
    if gpus > per_machine && splits_at(&layers, gpus) {
        // Split over every GPU: one stage (p = gpus / t = 1).
        let whole = shaped_plans(profile, topology, global_batch_size, min_slice, &[gpus]);
        plans.extend(whole.into_iter().map(|p| (p, WHALE_COLLOCATED)));
    }
    plans
}

/// The uniform plans at split degrees `degrees` (each with every context
/// degree the layers allow), every pipeline depth and
/// micro-batch size, with and without ZeRO-1 and re-computation.
fn shaped_plans(
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    min_slice: u32,
    degrees: &[u32],
) -> Vec<Plan> {
    let gpus = topology.num_devices();
    let inputs = PlanInputs::new(
        profile,
        topology,
        global_batch_size,
        min_slice,
        MEGATRON,
        None,
    );
    let layers = LayerCosts::new(profile);
    let recompute: &[Recompute] = if layers.recomputes_selectively() {
        &Recompute::ALL
    } else {
        &[Recompute::None, Recompute::Full, Recompute::PerLayer]
    };
    // Megatron-LM's distributed optimizer is sharding level 1.
    let shapes = [0, 1]
        .into_iter()
        .flat_map(|level| recompute.iter().map(move |&recompute| (level, recompute)));
    let shapes: Vec<(u8, Recompute)> = shapes.collect();
    let mut plans = Vec::new();
    let widths = degrees.iter().flat_map(|&t| {
        std::iter::once(1)
            .chain(layers.context_degrees(gpus / t))
            .filter(move |&c| gpus.is_multiple_of(t * c))
            .map(move |c| (t, c))
    });
    for (t, c) in widths {
        // Layers that do not split at t run data parallel over all t x d
        // GPUs of a stage: each GPU's b / t samples of them are a slice too
        // (`plan::check`'s rule; Whale's collocated split on 32 GPUs at 128
        // gave slices of 4 below a minimum of 8).
        let whole = t > 1
            && profile
                .layers
                .iter()
                .any(|l| !l.split.iter().any(|s| s.allows(t)));
        let slice_fits = |b: u32| b >= min_slice && (!whole || b / t >= min_slice);
        let width = t * c;
        for p in (1..=gpus / width).filter(|p| (gpus / width).is_multiple_of(*p)) {
            let Some(ranges) = equal_stages(profile, p as usize) else {
                continue;
            };
            let d = gpus / width / p;
            // Divisors, not a count to the batch: 2^32 - 1 samples took minutes.
            let per_replica = if global_batch_size.is_multiple_of(d) {
                divisors(global_batch_size / d)
            } else {
                Vec::new()
            };
            // With and without sequence parallelism where the blocks allow
            // it (runtimes without it take the plans without).
            let sequence: &[bool] = if t > 1 && layers.sequence_parallel_at(t) {
                &[false, true]
            } else {
                &[false]
            };
            for b in per_replica.into_iter().filter(|&b| slice_fits(b)) {
                for &(shard_level, recompute) in &shapes {
                    for &sequence_parallel in sequence {
                        let shape = StageShape {
                            tensor_parallel: t,
                            sequence_parallel,
                            shard_level,
                            recompute,
                            context_parallel: c,
                            // Expert parallelism and offloading are not
                            // among the uniform shapes yet.
                            ..StageShape::PLAIN
                        };
                        plans.push(uniform_plan(&inputs, &ranges, (t, d), b, &shape));
                    }
                }
            }
        }
    }
    plans
}

/// One Megatron-LM layout as a run used it (not costed): `shape` on every
/// stage (its split degree t, ZeRO-1, re-computation), `p` stages of equal
/// blocks, the GPUs left over as replicas (d = GPUs / (t p)), `b` samples a
/// replica per micro-batch, 1F1B. Errors say which number does not divide.
pub fn megatron_plan(
    profile: &Profile,
    topology: &Topology,
    global_batch_size: u32,
    (p, b): (u32, u32),
    shape: &StageShape,
) -> Result<Plan> {
    if !machines_alike(topology) {
        return Err(Error::incompatible(
            "a Megatron layout needs machines alike (one GPU type, as many GPUs each); this topology mixes them",
        ));
    }
    let (t, c) = (shape.tensor_parallel.max(1), shape.context_parallel.max(1));
    let gpus = topology.num_devices();
    if p == 0 || !gpus.is_multiple_of(t * c * p) {
        return Err(Error::field(
            "pipeline_parallel",
            if c == 1 {
                format!("value {p}: t x p = {t} x {p} must divide the {gpus} GPUs")
            } else {
                format!("value {p}: t x c x p = {t} x {c} x {p} must divide the {gpus} GPUs")
            },
        ));
    }
    let d = gpus / (t * c * p);
    if b == 0 || !global_batch_size.is_multiple_of(b * d) {
        return Err(Error::field(
            "micro_batch_size",
            format!(
                "value {b}: b x d = {b} x {d} must divide the global batch of {global_batch_size}"
            ),
        ));
    }
    let ranges = equal_stages(profile, p as usize).ok_or_else(|| {
        Error::field(
            "pipeline_parallel",
            format!("value {p} is more stages than the model has blocks"),
        )
    })?;
    let inputs = PlanInputs::new(profile, topology, global_batch_size, 1, MEGATRON, None);
    let mut plan = uniform_plan(&inputs, &ranges, (t, d), b, shape);
    // Megatron-LM's expert degrees are the run's; a stage of dense layers
    // alone has no experts to spread.
    let layers = LayerCosts::new(profile);
    plan.stages = plan
        .stages
        .into_iter()
        .map(|s| {
            let range = (s.layer_start, s.layer_end);
            s.over_layers(range, &layers)
        })
        .collect();
    Ok(plan)
}

/// The plan of `ranges` with `d` replicas of `t` shards each per stage and
/// `b` samples per replica of each micro-batch, under 1F1B.
fn uniform_plan(
    inputs: &PlanInputs,
    ranges: &[(usize, usize)],
    (t, d): (u32, u32),
    b: u32,
    shape: &StageShape,
) -> Plan {
    let p = ranges.len() as u32;
    let per_stage = t * shape.context_parallel.max(1) * d;
    let micro_batch = b * d;
    let m = inputs.global_batch_size / micro_batch;
    let stages = ranges
        .iter()
        .enumerate()
        .map(|(k, &(start, end))| {
            let first = k as u32 * per_stage;
            Stage {
                layer_start: start,
                layer_end: end,
                devices: (first..first + per_stage).collect(),
                warmup_micro_batches: WarmupPolicy::A.warmup(p - k as u32, m).unwrap_or(1),
                placement: None,
                slices: None,
                shape: *shape,
            }
        })
        .collect();
    let schedule = ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, WarmupPolicy::A);
    Plan::new(inputs.clone(), micro_batch, m, schedule, stages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::transformer::{transformer_profile, TransformerConfig, TransformerOptions};

    fn llama_2_7b(seq_len: u64) -> Profile {
        let config = TransformerConfig::named("llama-2-7b").unwrap();
        let options = TransformerOptions {
            gpu: "a100".into(),
            seq_len,
            micro_batch_sizes: vec![1, 2],
            efficiency: Some(0.5),
            attention: None,
            expert_imbalance: 1.0,
            dispatcher: crate::model::experts::TokenDispatcher::AllToAll,
            gradients: crate::model::transformer::GradientPrecision::Bf16,
            host_us_per_kernel: crate::model::transformer::HOST_US_PER_KERNEL,
        };
        transformer_profile("llama-2-7b", &config, &options).unwrap()
    }

    #[test]
    fn llama_2_7b_on_2x8_a100_tries_every_uniform_shape() {
        let profile = llama_2_7b(4096);
        let topology = Topology::from_spec("2x8-a100-80gb").unwrap();
        let plans = megatron_plans(&profile, &topology, 64, 1).unwrap();
        let mut shapes: Vec<(u32, usize, u32)> = plans
            .iter()
            .map(|p| {
                (
                    p.stages[0].shape.tensor_parallel,
                    p.stages.len(),
                    p.micro_batch_size,
                )
            })
            .collect();
        shapes.dedup();
        // t in 1, 2, 4, 8 (32 heads); p divides the 16 / t GPUs left.
        assert!(
            shapes.contains(&(8, 2, 1))
                && shapes.contains(&(1, 16, 1))
                && shapes.contains(&(2, 1, 8))
        );
        assert!(shapes.iter().all(|&(t, p, _)| 16 % (t * p as u32) == 0));
        let first = &plans[0];
        assert_eq!(first.stages[0].layer_start, 0);
        assert_eq!(first.stages.last().unwrap().layer_end, profile.layers.len());
    }

    #[test]
    fn stages_take_equal_blocks_with_the_ends_attached() {
        let profile = llama_2_7b(128);
        assert_eq!(
            equal_stages(&profile, 4).unwrap(),
            vec![(0, 9), (9, 17), (17, 25), (25, 34)]
        );
        // 32 blocks in 3: 10, 11, 11.
        assert_eq!(
            equal_stages(&profile, 3).unwrap(),
            vec![(0, 11), (11, 22), (22, 34)]
        );
        assert_eq!(equal_stages(&profile, 33), None);
    }
}
