//! What `dapple run --metrics` writes: the steps a run took, their times and
//! losses, and each rank's memory and time split (`dapple.run-metrics`).
//! The runtime measures; this is the file's one definition, and reading a
//! written file back goes through it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::formats::format::{FileFormat, FileObject, RUN_METRICS};
use crate::model::profile::Precision;
use crate::schedule::ScheduleKind;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunMetrics {
    pub format: String,
    pub schema_version: u32,
    /// The plan file that ran.
    pub plan: String,
    /// The model factory, `MODULE:FUNCTION`, and its arguments.
    pub model: String,
    pub model_args: BTreeMap<String, serde_json::Value>,
    /// The steps this invocation ran: `first_step..=steps` (1-based).
    pub first_step: u32,
    pub steps: u32,
    pub global_batch_size: u32,
    pub recompute: bool,
    pub exact_memory: bool,
    /// The optimizer's name (absent in version 1 files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<String>,
    /// The asynchronous schedule the run trained with (`dapple run
    /// --schedule`, or an asynchronous plan's own); absent for a
    /// synchronous run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleKind>,
    /// Version 4: the precision of the forwards and the loss (`dapple run
    /// --dtype`); fp32 in older files.
    #[serde(default)]
    pub dtype: Precision,
    /// One per step, on rank 0: from a barrier to the end of the loss
    /// reduction; under an asynchronous schedule, from one update of rank 0
    /// to the next.
    pub iteration_ms: Vec<f64>,
    /// The mean loss over each step's global batch; null where it was not a
    /// number (a diverged run).
    pub losses: Vec<Option<f64>>,
    pub mean_iteration_ms: f64,
    /// Version 3: the median of `iteration_ms` without its first
    /// `first_steps_left_out` (`planner/runtime/launcher.py`
    /// `FIRST_STEPS_LEFT_OUT`), the figure `dapple run` prints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub median_iteration_ms: Option<f64>,
    /// Version 3: the first steps of the invocation left out of
    /// `median_iteration_ms` (0 where the run took no more than that).
    #[serde(default)]
    pub first_steps_left_out: u32,
    /// The plan's formula estimate and simulated iteration, with `--profile`.
    pub estimate_ms: Option<f64>,
    pub simulated_ms: Option<f64>,
    /// By rank, as a decimal string.
    pub ranks: BTreeMap<String, RankMetrics>,
    /// The model on the validation split after every `--eval-every` steps.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evaluations: Vec<Evaluation>,
}

/// The trained model on the validation split after `step` steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Evaluation {
    pub step: u32,
    /// Mean loss over the validation samples.
    pub loss: Option<f64>,
    /// Share of validation samples classified right, where the model
    /// classifies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accuracy: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankMetrics {
    pub stage: usize,
    pub replica: usize,
    /// The rank's peak memory during the steps (see `memory_source`).
    pub peak_memory_bytes: f64,
    /// Its memory when the steps began; the difference is what training added.
    pub memory_before_bytes: f64,
    /// `rss-since-reset`, `rss-since-start` or `cuda-allocated`.
    pub memory_source: String,
    /// Totals over the steps: time outside receives, and blocked in them.
    pub compute_ms: f64,
    pub bubble_ms: f64,
    /// `bubble_ms` over the total iteration time.
    pub bubble_fraction: f64,
    /// One value per step for each phase: compute, recv_wait, send_wait,
    /// allreduce, optimizer, end_sync.
    pub phase_ms: BTreeMap<String, Vec<f64>>,
}

impl FileObject for RunMetrics {
    const FORMAT: FileFormat = RUN_METRICS;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_metrics_read_back_and_strangers_are_refused() {
        let parts = serde_json::json!({
            "plan": "p.json", "model": "m:f", "model_args": {"n_layers": 4},
            "first_step": 1, "steps": 2, "global_batch_size": 8,
            "recompute": false, "exact_memory": false,
            "iteration_ms": [10.0, 9.5], "losses": [2.3, null], "mean_iteration_ms": 9.75,
            "estimate_ms": null, "simulated_ms": 9.0,
            "ranks": {"0": {"stage": 0, "replica": 0, "peak_memory_bytes": 1e6,
                            "memory_before_bytes": 5e5, "memory_source": "rss-since-reset",
                            "compute_ms": 15.0, "bubble_ms": 4.5, "bubble_fraction": 0.23,
                            "phase_ms": {"compute": [7.0, 8.0]}}}
        });
        let metrics = RunMetrics::from_parts(parts.clone()).unwrap();
        assert_eq!(metrics.format, "dapple.run-metrics");
        assert_eq!(metrics.schema_version, 4);
        assert_eq!((metrics.schedule, metrics.evaluations.len()), (None, 0));
        assert_eq!(metrics.dtype, Precision::Fp32);
        assert_eq!(
            (metrics.median_iteration_ms, metrics.first_steps_left_out),
            (None, 0)
        );
        assert_eq!(RunMetrics::from_json(&metrics.to_json()).unwrap(), metrics);
        let mut curves = parts.clone();
        curves["schedule"] = serde_json::json!("xpipe");
        curves["evaluations"] = serde_json::json!([{"step": 2, "loss": 0.5, "accuracy": 0.9}]);
        curves["median_iteration_ms"] = serde_json::json!(9.5);
        curves["first_steps_left_out"] = serde_json::json!(1);
        curves["dtype"] = serde_json::json!("bf16");
        let read = RunMetrics::from_parts(curves.clone()).unwrap();
        assert_eq!(read.schedule, Some(ScheduleKind::XPipe));
        assert_eq!(read.dtype, Precision::Bf16);
        assert_eq!(
            (read.median_iteration_ms, read.first_steps_left_out),
            (Some(9.5), 1)
        );
        assert_eq!(RunMetrics::from_json(&read.to_json()).unwrap(), read);
        let mut bad_dtype = curves;
        bad_dtype["dtype"] = serde_json::json!("fp8");
        let e = RunMetrics::from_parts(bad_dtype).unwrap_err();
        assert!(e.to_string().contains("fp8"), "{e}");
        let mut unknown = parts;
        unknown["surprise"] = serde_json::json!(1);
        let e = RunMetrics::from_parts(unknown).unwrap_err();
        assert!(e.to_string().contains("surprise"), "{e}");
    }

    #[test]
    fn version_3_files_read_as_fp32_runs() {
        let v3 = serde_json::json!({
            "format": "dapple.run-metrics", "schema_version": 3,
            "plan": "p.json", "model": "m:f", "model_args": {},
            "first_step": 1, "steps": 1, "global_batch_size": 8,
            "recompute": false, "exact_memory": false,
            "iteration_ms": [10.0], "losses": [2.3], "mean_iteration_ms": 10.0,
            "estimate_ms": null, "simulated_ms": null, "ranks": {}
        });
        let read = RunMetrics::from_json(&v3.to_string()).unwrap();
        assert_eq!((read.schema_version, read.dtype), (3, Precision::Fp32));
    }
}
