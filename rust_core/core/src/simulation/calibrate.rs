//! `dapple calibrate`: a profile corrected by what a run of one of its
//! plans measured, so that the next plan uses it.
//!
//! The rule, per stage of the plan (`docs/runtime.md`, "Calibrating a
//! profile"):
//!
//! - **time**: the measured compute of one iteration (each rank's median,
//!   over the steps after `first_steps_left_out`, of its `compute` phase;
//!   the slowest of the stage's ranks, as the cost model prices a stage by
//!   its slowest GPU) over the cost model's compute of the same stage (its
//!   forward and backward of one micro-batch slice, times the
//!   micro-batches, from `costing::stage_costs` on the plan as the run ran
//!   it: re-computation where the run re-computed). The ratio scales the
//!   stage's layers' `fwd_ms` and `bwd_ms` at every batch size, on the GPU
//!   types the stage ran on.
//! - **memory**, from allocator peaks only (`memory_source`
//!   `cuda-allocated`): the highest peak of the stage's ranks, less what the
//!   cost model counts besides stored activations (model state, and the
//!   inputs a re-computing stage keeps), is the measured activation memory;
//!   over the cost model's own activation memory of the stage it scales the
//!   stage's layers' `stored_activation_bytes`. The stage's memory is
//!   linear in those bytes, so the calibrated profile predicts the
//!   measured peak. Process RSS (`rss-*`) counts the interpreter, torch's
//!   libraries and the allocator's cache besides tensors, so it leaves
//!   memory alone.
//!
//! The cost model's split between activations and the rest is its own:
//! the stage is costed twice, once with stored activations at zero
//! (`stage_costs`, no formula copied here).

use crate::cost::shape::Recompute;
use crate::cost::{Alloc, StageCost, StageCoster};
use crate::error::{Error, Result};
use crate::model::profile::Profile;
use crate::plan::layout::RunLayout;
use crate::plan::Plan;
use crate::simulation::costing::{stage_costs, with_coster, ProfileCosts};
use crate::simulation::metrics::RunMetrics;

/// The only memory source whose peaks are the tensors' own.
pub const EXACT_MEMORY_SOURCE: &str = "cuda-allocated";

/// What a run measured of one stage of its plan.
#[derive(Debug, Clone, PartialEq)]
pub struct StageMeasure {
    /// Compute of one iteration: the slowest of its ranks' medians.
    pub compute_ms: f64,
    /// The highest peak memory of its ranks.
    pub peak_memory_bytes: f64,
    /// The peaks' source (`RankMetrics::memory_source`), one for the stage:
    /// the least exact where ranks differ.
    pub memory_source: String,
}

/// A run's measurements by stage, checked against the plan that ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    pub stages: Vec<StageMeasure>,
    /// The run re-computed forward passes (`dapple run --recompute`).
    pub recompute: bool,
    /// The run's optimizer, as a profile names it (`optimizer` of
    /// `dapple.profile`), where the metrics say.
    pub optimizer: Option<String>,
    /// The steps the medians are over, 1-based and inclusive.
    pub steps: (u32, u32),
    /// The plan file that ran (`RunMetrics::plan`).
    pub plan: String,
}

/// One stage's calibration: measured, predicted and the factors applied.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StageCalibration {
    pub layer_start: usize,
    pub layer_end: usize,
    pub measured_compute_ms: f64,
    pub predicted_compute_ms: f64,
    /// Measured over predicted: the layers' times are multiplied by it.
    pub time_factor: f64,
    pub measured_peak_bytes: f64,
    pub predicted_peak_bytes: f64,
    pub memory_source: String,
    /// The layers' stored activations are multiplied by it; None where
    /// memory was left alone (`memory_note` says why).
    pub memory_factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_note: Option<String>,
}

/// The corrected profile, and what changed by how much.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub profile: Profile,
    pub stages: Vec<StageCalibration>,
}

