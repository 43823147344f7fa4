//! Per-layer profiles: the file format and the time/size functions the cost
//! model reads from it.
//!
//! A profile is an ordered chain of layers. Each layer holds one measurement
//! per profiled batch size (forward and backward time, output activation
//! bytes, optionally the bytes it keeps for backward) and its parameter bytes.
//! Branching models keep their graph edges in `inputs`, so a cut between two
//! positions carries every tensor that crosses it, not only the previous
//! layer's output.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::formats::format::{check_non_negative, FileFormat, FileObject, PROFILE};
use crate::model::context::ContextPattern;
use crate::model::experts::ExpertPattern;
use crate::model::range_table::{Greatest, RangeTable};
use crate::model::split::SplitPattern;

/// Value of `Layer::kind` that marks the model's own repeated layers
/// (BERT encoder layers, GNMT LSTM layers, AmoebaNet cells). Plans report
/// their split positions counted in these.
pub const BLOCK_KIND: &str = "block";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub format: String,
    pub schema_version: u32,
    /// Model name, e.g. "BERT-48".
    pub model: String,
    /// Where the numbers come from (who measured, on what, when).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// GPU type the times were measured on, e.g. "V100-16GB". Topologies give
    /// each GPU type a speed relative to this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Optimizer the model is trained with; sets the optimizer-state memory
    /// (adam, adamw, lamb, rmsprop-momentum: 2 slots per parameter;
    /// sgd-momentum, rmsprop, adagrad: 1; sgd: 0).
    #[serde(default = "default_optimizer")]
    pub optimizer: String,
    pub layers: Vec<Layer>,
    /// The same model timed on other GPU types: a
    /// topology group whose GPU type is one of these runs at these times
    /// instead of `device`'s times over its `relative_speed`, so per-layer
    /// speed ratios may differ between types. Sizes and memory come from
    /// `layers`: they do not depend on the GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub other_devices: Vec<DeviceTimes>,
    /// Bytes per parameter of what training holds. Absent: fp32 weights and
    /// gradients with the optimizer's slots in fp32, and `param_bytes`
    /// counts 4 bytes a parameter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameter_state: Option<ParameterState>,
    /// Model FLOPs of one sample's forward and backward pass (no
    /// re-computation): what MFU counts as useful work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_flops_per_sample: Option<f64>,
    /// The number format the layers computed in when measured (`dapple
    /// profile model --dtype`); absent: not recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Precision>,
    /// The GPU allocator's reserved bytes over its allocated bytes at the
    /// measured peak (torch's caching allocator keeps freed blocks, split
    /// by size): a plan's allocated peak times this must fit the GPU.
    /// Measured by `dapple profile model` on CUDA; absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_reserved_factor: Option<f64>,
    /// One step of `optimizer` over all the model's parameters on
    /// `device`; a stage's step takes its share by parameter bytes.
    /// Absent: 0 (steps cost nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_step_ms: Option<f64>,
    /// What that step allocates above what was held when it began, at its
    /// peak (torch's foreach Adam: about one more copy of the weights); a
    /// stage's step takes its share by parameter bytes. Measured by
    /// `dapple profile model`; absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_step_bytes: Option<u64>,
}

crate::named_enum! {
    /// Number formats layers compute in: `dapple profile model --dtype` and
    /// `dapple run --dtype`.
    pub enum Precision("a number format") {
        /// Everything in fp32.
        Fp32 = "fp32",
        /// Mixed precision: torch's autocast to bfloat16, weights,
        /// gradients and optimizer state in fp32.
        Bf16 = "bf16",
        /// Mixed precision: autocast to float16, with loss scaling.
        Fp16 = "fp16",
    }
}

// named_enum! declares the enum, so its default cannot be derived there.
#[allow(clippy::derivable_impls)]
impl Default for Precision {
    /// What a file that names none computed in (run metrics before
    /// version 4).
    fn default() -> Self {
        Precision::Fp32
    }
}

/// Bytes per parameter of each thing training holds for it. Mixed precision
/// with Adam is usually weights 2 (bf16), gradients 2, master weights 4 and
/// optimizer state 8 (two fp32 moments): 16 in all.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParameterState {
    /// The weights as the model computes with them; `param_bytes` counts
    /// parameters at this size.
    pub weight_bytes: f64,
    /// Gradients, as they are reduced between replicas.
    pub gradient_bytes: f64,
    /// The optimizer's own copy of the weights (fp32 under mixed
    /// precision), or 0.
    pub master_weight_bytes: f64,
    /// The optimizer's state (Adam: two moments).
    pub optimizer_bytes: f64,
}

impl ParameterState {
    /// What training under torch's autocast holds per parameter, whatever
    /// the compute dtype: fp32 weights (also the optimizer's own: no master
    /// copy), fp32 gradients, and the optimizer's slots in fp32. The cast
    /// copies autocast makes are measured per layer (`weight_copy_bytes`).
    /// None for an unknown optimizer.
    pub fn autocast(optimizer: &str) -> Option<ParameterState> {
        const FP32: f64 = 4.0;
        optimizer_state_slots(optimizer).map(|slots| ParameterState {
            weight_bytes: FP32,
            gradient_bytes: FP32,
            master_weight_bytes: 0.0,
            optimizer_bytes: f64::from(slots) * FP32,
        })
    }

    /// Bytes one optimizer step moves per parameter, as one fused pass runs
    /// it (apex's `multi_tensor_adam`, torch's fused Adam): it reads the
    /// gradient, the weights it updates (the master copy where there is
    /// one) and its state, writes the weights and the state back, and, with
    /// a master copy, writes the weights the model computes with
    /// (Megatron-LM's copy of the main parameters to the model's). Mixed
    /// precision with Adam: 2 + 2 x (4 + 8) + 2 = 28. Left out: the
    /// gradient's unscaling and norm, another read or two of it.
    pub fn step_bytes(&self) -> f64 {
        let (updated, copied) = if self.master_weight_bytes > 0.0 {
            (self.master_weight_bytes, self.weight_bytes)
        } else {
            (self.weight_bytes, 0.0)
        };
        self.gradient_bytes + 2.0 * (updated + self.optimizer_bytes) + copied
    }
}

