//! Whale's `split` as a profile states it: the ways a layer can be sharded
//! over t GPUs (tensor parallelism) and what each way costs.
//!
//! A layer lists its sharding patterns; a layer with none is never split.
//! Every pattern divides the layer's compute, and the parameters and stored
//! activations it does not keep whole, by t, and adds AllReduces of whole
//! tensors inside the t GPUs: Megatron's transformer block is columns then
//! rows (2 AllReduces of the block's output forward, 2 backward); a
//! vocabulary-split LM head or classifier with a distributed softmax
//! (Whale's SP1) reduces two numbers per token forward and the input's
//! gradient backward; splitting the classifier's input dimension instead
//! (SP2) reduces the whole logits forward. Where several patterns apply, the
//! one that moves the least is used (`cheapest`), as Whale's planner picks.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitPattern {
    /// What the pattern is, for people: "megatron-block", "SP1", ...
    pub name: String,
    /// Counts the split degree must divide, by what they count: attention
    /// heads, KV heads, vocabulary entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub divides: Vec<Divisor>,
    /// Bytes per sample of the AllReduces inside the t GPUs in the forward
    /// pass, summed (whole tensors: they do not shrink with t).
    pub fwd_allreduce_bytes_per_sample: f64,
    /// The same in the backward pass.
    pub bwd_allreduce_bytes_per_sample: f64,
    /// How many AllReduces of equal size each pass's bytes are (Megatron's
    /// block: 2), as the collective's speed depends on a call's size.
    #[serde(default = "one_call", skip_serializing_if = "is_one_call")]
    pub allreduce_calls_per_pass: u32,
    /// Share of the layer's parameter bytes every shard keeps whole (layer
    /// norms); the rest is divided by t.
    #[serde(default)]
    pub replicated_param_fraction: f64,
    /// Share of the layer's stored activations every shard keeps whole
    /// (the inputs of layer norms); the rest is divided by t.
    #[serde(default)]
    pub replicated_stored_fraction: f64,
    /// Share of the layer's time every shard spends whole (operators the
    /// split does not divide: norms, residual adds); the rest is divided
    /// by t. A generated profile computes it from its operators.
    #[serde(default)]
    pub replicated_compute_fraction: f64,
    /// The pattern may run with sequence parallelism (Korthikanti et al.,
    /// arXiv 2205.05198): the operators every shard would run whole run on
    /// 1/t of the sequence, so the replicated compute and stored shares
    /// are divided by t too, as is the layer's input, and each AllReduce
    /// becomes a reduce-scatter and an all-gather of the same tensor.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
    /// One shard's time over the whole layer's, timed at the shard's own
    /// shapes, by split degree and micro-batch size (`ShardCompute`):
    /// where a degree has entries they replace the rule of the replicated
    /// share (a shard's products are narrower and run below the whole
    /// layer's rate; the kernels it launches do not shrink with t). A
    /// generated profile writes them; a measured one may.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shard_compute: Vec<ShardCompute>,
}

/// A shard's compute at one split degree and micro-batch size, over the
/// whole layer's at that size (forward and backward together), without
/// and with sequence parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardCompute {
    pub degree: u32,
    pub batch_size: u32,
    pub factor: f64,
    /// With the operators every shard would run whole on 1/t of the
    /// sequence (the pattern's `sequence_parallel`); as `factor` where the
    /// pattern has none.
    pub sequence_parallel_factor: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Divisor {
    /// What is counted, as users say it: "attention heads".
    pub what: String,
    pub count: u64,
}

/// What one shard of a layer holds and moves at a split degree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardCost {
    /// Multiplies the layer's forward and backward time.
    pub compute_factor: f64,
    /// Multiplies its parameter bytes.
    pub param_factor: f64,
    /// Multiplies its stored activation bytes.
    pub stored_factor: f64,
    pub fwd_allreduce_bytes_per_sample: f64,
    pub bwd_allreduce_bytes_per_sample: f64,
    /// AllReduces each pass's bytes are split into.
    pub allreduce_calls_per_pass: u32,
    /// Under sequence parallelism each AllReduce is a reduce-scatter and an
    /// all-gather of the same tensor.
    pub scatter_gather: bool,
    /// Bytes per sample the backward gathers again (sequence parallelism:
    /// the forward's gathered inputs, which Megatron-LM does not keep), in
    /// as many all-gathers as a pass has AllReduces.
    pub bwd_regather_bytes_per_sample: f64,
    /// Multiplies the layer's input as one shard holds it: 1, or 1/t
    /// under sequence parallelism (the input is split along the sequence).
    pub input_factor: f64,
}