/// A run optimizer's name (`planner/runtime/optimizers.py`) as a profile
/// names it, by the state it keeps: `momentum` is SGD with momentum,
/// `rmsprop` is RMSProp with momentum. Other names: None (the profile's
/// own optimizer is kept).
pub fn profile_optimizer(run_optimizer: &str) -> Option<&'static str> {
    match run_optimizer {
        "sgd" => Some("sgd"),
        "momentum" => Some("sgd-momentum"),
        "rmsprop" => Some("rmsprop-momentum"),
        "adam" => Some("adam"),
        _ => None,
    }
}

impl StageMeasure {
    /// The stage as two of its ranks measured it: the slower compute, the
    /// higher peak, the less exact memory source.
    fn with(self, other: StageMeasure) -> StageMeasure {
        StageMeasure {
            compute_ms: self.compute_ms.max(other.compute_ms),
            peak_memory_bytes: self.peak_memory_bytes.max(other.peak_memory_bytes),
            memory_source: if self.memory_source == EXACT_MEMORY_SOURCE {
                other.memory_source
            } else {
                self.memory_source
            },
        }
    }
}

/// A run of a chunked plan measures each rank's chunks together: no
/// stage's own time to fit.
fn check_one_stage_a_rank(plan: &Plan) -> Result<()> {
    if !plan.schedule.kind.is_chunked() {
        return Ok(());
    }
    Err(Error::incompatible(format!(
        "schedule {}: the plan's ranks hold several stages each, and a run measures each rank's \
         chunks together; calibrate from a run of a plan of one stage a rank",
        plan.schedule.kind
    )))
}

impl Measured {
    /// Each stage's measurements from `metrics`, after checking that they
    /// are of a synchronous run of `plan`. Errors name the metrics' field.
    pub fn of(plan: &Plan, metrics: &RunMetrics) -> Result<Measured> {
        check_one_stage_a_rank(plan)?;
        let mismatch = |field: &str, message: String| {
            let mut e =
                Error::incompatible(format!("{message}: these metrics are not of this plan"));
            e.field = Some(field.to_string());
            e
        };
        if let Some(kind) = metrics.schedule {
            let mut e = Error::incompatible(format!(
                "value \"{}\": an asynchronous run; calibrate reads synchronous runs, whose steps \
                 are the plan's iterations",
                kind.name()
            ));
            e.field = Some("schedule".into());
            return Err(e);
        }
        let layout = RunLayout::of(plan)?;
        if metrics.global_batch_size != layout.global_batch_size() {
            return Err(mismatch(
                "global_batch_size",
                format!(
                    "value {} is not the plan's {} ({} micro-batches of {})",
                    metrics.global_batch_size,
                    layout.global_batch_size(),
                    plan.micro_batches,
                    plan.micro_batch_size
                ),
            ));
        }
        if metrics.ranks.len() != layout.world_size() {
            return Err(mismatch(
                "ranks",
                format!(
                    "{} ranks, the plan runs {} ({} stages)",
                    metrics.ranks.len(),
                    layout.world_size(),
                    plan.stages.len()
                ),
            ));
        }
        let mut stages: Vec<Option<StageMeasure>> = vec![None; plan.stages.len()];
        let skip = metrics.first_steps_left_out as usize;
        for (key, rank) in &metrics.ranks {
            let field = |f: &str| format!("ranks.{key}.{f}");
            let position = key.parse::<u32>().ok().and_then(|r| layout.position(r));
            let Some((stage, _)) = position else {
                return Err(mismatch(&format!("ranks.{key}"), "no such rank".into()));
            };
            if rank.stage != stage {
                return Err(mismatch(
                    &field("stage"),
                    format!(
                        "value {}, the plan's rank {key} is of stage {stage}",
                        rank.stage
                    ),
                ));
            }
            let compute_ms = median_after(rank.phase_ms.get("compute"), skip)
                .ok_or_else(|| Error::field(field("phase_ms.compute"), "no step measured"))?;
            let measure = StageMeasure {
                compute_ms,
                peak_memory_bytes: rank.peak_memory_bytes,
                memory_source: rank.memory_source.clone(),
            };
            let slot = &mut stages[stage];
            *slot = Some(match slot.take() {
                None => measure,
                Some(seen) => seen.with(measure),
            });
        }
        // As many ranks as the plan's, each the plan's; a rank written
        // twice ("1" and "01") leaves a stage without one.
        let stages = stages
            .into_iter()
            .enumerate()
            .map(|(i, s)| s.ok_or_else(|| mismatch("ranks", format!("no rank of stage {i}"))))
            .collect::<Result<Vec<_>>>()?;
        let steps = metrics.steps - metrics.first_step + 1;
        Ok(Measured {
            stages,
            recompute: metrics.recompute,
            optimizer: metrics
                .optimizer
                .as_deref()
                .and_then(profile_optimizer)
                .map(String::from),
            steps: (
                metrics.first_step + (skip as u32).min(steps.saturating_sub(1)),
                metrics.steps,
            ),
            plan: metrics.plan.clone(),
        })
    }
}

