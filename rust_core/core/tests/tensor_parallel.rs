//! Whale's `split` in the cost model, on literal cases: the bytes one split
//! block moves, SP1 against SP2 on Whale's classifier, the 1F1B bubble, and
//! Megatron-LM's shape for Llama-2-70B written as a dapple plan.

use dapple_core::cluster::topology::Topology;
use dapple_core::cost::shape::{Offload, Recompute, StageShape};
use dapple_core::cost::WarmupPolicy;
use dapple_core::model::profile::Profile;
use dapple_core::model::transformer::{transformer_profile, TransformerConfig, TransformerOptions};
use dapple_core::plan::{Plan, PlanInputs, ScheduleChoice, Stage};
use dapple_core::schedule::ScheduleKind;
use dapple_core::simulation::evaluate::evaluate;

fn llama(name: &str, gpu: &str, seq_len: u64, sizes: Vec<u32>) -> Profile {
    let config = TransformerConfig::named(name).unwrap();
    let options = TransformerOptions {
        gpu: gpu.into(),
        seq_len,
        micro_batch_sizes: sizes,
        efficiency: Some(0.5),
        attention: None,
        expert_imbalance: 1.0,
        dispatcher: dapple_core::model::experts::TokenDispatcher::AllToAll,
        gradients: dapple_core::model::transformer::GradientPrecision::Bf16,
        host_us_per_kernel: dapple_core::model::transformer::HOST_US_PER_KERNEL,
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
            Stage {
                layer_start: bounds[k],
                layer_end: bounds[k + 1],
                devices: (first..first + per_stage).collect(),
                warmup_micro_batches: (p - k as u32).min(gbs / micro_batch),
                placement: None,
                slices: None,
                shape: StageShape {
                    tensor_parallel: t,
                    ..shape
                },
            }
        })
        .collect();
    let inputs = PlanInputs::new(profile, topology, gbs, 1, "megatron", None);
    let schedule = ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, WarmupPolicy::A);
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

/// Llama-2-70B on 64x8 A100s in Megatron's shape: t8 p4 d16 with ZeRO-1,
/// 32 micro-batches of one a replica at a global batch of 512.
fn llama_2_70b_t8_p4_d16() -> (Profile, Plan) {
    let profile = llama("llama-2-70b", "a100-80gb", 4096, vec![1, 2, 4, 8]);
    let topology = Topology::from_spec("64x8-a100-80gb").unwrap();
    let shape = StageShape {
        tensor_parallel: 8,
        sequence_parallel: false,
        shard_level: 1,
        reshard_after_forward: false,
        recompute: Recompute::None,
        expert_parallel: 1,
        expert_tensor_parallel: None,
        offload: Offload::None,
        context_parallel: 1,
    };
    let plan = megatron_plan(&profile, &topology, 512, (8, 4, 1), shape);
    (profile, plan)
}