fn one_call() -> u32 {
    1
}

fn is_one_call(calls: &u32) -> bool {
    *calls == 1
}

impl ShardCost {
    /// A layer that is not split: all of it on every GPU, nothing moved.
    pub const WHOLE: ShardCost = ShardCost {
        compute_factor: 1.0,
        param_factor: 1.0,
        stored_factor: 1.0,
        fwd_allreduce_bytes_per_sample: 0.0,
        bwd_allreduce_bytes_per_sample: 0.0,
        allreduce_calls_per_pass: 1,
        scatter_gather: false,
        bwd_regather_bytes_per_sample: 0.0,
        input_factor: 1.0,
    };
}

impl SplitPattern {
    /// Whether the pattern can shard over `degree` GPUs.
    pub fn allows(&self, degree: u32) -> bool {
        self.divides
            .iter()
            .all(|d| d.count % u64::from(degree) == 0)
    }

    /// The first count `degree` does not divide, for an error.
    pub fn refusal(&self, degree: u32) -> Option<&Divisor> {
        self.divides
            .iter()
            .find(|d| !d.count.is_multiple_of(u64::from(degree)))
    }

    /// One shard's share at `degree` (at least 2), with sequence
    /// parallelism where `sequence_parallel` asks for it and the pattern
    /// allows it. A reduce-scatter and an all-gather move what the ring
    /// AllReduce they replace moves (NCCL's ring AllReduce is the two in
    /// turn; Korthikanti et al., Section 4.2.2), each at its own measured
    /// speed (`cost::Collective`); and the backward gathers again what the
    /// forward gathered (the inputs of the column-parallel products, which
    /// Megatron-LM does not keep: Korthikanti et al., Section 4.2.3), half
    /// the forward's volume more, exposed as the rest.
    ///
    /// Its compute is the least the pattern's `shard_compute` gives at this
    /// degree over every micro-batch size (a floor the search may bound
    /// by), or the rule of the replicated share where it gives none; the
    /// cost of a stage reads it at its own size (`shard_at`).
    pub fn shard(&self, degree: u32, sequence_parallel: bool) -> ShardCost {
        let by_sequence = sequence_parallel && self.sequence_parallel;
        let timed = self
            .shard_compute
            .iter()
            .filter(|c| c.degree == degree)
            .map(|c| c.of(by_sequence))
            .reduce(f64::min);
        self.shard_with(degree, by_sequence, timed)
    }

    /// One shard's share at `degree`, its compute at micro-batch size
    /// `batch`: linear in the size between two timed sizes, the nearest
    /// beyond them (`shard_compute`), or the replicated share's rule.
    pub fn shard_at(&self, degree: u32, sequence_parallel: bool, batch: u32) -> ShardCost {
        let by_sequence = sequence_parallel && self.sequence_parallel;
        let mut below: Option<&ShardCompute> = None;
        let mut above: Option<&ShardCompute> = None;
        for c in self.shard_compute.iter().filter(|c| c.degree == degree) {
            if c.batch_size <= batch && below.is_none_or(|b| c.batch_size > b.batch_size) {
                below = Some(c);
            }
            if c.batch_size >= batch && above.is_none_or(|a| c.batch_size < a.batch_size) {
                above = Some(c);
            }
        }
        let timed = match (below, above) {
            (Some(b), Some(a)) if a.batch_size > b.batch_size => {
                let w = f64::from(batch - b.batch_size) / f64::from(a.batch_size - b.batch_size);
                Some(b.of(by_sequence) + w * (a.of(by_sequence) - b.of(by_sequence)))
            }
            (Some(c), _) | (None, Some(c)) => Some(c.of(by_sequence)),
            (None, None) => None,
        };
        self.shard_with(degree, by_sequence, timed)
    }

    fn shard_with(&self, degree: u32, by_sequence: bool, timed: Option<f64>) -> ShardCost {
        let t = f64::from(degree);
        let kept = |whole: f64| whole + (1.0 - whole) / t;
        let replicated = |whole: f64| if by_sequence { 1.0 / t } else { kept(whole) };
        ShardCost {
            compute_factor: timed.unwrap_or_else(|| replicated(self.replicated_compute_fraction)),
            param_factor: kept(self.replicated_param_fraction),
            stored_factor: replicated(self.replicated_stored_fraction),
            fwd_allreduce_bytes_per_sample: self.fwd_allreduce_bytes_per_sample,
            bwd_allreduce_bytes_per_sample: self.bwd_allreduce_bytes_per_sample,
            allreduce_calls_per_pass: self.allreduce_calls_per_pass,
            scatter_gather: by_sequence,
            bwd_regather_bytes_per_sample: if by_sequence {
                self.fwd_allreduce_bytes_per_sample
            } else {
                0.0
            },
            input_factor: if by_sequence { 1.0 / t } else { 1.0 },
        }
    }

