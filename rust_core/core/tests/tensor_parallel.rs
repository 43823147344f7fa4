//! Whale's `split` in the cost model, on literal cases: the bytes one split
//! block moves, SP1 against SP2 on Whale's classifier, the 1F1B bubble, and
//! Megatron-LM's shape for Llama-2-70B written as a dapple plan.

use dapple_core::cost::WarmupPolicy;
use dapple_core::evaluate::evaluate;
use dapple_core::plan::{Plan, PlanInputs, ScheduleChoice, Stage};
use dapple_core::profile::Profile;
use dapple_core::schedule::ScheduleKind;
use dapple_core::shape::{Recompute, StageShape};
use dapple_core::topology::Topology;
use dapple_core::transformer::{transformer_profile, TransformerConfig, TransformerOptions};

fn llama(name: &str, gpu: &str, seq_len: u64, sizes: Vec<u32>) -> Profile {
    let config = TransformerConfig::named(name).unwrap();
    let options = TransformerOptions {
        gpu: gpu.into(),
        seq_len,
        micro_batch_sizes: sizes,
        efficiency: 0.5,
    };
    transformer_profile(name, &config, &options).unwrap()
}

/// Megatron's shape written as a plan: `p` stages of equal blocks (the
/// embedding with the first, the head with the last), each on `gpus /
/// p` GPUs split `t` ways, micro-batches of `b` samples per replica.
fn megatron_plan(
    profile: &Profile,
    topology: &Topology,
    gbs: u32,
    (t, p, b): (u32, u32, u32),
    shape: StageShape,
) -> Plan {
    let gpus = topology.num_devices();
    let per_stage = gpus / p;
    let replicas = per_stage / t;
    let micro_batch = b * replicas;
    let blocks = profile.layers.len() - 2;
    let bounds: Vec<usize> = (0..=p as usize)
        .map(|k| match k {
            0 => 0,
            k if k == p as usize => blocks + 2,
            k => 1 + k * blocks / p as usize,
        })
        .collect();
    let stages: Vec<Stage> = (0..p as usize)
        .map(|k| {
            let first = k as u32 * per_stage;
            let stage = Stage {
                layer_start: bounds[k],
                layer_end: bounds[k + 1],
                devices: (first..first + per_stage).collect(),
                warmup_micro_batches: (p - k as u32).min(gbs / micro_batch),
                placement: None,
                slices: None,
                tensor_parallel: 1,
                shard_optimizer: false,
                recompute: Recompute::None,
            };
            stage.with_shape(&StageShape {
                tensor_parallel: t,
                ..shape
            })
        })
        .collect();
    let inputs = PlanInputs::new(profile, topology, gbs, 1, "megatron", None);
    let schedule = ScheduleChoice {
        kind: ScheduleKind::EarlyBackward1F1B,
        warmup_policy: WarmupPolicy::A,
    };
    Plan::new(inputs, micro_batch, gbs / micro_batch, schedule, stages)
}

#[test]
fn one_split_block_moves_four_allreduces_of_its_output() {
    let p = llama("llama-2-7b", "a100-80gb", 4096, vec![1]);
    let block = &p.layers[1].split[0];
    // Two AllReduces of s x h bf16 values forward, two backward.
    assert_eq!(
        block.fwd_allreduce_bytes_per_sample,
        2.0 * 4096.0 * 4096.0 * 2.0
    );
    assert_eq!(
        block.bwd_allreduce_bytes_per_sample,
        2.0 * 4096.0 * 4096.0 * 2.0
    );
    let divisors: Vec<(String, u64)> = block
        .divides
        .iter()
        .map(|d| (d.what.clone(), d.count))
        .collect();
    assert_eq!(
        divisors,
        vec![
            ("attention heads".to_string(), 32),
            ("KV heads".to_string(), 32)
        ]
    );
}

#[test]
fn llama_2_70b_in_megatrons_shape_fits_and_is_costed() {
    let profile = llama("llama-2-70b", "a100-80gb", 4096, vec![1, 2, 4, 8]);
    let topology = Topology::from_spec("64x8-a100-80gb").unwrap();
    let shape = StageShape {
        tensor_parallel: 8,
        shard_optimizer: true,
        recompute: Recompute::None,
    };
    let plan = megatron_plan(&profile, &topology, 512, (8, 4, 1), shape);
    let estimate = evaluate(&plan, &profile).unwrap();
    let mfu = estimate.mfu.unwrap();
    eprintln!(
        "Llama-2-70B t8 p4 d16: {:.1} ms, MFU {mfu:.3}, peak {:.1} GiB",
        estimate.iteration_ms.unwrap(),
        estimate.peak_memory_bytes / (1u64 << 30) as f64
    );
    assert!(estimate.fits_memory);
    // Below the profile's ceiling (its efficiency, 0.5): bubbles and the
    // split's AllReduces cost something.
    assert!(mfu < 0.5 && mfu > 0.3, "{mfu}");
}