/// The median of `values` without the first `skip` (all of them where
/// that leaves none); None for no values.
fn median_after(values: Option<&Vec<f64>>, skip: usize) -> Option<f64> {
    let values = values?;
    let kept = if skip < values.len() {
        &values[skip..]
    } else {
        &values[..]
    };
    let mut sorted: Vec<f64> = kept.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    Some(if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    })
}

/// The stage costs of `plan` as a run with `measured`'s options ran it,
/// with `profile`, and the GPU types (timings) each stage ran on.
fn run_costs(
    plan: &Plan,
    profile: &Profile,
    recompute: bool,
) -> Result<(Vec<StageCost>, Vec<Vec<usize>>)> {
    let mut ran = plan.clone();
    if recompute {
        for s in &mut ran.stages {
            s.shape.recompute = Recompute::Full;
        }
    }
    // The profile may be a variant of the plan's own (the run's optimizer,
    // no stored activations): the plan's check of its hash is done once,
    // by the caller, on the profile itself.
    ran.inputs.profile_sha256 = String::new();
    with_coster(
        &ran,
        &ProfileCosts::new(profile),
        |coster: &StageCoster, allocs: &[Alloc], _| {
            let (costs, _) = stage_costs(coster, &ran, allocs, ran.stages.len() == 1);
            let timings = ran
                .stages
                .iter()
                .map(|s| {
                    let mut t: Vec<usize> = s
                        .devices
                        .iter()
                        .map(|&d| {
                            let m = coster.cluster.machine_of(d).expect("checked device");
                            coster.cluster.machines[m].timing
                        })
                        .collect();
                    t.sort_unstable();
                    t.dedup();
                    t
                })
                .collect();
            (costs, timings)
        },
    )
}

/// `profile` corrected by `measured`, a run of `plan` (checked by
/// [`Measured::of`]). Errors are about the plan and the profile.
pub fn calibrate(profile: &Profile, plan: &Plan, measured: &Measured) -> Result<Calibration> {
    crate::plan::check(plan, profile)?;
    let (costs, timings) = run_costs(plan, profile, measured.recompute)?;
    let mut as_run = profile.clone();
    if let Some(optimizer) = &measured.optimizer {
        as_run = as_run.with_optimizer(optimizer);
    }
    let (memory, _) = run_costs(plan, &as_run, measured.recompute)?;
    let mut without = as_run;
    for m in without
        .layers
        .iter_mut()
        .flat_map(|l| l.measurements.iter_mut())
    {
        m.stored_activation_bytes = Some(0);
    }
    let (rest, _) = run_costs(plan, &without, measured.recompute)?;
    let m = f64::from(plan.micro_batches);
    let stages: Vec<StageCalibration> = plan
        .stages
        .iter()
        .zip(&measured.stages)
        .enumerate()
        .map(|(i, (s, got))| {
            let predicted_compute_ms = (costs[i].fwd_ms + costs[i].bwd_ms) * m;
            let (memory_factor, memory_note) =
                memory_factor(got, memory[i].memory_bytes, rest[i].memory_bytes);
            StageCalibration {
                layer_start: s.layer_start,
                layer_end: s.layer_end,
                measured_compute_ms: got.compute_ms,
                predicted_compute_ms,
                time_factor: time_factor(got.compute_ms, predicted_compute_ms),
                measured_peak_bytes: got.peak_memory_bytes,
                predicted_peak_bytes: memory[i].memory_bytes,
                memory_source: got.memory_source.clone(),
                memory_factor,
                memory_note,
            }
        })
        .collect();
    let mut out = profile.clone();
    for (c, on) in stages.iter().zip(&timings) {
        scale_stage(&mut out, c, on);
    }
    out.source = Some(source_note(profile, measured, &stages));
    out.validate()?;
    Ok(Calibration {
        profile: out,
        stages,
    })
}

