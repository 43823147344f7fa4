//! Context parallelism as a profile states it: a layer's sequence cut over
//! c GPUs, each holding 2c equal chunks' worth (chunks k and 2c - 1 - k, so
//! that every GPU does the same share of causal attention's work, as
//! Llama 3 and Megatron-LM cut it), every GPU computing its own tokens'
//! queries against every earlier token's keys and values.
//!
//! Every operator but attention works token by token, so a GPU runs 1/c of
//! the layer and keeps 1/c of its activations. Attention needs the other
//! GPUs' keys and values: a ring passes them on in c - 1 steps (each GPU
//! sends its own chunk's keys and values and receives a neighbour's), the
//! backward passes them again and sends their gradients back the other
//! way. Each step's exchange runs beside the attention of the chunk
//! already held (Megatron-LM's and torch's ring attention), so only what
//! outlasts the attention core is exposed. Weights are whole on every GPU
//! of a context group: their gradients are reduced over the data replicas
//! and the context ranks together, and sharding (`cost/sharding.rs`) shards over
//! both (Megatron-LM's distributed optimizer over dp x cp).

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextPattern {
    /// Tokens of one sample: a degree c must cut them into 2c equal chunks.
    pub sequence_length: u64,
    /// Bytes of one sample's keys and values over the whole sequence, all
    /// the layer's key-value heads (divided by t where the layer splits):
    /// what the ring passes around. 0 for a layer without attention.
    pub kv_bytes_per_sample: f64,
    /// Share of the layer's forward and backward time in the attention
    /// core: what the exchange runs beside.
    pub attention_compute_fraction: f64,
}

/// Bytes one GPU sends in each pass of a layer whose keys and values of
/// its samples are `kv_bytes` over the whole sequence, at context degree
/// `c`: forward, c - 1 chunks of keys and values (a 1/c each); backward,
/// the same again and as many of their gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingTraffic {
    pub fwd_bytes: f64,
    pub bwd_bytes: f64,
}

impl RingTraffic {
    pub fn of(kv_bytes: f64, c: u32) -> RingTraffic {
        let sent = kv_bytes * f64::from(c.saturating_sub(1)) / f64::from(c.max(1));
        RingTraffic {
            fwd_bytes: sent,
            bwd_bytes: 2.0 * sent,
        }
    }
}

/// The shortest sequence whose context degrees the search weighs:
/// Megatron Core's parallelism guide gives context parallelism for "long
/// sequences (8K+ tokens)" (docs.nvidia.com/megatron-core/developer-guide,
/// "Parallelism Strategies Guide"). Below it the cost model would misprice
/// it: it divides each layer's passes by c without re-timing its operators
/// at s / c tokens, so a GPU's few hundred tokens would run as fast as the
/// whole sequence's. A plan may still ask for any degree.
pub const MIN_SEARCHED_SEQUENCE_TOKENS: u64 = 8192;

/// How many chunks of keys and values (each 1/c of the sequence's) a GPU
/// holds at once beside its own while the ring runs: the one it attends to
/// and the one arriving, and in the backward their gradients too.
pub const RING_BUFFER_CHUNKS: f64 = 4.0;

impl ContextPattern {
    /// Whether the sequence cuts into 2c equal chunks.
    pub fn allows(&self, c: u32) -> bool {
        c >= 1 && self.sequence_length.is_multiple_of(2 * u64::from(c))
    }

    pub fn validate(&self) -> Result<()> {
        if self.sequence_length == 0 {
            return Err(Error::field(
                "sequence_length",
                "value 0 is not a number of tokens".to_string(),
            ));
        }
        if !(self.kv_bytes_per_sample.is_finite() && self.kv_bytes_per_sample >= 0.0) {
            return Err(Error::field(
                "kv_bytes_per_sample",
                format!("value {} is not a byte count", self.kv_bytes_per_sample),
            ));
        }
        if !(0.0..=1.0).contains(&self.attention_compute_fraction) {
            return Err(Error::field(
                "attention_compute_fraction",
                format!(
                    "value {} is not a share between 0 and 1",
                    self.attention_compute_fraction
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_sends_c_minus_1_chunks_forward_and_twice_that_backward() {
        // Keys and values of 8 MB: at c = 2 a GPU sends the other's half
        // forward, and half again plus its gradients backward.
        let two = RingTraffic::of(8e6, 2);
        assert_eq!((two.fwd_bytes, two.bwd_bytes), (4e6, 8e6));
        // At c = 4, three quarters forward, six backward.
        let four = RingTraffic::of(8e6, 4);
        assert_eq!((four.fwd_bytes, four.bwd_bytes), (6e6, 12e6));
        // No ring at c = 1.
        assert_eq!(RingTraffic::of(8e6, 1).fwd_bytes, 0.0);
    }

    #[test]
    fn the_search_weighs_context_degrees_from_8k_tokens_on() {
        let degrees = |tokens: u64| {
            let mut profile =
                crate::model::profile::profile_of_layers("s", &[(1.0, 2.0, 1000, 1000)], 1);
            profile.layers[0].context = Some(ContextPattern {
                sequence_length: tokens,
                kv_bytes_per_sample: 1.0,
                attention_compute_fraction: 0.5,
            });
            crate::model::profile::LayerCosts::new(&profile).context_degrees(8)
        };
        assert!(degrees(4096).is_empty());
        assert_eq!(degrees(8192), vec![2, 4, 8]);
        // 2c equal chunks: 12,288 tokens cut 2, 3, 4, 6 or 8 ways.
        assert_eq!(degrees(12288), vec![2, 3, 4, 6, 8]);
    }

    #[test]
    fn a_degree_must_cut_the_sequence_into_2c_chunks() {
        let pattern = ContextPattern {
            sequence_length: 4096,
            kv_bytes_per_sample: 1.0,
            attention_compute_fraction: 0.3,
        };
        assert!(pattern.allows(1) && pattern.allows(2) && pattern.allows(2048));
        assert!(!pattern.allows(3) && !pattern.allows(4096));
        let bad = ContextPattern {
            attention_compute_fraction: 1.5,
            ..pattern.clone()
        };
        assert!(bad.validate().is_err());
        assert!(pattern.validate().is_ok());
    }
}