    /// Bytes per sample it moves, forward and backward together: what
    /// `cheapest` compares.
    pub fn allreduce_bytes_per_sample(&self) -> f64 {
        self.fwd_allreduce_bytes_per_sample + self.bwd_allreduce_bytes_per_sample
    }

    pub fn validate(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            return Err(Error::field("name", "must not be empty"));
        }
        if self.allreduce_calls_per_pass == 0 {
            return Err(Error::field(
                "allreduce_calls_per_pass",
                "value 0 must be >= 1",
            ));
        }
        for (k, d) in self.divides.iter().enumerate() {
            if d.count == 0 {
                return Err(Error::field(
                    format!("divides[{k}].count"),
                    "value 0 must be >= 1",
                ));
            }
        }
        let bytes = [
            (
                "fwd_allreduce_bytes_per_sample",
                self.fwd_allreduce_bytes_per_sample,
            ),
            (
                "bwd_allreduce_bytes_per_sample",
                self.bwd_allreduce_bytes_per_sample,
            ),
        ];
        for (field, value) in bytes {
            if !(value.is_finite() && value >= 0.0) {
                return Err(Error::field(
                    field,
                    format!("value {value} must be a finite number >= 0"),
                ));
            }
        }
        let fractions = [
            ("replicated_param_fraction", self.replicated_param_fraction),
            (
                "replicated_stored_fraction",
                self.replicated_stored_fraction,
            ),
            (
                "replicated_compute_fraction",
                self.replicated_compute_fraction,
            ),
        ];
        for (field, value) in fractions {
            if !(0.0..=1.0).contains(&value) {
                return Err(Error::field(
                    field,
                    format!("value {value} must be in [0, 1]"),
                ));
            }
        }
        for (k, c) in self.shard_compute.iter().enumerate() {
            let at = |field: &str| format!("shard_compute[{k}].{field}");
            if c.degree < 2 {
                return Err(Error::field(
                    at("degree"),
                    format!("value {} must be >= 2", c.degree),
                ));
            }
            if c.batch_size == 0 {
                return Err(Error::field(at("batch_size"), "value 0 must be >= 1"));
            }
            for (field, value) in [
                ("factor", c.factor),
                ("sequence_parallel_factor", c.sequence_parallel_factor),
            ] {
                if !(value.is_finite() && value > 0.0) {
                    return Err(Error::field(
                        at(field),
                        format!("value {value} must be a finite number > 0"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl ShardCompute {
    fn of(&self, by_sequence: bool) -> f64 {
        if by_sequence {
            self.sequence_parallel_factor
        } else {
            self.factor
        }
    }
}

/// The pattern of `patterns` that allows `degree` and moves the fewest
/// bytes (the first of equals), if any does.
pub fn cheapest(patterns: &[SplitPattern], degree: u32) -> Option<&SplitPattern> {
    patterns.iter().filter(|p| p.allows(degree)).min_by(|a, b| {
        a.allreduce_bytes_per_sample()
            .total_cmp(&b.allreduce_bytes_per_sample())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(name: &str, fwd: f64, bwd: f64, divides: &[u64]) -> SplitPattern {
        SplitPattern {
            name: name.into(),
            divides: divides
                .iter()
                .map(|&count| Divisor {
                    what: "heads".into(),
                    count,
                })
                .collect(),
            fwd_allreduce_bytes_per_sample: fwd,
            bwd_allreduce_bytes_per_sample: bwd,
            replicated_param_fraction: 0.0,
            replicated_stored_fraction: 0.0,
            replicated_compute_fraction: 0.0,
            allreduce_calls_per_pass: 1,
            sequence_parallel: false,
            shard_compute: Vec::new(),
        }
    }

    #[test]
    fn a_shard_keeps_the_replicated_share_whole_and_a_t_th_of_the_rest() {
        let mut p = pattern("megatron-block", 2.0, 2.0, &[64, 8]);
        p.replicated_param_fraction = 0.25;
        p.replicated_stored_fraction = 0.5;
        let s = p.shard(4, false);
        assert_eq!(
            (s.compute_factor, s.param_factor, s.stored_factor),
            (0.25, 0.25 + 0.75 / 4.0, 0.5 + 0.5 / 4.0)
        );
        // A pattern that does not allow sequence parallelism ignores the request.
        assert_eq!(p.shard(4, true), s);
        assert_eq!(
            (
                s.fwd_allreduce_bytes_per_sample,
                s.bwd_allreduce_bytes_per_sample
            ),
            (2.0, 2.0)
        );
    }

    #[test]
    fn sequence_parallelism_divides_the_replicated_share_and_the_input_too() {
        let mut p = pattern("megatron-block", 2.0, 2.0, &[64, 8]);
        p.replicated_param_fraction = 0.25;
        p.replicated_stored_fraction = 0.5;
        p.replicated_compute_fraction = 0.1;
        p.sequence_parallel = true;
        let s = p.shard(4, true);
        // The norms' weights stay whole on every shard.
        assert_eq!(
            (
                s.compute_factor,
                s.param_factor,
                s.stored_factor,
                s.input_factor
            ),
            (0.25, 0.25 + 0.75 / 4.0, 0.25, 0.25)
        );
        // Each AllReduce a reduce-scatter and an all-gather, and the
        // backward gathers the forward's gathered inputs again.
        assert_eq!(
            (
                s.fwd_allreduce_bytes_per_sample,
                s.bwd_allreduce_bytes_per_sample,
                s.allreduce_calls_per_pass,
                s.scatter_gather,
                s.bwd_regather_bytes_per_sample
            ),
            (2.0, 2.0, 1, true, 2.0)
        );
        let plain = p.shard(4, false);
        assert_eq!(plain.input_factor, 1.0);
        assert!(!plain.scatter_gather && plain.bwd_regather_bytes_per_sample == 0.0);
    }

    #[test]
    fn the_degree_must_divide_every_count() {
        let p = pattern("megatron-block", 1.0, 1.0, &[64, 8]);
        assert!(p.allows(8) && p.allows(2) && !p.allows(16) && !p.allows(3));
        assert_eq!(p.refusal(16).map(|d| d.count), Some(8));
        assert_eq!(p.refusal(4), None);
    }

    #[test]
    fn the_cheapest_allowed_pattern_wins() {
        let sp1 = pattern("SP1", 8.0, 4096.0, &[100_000]);
        let sp2 = pattern("SP2", 400_000.0, 0.0, &[2048]);
        assert_eq!(
            cheapest(&[sp2.clone(), sp1.clone()], 8).unwrap().name,
            "SP1"
        );
        // 3 does not divide 100,000 classes, but it does not divide 2048 either.
        assert!(cheapest(&[sp1.clone(), sp2.clone()], 3).is_none());
        assert_eq!(cheapest(&[sp1, sp2], 32).unwrap().name, "SP1");
    }

    #[test]
    fn bad_patterns_name_their_field() {
        let mut p = pattern("x", 1.0, f64::NAN, &[4]);
        assert_eq!(
            p.validate().unwrap_err().field.as_deref(),
            Some("bwd_allreduce_bytes_per_sample")
        );
        p.bwd_allreduce_bytes_per_sample = 0.0;
        p.replicated_stored_fraction = 1.5;
        assert_eq!(
            p.validate().unwrap_err().field.as_deref(),
            Some("replicated_stored_fraction")
        );
        p.replicated_stored_fraction = 0.0;
        p.divides[0].count = 0;
        assert_eq!(
            p.validate().unwrap_err().field.as_deref(),
            Some("divides[0].count")
        );
    }

    #[test]
    fn a_shards_timed_compute_is_read_at_its_size_and_checked() {
        let mut p = pattern("megatron-block", 2.0, 2.0, &[8]);
        p.replicated_compute_fraction = 0.1;
        let at = |batch_size, factor| ShardCompute {
            degree: 4,
            batch_size,
            factor,
            sequence_parallel_factor: factor,
        };
        p.shard_compute = vec![at(1, 0.9), at(4, 0.3)];
        // Timed sizes exactly, linear between them, the nearest beyond.
        assert_eq!(p.shard_at(4, false, 1).compute_factor, 0.9);
        assert!((p.shard_at(4, false, 2).compute_factor - 0.7).abs() < 1e-12);
        assert_eq!(p.shard_at(4, false, 16).compute_factor, 0.3);
        // The search's floor is the least; an untimed degree keeps the rule.
        assert_eq!(p.shard(4, false).compute_factor, 0.3);
        assert_eq!(p.shard_at(2, false, 1).compute_factor, 0.1 + 0.9 / 2.0);
        assert!(p.validate().is_ok());
        p.shard_compute[1].degree = 1;
        let e = p.validate().unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shard_compute[1].degree"));
        p.shard_compute[1] = at(4, f64::NAN);
        let e = p.validate().unwrap_err();
        assert_eq!(e.field.as_deref(), Some("shard_compute[1].factor"));
    }
}