/// Measured over predicted compute; 1 (left alone) where either is 0.
fn time_factor(measured_ms: f64, predicted_ms: f64) -> f64 {
    if measured_ms > 0.0 && predicted_ms > 0.0 {
        measured_ms / predicted_ms
    } else {
        1.0
    }
}

/// The factor on a stage's stored activations, from its measured peak,
/// the cost model's memory of it (`predicted`) and that memory without
/// stored activations (`rest`); or None and why memory is left alone.
fn memory_factor(got: &StageMeasure, predicted: f64, rest: f64) -> (Option<f64>, Option<String>) {
    const MIB: f64 = (1u64 << 20) as f64;
    if got.memory_source != EXACT_MEMORY_SOURCE {
        let why = format!(
            "{} peaks count the process, not its tensors",
            got.memory_source
        );
        return (None, Some(why));
    }
    let activations = predicted - rest;
    let measured = got.peak_memory_bytes - rest;
    if activations <= 0.0 {
        return (
            None,
            Some("the cost model counts no activations here".into()),
        );
    }
    if measured <= 0.0 {
        let why = format!(
            "the measured peak {:.1} MiB is not above the predicted model state {:.1} MiB",
            got.peak_memory_bytes / MIB,
            rest / MIB
        );
        return (None, Some(why));
    }
    (Some(measured / activations), None)
}

/// Multiply the stage's layers' times on the GPU types it ran on (`on`:
/// indices of `LayerCosts::devices`, 0 the profile's own) and their
/// stored activations by the stage's factors.
fn scale_stage(profile: &mut Profile, c: &StageCalibration, on: &[usize]) {
    let f = c.time_factor;
    for l in c.layer_start..c.layer_end {
        for &timing in on {
            if timing == 0 {
                for m in &mut profile.layers[l].measurements {
                    m.scale_times(f);
                }
            } else {
                for m in &mut profile.other_devices[timing - 1].layers[l].measurements {
                    m.fwd_ms *= f;
                    m.bwd_ms *= f;
                }
            }
        }
        if let Some(g) = c.memory_factor {
            for m in &mut profile.layers[l].measurements {
                let stored = m.stored_activation_bytes.unwrap_or(m.activation_bytes) as f64;
                m.stored_activation_bytes = Some((stored * g).round() as u64);
            }
        }
    }
}