#[test]
fn llama_2_70b_in_megatrons_shape_fits_and_is_costed() {
    let (profile, plan) = llama_2_70b_t8_p4_d16();
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

#[test]
fn interleaving_megatrons_llama_2_70b_cuts_its_bubble() {
    // t8 p4 d16, 32 micro-batches of one a replica: the 1F1B bubble is
    // (p - 1) / m = 9.4% of the work, interleaved (p - 1) / (v m). The
    // chunks cover the model in order, p x v of them, and interleaving
    // shortens the iteration by at most that share.
    use dapple_core::search::interleave::chunked;
    let looped = ScheduleKind::Interleaved1F1B;
    let (profile, plan) = llama_2_70b_t8_p4_d16();
    let runs: Vec<Plan> = (1..=4)
        .map(|v| chunked(&plan, &profile, looped, Some(v)).unwrap())
        .collect();
    for (v, run) in (1..).zip(&runs) {
        let ends: Vec<usize> = run.stages.iter().map(|c| c.layer_end).collect();
        let starts: Vec<usize> = run.stages.iter().map(|c| c.layer_start).collect();
        assert_eq!(run.stages.len(), 4 * v);
        assert_eq!(
            (starts[0], *ends.last().unwrap()),
            (0, profile.layers.len())
        );
        assert_eq!(starts[1..], ends[..ends.len() - 1]);
        assert!(run.estimate.as_ref().unwrap().fits_memory);
    }
    let ms: Vec<f64> = runs.iter().map(|r| r.iteration_ms().unwrap()).collect();
    eprintln!("Llama-2-70B t8 p4 d16 interleaved, v = 1..4: {ms:?}");
    // Every interleaving beats 1F1B; more chunks are not always faster,
    // where the layers do not cut evenly (82 into 12 chunks: 6 or 7 each).
    assert!(ms[1..].iter().all(|&t| t < ms[0]), "{ms:?}");
    assert!(ms[3] < ms[1], "{ms:?}");
    // Slack for the chunks' balance, which finer chunks improve too.
    let most_saved = ms[0] * (3.0 / 32.0) * (1.0 - 1.0 / 4.0);
    assert!(ms[0] - ms[3] <= most_saved * 1.05, "{ms:?}");
    // 4 x 21 chunks need more layers than the model's 82.
    let e = chunked(&plan, &profile, looped, Some(21))
        .unwrap_err()
        .to_string();
    assert!(e.contains("chunks") && e.contains("82"), "{e}");
}

#[test]
fn the_1f1b_bubble_is_p_minus_1_over_m() {
    use dapple_core::schedule::Schedule;
    use dapple_core::simulation::simulate::{simulate_stages, SimStage};
    for p in 1..=6usize {
        for m in [1u32, 4, 8, 16, 32] {
            let stage = SimStage {
                fwd_ms: 1.0,
                recompute_ms: 1.0,
                bwd_ms: 2.0,
                bwd_weight_ms: 1.0,
                allreduce_ms: 0.0,
                optimizer_ms: 0.0,
                model_state_bytes: 0.0,
                weight_bytes: 0.0,
                own_adam_moments_bytes: 0.0,
                stored_bytes: 0.0,
                input_bytes: 0.0,
                working_bytes: 0.0,
                rerun_bytes: 0.0,
                recompute_backward_bytes: 0.0,
                gradient_bytes: 0.0,
                optimizer_step_bytes: 0.0,
                allocator_reserved_factor: 1.0,
                memory_limit_bytes: 1.0,
                recomputes: false,
            };
            let warmup: Vec<u32> = (0..p as u32).map(|i| (p as u32 - i).min(m)).collect();
            let schedule = Schedule::early_backward(p, m, &warmup).unwrap();
            let sim =
                simulate_stages(&vec![stage; p], &vec![0.0; p - 1], &schedule, false).unwrap();
            let ideal = f64::from(m) * 3.0;
            assert_eq!(
                (sim.iteration_ms - ideal) / ideal,
                (p as f64 - 1.0) / f64::from(m),
                "p {p} m {m}"
            );
        }
    }
}

/// Whale's classifier: a backbone that cannot split (data parallel) and an
/// FC layer of `classes` outputs over 2048 fp32 features, splittable by
/// classes with a distributed softmax (SP1) or by features (SP2).
fn classifier(classes: u64, patterns: &[&str]) -> Profile {
    use dapple_core::model::split::{Divisor, SplitPattern};
    let features = 2048.0 * 4.0;
    let sp = |name: &str| -> SplitPattern {
        let (fwd, bwd, count) = match name {
            // Each shard its classes of every sample: a max and a sum per sample
            // forward, the features' gradient backward.
            "SP1" => (2.0 * 4.0, features, classes),
            // Each shard its features: the whole logits forward.
            _ => (classes as f64 * 4.0, 0.0, 2048),
        };
        SplitPattern {
            name: name.into(),
            divides: vec![Divisor {
                what: "classes".into(),
                count,
            }],
            fwd_allreduce_bytes_per_sample: fwd,
            bwd_allreduce_bytes_per_sample: bwd,
            replicated_param_fraction: 0.0,
            replicated_stored_fraction: 0.0,
            replicated_compute_fraction: 0.0,
            allreduce_calls_per_pass: 1,
            sequence_parallel: false,
            shard_compute: Vec::new(),
        }
    };
    let text = serde_json::json!({
        "format": "dapple.profile", "schema_version": 1, "model": "classifier", "optimizer": "adam",
        "layers": [
            {"name": "backbone", "param_bytes": 90_000_000u64,
             "measurements": [{"batch_size": 32, "fwd_ms": 30.0, "bwd_ms": 60.0, "activation_bytes": 32 * 8192}]},
            {"name": "fc", "param_bytes": 2048 * classes * 4,
             "measurements": [{"batch_size": 32, "fwd_ms": 4.0, "bwd_ms": 8.0, "activation_bytes": 32 * 4}],
             "split": patterns.iter().map(|p| sp(p)).collect::<Vec<_>>()}
        ]
    });
    use dapple_core::FileObject;
    Profile::from_json(&text.to_string()).unwrap()
}

fn one_stage_plan(profile: &Profile, topology: &Topology, gbs: u32, t: u32) -> Plan {
    let gpus = topology.num_devices();
    let stage = Stage {
        layer_start: 0,
        layer_end: profile.layers.len(),
        devices: (0..gpus).collect(),
        warmup_micro_batches: 1,
        placement: None,
        slices: None,
        shape: StageShape {
            tensor_parallel: t,
            ..StageShape::PLAIN
        },
    };
    let inputs = PlanInputs::new(profile, topology, gbs, 1, "hand", None);
    let schedule = ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, WarmupPolicy::A);
    Plan::new(inputs, gbs, 1, schedule, vec![stage])
}