/// The model's layer times measured on one more GPU type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceTimes {
    /// GPU type, matched to a topology group's `gpu.type`.
    pub device: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// One entry per layer of the profile, in the same order and with the
    /// same names.
    pub layers: Vec<LayerTimes>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerTimes {
    pub name: String,
    /// Ascending batch sizes, the same for every layer of this device.
    pub measurements: Vec<TimeMeasurement>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeMeasurement {
    pub batch_size: u32,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
}

fn default_optimizer() -> String {
    "adam".to_string()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    pub name: String,
    /// "block" for the model's own repeated layers; free text otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub param_bytes: u64,
    /// Indices of the layers whose outputs this layer reads. Absent means
    /// the previous layer (a plain chain); `[]` means it reads only input data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inputs: Option<Vec<usize>>,
    /// One entry per profiled batch size, ascending, the same sizes for
    /// every layer.
    pub measurements: Vec<Measurement>,
    /// Bytes of the layer's weights cast to the compute dtype that one
    /// micro-batch keeps from its forward to its backward (torch's autocast
    /// casts them anew in each forward and its backward needs them):
    /// memory per micro-batch in flight that does not grow with its
    /// samples. Absent: none (fp32, or weights stored in the compute dtype).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_copy_bytes: Option<u64>,
    /// The ways the layer can be sharded over several GPUs (`model/split.rs`);
    /// none: it is never split.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub split: Vec<SplitPattern>,
    /// The layer's routed experts, when it is a mixture of experts that
    /// expert parallelism may spread (`model/experts.rs`); none: it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertPattern>,
    /// How the layer's sequence may be cut over several GPUs (context
    /// parallelism, `model/context.rs`); none: it never is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<ContextPattern>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Measurement {
    pub batch_size: u32,
    pub fwd_ms: f64,
    pub bwd_ms: f64,
    /// Bytes of the layer's output(s) at this batch size.
    pub activation_bytes: u64,
    /// Bytes the layer keeps alive from its forward pass until its backward
    /// pass. Absent: the memory model assumes `activation_bytes` (each layer
    /// keeps its output, which is the next layer's saved input).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_activation_bytes: Option<u64>,
    /// Bytes the layer's backward allocates above what was held when it
    /// began, at its peak: gradients of its activations and temporaries
    /// (on the last layer, the loss's gradient of the logits). Parameter
    /// gradients are model state, not counted here. Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_working_bytes: Option<u64>,
    /// The forward time the backward re-runs when the layer ends a
    /// re-computed stage: torch's checkpoint re-runs a segment's forward
    /// only until every tensor the backward needs is back, so a last
    /// operation whose output nothing in the segment keeps (the LM head's
    /// final matmul) is not re-run, nor the loss outside the segment.
    /// It includes the checkpoint's own work (once per stage), which at
    /// small batches may exceed what it leaves. Absent: `fwd_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_fwd_ms: Option<f64>,
    /// Of `stored_activation_bytes`, what the loss keeps (the last layer's
    /// log-probabilities of a cross-entropy): under re-computation it stays
    /// outside the checkpoint, kept by every micro-batch in flight.
    /// Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_stored_bytes: Option<u64>,
    /// Of `bwd_ms`, the weight gradient (W) when the backward splits into
    /// its input gradient (I, the rest) and W, as zero-bubble schedules
    /// run it. Absent: [`Layer::backward_splits`]'s rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bwd_weight_ms: Option<f64>,
    /// Of `stored_activation_bytes`, what selective re-computation does not
    /// keep (the attention core's scores, probabilities and dropout mask,
    /// Korthikanti et al.'s 5 a s^2 b bytes), re-run in the backward
    /// instead. Absent: 0 (nothing to re-run selectively).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selective_stored_bytes: Option<u64>,
    /// The forward time of what `selective_stored_bytes` comes from, which
    /// the backward runs again under selective re-computation. Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selective_recompute_ms: Option<f64>,
    /// Of `fwd_ms` and `bwd_ms` of a layer with routed experts, the part
    /// that grows with the experts a GPU holds (all E of them here): what
    /// running the same tokens' copies through E experts takes over
    /// running them through one (reading E weights, not one, and in the
    /// backward writing E gradients). A GPU holding E/e of them takes
    /// (E/e - 1) / (E - 1) of it (`model/experts.rs`). Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_held_fwd_ms: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts_held_bwd_ms: Option<f64>,
}

impl Measurement {
    /// Its optional parts checked against the whole they are part of,
    /// `at(field)` naming a field in an error.
    fn check_parts(&self, at: impl Fn(&str) -> String) -> Result<()> {
        for (field, ms) in [
            ("recompute_fwd_ms", self.recompute_fwd_ms),
            ("selective_recompute_ms", self.selective_recompute_ms),
        ] {
            if let Some(ms) = ms {
                check_non_negative(|| at(field), ms)?;
            }
        }
        for (field, ms, whole, pass) in [
            (
                "experts_held_fwd_ms",
                self.experts_held_fwd_ms,
                self.fwd_ms,
                "fwd_ms",
            ),
            (
                "experts_held_bwd_ms",
                self.experts_held_bwd_ms,
                self.bwd_ms,
                "bwd_ms",
            ),
        ] {
            if let Some(ms) = ms.filter(|ms| !(ms.is_finite() && (0.0..=whole).contains(ms))) {
                return Err(Error::field(
                    at(field),
                    format!("value {ms} must be a number in 0..={pass} ({whole}): it is part of that pass"),
                ));
            }
        }
        let stored = self
            .stored_activation_bytes
            .unwrap_or(self.activation_bytes);
        if let Some(bytes) = self.selective_stored_bytes.filter(|&b| b > stored) {
            return Err(Error::field(
                at("selective_stored_bytes"),
                format!("value {bytes} must be at most the stored activations ({stored}): it is part of them"),
            ));
        }
        if let Some(ms) = self.bwd_weight_ms {
            if !(ms.is_finite() && (0.0..=self.bwd_ms).contains(&ms)) {
                return Err(Error::field(
                    at("bwd_weight_ms"),
                    format!(
                        "value {ms} must be a number in 0..=bwd_ms ({}): it is part of the backward",
                        self.bwd_ms
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every time of the measurement multiplied by `factor` (a calibration):
    /// the passes, and the parts of them the profile records, so that
    /// their shares stay.
    pub fn scale_times(&mut self, factor: f64) {
        self.fwd_ms *= factor;
        self.bwd_ms *= factor;
        for ms in [
            &mut self.recompute_fwd_ms,
            &mut self.bwd_weight_ms,
            &mut self.selective_recompute_ms,
            &mut self.experts_held_fwd_ms,
            &mut self.experts_held_bwd_ms,
        ]
        .into_iter()
        .flatten()
        {
            *ms *= factor;
        }
    }
}

impl Layer {
    /// The measurement sizes are taken from: the largest measured batch,
    /// where fixed overheads weigh least (sizes are linear in the batch).
    fn largest_measurement(&self) -> &Measurement {
        self.measurements
            .last()
            .expect("validated: at least one measurement")
    }

    /// Bytes of the layer's output(s) per sample.
    pub fn activation_bytes_per_sample(&self) -> f64 {
        self.per_sample(|m| m.activation_bytes)
    }

    /// `bytes` of the largest measurement, per sample.
    fn per_sample(&self, bytes: impl Fn(&Measurement) -> u64) -> f64 {
        let m = self.largest_measurement();
        bytes(m) as f64 / f64::from(m.batch_size)
    }

    /// Bytes per sample kept from the forward pass until the backward pass.
    pub fn stored_bytes_per_sample(&self) -> f64 {
        self.per_sample(|m| m.stored_activation_bytes.unwrap_or(m.activation_bytes))
    }

    /// Bytes per sample the backward needs on top of what it holds.
    pub fn backward_working_bytes_per_sample(&self) -> f64 {
        self.per_sample(|m| m.backward_working_bytes.unwrap_or(0))
    }

    /// Bytes per sample the loss keeps outside a re-computed stage.
    pub fn loss_stored_bytes_per_sample(&self) -> f64 {
        self.per_sample(|m| m.loss_stored_bytes.unwrap_or(0))
    }

    /// Bytes per sample selective re-computation does not keep.
    pub fn selective_stored_bytes_per_sample(&self) -> f64 {
        self.per_sample(|m| m.selective_stored_bytes.unwrap_or(0))
    }

    /// The share of its forward selective re-computation runs again, at
    /// each measured batch size (0 where not measured).
    pub fn selective_fractions(&self) -> Vec<(u32, f64)> {
        self.measurements
            .iter()
            .map(|m| {
                let ms = m.selective_recompute_ms.unwrap_or(0.0);
                let share = if m.fwd_ms > 0.0 { ms / m.fwd_ms } else { 0.0 };
                (m.batch_size, share)
            })
            .collect()
    }

    /// The shares of its forward and backward that grow with the routed
    /// experts a GPU holds (`Measurement::experts_held_fwd_ms`), at each
    /// measured batch size (0 where not measured).
    pub fn experts_held_fractions(&self) -> [Vec<(u32, f64)>; 2] {
        let share = |ms: Option<f64>, whole: f64| {
            if whole > 0.0 {
                ms.unwrap_or(0.0) / whole
            } else {
                0.0
            }
        };
        [
            self.measurements
                .iter()
                .map(|m| (m.batch_size, share(m.experts_held_fwd_ms, m.fwd_ms)))
                .collect(),
            self.measurements
                .iter()
                .map(|m| (m.batch_size, share(m.experts_held_bwd_ms, m.bwd_ms)))
                .collect(),
        ]
    }

    /// The share of its forward the layer re-runs when it ends a
    /// re-computed stage, the checkpoint's own work included, at each
    /// measured batch size (1 where not measured).
    pub fn rerun_fractions(&self) -> Vec<(u32, f64)> {
        self.measurements
            .iter()
            .map(|m| {
                let share = match m.recompute_fwd_ms {
                    // Above 1 where the checkpoint's own work outweighs what
                    // it leaves (small batches).
                    Some(ms) if m.fwd_ms > 0.0 => (ms / m.fwd_ms).max(0.0),
                    _ => 1.0,
                };
                (m.batch_size, share)
            })
            .collect()
    }

    /// The backward split into its input gradient (I) and its weight
    /// gradient (W), at each measured batch size: (batch, I ms, W ms), with
    /// I + W = `bwd_ms`. Measured where the profile says (`bwd_weight_ms`);
    /// otherwise W is half the backward of a layer with parameters, as for
    /// a matrix product y = x W, whose backward is two products of the
    /// forward's size (dx = dy W^T, dW = x^T dy), and nothing for a layer
    /// without (Qi et al. assume I = W too).
    pub fn backward_splits(&self) -> Vec<(u32, f64, f64)> {
        self.measurements
            .iter()
            .map(|m| {
                let weight_ms = match m.bwd_weight_ms {
                    Some(ms) => ms,
                    None if self.param_bytes > 0 => m.bwd_ms / 2.0,
                    None => 0.0,
                };
                (m.batch_size, m.bwd_ms - weight_ms, weight_ms)
            })
            .collect()
    }
}

impl ParameterState {
    fn validate(&self) -> Result<()> {
        let fields = [
            ("weight_bytes", self.weight_bytes),
            ("gradient_bytes", self.gradient_bytes),
            ("master_weight_bytes", self.master_weight_bytes),
            ("optimizer_bytes", self.optimizer_bytes),
        ];
        for (field, value) in fields {
            if !(value.is_finite() && value >= 0.0) {
                return Err(Error::field(
                    field,
                    format!("value {value} must be a finite number >= 0"),
                ));
            }
        }
        if self.gradient_bytes == 0.0 {
            return Err(Error::field(
                "gradient_bytes",
                "value 0 must be > 0: replicas reduce gradients",
            ));
        }
        if self.weight_bytes == 0.0 {
            return Err(Error::field(
                "weight_bytes",
                "value 0 must be > 0: param_bytes counts parameters at this size",
            ));
        }
        Ok(())
    }
}

/// Number of optimizer-state slots per parameter for a named optimizer.
pub fn optimizer_state_slots(optimizer: &str) -> Option<u32> {
    match optimizer {
        "sgd" => Some(0),
        "sgd-momentum" | "rmsprop" | "adagrad" => Some(1),
        "adam" | "adamw" | "lamb" | "rmsprop-momentum" => Some(2),
        _ => None,
    }
}

impl FileObject for Profile {
    const FORMAT: FileFormat = PROFILE;

    fn check(&self) -> Result<()> {
        self.validate()
    }
}

impl Profile {
    /// The profile with every layer's stored-activation bytes scaled so that
    /// one GPU training the whole model at `batch_size` needs
    /// `peak_memory_bytes`.
    ///
    /// Profiles that only record layer outputs miss what layers keep inside
    /// (attention maps, dropout masks, gates): a transformer layer keeps many
    /// times its output. A measured whole-model peak pins the total down; it
    /// is spread over layers in proportion to their outputs, after the model
    /// state (weights, gradients, optimizer slots) is taken off.
    pub fn calibrated_stored_activations(
        &self,
        peak_memory_bytes: f64,
        batch_size: u32,
    ) -> Result<Profile> {
        let sizes = self.batch_sizes();
        let Some(k) = sizes.iter().position(|&b| b == batch_size) else {
            return Err(Error::invalid(format!(
                "batch size {batch_size} is not a profiled batch size ({sizes:?}); cannot calibrate"
            )));
        };
        let state = LayerCosts::new(self).model_state_bytes(0, self.layers.len());
        let outputs: f64 = self
            .layers
            .iter()
            .map(|l| l.measurements[k].activation_bytes as f64)
            .sum();
        const GIB: f64 = (1u64 << 30) as f64;
        if peak_memory_bytes.partial_cmp(&state) != Some(std::cmp::Ordering::Greater)
            || outputs == 0.0
        {
            return Err(Error::invalid(format!(
                "measured peak memory {:.2} GiB is not above the model state {:.2} GiB \
                 (weights, gradients and {} state); cannot calibrate",
                peak_memory_bytes / GIB,
                state / GIB,
                self.optimizer
            )));
        }
        let factor = (peak_memory_bytes - state) / outputs;
        let mut out = self.clone();
        for m in out
            .layers
            .iter_mut()
            .flat_map(|l| l.measurements.iter_mut())
        {
            m.stored_activation_bytes = Some((m.activation_bytes as f64 * factor).round() as u64);
        }
        let note = format!(
            "stored activations = {factor:.2} x layer outputs, so that the whole model at batch \
             {batch_size} needs {:.2} GiB",
            peak_memory_bytes / GIB
        );
        out.source = Some(match &self.source {
            Some(s) if !s.is_empty() => format!("{s}; {note}"),
            _ => note,
        });
        out.validate()?;
        Ok(out)
    }

    /// This profile with `other`'s layer times added as those of its GPU
    /// type (`dapple profile merge`), and any types `other` itself holds.
    /// `other` must be the same model: the same layers, by name and order,
    /// with the same parameter bytes. Its memory figures are not kept:
    /// sizes do not depend on the GPU.
    ///
    /// Errors are about `other` (its fields), except that this profile
    /// must name its own device first ([`Profile::check_merge_base`]).
    pub fn with_times_of(&self, other: &Profile) -> Result<Profile> {
        let Some(device) = other.named_device() else {
            return Err(Error::field(
                "device",
                "is absent: name the GPU type its times were measured on",
            ));
        };
        let timed = self.timed_devices();
        let theirs = std::iter::once(("device".to_string(), device)).chain(
            other
                .other_devices
                .iter()
                .enumerate()
                .map(|(k, d)| (format!("other_devices[{k}].device"), d.device.as_str())),
        );
        for (field, name) in theirs {
            if timed.contains(&Some(name)) {
                return Err(Error::field(
                    field,
                    format!("value {name:?} is timed already; merge each GPU type once"),
                ));
            }
        }
        if other.layers.len() != self.layers.len() {
            return Err(Error::field(
                "layers",
                format!(
                    "has {} layers where the first profile has {}; merge profiles of one model",
                    other.layers.len(),
                    self.layers.len()
                ),
            ));
        }
        for (i, (theirs, ours)) in other.layers.iter().zip(&self.layers).enumerate() {
            if theirs.name != ours.name {
                return Err(Error::field(
                    format!("layers[{i}].name"),
                    format!(
                        "value {:?} differs from the first profile's {:?}; merge profiles of one model",
                        theirs.name, ours.name
                    ),
                ));
            }
            if theirs.param_bytes != ours.param_bytes {
                return Err(Error::field(
                    format!("layers[{i}].param_bytes"),
                    format!(
                        "value {} differs from the first profile's {}; merge profiles of one model",
                        theirs.param_bytes, ours.param_bytes
                    ),
                ));
            }
        }
        let mut merged = self.clone();
        merged.other_devices.push(DeviceTimes {
            device: device.to_string(),
            source: other.source.clone(),
            layers: other
                .layers
                .iter()
                .map(|l| LayerTimes {
                    name: l.name.clone(),
                    measurements: l.measurements.iter().map(TimeMeasurement::of).collect(),
                })
                .collect(),
        });
        merged
            .other_devices
            .extend(other.other_devices.iter().cloned());
        merged.validate()?;
        Ok(merged)
    }

    /// A profile others' times can be merged into names its own device.
    pub fn check_merge_base(&self) -> Result<()> {
        match self.named_device() {
            Some(_) => Ok(()),
            None => Err(Error::field(
                "device",
                "is absent: name the GPU type its times were measured on; the first profile's \
                 device is the one the others are merged beside",
            )),
        }
    }

    /// The GPU type `layers` were timed on, when named (not blank).
    pub fn named_device(&self) -> Option<&str> {
        self.device.as_deref().filter(|d| !d.trim().is_empty())
    }

    /// Every GPU type the profile times: its own `device` first, then
    /// `other_devices` in order.
    pub fn timed_devices(&self) -> Vec<Option<&str>> {
        std::iter::once(self.device.as_deref())
            .chain(self.other_devices.iter().map(|d| Some(d.device.as_str())))
            .collect()
    }

    /// The profile trained with `optimizer` instead: its parameter state
    /// follows where it is the autocast state of the profile's own
    /// optimizer (what `dapple profile model` records), else it stays.
    pub fn with_optimizer(&self, optimizer: &str) -> Profile {
        let mut out = self.clone();
        if self.parameter_state.is_some()
            && self.parameter_state == ParameterState::autocast(&self.optimizer)
        {
            out.parameter_state = ParameterState::autocast(optimizer);
        }
        out.optimizer = optimizer.to_string();
        out
    }

    /// SHA-256 of the canonical JSON form, so a plan can tell whether it is
    /// evaluated against the profile it was made from.
    pub fn sha256(&self) -> String {
        let digest = Sha256::digest(self.to_json().as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Indices of the layers whose outputs layer `layer` reads.
    pub fn reads(&self, layer: usize) -> Vec<usize> {
        match &self.layers[layer].inputs {
            Some(sources) => sources.clone(),
            None if layer > 0 => vec![layer - 1],
            None => Vec::new(),
        }
    }

    /// For each layer, the layers that read its output, ascending.
    pub fn readers(&self) -> Vec<Vec<usize>> {
        let mut readers = vec![Vec::new(); self.layers.len()];
        for layer in 0..self.layers.len() {
            for source in self.reads(layer) {
                readers[source].push(layer);
            }
        }
        readers
    }

    pub fn batch_sizes(&self) -> Vec<u32> {
        self.layers
            .first()
            .map(|l| l.measurements.iter().map(|m| m.batch_size).collect())
            .unwrap_or_default()
    }

    pub fn min_batch_size(&self) -> u32 {
        self.batch_sizes().first().copied().unwrap_or(1)
    }

    /// Smallest per-device slice of a micro-batch a plan may use: the one
    /// asked for, else the smallest profiled batch size; at least 1.
    pub fn min_slice(&self, requested: Option<u32>) -> u32 {
        requested.unwrap_or_else(|| self.min_batch_size()).max(1)
    }

    pub fn validate(&self) -> Result<()> {
        if self.model.trim().is_empty() {
            return Err(Error::field("model", "must not be empty"));
        }
        if optimizer_state_slots(&self.optimizer).is_none() {
            return Err(Error::field(
                "optimizer",
                format!(
                    "value {:?} is unknown; use one of sgd, sgd-momentum, rmsprop, rmsprop-momentum, adagrad, adam, adamw, lamb",
                    self.optimizer
                ),
            ));
        }
        if self.layers.is_empty() {
            return Err(Error::field(
                "layers",
                "the profile has zero layers; it needs at least one",
            ));
        }
        if let Some(ms) = self.optimizer_step_ms {
            check_non_negative(|| "optimizer_step_ms".into(), ms)?;
        }
        if let Some(factor) = self.allocator_reserved_factor {
            if !(factor.is_finite() && factor >= 1.0) {
                return Err(Error::field(
                    "allocator_reserved_factor",
                    format!("value {factor} must be a finite number >= 1: an allocator reserves at least what it allocates"),
                ));
            }
        }
        let sizes = self.batch_sizes();
        for (i, layer) in self.layers.iter().enumerate() {
            let at = |f: &str| format!("layers[{i}].{f}");
            if layer.name.trim().is_empty() {
                return Err(Error::field(at("name"), "must not be empty"));
            }
            let times: Vec<TimeMeasurement> =
                layer.measurements.iter().map(TimeMeasurement::of).collect();
            check_times(&format!("layers[{i}]"), &times, &sizes)?;
            for (k, m) in layer.measurements.iter().enumerate() {
                m.check_parts(|f| at(&format!("measurements[{k}].{f}")))?;
            }
            if let Some(inputs) = &layer.inputs {
                for (k, &src) in inputs.iter().enumerate() {
                    if src >= i {
                        return Err(Error::field(
                            format!("layers[{i}].inputs[{k}]"),
                            format!("value {src} must name an earlier layer (< {i}); layers are listed in execution order"),
                        ));
                    }
                }
            }
        }
        for (i, layer) in self.layers.iter().enumerate() {
            for (k, pattern) in layer.split.iter().enumerate() {
                pattern
                    .validate()
                    .map_err(|e| e.under(&format!("layers[{i}].split[{k}]")))?;
            }
            if let Some(experts) = &layer.experts {
                experts
                    .validate()
                    .map_err(|e| e.under(&format!("layers[{i}].experts")))?;
            }
            if let Some(context) = &layer.context {
                context
                    .validate()
                    .map_err(|e| e.under(&format!("layers[{i}].context")))?;
            }
        }
        if let Some(state) = &self.parameter_state {
            state.validate().map_err(|e| e.under("parameter_state"))?;
        }
        if let Some(flops) = self.model_flops_per_sample {
            if !(flops.is_finite() && flops >= 0.0) {
                return Err(Error::field(
                    "model_flops_per_sample",
                    format!("value {flops} must be a finite number >= 0"),
                ));
            }
        }
        check_some_time("layers", &sizes, |k| {
            self.layers
                .iter()
                .map(|l| l.measurements[k].fwd_ms + l.measurements[k].bwd_ms)
                .sum()
        })?;
        self.validate_other_devices()
    }

    /// Each other device times the same layers, by name and order, at
    /// ascending batch sizes shared by its layers, with some compute time;
    /// device names are distinct and the profile names its own device.
    fn validate_other_devices(&self) -> Result<()> {
        if self.other_devices.is_empty() {
            return Ok(());
        }
        let Some(own) = self.named_device() else {
            return Err(Error::field(
                "device",
                "must name the GPU type `layers` were timed on when other_devices are given",
            ));
        };
        let mut seen = vec![own];
        for (d, other) in self.other_devices.iter().enumerate() {
            let at = |f: &str| format!("other_devices[{d}].{f}");
            if other.device.trim().is_empty() {
                return Err(Error::field(at("device"), "must not be empty"));
            }
            if seen.contains(&other.device.as_str()) {
                return Err(Error::field(
                    at("device"),
                    format!(
                        "value {:?} is given twice; each GPU type is timed once",
                        other.device
                    ),
                ));
            }
            seen.push(&other.device);
            if other.layers.len() != self.layers.len() {
                return Err(Error::field(
                    at("layers"),
                    format!(
                        "has {} layers where the profile has {}; time every layer",
                        other.layers.len(),
                        self.layers.len()
                    ),
                ));
            }
            let sizes: Vec<u32> = other.layers[0]
                .measurements
                .iter()
                .map(|m| m.batch_size)
                .collect();
            for (i, (layer, own_layer)) in other.layers.iter().zip(&self.layers).enumerate() {
                let lat = |f: &str| format!("other_devices[{d}].layers[{i}].{f}");
                if layer.name != own_layer.name {
                    return Err(Error::field(
                        lat("name"),
                        format!(
                            "value {:?} differs from layers[{i}].name {:?}; list the same layers in the same order",
                            layer.name, own_layer.name
                        ),
                    ));
                }
                check_times(
                    &format!("other_devices[{d}].layers[{i}]"),
                    &layer.measurements,
                    &sizes,
                )?;
            }
            check_some_time(&format!("other_devices[{d}].layers"), &sizes, |k| {
                other
                    .layers
                    .iter()
                    .map(|l| l.measurements[k].fwd_ms + l.measurements[k].bwd_ms)
                    .sum()
            })?;
        }
        Ok(())
    }
}

/// One layer's measured times at `at` (`layers[3]`): at least one, at
/// `sizes` (its layer 0's batch sizes), ascending from 1, times in range.
fn check_times(at: &str, measured: &[TimeMeasurement], sizes: &[u32]) -> Result<()> {
    if measured.is_empty() {
        return Err(Error::field(
            format!("{at}.measurements"),
            "needs at least one measurement",
        ));
    }
    let these: Vec<u32> = measured.iter().map(|m| m.batch_size).collect();
    if these != sizes {
        return Err(Error::field(
            format!("{at}.measurements"),
            format!(
                "batch sizes {these:?} differ from layer 0's {sizes:?}; every layer must be measured at the same batch sizes"
            ),
        ));
    }
    for (k, m) in measured.iter().enumerate() {
        let mat = |f: &str| format!("{at}.measurements[{k}].{f}");
        if m.batch_size == 0 {
            return Err(Error::field(mat("batch_size"), "value 0 must be >= 1"));
        }
        if k > 0 && m.batch_size <= measured[k - 1].batch_size {
            return Err(Error::field(
                mat("batch_size"),
                format!("value {} must be larger than the previous one; list batch sizes in ascending order", m.batch_size),
            ));
        }
        check_non_negative(|| mat("fwd_ms"), m.fwd_ms)?;
        check_non_negative(|| mat("bwd_ms"), m.bwd_ms)?;
    }
    Ok(())
}

/// A model that takes no time cannot be planned (speedups divide by it):
/// `total_ms(k)`, all layers at `sizes[k]`, is above 0 for every k.
fn check_some_time(layers: &str, sizes: &[u32], total_ms: impl Fn(usize) -> f64) -> Result<()> {
    for (k, &b) in sizes.iter().enumerate() {
        if total_ms(k) <= 0.0 {
            return Err(Error::field(
                format!("{layers}[*].measurements[{k}]"),
                format!(
                    "every layer takes 0 ms at batch size {b}; the model needs some compute time"
                ),
            ));
        }
    }
    Ok(())
}

impl TimeMeasurement {
    fn of(m: &Measurement) -> TimeMeasurement {
        TimeMeasurement {
            batch_size: m.batch_size,
            fwd_ms: m.fwd_ms,
            bwd_ms: m.bwd_ms,
        }
    }
}

/// What the backward of a re-computed stage needs on top of what its
/// micro-batch kept (its input, and on the last stage what the loss keeps
/// outside the checkpoint, `loss_kept_bytes`), at its peak. torch's
/// checkpoint re-runs the forward at the first saved tensor the backward
/// asks for, so the backward has two moments:
/// - the loss's backward first, before anything is re-run: the largest
///   `working_bytes` on top of what was kept;
/// - then the re-run's activations (`rerun_bytes`: the stored activations
///   and weight copies, less what the loss kept) with each layer's backward
///   on them (`rerun_working_bytes`, the loss's share left out), while the
///   loss's kept bytes are gone and the input stays.
///
/// On a stage without the loss the second is always the larger: the
/// re-run's activations and the working memory on top.
pub fn recompute_backward_bytes(
    working_bytes: f64,
    rerun_bytes: f64,
    rerun_working_bytes: f64,
    loss_kept_bytes: f64,
) -> f64 {
    working_bytes.max(rerun_bytes + rerun_working_bytes - loss_kept_bytes)
}

/// The profile reduced to what the cost model reads: per-layer time
/// functions of the batch size, parameter bytes, and the bytes crossing
/// each cut position, as prefix sums so any layer range costs O(1).
#[derive(Debug, Clone)]
pub struct LayerCosts {
    pub num_layers: usize,
    /// The layer times of each GPU type the profile measured: the
    /// profile's own `device` first, then `other_devices` in order.
    timings: Vec<Timing>,
    /// Per-sample bytes kept for backward, per layer.
    stored_per_sample: Vec<f64>,
    param_prefix: Vec<f64>,
    stored_prefix: Vec<f64>,
    /// Autocast's weight copies, kept per micro-batch in flight.
    weight_copy_prefix: Vec<f64>,
    /// Per-sample bytes each layer's backward needs on top, as a range-max table.
    working_per_sample: RangeTable<Greatest>,
    /// The allocator's reserved bytes over allocated ones (1: none).
    pub allocator_reserved_factor: f64,
    /// Per layer and measured batch size: the share of its forward re-run
    /// when it ends a re-computed stage (`Measurement::recompute_fwd_ms`).
    rerun_fractions: Vec<Vec<(u32, f64)>>,
    /// Per layer and measured batch size: the weight gradient's share of
    /// its backward (`Layer::backward_splits`).
    weight_fractions: Vec<Vec<(u32, f64)>>,
    /// Per layer: bytes per sample the loss keeps outside a re-computed stage.
    loss_stored_per_sample: Vec<f64>,
    /// Per layer: bytes per sample selective re-computation does not keep,
    /// and by measured batch size the share of the forward it runs again.
    selective_stored_per_sample: Vec<f64>,
    selective_fractions: Vec<Vec<(u32, f64)>>,
    /// Per layer and measured batch size: the shares of its forward and
    /// backward that grow with the routed experts a GPU holds.
    experts_held_fractions: Vec<[Vec<(u32, f64)>; 2]>,
    /// The optimizer's step time per parameter byte, on the profile's device.
    optimizer_ms_per_param_byte: f64,
    /// What the optimizer's step allocates above what it holds, per
    /// parameter byte it steps.
    optimizer_step_bytes_per_param_byte: f64,
    /// cut_per_sample[p]: bytes per sample crossing the cut before layer p
    /// (p in 1..num_layers); entry 0 and num_layers are 0.
    cut_per_sample: Vec<f64>,
    /// Bytes of weights, gradients, master weights and optimizer state per
    /// byte of `param_bytes` (4 for Adam in fp32; 16 / 2 = 8 for bf16 with
    /// Adam).
    state_per_param_byte: f64,
    /// Bytes of gradients per byte of `param_bytes`.
    gradient_per_param_byte: f64,
    /// Of `state_per_param_byte`, the master weights and optimizer state:
    /// what ZeRO-1 shards over replicas.
    optimizer_per_param_byte: f64,
    /// Bytes of one parameter in `param_bytes` (4 in fp32, 2 in bf16).
    weight_bytes_per_param: f64,
    /// Each layer's sharding patterns (`model/split.rs`).
    split: Vec<Vec<SplitPattern>>,
    /// Each layer's routed experts (`model/experts.rs`).
    experts: Vec<Option<ExpertPattern>>,
    context: Vec<Option<ContextPattern>>,
    /// expert_layer_prefix[p]: layers before p that have experts.
    expert_layer_prefix: Vec<u32>,
    /// Some layer's experts exchange their tokens deduplicated
    /// (`TokenDispatcher::DeepEp`).
    deduplicates_tokens: bool,
    /// The profile's model FLOPs of one sample (forward and backward).
    pub model_flops_per_sample: Option<f64>,
    /// Whether the optimizer keeps Adam's two moments, which XPipe's
    /// prediction then reads instead of keeping its own.
    pub keeps_adam_moments: bool,
}

/// Bytes per sample crossing each cut position 0..=n. A producer's output
/// crosses cut p (between p-1 and p) when the producer is before p and some
/// consumer is at or after p. Each tensor is sent once per cut, however
/// many consumers lie beyond. (Nothing crosses cut 0, before the first
/// layer, or cut n, after the last: no producer is before the one, no
/// consumer after the other.)
fn cut_bytes_per_sample(profile: &Profile, act_per_sample: &[f64]) -> Vec<f64> {
    let last_consumer: Vec<usize> = profile
        .readers()
        .iter()
        .enumerate()
        .map(|(i, r)| r.iter().copied().fold(i, usize::max))
        .collect();
    (0..=profile.layers.len())
        .map(|p| {
            (0..p)
                .filter(|&s| last_consumer[s] >= p)
                .map(|s| act_per_sample[s])
                .sum()
        })
        .collect()
}

/// The profile's optimizer step, its time and its temporaries, per
/// parameter byte (0 where it gives none).
fn optimizer_step_per_param_byte(profile: &Profile) -> (f64, f64) {
    // As f64: a sum of u64 sizes may overflow.
    let params: f64 = profile.layers.iter().map(|l| l.param_bytes as f64).sum();
    if params <= 0.0 {
        return (0.0, 0.0);
    }
    (
        profile.optimizer_step_ms.unwrap_or(0.0) / params,
        profile.optimizer_step_bytes.unwrap_or(0) as f64 / params,
    )
}

/// One GPU type's measured layer times.
#[derive(Debug, Clone)]
struct Timing {
    device: Option<String>,
    batch_sizes: Vec<u32>,
    /// fwd[k][i]: forward ms of layer i at batch_sizes[k].
    fwd: Vec<Vec<f64>>,
    bwd: Vec<Vec<f64>>,
}

impl Timing {
    fn new(
        device: Option<String>,
        layers: impl ExactSizeIterator<Item = Vec<TimeMeasurement>>,
    ) -> Timing {
        let n = layers.len();
        let mut batch_sizes = Vec::new();
        let (mut fwd, mut bwd): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (Vec::new(), Vec::new());
        for (i, measured) in layers.enumerate() {
            if i == 0 {
                batch_sizes = measured.iter().map(|m| m.batch_size).collect();
                fwd = vec![vec![0.0; n]; batch_sizes.len()];
                bwd = vec![vec![0.0; n]; batch_sizes.len()];
            }
            for (k, m) in measured.iter().enumerate() {
                fwd[k][i] = m.fwd_ms;
                bwd[k][i] = m.bwd_ms;
            }
        }
        Timing {
            device,
            batch_sizes,
            fwd,
            bwd,
        }
    }

    /// Per-layer times at `batch` samples, as prefix sums (see
    /// [`LayerCosts::times_at`]).
    fn prefix_at(&self, batch: u32) -> TimePrefix {
        let n = self.fwd.first().map_or(0, Vec::len);
        let spot = self.spot(batch);
        let mut f = vec![0.0; n + 1];
        let mut b = vec![0.0; n + 1];
        for i in 0..n {
            f[i + 1] = f[i] + spot.interpolate(&self.fwd, i);
            b[i + 1] = b[i] + spot.interpolate(&self.bwd, i);
        }
        TimePrefix { fwd: f, bwd: b }
    }

    /// Where `batch` lies among the measured sizes (the same for every
    /// layer: found once a batch, not once a layer).
    fn spot(&self, batch: u32) -> Spot {
        let sizes = &self.batch_sizes;
        let x = f64::from(batch);
        let last = sizes.len() - 1;
        if batch <= sizes[0] {
            return Spot::Scaled {
                k: 0,
                x,
                at: f64::from(sizes[0]),
            };
        }
        if batch >= sizes[last] {
            return Spot::Scaled {
                k: last,
                x,
                at: f64::from(sizes[last]),
            };
        }
        let k = sizes
            .iter()
            .position(|&s| s >= batch)
            .expect("inside the measured range");
        Spot::Between {
            k,
            x,
            x0: f64::from(sizes[k - 1]),
            x1: f64::from(sizes[k]),
        }
    }
}

/// A batch size among a timing's measured ones: outside them a layer's time
/// is proportional to the batch (scaled from measured size `k`, `at`
/// samples), between two linear.
#[derive(Debug, Clone, Copy)]
enum Spot {
    Scaled { k: usize, x: f64, at: f64 },
    Between { k: usize, x: f64, x0: f64, x1: f64 },
}

impl Spot {
    /// `table[k][layer]` (a time of each measured size) at this batch.
    fn interpolate(&self, table: &[Vec<f64>], layer: usize) -> f64 {
        match *self {
            Spot::Scaled { k, x, at } => table[k][layer] * x / at,
            Spot::Between { k, x, x0, x1 } => {
                let (y0, y1) = (table[k - 1][layer], table[k][layer]);
                y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            }
        }
    }
}

/// Per-batch-size prefix sums of forward and backward time.
#[derive(Debug, Clone)]
pub struct TimePrefix {
    fwd: Vec<f64>,
    bwd: Vec<f64>,
}

impl TimePrefix {
    pub fn fwd(&self, start: usize, end: usize) -> f64 {
        self.fwd[end] - self.fwd[start]
    }
    pub fn bwd(&self, start: usize, end: usize) -> f64 {
        self.bwd[end] - self.bwd[start]
    }
}

/// The share of layers `start..end`'s pass (`pass(a, b)`: layers a..b's
/// time) that each layer's measured `fractions` at `batch` make up, each
/// weighted by its own time; 0 for no layers or no time.
fn weighted_share(
    pass: impl Fn(usize, usize) -> f64,
    fractions: &[Vec<(u32, f64)>],
    (start, end): (usize, usize),
    batch: u32,
) -> f64 {
    let whole = pass(start, end);
    if end <= start || whole <= 0.0 {
        return 0.0;
    }
    let part: f64 = (start..end)
        .map(|l| pass(l, l + 1) * fraction_at(&fractions[l], batch, 0.0))
        .sum();
    part / whole
}

/// `f` of each of the profile's layers.
fn per_layer<T>(profile: &Profile, f: impl Fn(&Layer) -> T) -> Vec<T> {
    profile.layers.iter().map(f).collect()
}

/// A per-layer share measured at some batch sizes, at `batch`: linear
/// between measured sizes, the nearest one's outside them; `none` where
/// nothing was measured.
fn fraction_at(measured: &[(u32, f64)], batch: u32, none: f64) -> f64 {
    let x = f64::from(batch);
    match measured.iter().position(|&(b, _)| b >= batch) {
        Some(0) => measured[0].1,
        None => measured.last().map_or(none, |m| m.1),
        Some(k) => {
            let ((b0, y0), (b1, y1)) = (measured[k - 1], measured[k]);
            y0 + (y1 - y0) * (x - f64::from(b0)) / f64::from(b1 - b0)
        }
    }
}

impl LayerCosts {
    pub fn new(profile: &Profile) -> LayerCosts {
        let n = profile.layers.len();
        let mut timings = vec![Timing::new(
            profile.device.clone(),
            profile
                .layers
                .iter()
                .map(|l| l.measurements.iter().map(TimeMeasurement::of).collect()),
        )];
        for other in &profile.other_devices {
            timings.push(Timing::new(
                Some(other.device.clone()),
                other.layers.iter().map(|l| l.measurements.clone()),
            ));
        }
        let mut stored_per_sample = vec![0.0; n];
        let mut act_per_sample = vec![0.0; n];
        for (i, layer) in profile.layers.iter().enumerate() {
            act_per_sample[i] = layer.activation_bytes_per_sample();
            stored_per_sample[i] = layer.stored_bytes_per_sample();
        }
        let prefix = |v: &[f64]| {
            let mut p = vec![0.0; v.len() + 1];
            for (i, x) in v.iter().enumerate() {
                p[i + 1] = p[i] + x;
            }
            p
        };
        let params = per_layer(profile, |l| l.param_bytes as f64);
        let cut_per_sample = cut_bytes_per_sample(profile, &act_per_sample);
        let (optimizer_ms_per_param_byte, optimizer_step_bytes_per_param_byte) =
            optimizer_step_per_param_byte(profile);
        LayerCosts {
            num_layers: n,
            timings,
            stored_per_sample: stored_per_sample.clone(),
            param_prefix: prefix(&params),
            stored_prefix: prefix(&stored_per_sample),
            weight_copy_prefix: prefix(&per_layer(profile, |l| {
                l.weight_copy_bytes.unwrap_or(0) as f64
            })),
            working_per_sample: RangeTable::new(per_layer(
                profile,
                Layer::backward_working_bytes_per_sample,
            )),
            allocator_reserved_factor: profile.allocator_reserved_factor.unwrap_or(1.0),
            rerun_fractions: per_layer(profile, Layer::rerun_fractions),
            weight_fractions: profile
                .layers
                .iter()
                .map(|l| {
                    let shares = l.backward_splits().into_iter().map(|(b, input, weight)| {
                        let whole = input + weight;
                        (b, if whole > 0.0 { weight / whole } else { 0.0 })
                    });
                    shares.collect()
                })
                .collect(),
            loss_stored_per_sample: per_layer(profile, Layer::loss_stored_bytes_per_sample),
            selective_stored_per_sample: per_layer(
                profile,
                Layer::selective_stored_bytes_per_sample,
            ),
            selective_fractions: per_layer(profile, Layer::selective_fractions),
            experts_held_fractions: per_layer(profile, Layer::experts_held_fractions),
            cut_per_sample,
            state_per_param_byte: match &profile.parameter_state {
                Some(p) => {
                    (p.weight_bytes + p.gradient_bytes + p.master_weight_bytes + p.optimizer_bytes)
                        / p.weight_bytes
                }
                // fp32 weights, gradients and optimizer slots.
                None => f64::from(2 + optimizer_state_slots(&profile.optimizer).unwrap_or(2)),
            },
            gradient_per_param_byte: profile
                .parameter_state
                .map_or(1.0, |p| p.gradient_bytes / p.weight_bytes),
            optimizer_per_param_byte: match &profile.parameter_state {
                Some(p) => (p.master_weight_bytes + p.optimizer_bytes) / p.weight_bytes,
                None => f64::from(optimizer_state_slots(&profile.optimizer).unwrap_or(2)),
            },
            weight_bytes_per_param: profile.parameter_state.map_or(4.0, |p| p.weight_bytes),
            split: per_layer(profile, |l| l.split.clone()),
            experts: per_layer(profile, |l| l.experts.clone()),
            context: per_layer(profile, |l| l.context.clone()),
            expert_layer_prefix: std::iter::once(0)
                .chain(profile.layers.iter().scan(0, |n, l| {
                    *n += u32::from(l.experts.is_some());
                    Some(*n)
                }))
                .collect(),
            deduplicates_tokens: (profile.layers.iter().flat_map(|l| &l.experts))
                .any(ExpertPattern::deduplicates_tokens),
            model_flops_per_sample: profile.model_flops_per_sample,
            optimizer_ms_per_param_byte,
            optimizer_step_bytes_per_param_byte,
            keeps_adam_moments: matches!(profile.optimizer.as_str(), "adam" | "adamw" | "lamb"),
        }
    }

    /// Per-layer forward/backward time at `batch` samples on the profile's
    /// own device, as prefix sums.
    ///
    /// Between two measured batch sizes the time is interpolated linearly;
    /// above the largest it is scaled linearly from the largest; below the
    /// smallest it is scaled linearly from the smallest. The planner only
    /// asks for sizes below the smallest when the user allowed it, because
    /// linear scaling makes tiny micro-batches look free.
    pub fn times_at(&self, batch: u32) -> TimePrefix {
        self.times_on(0, batch)
    }

    /// [`LayerCosts::times_at`] on GPU type `timing` (an index into
    /// [`LayerCosts::devices`]).
    pub fn times_on(&self, timing: usize, batch: u32) -> TimePrefix {
        self.timings[timing].prefix_at(batch)
    }

    /// The GPU types the profile timed, its own device first.
    pub fn devices(&self) -> Vec<Option<&str>> {
        self.timings.iter().map(|t| t.device.as_deref()).collect()
    }

    /// Batch sizes GPU type `timing` was measured at, ascending. Between
    /// them a layer's time is linear in the batch, and outside them
    /// proportional to it, so its smallest time over a range of batch
    /// sizes is at one of these or at the range's ends.
    pub fn measured_batch_sizes(&self, timing: usize) -> &[u32] {
        &self.timings[timing].batch_sizes
    }

    pub fn param_bytes(&self, start: usize, end: usize) -> f64 {
        self.param_prefix[end] - self.param_prefix[start]
    }

    pub fn param_bytes_of_layer(&self, layer: usize) -> f64 {
        self.param_bytes(layer, layer + 1)
    }

    pub fn stored_bytes_per_sample(&self, start: usize, end: usize) -> f64 {
        self.stored_prefix[end] - self.stored_prefix[start]
    }

    pub fn stored_bytes_per_sample_of_layer(&self, layer: usize) -> f64 {
        self.stored_per_sample[layer]
    }

    /// What one micro-batch of `slice` samples keeps on a GPU of layers
    /// `start..end` from its forward to its backward: the stored
    /// activations and autocast's weight copies. The memory per micro-batch
    /// in flight.
    pub fn in_flight_bytes(&self, start: usize, end: usize, slice: u32) -> f64 {
        f64::from(slice) * self.stored_bytes_per_sample(start, end)
            + self.weight_copy_bytes(start, end)
    }

    /// The optimizer's step over `param_bytes` of weights (a GPU's share of
    /// a stage), on the profile's device.
    pub fn optimizer_step_ms(&self, param_bytes: f64) -> f64 {
        self.optimizer_ms_per_param_byte * param_bytes
    }

    /// What the optimizer's step over `param_bytes` of weights allocates
    /// above what the GPU holds, at its peak.
    pub fn optimizer_step_bytes(&self, param_bytes: f64) -> f64 {
        self.optimizer_step_bytes_per_param_byte * param_bytes
    }

    /// A GPU's memory while it steps the optimizer over layers
    /// `start..end`, whole: their model state and the step's temporaries.
    /// Activations are gone by then, so a stage's peak is the larger of
    /// this and its backward's (`cost::stage_memory_bytes`).
    pub fn optimizer_step_peak_bytes(&self, start: usize, end: usize) -> f64 {
        self.model_state_bytes(start, end) + self.optimizer_step_bytes(self.param_bytes(start, end))
    }

    /// The forward a re-computed stage of layers `start..end` runs again in
    /// its backward, over its whole forward, on `times` (any GPU type, at
    /// slices of `batch`): every layer's but the part of the last one
    /// torch's checkpoint does not re-run.
    pub fn rerun_ratio(&self, times: &TimePrefix, start: usize, end: usize, batch: u32) -> f64 {
        let whole = times.fwd(start, end);
        if end <= start || whole <= 0.0 {
            return 1.0;
        }
        let skipped = times.fwd(end - 1, end)
            * (1.0 - fraction_at(&self.rerun_fractions[end - 1], batch, 1.0));
        (whole - skipped) / whole
    }

    /// The forward selective re-computation of layers `start..end` runs
    /// again in their backward, over their whole forward, on `times` (any
    /// GPU type, at slices of `batch`): each layer's selective share
    /// weighted by its forward time.
    pub fn selective_ratio(&self, times: &TimePrefix, start: usize, end: usize, batch: u32) -> f64 {
        weighted_share(
            |a, b| times.fwd(a, b),
            &self.selective_fractions,
            (start, end),
            batch,
        )
    }

    /// Of layer `l`'s forward on `times` (at slices of `batch`), the ms
    /// selective re-computation runs again: a term of
    /// [`LayerCosts::selective_ratio`]'s sum, for callers that sum a stage
    /// a layer at a time.
    pub fn selective_rerun_fwd_ms(&self, times: &TimePrefix, l: usize, batch: u32) -> f64 {
        let fractions = &self.selective_fractions[l];
        if fractions.is_empty() {
            return 0.0;
        }
        times.fwd(l, l + 1) * fraction_at(fractions, batch, 0.0)
    }

    /// The shares of layer `l`'s forward and backward at slices of `batch`
    /// that grow with the routed experts a GPU holds (0 and 0 for a layer
    /// without experts, or a profile that does not say).
    pub fn experts_held_shares(&self, l: usize, batch: u32) -> (f64, f64) {
        let [fwd, bwd] = &self.experts_held_fractions[l];
        (fraction_at(fwd, batch, 0.0), fraction_at(bwd, batch, 0.0))
    }

    /// Per sample, what selective re-computation does not keep of layer `layer`.
    pub fn selective_stored_bytes_per_sample_of_layer(&self, layer: usize) -> f64 {
        self.selective_stored_per_sample[layer]
    }

    /// Some layer has something to re-run selectively.
    pub fn recomputes_selectively(&self) -> bool {
        self.selective_stored_per_sample.iter().any(|&b| b > 0.0)
    }

    /// The share of the backward of layers `start..end` that is their
    /// weight gradient (W; the rest, the input gradient I, is what the
    /// stage before waits for), on `times` (any GPU type, at slices of
    /// `batch`): each layer's share weighted by its backward time.
    pub fn weight_gradient_ratio(
        &self,
        times: &TimePrefix,
        start: usize,
        end: usize,
        batch: u32,
    ) -> f64 {
        weighted_share(
            |a, b| times.bwd(a, b),
            &self.weight_fractions,
            (start, end),
            batch,
        )
    }

    /// What a re-computed stage of layers `start..end` keeps per sample of
    /// a micro-batch in flight: its input, and what the loss keeps outside
    /// the checkpoint where the stage ends with it.
    pub fn recompute_kept_bytes_per_sample(&self, start: usize, end: usize) -> f64 {
        self.cut_bytes_per_sample(start) + self.loss_stored_bytes_per_sample_of_layer(end - 1)
    }

    /// Per sample, what the loss keeps outside a re-computed stage ending at `layer`.
    pub fn loss_stored_bytes_per_sample_of_layer(&self, layer: usize) -> f64 {
        self.loss_stored_per_sample[layer]
    }

    /// Per sample, what layer `layer`'s backward needs on top when it runs
    /// after the loss's own backward has finished and freed what the loss
    /// kept: its working memory without the loss's share (the same as
    /// [`LayerCosts::backward_working_bytes_per_sample_of_layer`] for a
    /// layer without the loss).
    pub fn rerun_working_bytes_per_sample_of_layer(&self, layer: usize) -> f64 {
        (self.backward_working_bytes_per_sample_of_layer(layer)
            - self.loss_stored_bytes_per_sample_of_layer(layer))
        .max(0.0)
    }

    /// What the backward of a re-computed stage of layers `start..end`
    /// needs on top of what its micro-batch kept
    /// ([`LayerCosts::recompute_kept_bytes_per_sample`]), at its peak, for
    /// a slice of `slice` samples ([`recompute_backward_bytes`]).
    pub fn recompute_backward_bytes(&self, start: usize, end: usize, slice: u32) -> f64 {
        let samples = f64::from(slice);
        let rerun_working = (start..end)
            .map(|l| samples * self.rerun_working_bytes_per_sample_of_layer(l))
            .fold(0.0, f64::max);
        recompute_backward_bytes(
            self.backward_working_bytes(start, end, slice),
            self.rerun_bytes(start, end, slice),
            rerun_working,
            samples * self.loss_stored_bytes_per_sample_of_layer(end - 1),
        )
    }

    /// What the backward of a re-computed stage of layers `start..end`
    /// brings back for a slice of `slice` samples: what a micro-batch keeps
    /// in flight without re-computation, less what the loss keeps outside
    /// the checkpoint.
    pub fn rerun_bytes(&self, start: usize, end: usize, slice: u32) -> f64 {
        self.in_flight_bytes(start, end, slice)
            - f64::from(slice) * self.loss_stored_bytes_per_sample_of_layer(end - 1)
    }

    /// Autocast's weight copies of layers `start..end`, per micro-batch.
    pub fn weight_copy_bytes(&self, start: usize, end: usize) -> f64 {
        self.weight_copy_prefix[end] - self.weight_copy_prefix[start]
    }

    /// What the backward of a slice of `slice` samples needs on top of what
    /// the GPU holds, at its peak: the largest of layers `start..end`'s (one
    /// layer's backward runs at a time, and frees its temporaries).
    pub fn backward_working_bytes(&self, start: usize, end: usize, slice: u32) -> f64 {
        if end <= start {
            return 0.0;
        }
        f64::from(slice) * self.working_per_sample.over(start, end)
    }

    /// Per-sample [`LayerCosts::backward_working_bytes`] of one layer.
    pub fn backward_working_bytes_per_sample_of_layer(&self, layer: usize) -> f64 {
        self.working_per_sample.over(layer, layer + 1)
    }

    /// Bytes per sample crossing the cut just before layer `position`.
    pub fn cut_bytes_per_sample(&self, position: usize) -> f64 {
        self.cut_per_sample[position]
    }

    /// Weights, gradients and optimizer state, in bytes, for a layer range.
    pub fn model_state_bytes(&self, start: usize, end: usize) -> f64 {
        self.param_bytes(start, end) * self.state_per_param_byte
    }

    /// [`LayerCosts::model_state_bytes`] with the master weights and
    /// optimizer state divided among `sharers` replicas (ZeRO-1; 1: none).
    pub fn model_state_bytes_sharded(&self, start: usize, end: usize, sharers: u32) -> f64 {
        self.held_model_state_bytes(start, end, sharers, 1.0)
    }

    /// [`LayerCosts::model_state_bytes_sharded`] of a GPU that holds
    /// `held` of the layers' parameters (expert parallelism leaves it its
    /// share of the routed experts): its weights and gradients, and
    /// unsharded its optimizer state, scaled by it; sharded, the optimizer
    /// state is 1/`sharers` of the whole layers', as the GPUs that hold
    /// the same experts shard theirs among themselves.
    pub fn held_model_state_bytes(&self, start: usize, end: usize, sharers: u32, held: f64) -> f64 {
        let params = self.param_bytes(start, end);
        if sharers <= 1 {
            return held * params * self.state_per_param_byte;
        }
        let optimizer = params * self.optimizer_per_param_byte;
        held * (params * self.state_per_param_byte - optimizer)
            + self.held_optimizer_state_bytes(start, end, sharers, held)
    }

    /// Of [`LayerCosts::held_model_state_bytes`], the master weights and
    /// optimizer state alone: what an offloaded stage keeps in host memory.
    pub fn held_optimizer_state_bytes(
        &self,
        start: usize,
        end: usize,
        sharers: u32,
        held: f64,
    ) -> f64 {
        let optimizer = self.param_bytes(start, end) * self.optimizer_per_param_byte;
        if sharers <= 1 {
            held * optimizer
        } else {
            optimizer / f64::from(sharers)
        }
    }

    /// Bytes of gradients per byte of weights.
    pub fn gradient_per_weight_byte(&self) -> f64 {
        self.gradient_per_param_byte
    }

    /// Bytes of one parameter as `param_bytes` counts them.
    pub fn weight_bytes_per_param(&self) -> f64 {
        self.weight_bytes_per_param
    }

    /// Gradient bytes per byte of weights: what ZeRO-1's all-gather of the
    /// weights costs against its reduce-scatter of the gradients.
    pub fn weights_per_gradient_byte(&self) -> f64 {
        1.0 / self.gradient_per_param_byte
    }

    /// Layer `layer`'s shard at split degree `t`: its least-communication
    /// pattern that `t` can split, if any.
    pub fn shard(
        &self,
        layer: usize,
        t: u32,
        sequence_parallel: bool,
    ) -> Option<crate::model::split::ShardCost> {
        crate::model::split::cheapest(&self.split[layer], t).map(|p| p.shard(t, sequence_parallel))
    }

    /// [`LayerCosts::shard`] with its compute at micro-batch size `batch`
    /// (`SplitPattern::shard_at`): what a stage's cost reads.
    pub fn shard_at(
        &self,
        layer: usize,
        t: u32,
        sequence_parallel: bool,
        batch: u32,
    ) -> Option<crate::model::split::ShardCost> {
        crate::model::split::cheapest(&self.split[layer], t)
            .map(|p| p.shard_at(t, sequence_parallel, batch))
    }

    /// The routed experts of layer `layer`, if it has any.
    pub fn experts(&self, layer: usize) -> Option<&ExpertPattern> {
        self.experts[layer].as_ref()
    }

    /// Whether some layer's experts exchange their tokens deduplicated
    /// (`TokenDispatcher::DeepEp`), which prices where expert groups sit.
    pub fn deduplicates_tokens(&self) -> bool {
        self.deduplicates_tokens
    }

    /// Whether some layer of `start..end` has routed experts.
    pub fn has_experts(&self, start: usize, end: usize) -> bool {
        self.expert_layer_prefix[end] > self.expert_layer_prefix[start]
    }

    /// The expert degrees (at least 2) every layer with experts allows:
    /// the divisors of their expert counts' greatest common divisor.
    /// Empty where no layer has experts.
    pub fn expert_degrees(&self) -> Vec<u32> {
        let gcd = |mut a: u32, mut b: u32| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        let common = self.experts.iter().flatten().map(|p| p.count).fold(0, gcd);
        // Counted to the common count (hundreds at most), not with
        // `cost::divisors`: `cost` reads this module.
        (2..=common).filter(|e| common.is_multiple_of(*e)).collect()
    }

    /// How layer `layer`'s sequence may be cut (context parallelism), if it may.
    pub fn context(&self, layer: usize) -> Option<&ContextPattern> {
        self.context[layer].as_ref()
    }

    /// Whether layer `layer` may run at context degree `c`: always at 1;
    /// above, where its pattern cuts the sequence into 2c chunks.
    pub fn context_runs_at(&self, layer: usize, c: u32) -> bool {
        c == 1 || self.context(layer).is_some_and(|p| p.allows(c))
    }

    /// The context degrees (at least 2, at most `max`) the search weighs,
    /// ascending, where some layer with attention has a sequence of at
    /// least `MIN_SEARCHED_SEQUENCE_TOKENS`: a stage takes one where all
    /// its layers may (`context_runs_at`). Empty where no layer has a
    /// pattern with keys and values to pass.
    pub fn context_degrees(&self, max: u32) -> Vec<u32> {
        let attends = |p: &&ContextPattern| {
            p.kv_bytes_per_sample > 0.0
                && p.sequence_length >= crate::model::context::MIN_SEARCHED_SEQUENCE_TOKENS
        };
        let Some(pattern) = self.context.iter().flatten().find(attends) else {
            return Vec::new();
        };
        (2..=max).filter(|&c| pattern.allows(c)).collect()
    }

    /// Some layer's pattern at degree `t` runs with sequence parallelism.
    pub fn sequence_parallel_at(&self, t: u32) -> bool {
        (0..self.num_layers).any(|l| {
            crate::model::split::cheapest(&self.split[l], t).is_some_and(|p| p.sequence_parallel)
        })
    }

    /// The sharding patterns of layer `layer`.
    pub fn split_patterns(&self, layer: usize) -> &[SplitPattern] {
        &self.split[layer]
    }

    /// Whether some layer can split (the profile gives it a pattern).
    pub fn splits_any(&self) -> bool {
        self.split.iter().any(|patterns| !patterns.is_empty())
    }

    /// Bytes of a layer range's gradients, as replicas reduce them.
    pub fn gradient_bytes(&self, start: usize, end: usize) -> f64 {
        self.param_bytes(start, end) * self.gradient_per_param_byte
    }
}

#[cfg(test)]
pub(crate) use tests::{chain_profile, profile_of_layers, profile_with_memory_terms};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_optimizer_step_moves_its_state_twice_and_the_gradient_once() {
        // Mixed precision: the bf16 gradient read, the fp32 master weights
        // and two moments read and written, the bf16 weights written.
        let mixed = ParameterState {
            weight_bytes: 2.0,
            gradient_bytes: 2.0,
            master_weight_bytes: 4.0,
            optimizer_bytes: 8.0,
        };
        assert_eq!(mixed.step_bytes(), 2.0 + 2.0 * 12.0 + 2.0);
        // Under autocast the fp32 weights are the ones updated: no copy.
        assert_eq!(
            ParameterState::autocast("adam").unwrap().step_bytes(),
            4.0 + 2.0 * 12.0
        );
        assert_eq!(
            ParameterState::autocast("sgd").unwrap().step_bytes(),
            4.0 + 2.0 * 4.0
        );
    }

    #[test]
    fn a_gpu_steps_its_share_of_the_optimizer() {
        // 10 ms over 4000 parameter bytes: a GPU holding the second layer's
        // 3000 takes 7.5 ms, one holding half of it (split in two) 3.75.
        let mut p = profile_of_layers("opt", &[(1.0, 2.0, 1000, 100), (1.0, 2.0, 3000, 100)], 4);
        assert_eq!(LayerCosts::new(&p).optimizer_step_ms(3000.0), 0.0);
        p.optimizer_step_ms = Some(10.0);
        let layers = LayerCosts::new(&p);
        assert_eq!(layers.optimizer_step_ms(3000.0), 7.5);
        assert_eq!(layers.optimizer_step_ms(1500.0), 3.75);
        p.optimizer_step_ms = Some(-1.0);
        assert_eq!(
            p.validate().unwrap_err().field.as_deref(),
            Some("optimizer_step_ms")
        );
    }

    #[test]
    fn a_recomputed_backward_peaks_at_the_larger_of_its_two_moments() {
        // GPT 4 x 256, sequence 256, batch 8 on the CPU, in MiB as torch's
        // MemTracker measured one step re-computing the whole model: the
        // blocks store 129.3 and the head 36 (32 of them the loss's
        // log-probabilities); the head's backward needs 64 with the loss's
        // gradients, a block's 9. Before the re-run the loss's backward
        // needs 64 over what was kept; after it, the 133.3 re-run with the
        // head's 64 less the loss's 32 on them, the loss's 32 gone.
        assert_eq!(recompute_backward_bytes(64.0, 133.3, 32.0, 32.0), 133.3);
        // Small blocks: the loss's moment is the larger.
        assert_eq!(recompute_backward_bytes(64.0, 10.0, 32.0, 32.0), 64.0);
        // No loss on the stage: all it stored, and the working memory on top.
        assert_eq!(recompute_backward_bytes(9.0, 129.0, 9.0, 0.0), 138.0);
        // From a profile: the same two moments, layer by layer. Batch 4;
        // the last layer stores 800 (400 of them the loss's) and needs 600
        // (the loss's 400 and 200 of its own); the first stores 1200 and
        // needs 80.
        let mut p = profile_of_layers("rc", &[(1.0, 2.0, 1000, 100), (1.0, 2.0, 1000, 100)], 4);
        for (layer, (stored, working)) in p.layers.iter_mut().zip([(1200, 80), (800, 600)]) {
            layer.measurements[0].stored_activation_bytes = Some(stored);
            layer.measurements[0].backward_working_bytes = Some(working);
        }
        p.layers[1].measurements[0].loss_stored_bytes = Some(400);
        let layers = LayerCosts::new(&p);
        assert_eq!(layers.rerun_working_bytes_per_sample_of_layer(1), 50.0);
        assert_eq!(layers.rerun_working_bytes_per_sample_of_layer(0), 20.0);
        // Slice 4: max(600, (2000 - 400) + 200 - 400) = 1400.
        assert_eq!(layers.recompute_backward_bytes(0, 2, 4), 1400.0);
        // Without the loss's layer: 1200 re-run, 80 on top.
        assert_eq!(layers.recompute_backward_bytes(0, 1, 4), 1280.0);
        // The last layer alone: the loss's moment, max(600, 400 + 200 - 400).
        assert_eq!(layers.recompute_backward_bytes(1, 2, 4), 600.0);
    }

    #[test]
    fn a_recomputed_stage_reruns_all_but_the_last_layers_tail() {
        // Forwards of 1 and 3 ms at batch 4; the last layer re-runs a
        // quarter of its forward (0.75 ms) when it ends a re-computed stage,
        // and its loss keeps 400 bytes (100 a sample) outside the checkpoint.
        let mut p = profile_of_layers("rc", &[(1.0, 2.0, 1000, 100), (3.0, 2.0, 1000, 100)], 4);
        p.layers[1].measurements[0].recompute_fwd_ms = Some(0.75);
        p.layers[1].measurements[0].loss_stored_bytes = Some(400);
        // At batch 8 it re-runs three quarters (9 of 12 ms; the other
        // layer's forward 2, nothing measured): 6 ms at 6, between the two.
        for l in &mut p.layers {
            let mut at_8 = l.measurements[0].clone();
            (at_8.batch_size, at_8.fwd_ms) = (8, 4.0 * l.measurements[0].fwd_ms);
            at_8.recompute_fwd_ms = at_8.recompute_fwd_ms.map(|_| 9.0);
            at_8.activation_bytes *= 2;
            at_8.loss_stored_bytes = at_8.loss_stored_bytes.map(|b| 2 * b);
            l.measurements.push(at_8);
        }
        let layers = LayerCosts::new(&p);
        let times = layers.times_at(4);
        // Both layers: (1 + 0.75) / 4 of the forward.
        assert_eq!(layers.rerun_ratio(&times, 0, 2, 4), 0.4375);
        // At 6 (between 4 and 8) the last layer re-runs half; below 4 and
        // above 8 the nearest measured share.
        assert_eq!(layers.rerun_ratio(&times, 0, 2, 6), 2.5 / 4.0);
        assert_eq!(layers.rerun_ratio(&times, 0, 2, 1), 0.4375);
        assert_eq!(layers.rerun_ratio(&times, 0, 2, 64), 3.25 / 4.0);
        // The first alone re-runs all of its forward (nothing measured).
        assert_eq!(layers.rerun_ratio(&times, 0, 1, 4), 1.0);
        // A checkpoint whose own work outweighs what it leaves: 3.6 ms
        // re-run of a 3 ms forward, 0.6 ms more than the forward.
        p.layers[1].measurements[0].recompute_fwd_ms = Some(3.6);
        let layers = LayerCosts::new(&p);
        assert!((layers.rerun_ratio(&times, 0, 2, 4) - 4.6 / 4.0).abs() < 1e-12);
        // Kept per sample: the stage's input (25 bytes), and the loss's 100.
        assert_eq!(layers.recompute_kept_bytes_per_sample(1, 2), 125.0);
        assert_eq!(layers.recompute_kept_bytes_per_sample(0, 1), 0.0);
        p.layers[1].measurements[0].recompute_fwd_ms = Some(f64::NAN);
        assert_eq!(
            p.validate().unwrap_err().field.as_deref(),
            Some("layers[1].measurements[0].recompute_fwd_ms")
        );
    }

    #[test]
    fn a_backward_splits_as_measured_or_in_halves_where_the_layer_has_weights() {
        let mut p = profile_of_layers("zb", &[(1.0, 2.0, 1000, 100), (3.0, 4.0, 1000, 100)], 4);
        p.layers[0].param_bytes = 0;
        p.layers[1].measurements[0].bwd_weight_ms = Some(1.5);
        assert_eq!(p.layers[0].backward_splits(), [(4, 2.0, 0.0)]);
        assert_eq!(p.layers[1].backward_splits(), [(4, 2.5, 1.5)]);
        p.layers[1].measurements[0].bwd_weight_ms = None;
        assert_eq!(p.layers[1].backward_splits(), [(4, 2.0, 2.0)]);
        p.layers[1].measurements[0].bwd_weight_ms = Some(4.5);
        assert_eq!(
            p.validate().unwrap_err().field.as_deref(),
            Some("layers[1].measurements[0].bwd_weight_ms")
        );
    }

    #[test]
    fn a_stages_weight_gradient_share_weighs_each_layers_by_its_backward() {
        // Layer 0 has no weights (W = 0 of 2 ms), layer 1 measured W = 1.5
        // of 4 ms, layer 2 has weights and no measurement (half of 6 ms),
        // all at batch 4; at batch 8 layer 1's W is 5 of 8 ms.
        let mut p = profile_of_layers(
            "zb",
            &[
                (1.0, 2.0, 1000, 100),
                (3.0, 4.0, 1000, 100),
                (1.0, 6.0, 1000, 100),
            ],
            4,
        );
        p.layers[0].param_bytes = 0;
        p.layers[1].measurements[0].bwd_weight_ms = Some(1.5);
        for layer in &mut p.layers {
            let mut at_8 = layer.measurements[0].clone();
            at_8.batch_size = 8;
            at_8.scale_times(2.0);
            layer.measurements.push(at_8);
        }
        p.layers[1].measurements[1].bwd_weight_ms = Some(5.0);
        p.validate().unwrap();
        let costs = LayerCosts::new(&p);
        let times = costs.times_at(4);
        let ratio = |s, e, b| costs.weight_gradient_ratio(&times, s, e, b);
        assert_eq!(ratio(0, 1, 4), 0.0);
        assert!((ratio(0, 3, 4) - (1.5 + 3.0) / 12.0).abs() < 1e-12);
        // Between measured sizes the share is linear: 0.375 at 4, 0.625 at 8.
        assert!((ratio(1, 2, 6) - 0.5).abs() < 1e-12);
        assert_eq!(ratio(2, 2, 4), 0.0);
    }

    #[test]
    fn scaled_times_keep_the_shares_of_re_run_and_weight_gradient() {
        let mut p = profile_of_layers("cal", &[(2.0, 4.0, 1000, 100)], 4);
        let m = &mut p.layers[0].measurements[0];
        (m.recompute_fwd_ms, m.bwd_weight_ms) = (Some(1.0), Some(3.0));
        m.scale_times(0.5);
        assert_eq!(
            (m.fwd_ms, m.bwd_ms, m.recompute_fwd_ms, m.bwd_weight_ms),
            (1.0, 2.0, Some(0.5), Some(1.5))
        );
        p.validate().unwrap();
    }

    pub(crate) fn chain_profile(times: &[(f64, f64)], batch: u32) -> Profile {
        let layers: Vec<(f64, f64, u64, u64)> = times
            .iter()
            .map(|&(f, b)| (f, b, 1000, 100 * u64::from(batch)))
            .collect();
        profile_of_layers("test", &layers, batch)
    }

    /// Two layers measured at batch 4: 1000 and 3000 parameter bytes (fp32:
    /// 250 and 750 parameters), keeping 400 and 800 bytes for backward,
    /// their backwards needing 80 and 40 bytes on top; the second's weights
    /// cast by autocast to bf16 (750 x 2 bytes). The memory terms' literal
    /// cases.
    pub(crate) fn profile_with_memory_terms() -> Profile {
        let mut p = profile_of_layers("terms", &[(1.0, 2.0, 1000, 100), (1.0, 2.0, 3000, 100)], 4);
        for (layer, (stored, working)) in p.layers.iter_mut().zip([(400, 80), (800, 40)]) {
            layer.measurements[0].stored_activation_bytes = Some(stored);
            layer.measurements[0].backward_working_bytes = Some(working);
        }
        p.layers[1].weight_copy_bytes = Some(1500);
        p
    }

    /// A chain of layers (fwd ms, bwd ms, parameter bytes, activation bytes)
    /// measured at batch size `batch`, named l0, l1, ...
    pub(crate) fn profile_of_layers(
        model: &str,
        layers: &[(f64, f64, u64, u64)],
        batch: u32,
    ) -> Profile {
        Profile {
            optimizer_step_ms: None,
            optimizer_step_bytes: None,
            dtype: None,
            allocator_reserved_factor: None,
            format: PROFILE.name.into(),
            schema_version: PROFILE.version,
            model: model.into(),
            source: None,
            device: None,
            optimizer: "adam".into(),
            other_devices: Vec::new(),
            parameter_state: None,
            model_flops_per_sample: None,
            layers: layers
                .iter()
                .enumerate()
                .map(
                    |(i, &(fwd_ms, bwd_ms, param_bytes, activation_bytes))| Layer {
                        weight_copy_bytes: None,
                        name: format!("l{i}"),
                        kind: None,
                        param_bytes,
                        inputs: None,
                        measurements: vec![Measurement {
                            backward_working_bytes: None,
                            recompute_fwd_ms: None,
                            selective_stored_bytes: None,
                            selective_recompute_ms: None,
                            experts_held_fwd_ms: None,
                            experts_held_bwd_ms: None,
                            bwd_weight_ms: None,
                            loss_stored_bytes: None,
                            batch_size: batch,
                            fwd_ms,
                            bwd_ms,
                            activation_bytes,
                            stored_activation_bytes: None,
                        }],
                        split: Vec::new(),
                        experts: None,
                        context: None,
                    },
                )
                .collect(),
        }
    }

    #[test]
    fn json_round_trip_keeps_everything() {
        let p = chain_profile(&[(1.0, 2.0), (3.0, 4.0)], 2);
        let back = Profile::from_json(&p.to_json()).unwrap();
        assert_eq!(p, back);
        assert_eq!(p.sha256(), back.sha256());
    }

    #[test]
    fn a_key_given_twice_is_refused_by_field() {
        let text = chain_profile(&[(1.0, 2.0)], 2).to_json();
        let twice = text.replacen("\"fwd_ms\": 1.0,", "\"fwd_ms\": 1.0, \"fwd_ms\": 9.0,", 1);
        assert_ne!(text, twice);
        let e = Profile::from_json(&twice).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("layers[0].measurements[0]"));
        assert!(
            e.message.contains("duplicate field `fwd_ms`"),
            "{}",
            e.message
        );
        let top = text.replacen(
            "\"model\": \"test\",",
            "\"model\": \"test\", \"model\": \"x\",",
            1,
        );
        let e = Profile::from_json(&top).unwrap_err();
        assert!(
            e.message.contains("duplicate field `model`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn unknown_version_is_rejected_by_name() {
        let p = chain_profile(&[(1.0, 2.0)], 2);
        let text = p
            .to_json()
            .replace("\"schema_version\": 1", "\"schema_version\": 7");
        let e = Profile::from_json(&text).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("schema_version"));
        assert!(e.message.contains("value 7"), "{e}");
    }

    #[test]
    fn negative_time_names_the_field_and_value() {
        let mut p = chain_profile(&[(1.0, 2.0), (3.0, 4.0)], 2);
        p.layers[1].measurements[0].bwd_ms = -4.0;
        let e = Profile::from_json(&p.to_json()).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("layers[1].measurements[0].bwd_ms"));
        assert!(e.message.contains("-4"), "{e}");
    }

    #[test]
    fn missing_field_is_reported_with_its_path() {
        let p = chain_profile(&[(1.0, 2.0)], 2);
        let text = p.to_json().replace("\"fwd_ms\": 1.0,", "");
        let e = Profile::from_json(&text).unwrap_err();
        assert!(e.to_string().contains("fwd_ms"), "{e}");
        assert!(e.to_string().contains("layers[0].measurements[0]"), "{e}");
    }

    #[test]
    fn interpolates_between_and_scales_outside_measurements() {
        let mut p = chain_profile(&[(0.0, 0.0)], 2);
        p.layers[0].measurements = vec![
            Measurement {
                backward_working_bytes: None,
                recompute_fwd_ms: None,
                selective_stored_bytes: None,
                selective_recompute_ms: None,
                experts_held_fwd_ms: None,
                experts_held_bwd_ms: None,
                bwd_weight_ms: None,
                loss_stored_bytes: None,
                batch_size: 2,
                fwd_ms: 4.0,
                bwd_ms: 8.0,
                activation_bytes: 20,
                stored_activation_bytes: None,
            },
            Measurement {
                backward_working_bytes: None,
                recompute_fwd_ms: None,
                selective_stored_bytes: None,
                selective_recompute_ms: None,
                experts_held_fwd_ms: None,
                experts_held_bwd_ms: None,
                bwd_weight_ms: None,
                loss_stored_bytes: None,
                batch_size: 4,
                fwd_ms: 6.0,
                bwd_ms: 10.0,
                activation_bytes: 40,
                stored_activation_bytes: None,
            },
        ];
        let c = LayerCosts::new(&p);
        assert_eq!(c.times_at(3).fwd(0, 1), 5.0);
        assert_eq!(c.times_at(8).fwd(0, 1), 12.0);
        assert_eq!(c.times_at(1).bwd(0, 1), 4.0);
    }

    #[test]
    fn other_devices_time_the_same_layers() {
        use super::{DeviceTimes, LayerTimes, TimeMeasurement};
        let mut p = chain_profile(&[(1.0, 2.0), (3.0, 4.0)], 2);
        let times = |name: &str, batch: u32, fwd_ms: f64| LayerTimes {
            name: name.into(),
            measurements: vec![TimeMeasurement {
                batch_size: batch,
                fwd_ms,
                bwd_ms: 1.0,
            }],
        };
        p.other_devices = vec![DeviceTimes {
            device: "P100".into(),
            source: None,
            layers: vec![times("l0", 4, 2.0), times("l1", 4, 5.0)],
        }];
        let field = |p: &Profile| p.validate().unwrap_err().field.unwrap();
        // The profile must name its own device.
        assert_eq!(field(&p), "device");
        p.device = Some("V100".into());
        p.validate().unwrap();
        // Another device's batch sizes may differ from the profile's.
        let costs = LayerCosts::new(&p);
        assert_eq!(costs.devices(), vec![Some("V100"), Some("P100")]);
        assert_eq!(costs.times_on(1, 2).fwd(0, 2), 3.5);
        assert_eq!(costs.times_on(0, 2).fwd(0, 2), 4.0);
        let mut bad = p.clone();
        bad.other_devices[0].layers[1].name = "other".into();
        assert_eq!(field(&bad), "other_devices[0].layers[1].name");
        let mut bad = p.clone();
        bad.other_devices[0].layers.pop();
        assert_eq!(field(&bad), "other_devices[0].layers");
        let mut bad = p.clone();
        bad.other_devices[0].device = "V100".into();
        assert_eq!(field(&bad), "other_devices[0].device");
        let mut bad = p.clone();
        bad.other_devices[0].layers[0].measurements[0].fwd_ms = -1.0;
        assert_eq!(
            field(&bad),
            "other_devices[0].layers[0].measurements[0].fwd_ms"
        );
        let mut bad = p.clone();
        bad.other_devices[0].layers[1].measurements[0].batch_size = 8;
        assert_eq!(field(&bad), "other_devices[0].layers[1].measurements");
        // Round trip.
        assert_eq!(Profile::from_json(&p.to_json()).unwrap(), p);
    }

    #[test]
    fn profiles_of_one_model_merge_into_one_with_several_devices() {
        let mut v100 = chain_profile(&[(1.0, 2.0), (3.0, 4.0)], 2);
        v100.device = Some("V100".into());
        let mut p100 = chain_profile(&[(2.0, 4.0), (5.0, 9.0)], 2);
        p100.device = Some("P100".into());
        let merged = v100.with_times_of(&p100).unwrap();
        assert_eq!(merged.layers, v100.layers);
        let costs = LayerCosts::new(&merged);
        assert_eq!(costs.times_on(1, 2).bwd(0, 2), 13.0);
        // Merging what is already there, or another model, is refused by field.
        let field = |r: Result<Profile>| r.unwrap_err().field.unwrap();
        assert_eq!(field(merged.with_times_of(&p100)), "device");
        let base = chain_profile(&[(1.0, 1.0)], 2).check_merge_base();
        assert_eq!(base.unwrap_err().field.as_deref(), Some("device"));
        let mut other = p100.clone();
        other.layers[1].param_bytes += 1;
        assert_eq!(field(v100.with_times_of(&other)), "layers[1].param_bytes");
        other.device = None;
        assert_eq!(field(v100.with_times_of(&other)), "device");
    }

    #[test]
    fn cut_carries_every_crossing_tensor() {
        // 0 -> 1 -> 2 -> 3 with a skip edge 0 -> 3.
        let mut p = chain_profile(&[(1.0, 1.0); 4], 1);
        p.layers[3].inputs = Some(vec![2, 0]);
        let c = LayerCosts::new(&p);
        assert_eq!(c.cut_bytes_per_sample(1), 100.0); // output of 0
        assert_eq!(c.cut_bytes_per_sample(2), 200.0); // outputs of 0 and 1
        assert_eq!(c.cut_bytes_per_sample(3), 200.0); // outputs of 0 and 2
    }
}