/// The profile's `source`, with what calibration changed appended.
fn source_note(profile: &Profile, measured: &Measured, stages: &[StageCalibration]) -> String {
    let parts: Vec<String> = stages
        .iter()
        .map(|c| {
            let memory = match c.memory_factor {
                Some(g) => format!(", stored activations x{g:.3}"),
                None => String::new(),
            };
            format!(
                "layers {}..{} times x{:.3}{memory}",
                c.layer_start, c.layer_end, c.time_factor
            )
        })
        .collect();
    let left_alone = stages.iter().find_map(|c| c.memory_note.as_ref());
    let memory = match left_alone {
        Some(why) => format!("; memory left alone where {why}"),
        None => String::new(),
    };
    let note = format!(
        "calibrated by dapple calibrate from a run of {} (median compute of steps {}..{}): {}{memory}",
        measured.plan,
        measured.steps.0,
        measured.steps.1,
        parts.join(", ")
    );
    match &profile.source {
        Some(s) if !s.is_empty() => format!("{s}; {note}"),
        _ => note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::topology::Topology;
    use crate::cost::WarmupPolicy;
    use crate::formats::format::FileObject;
    use crate::plan::{PlanInputs, PlanOptions, ScheduleChoice, Stage};
    use crate::schedule::ScheduleKind;

    /// Four layers of 1000 parameter bytes each (250 fp32 parameters),
    /// trained with SGD: at batch b, forward b ms, backward 2b ms, outputs
    /// 1000 b bytes; layer 1 stores 3000 b.
    fn profile() -> Profile {
        let layers: Vec<serde_json::Value> = (0..4)
            .map(|i| {
                let stored = if i == 1 { 3000 } else { 1000 };
                let measurements: Vec<serde_json::Value> = [1u32, 2, 4]
                    .iter()
                    .map(|&b| {
                        serde_json::json!({
                            "batch_size": b, "fwd_ms": f64::from(b), "bwd_ms": 2.0 * f64::from(b),
                            "activation_bytes": 1000 * b, "stored_activation_bytes": stored * b,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "name": format!("l{i}"), "param_bytes": 1000, "measurements": measurements,
                })
            })
            .collect();
        Profile::from_parts(serde_json::json!({
            "model": "tiny", "source": "by hand", "optimizer": "sgd", "layers": layers,
        }))
        .unwrap()
    }

    /// A straight pipeline over 1x2-pcie: layers 0..2 on device 0 (K 2),
    /// 2..4 on device 1 (K 1), 4 micro-batches of 2.
    fn plan_of(profile: &Profile) -> Plan {
        let stages = [(0, 2, 0, 2), (2, 4, 1, 1)];
        Plan::new(
            PlanInputs {
                model: "tiny".into(),
                profile_sha256: profile.sha256(),
                profile_path: None,
                topology: Topology::from_spec("1x2-pcie").unwrap(),
                global_batch_size: 8,
                options: PlanOptions {
                    min_micro_batch_size: 1,
                    search_space: None,
                    hints: Default::default(),
                },
            },
            2,
            4,
            ScheduleChoice::new(ScheduleKind::EarlyBackward1F1B, WarmupPolicy::A),
            stages
                .iter()
                .map(|&(a, b, d, k)| Stage {
                    layer_start: a,
                    layer_end: b,
                    devices: vec![d],
                    warmup_micro_batches: k,
                    ..Default::default()
                })
                .collect(),
        )
    }

    /// Metrics of a run of `plan`: rank r's compute per step and peak.
    fn metrics(compute: [&[f64]; 2], peaks: [f64; 2], source: &str) -> RunMetrics {
        let rank = |r: usize| {
            serde_json::json!({
                "stage": r, "replica": 0, "peak_memory_bytes": peaks[r],
                "memory_before_bytes": 0.0, "memory_source": source,
                "compute_ms": 0.0, "bubble_ms": 0.0, "bubble_fraction": 0.0,
                "phase_ms": {"compute": compute[r]},
            })
        };
        RunMetrics::from_parts(serde_json::json!({
            "plan": "plan.json", "model": "m:f", "model_args": {},
            "first_step": 1, "steps": 4, "global_batch_size": 8,
            "recompute": false, "exact_memory": false, "optimizer": "sgd",
            "iteration_ms": [1.0, 1.0, 1.0, 1.0], "losses": [1.0, 1.0, 1.0, 1.0],
            "mean_iteration_ms": 1.0, "median_iteration_ms": 1.0, "first_steps_left_out": 1,
            "estimate_ms": null, "simulated_ms": null,
            "ranks": {"0": rank(0), "1": rank(1)},
        }))
        .unwrap()
    }

    #[test]
    fn measured_time_and_allocator_peak_scale_each_stages_layers() {
        let p = profile();
        let plan = plan_of(&p);
        // Stage 0 computes (2 + 4) ms forward and backward per layer at
        // slice 2: 12 ms a micro-batch, 48 ms for 4; it measured a median
        // of 66 ms after the first step (100 left out): x1.375. Stage 1
        // measured 24 ms: x0.5.
        // Stage 0's memory: model state 2000 weight + 2000 gradient bytes
        // (SGD: no slots), stored (1000 + 3000) x 2 samples x K 2 = 16000;
        // its peak 4000 + 1.5 x 16000. Stage 1: 4000 + (2000 x 2 x 1) x 0.25.
        let run = metrics(
            [&[100.0, 60.0, 72.0, 66.0], &[24.0, 30.0, 20.0, 24.0]],
            [28000.0, 5000.0],
            EXACT_MEMORY_SOURCE,
        );
        let measured = Measured::of(&plan, &run).unwrap();
        assert_eq!(measured.steps, (2, 4));
        let cal = calibrate(&p, &plan, &measured).unwrap();
        let s0 = &cal.stages[0];
        assert_eq!(
            (s0.measured_compute_ms, s0.predicted_compute_ms),
            (66.0, 48.0)
        );
        assert_eq!(s0.time_factor, 1.375);
        assert_eq!(
            (s0.predicted_peak_bytes, s0.memory_factor),
            (20000.0, Some(1.5))
        );
        let s1 = &cal.stages[1];
        assert_eq!((s1.predicted_compute_ms, s1.time_factor), (48.0, 0.5));
        assert_eq!(
            (s1.predicted_peak_bytes, s1.memory_factor),
            (8000.0, Some(0.25))
        );
        // Every batch size is scaled, each stage's layers by its factors.
        let m = &cal.profile.layers[1].measurements;
        assert_eq!((m[0].fwd_ms, m[2].bwd_ms), (1.375, 11.0));
        assert_eq!(m[2].stored_activation_bytes, Some(18000));
        let m = &cal.profile.layers[3].measurements;
        assert_eq!(
            (m[1].fwd_ms, m[1].bwd_ms, m[1].stored_activation_bytes),
            (1.0, 2.0, Some(500))
        );
        assert_eq!(
            m[1].activation_bytes, 2000,
            "outputs are what crosses a cut: unchanged"
        );
        // The calibrated profile predicts what was measured.
        let again = calibrate(&cal.profile, &plan_of(&cal.profile), &measured).unwrap();
        for c in &again.stages {
            assert!((c.time_factor - 1.0).abs() < 1e-12, "{c:?}");
            assert!((c.memory_factor.unwrap() - 1.0).abs() < 1e-3, "{c:?}");
        }
        let source = cal.profile.source.unwrap();
        assert!(source.starts_with("by hand; calibrated by dapple calibrate from a run of plan.json (median compute of steps 2..4): layers 0..2 times x1.375, stored activations x1.500, layers 2..4 times x0.500"), "{source}");
    }

    #[test]
    fn process_rss_leaves_memory_alone_and_slowest_rank_sets_the_time() {
        let p = profile();
        let mut two = plan_of(&p);
        // One stage of both GPUs (data parallel): slices of 1, 4 micro-batches.
        two.stages = vec![Stage {
            layer_start: 0,
            layer_end: 4,
            devices: vec![0, 1],
            warmup_micro_batches: 1,
            ..Default::default()
        }];
        let mut run = metrics(
            [&[9.0, 12.0, 12.0], &[9.0, 18.0, 18.0]],
            [1e9, 1e9],
            "rss-since-reset",
        );
        run.ranks.get_mut("1").unwrap().stage = 0;
        run.ranks.get_mut("1").unwrap().replica = 1;
        let measured = Measured::of(&two, &run).unwrap();
        let cal = calibrate(&p, &two, &measured).unwrap();
        let c = &cal.stages[0];
        // 4 layers x 3 ms at slice 1, 4 micro-batches: 48 ms; the slower rank's median 18.
        assert_eq!(
            (c.predicted_compute_ms, c.measured_compute_ms, c.time_factor),
            (48.0, 18.0, 0.375)
        );
        assert_eq!(c.memory_factor, None);
        assert!(c
            .memory_note
            .as_deref()
            .unwrap()
            .starts_with("rss-since-reset"));
        assert_eq!(
            cal.profile.layers[1].measurements[0].stored_activation_bytes,
            Some(3000)
        );
        assert!(cal.profile.source.unwrap().ends_with(
            "; memory left alone where rss-since-reset peaks count the process, not its tensors"
        ));
    }

    #[test]
    fn metrics_of_another_plan_are_refused_by_field() {
        let p = profile();
        let plan = plan_of(&p);
        let ok = metrics([&[1.0], &[1.0]], [0.0, 0.0], "rss-since-start");
        let refused = |run: RunMetrics| {
            let e = Measured::of(&plan, &run).unwrap_err();
            (e.kind, e.field.unwrap(), e.message)
        };
        let mut batch = ok.clone();
        batch.global_batch_size = 16;
        let (kind, field, message) = refused(batch);
        assert_eq!(
            (kind, field.as_str()),
            (crate::ErrorKind::Incompatible, "global_batch_size")
        );
        assert_eq!(message, "value 16 is not the plan's 8 (4 micro-batches of 2): these metrics are not of this plan");
        let mut one = ok.clone();
        one.ranks.remove("1");
        assert_eq!(refused(one).1, "ranks");
        let mut swapped = ok.clone();
        swapped.ranks.get_mut("1").unwrap().stage = 0;
        assert_eq!(refused(swapped).1, "ranks.1.stage");
        let mut renamed = ok.clone();
        let r = renamed.ranks.remove("1").unwrap();
        renamed.ranks.insert("7".into(), r);
        assert_eq!(refused(renamed).1, "ranks.7");
        let mut empty = ok.clone();
        empty.ranks.get_mut("0").unwrap().phase_ms.clear();
        let (kind, field, _) = refused(empty);
        assert_eq!(
            (kind, field.as_str()),
            (crate::ErrorKind::InvalidInput, "ranks.0.phase_ms.compute")
        );
        let mut twice = ok.clone();
        let r = twice.ranks.remove("1").unwrap();
        twice.ranks.insert("00".into(), r);
        twice.ranks.get_mut("00").unwrap().stage = 0;
        let (_, field, message) = refused(twice);
        assert_eq!(
            (field.as_str(), message.as_str()),
            (
                "ranks",
                "no rank of stage 1: these metrics are not of this plan"
            )
        );
        let mut xpipe = ok;
        xpipe.schedule = Some(ScheduleKind::XPipe);
        assert_eq!(refused(xpipe).1, "schedule");
        // A profile other than the plan's is the plan's error.
        let mut other = p.clone();
        other.model = "another".into();
        let measured = Measured::of(&plan, &metrics([&[1.0], &[1.0]], [0.0, 0.0], "x")).unwrap();
        let e = calibrate(&other, &plan, &measured).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("inputs.profile_sha256"));
    }

    #[test]
    fn a_run_that_recomputed_is_costed_recomputing() {
        let p = profile();
        let plan = plan_of(&p);
        // Stage 0 re-runs its forward in the backward: (4 + 4 + 8) ms a
        // micro-batch, 64 for 4.
        let mut run = metrics([&[0.0, 64.0], &[0.0, 48.0]], [0.0, 0.0], "rss-since-reset");
        run.recompute = true;
        let cal = calibrate(&p, &plan, &Measured::of(&plan, &run).unwrap()).unwrap();
        assert_eq!(cal.stages[0].predicted_compute_ms, 64.0);
        assert_eq!(cal.stages[0].time_factor, 1.0);
        assert_eq!(cal.stages[1].time_factor, 48.0 / 64.0);
    }

    #[test]
    fn the_median_leaves_out_the_first_steps_unless_none_would_be_left() {
        assert_eq!(median_after(Some(&vec![9.0, 1.0, 3.0, 2.0]), 1), Some(2.0));
        assert_eq!(median_after(Some(&vec![9.0, 1.0, 3.0]), 1), Some(2.0));
        assert_eq!(median_after(Some(&vec![9.0]), 1), Some(9.0));
        assert_eq!(median_after(Some(&vec![]), 0), None);
        assert_eq!(median_after(None, 0), None);
    }
}