#[test]
fn sp1_moves_less_than_sp2_and_is_chosen() {
    let topology = Topology::from_spec("4x8-v100-32gb-nvlink-50gbps").unwrap();
    let ms = |patterns: &[&str]| {
        let profile = classifier(100_000, patterns);
        evaluate(&one_stage_plan(&profile, &topology, 1024, 32), &profile)
            .unwrap()
            .iteration_ms
            .unwrap()
    };
    let (sp1, sp2, both) = (ms(&["SP1"]), ms(&["SP2"]), ms(&["SP2", "SP1"]));
    // SP2 reduces 100,000 fp32 logits of every sample forward; SP1 two numbers.
    eprintln!("classifier 100K on 4x8: SP1 {sp1:.1} ms, SP2 {sp2:.1} ms");
    assert!(sp2 > 1.5 * sp1, "SP1 {sp1} ms, SP2 {sp2} ms");
    assert_eq!(both, sp1, "the least-communication pattern is used");
    // Data parallelism reduces the classifier's 819 MB of gradients over the network.
    let profile = classifier(100_000, &["SP1"]);
    let dp = evaluate(&one_stage_plan(&profile, &topology, 1024, 1), &profile)
        .unwrap()
        .iteration_ms
        .unwrap();
    eprintln!("data parallel {dp:.1} ms");
    assert!(dp > sp1, "data parallel {dp} ms, split {sp1} ms");
}

fn tiny_llama() -> Profile {
    let text = r#"{"model_type": "llama", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 688,
        "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000}"#;
    let config = TransformerConfig::from_json(text).unwrap();
    let options = TransformerOptions {
        gpu: "a100".into(),
        seq_len: 128,
        micro_batch_sizes: vec![1, 2],
        efficiency: Some(0.5),
        attention: None,
        expert_imbalance: 1.0,
        dispatcher: dapple_core::model::experts::TokenDispatcher::AllToAll,
        gradients: dapple_core::model::transformer::GradientPrecision::Bf16,
        host_us_per_kernel: dapple_core::model::transformer::HOST_US_PER_KERNEL,
    };
    transformer_profile("tiny", &config, &options).unwrap()
}

#[test]
fn a_split_profile_plans_on_mixed_machines_without_offering_plans_it_cannot_cost() {
    use dapple_core::search::{search, SearchOptions};
    let profile = tiny_llama();
    let mut topology = Topology::from_spec("2x8-a100-80gb").unwrap();
    let mut slow = topology.machine_groups[0].clone();
    topology.machine_groups[0].machines = 1;
    slow.machines = 1;
    slow.gpu.gpu_type = "A100-80GB slow".into();
    slow.gpu.relative_speed = Some(0.5);
    topology.machine_groups.push(slow);
    let plan = search(&profile, &topology, &SearchOptions::new(64))
        .unwrap()
        .plan;
    assert!(
        plan.stages.iter().all(|s| s.shape.is_plain()),
        "{:?}",
        plan.stages
    );
    let megatron = dapple_core::baselines::baseline_plan(
        dapple_core::baselines::Baseline::Megatron,
        &profile,
        &topology,
        64,
        None,
        WarmupPolicy::Auto,
    );
    assert_eq!(
        megatron.unwrap_err().kind,
        dapple_core::ErrorKind::Incompatible
    );
}

#[test]
fn a_split_stage_lists_its_devices_in_order_and_gives_whole_layers_their_slices() {
    let profile = classifier(100_000, &["SP1"]);
    let topology = Topology::from_spec("2x8-a100-80gb").unwrap();
    let mut plan = one_stage_plan(&profile, &topology, 64, 2);
    plan.stages[0].devices = (0..8).flat_map(|i| [i, i + 8]).collect();
    let e = evaluate(&plan, &profile).unwrap_err();
    assert_eq!(e.field.as_deref(), Some("stages[0].devices"), "{e}");
    assert!(e.message.contains("ascending order"), "{e}");
    // Micro-batch 8 on 16 GPUs: the FC's 8 replicas of 2 shards take one
    // sample each, but the backbone, which does not split, would leave 8 GPUs none.
    let mut plan = one_stage_plan(&profile, &topology, 8, 2);
    plan.inputs.options.min_micro_batch_size = 1;
    let e = evaluate(&plan, &profile).unwrap_err();
    assert_eq!(e.field.as_deref(), Some("stages[0].devices"), "{e}");
    assert!(e.message.contains("do not split"), "{e}");
}

#[test]
fn plain_and_re_computed_stages_reduce_the_same_gradient_bytes() {
    let mut profile = tiny_llama();
    profile.parameter_state.as_mut().unwrap().gradient_bytes = 4.0;
    let topology = Topology::from_spec("1x8-a100-80gb").unwrap();
    let plain = one_stage_plan(&profile, &topology, 64, 1);
    let mut recomputed = plain.clone();
    recomputed.stages[0].shape.recompute = Recompute::Full;
    let (a, b) = (
        evaluate(&plain, &profile).unwrap(),
        evaluate(&recomputed, &profile).unwrap(),
    );
    assert_eq!(a.stages[0].allreduce_ms, b.stages[0].allreduce_ms);
    assert!(b.stages[0].bwd_ms > a.stages[0].bwd_ms);
    // One micro-batch in flight, and a first stage's input is the data (the
    // profile counts no bytes for it): re-computation holds what a plain stage does.
    assert_eq!(b.peak_memory_bytes, a.peak_memory_bytes);
    profile.parameter_state.as_mut().unwrap().gradient_bytes = 0.0;
    assert_eq!(
        profile.validate().unwrap_err().field.as_deref(),
        Some("parameter_state.gradient_bytes")
    );
}
