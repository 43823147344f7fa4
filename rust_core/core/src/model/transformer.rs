//! Profiles of transformers without a GPU (`dapple profile transformer`):
//! each layer's FLOPs, parameter and activation bytes from a model config
//! (a Hugging Face `config.json`, or a shipped name), its time the FLOPs
//! over a GPU type's bf16 peak times an efficiency, and the ways it splits.
//!
//! The layers are the embedding, the blocks and the LM head (the final norm,
//! the output projection and the loss). Everything is bf16 but the logits,
//! which the loss reads in fp32. The formulas, and what they leave out, are
//! in docs/cost-model.md ("Transformer profiles").

use serde_json::Value;

use crate::cluster::gpus::{gpu_type, GpuType};
use crate::error::{Error, Result};
use crate::model::context::ContextPattern;
use crate::model::experts::{ExpertPattern, RoutingGroups, TokenDispatcher};
use crate::model::kernels::{
    attention_ms, memory_bound_ms, AttentionKernel, Gemm, SUSTAINED_SHARE,
};
use crate::model::profile::{Layer, Measurement, ParameterState, Profile, BLOCK_KIND};
use crate::model::split::{Divisor, ShardCompute, SplitPattern};

/// Bytes of a bf16 value, of an fp32 one, and of a token id.
const BF16: f64 = 2.0;
const FP32: f64 = 4.0;
const TOKEN_ID: f64 = 8.0;
/// Bytes of a dropout mask's entry (torch keeps it as bool).
const MASK: f64 = 1.0;
/// Megatron-LM pads the vocabulary to a multiple of this
/// (`--make-vocab-size-divisible-by`), so that it splits evenly.
pub const VOCAB_PADDING: u64 = 128;

/// Most blocks a config may ask for. A profile takes about 1.7 KB a
/// block, so 100,000 blocks write about 170 MB, which reads back under
/// the 256 MiB every command reads a file with (`limits.py`); the largest
/// models have about a hundred. Past it the layers alone would not fit in
/// memory (2^31 blocks asked for 309 GB, an abort, in a fuzz campaign).
pub const MAX_BLOCKS: u64 = 100_000;

/// Shipped model configs, by name: Hugging Face `config.json` files.
pub const MODELS: [(&str, &str); 14] = [
    (
        "gpt3-175b",
        include_str!("../../../../dapple/profiles/models/gpt3-175b.json"),
    ),
    (
        "llama-2-7b",
        include_str!("../../../../dapple/profiles/models/llama-2-7b.json"),
    ),
    (
        "llama-2-13b",
        include_str!("../../../../dapple/profiles/models/llama-2-13b.json"),
    ),
    (
        "llama-2-70b",
        include_str!("../../../../dapple/profiles/models/llama-2-70b.json"),
    ),
    (
        "llama-3-8b",
        include_str!("../../../../dapple/profiles/models/llama-3-8b.json"),
    ),
    (
        "llama-3-70b",
        include_str!("../../../../dapple/profiles/models/llama-3-70b.json"),
    ),
    (
        "llama-3-405b",
        include_str!("../../../../dapple/profiles/models/llama-3-405b.json"),
    ),
    (
        "mixtral-8x7b",
        include_str!("../../../../dapple/profiles/models/mixtral-8x7b.json"),
    ),
    (
        "qwen3-30b-a3b",
        include_str!("../../../../dapple/profiles/models/qwen3-30b-a3b.json"),
    ),
    (
        "qwen3-235b-a22b",
        include_str!("../../../../dapple/profiles/models/qwen3-235b-a22b.json"),
    ),
    (
        "deepseek-v3",
        include_str!("../../../../dapple/profiles/models/deepseek-v3.json"),
    ),
    (
        "m6-moe-100b",
        include_str!("../../../../dapple/profiles/models/m6-moe-100b.json"),
    ),
    (
        "m6-moe-1t",
        include_str!("../../../../dapple/profiles/models/m6-moe-1t.json"),
    ),
    (
        "m6-moe-10t",
        include_str!("../../../../dapple/profiles/models/m6-moe-10t.json"),
    ),
];

/// The shape of a decoder-only transformer, as the generator reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerConfig {
    pub hidden: u64,
    /// The MLP width of a dense block.
    pub ffn: u64,
    pub heads: u64,
    pub kv_heads: u64,
    /// Width of one attention head (Qwen3's `head_dim`; else hidden / heads).
    pub head_dim: u64,
    pub blocks: u64,
    pub vocabulary: u64,
    /// Learned position embeddings (GPT-2 style), else rotary (none held).
    pub positions: Option<u64>,
    /// A gated MLP (SwiGLU: three matrices) rather than two with GeLU.
    pub gated_mlp: bool,
    /// Biases and LayerNorm (GPT) rather than none and RMSNorm (Llama).
    pub biases: bool,
    /// Dropout after the attention and after the MLP (each keeps a mask).
    pub hidden_dropout: bool,
    /// Dropout of the attention probabilities.
    pub attention_dropout: bool,
    /// Mixture-of-experts MLPs (Mixtral, Qwen3-MoE); None: every block dense.
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention (DeepSeek-V2 and V3); None: the heads'
    /// own queries, keys and values (grouped where fewer KV heads).
    pub mla: Option<MlaConfig>,
}

/// DeepSeek's multi-head latent attention: queries (where `q_lora_rank`
/// is given) and keys and values go through low-rank latents, each
/// normed, then up to every head; each head's queries and keys have a
/// part without positions (`qk_nope_head_dim`) and a rotary one
/// (`qk_rope_head_dim`, the keys' shared by the heads).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaConfig {
    /// 0: the queries come from the hidden state directly (DeepSeek-V2-Lite).
    pub q_lora_rank: u64,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

/// A block's attention by its matrices and what it keeps, per token.
struct AttentionSizes {
    /// Parameters of the matrices a split divides (by heads), and of those
    /// every shard keeps whole (MLA's down projections).
    split_params: f64,
    whole_params: f64,
    /// Parameters of the latents' norms (MLA), whole.
    norm_params: f64,
    /// Values kept for the backward: queries, keys and values, and the
    /// attention's output (split by heads), and what every shard keeps
    /// whole (MLA's latents before and after their norms, and the shared
    /// rotary key).
    qkv_stored: f64,
    output_stored: f64,
    whole_stored: f64,
}

/// A mixture of experts in place of a block's MLP: a router picks
/// `experts_per_token` of `experts` routed experts for each token, and
/// shared experts (`shared_ffn` columns in all) take every token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    pub experts: u64,
    pub experts_per_token: u64,
    /// One routed expert's MLP width.
    pub expert_ffn: u64,
    /// The shared experts' MLP width together (0: none).
    pub shared_ffn: u64,
    /// The first blocks keep a dense MLP (DeepSeek's `first_k_dense_replace`).
    pub dense_blocks: u64,
    /// Group-limited routing (DeepSeek's `n_group` and `topk_group`; None:
    /// absent, or one group).
    pub routing_groups: Option<RoutingGroups>,
}

/// What the generator is asked for besides the model.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerOptions {
    pub gpu: String,
    pub seq_len: u64,
    pub micro_batch_sizes: Vec<u32>,
    /// Share of the GPU's bf16 peak every layer reaches, where the user
    /// gives one; None: each operator timed by its shape (`model/kernels.rs`).
    pub efficiency: Option<f64>,
    /// How the attention core runs (its time, and whether the s x s
    /// probabilities are kept); None: FlashAttention where the GPU type
    /// has it measured, else unfused.
    pub attention: Option<AttentionKernel>,
    /// The router's imbalance a block with experts records
    /// (`ExpertPattern::imbalance`): 1 balanced.
    pub expert_imbalance: f64,
    /// How the runtime exchanges a block's tokens with its experts
    /// (`ExpertPattern::dispatcher`).
    pub dispatcher: TokenDispatcher,
    /// The precision the runtime accumulates and reduces gradients in.
    pub gradients: GradientPrecision,
    /// What the runtime's host takes to issue one kernel, us: a pass takes
    /// no less than its kernels issued one after another (operator by
    /// operator only). `HOST_US_PER_KERNEL` by default.
    pub host_us_per_kernel: f64,
}

/// What an eager PyTorch runtime's host takes to issue one of the kernels
/// this profile counts, us: a PyTorch operator's host overhead, at least 7
/// (meta-pytorch/autoparallel#146's `kernel_launch_overhead`; the raw
/// driver call alone takes 3.0, meta-pytorch/tritonbench#1017). A runtime
/// with more Python per kernel takes more: `dapple calibrate --runs` fits
/// the figure to a user's own measured runs (on the 1,440 Megatron-
/// DeepSpeed runs of `shared/reference/vtrain-single-node/` it fits 70.97,
/// docs/fidelity.md, "Measured runs"), and `--host-us-per-kernel` takes
/// it. No measured run's iteration time enters this default.
pub const HOST_US_PER_KERNEL: f64 = 7.0;

/// The largest split degree a generated profile times its layers'
/// shards at (`SplitPattern::shard_compute`); beyond it, the replicated
/// share's rule.
pub const MAX_TIMED_SPLIT_DEGREE: u32 = 64;

crate::named_enum! {
    /// The precision a runtime keeps gradients in while it accumulates them
    /// over micro-batches and reduces them between replicas: what the
    /// profile's `parameter_state.gradient_bytes` records (their memory,
    /// their reduction's bytes, Adam's read of them).
    #[derive(Default)]
    pub enum GradientPrecision("a gradient precision") {
        /// As the weights (bf16).
        #[default]
        Bf16 = "bf16",
        /// fp32 under bf16 weights: Megatron-LM's
        /// `--accumulate-allreduce-grads-in-fp32` (which it sets for bf16),
        /// DeepSpeed's `BF16_Optimizer` (its fp32 gradient buffers,
        /// reduced as they are), Llama 3's FSDP ("FP32 grad accumulation and
        /// FP32 reduce-scatter").
        Fp32 = "fp32",
    }
}

impl GradientPrecision {
    /// Bytes of one parameter's gradient.
    pub fn bytes(self) -> f64 {
        match self {
            GradientPrecision::Bf16 => BF16,
            GradientPrecision::Fp32 => FP32,
        }
    }
}

impl TransformerConfig {
    /// A shipped config by name.
    pub fn named(name: &str) -> Result<TransformerConfig> {
        match MODELS.iter().find(|(n, _)| *n == name) {
            Some((_, text)) => TransformerConfig::from_json(text),
            None => Err(Error::invalid(format!(
                "unknown model config {name:?}; shipped: {} (or give a config.json file)",
                MODELS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// A Hugging Face `config.json`: Llama's keys (`hidden_size`, ...) or
    /// GPT-2's (`n_embd`, ...). Errors name the missing or bad field.
    pub fn from_json(text: &str) -> Result<TransformerConfig> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid(format!("not valid JSON: {e}")))?;
        let Value::Object(obj) = &value else {
            return Err(Error::invalid("a model config must be a JSON object"));
        };
        let number = |keys: &[&str], what: &str| whole_number(obj, keys, what);
        let required = |keys: &[&str], what: &str| -> Result<u64> {
            number(keys, what)?.ok_or_else(|| {
                Error::field(
                    keys[0],
                    format!(
                        "is missing: the generator needs {what} ({})",
                        keys.join(" or ")
                    ),
                )
            })
        };
        let hidden = required(&["hidden_size", "n_embd", "d_model"], "the hidden size")?;
        let heads = required(&["num_attention_heads", "n_head"], "the attention heads")?;
        let blocks = required(&["num_hidden_layers", "n_layer"], "the number of blocks")?;
        if blocks > MAX_BLOCKS {
            let key = ["num_hidden_layers", "n_layer"]
                .into_iter()
                .find(|k| obj.get(*k).is_some_and(|v| !v.is_null()))
                .unwrap_or("num_hidden_layers");
            return Err(Error::field(
                key,
                format!(
                    "value {blocks} is over the {MAX_BLOCKS} blocks a generated profile may have"
                ),
            ));
        }
        let vocabulary = required(&["vocab_size"], "the vocabulary size")?;
        let kv_heads = number(&["num_key_value_heads"], "the KV heads")?.unwrap_or(heads);
        let gpt_style = obj.contains_key("n_embd");
        let ffn = match number(
            &["intermediate_size", "n_inner", "ffn_dim"],
            "the MLP width",
        )? {
            Some(f) => f,
            // GPT-2's n_inner: null means 4 x hidden.
            None if gpt_style => 4 * hidden,
            None => {
                return Err(Error::field(
                    "intermediate_size",
                    "is missing: the generator needs the MLP width",
                ))
            }
        };
        let head_dim = number(&["head_dim"], "the width of an attention head")?;
        if (head_dim.is_none() && hidden % heads != 0) || heads % kv_heads != 0 {
            return Err(Error::field(
                "num_attention_heads",
                format!("value {heads} must divide the hidden size {hidden} and be a multiple of the KV heads {kv_heads}"),
            ));
        }
        let act = obj
            .get("hidden_act")
            .or_else(|| obj.get("activation_function"))
            .and_then(Value::as_str)
            .unwrap_or(if gpt_style { "gelu_new" } else { "silu" });
        Ok(TransformerConfig {
            hidden,
            ffn,
            heads,
            kv_heads,
            blocks,
            vocabulary,
            positions: if gpt_style {
                number(&["n_positions"], "the positions")?
            } else {
                None
            },
            gated_mlp: matches!(act, "silu" | "swiglu" | "swish"),
            biases: gpt_style,
            // Hugging Face's GPT-2 config defaults both to 0.1; Llama's
            // `attention_dropout` to 0 and it has no hidden dropout.
            hidden_dropout: probability(obj, &["resid_pdrop", "hidden_dropout"], gpt_style)?,
            attention_dropout: probability(obj, &["attn_pdrop", "attention_dropout"], gpt_style)?,
            head_dim: head_dim.unwrap_or(hidden / heads),
            moe: MoeConfig::from_json(obj, ffn, blocks)?,
            mla: MlaConfig::from_json(obj)?,
        })
    }

    fn padded_vocabulary(&self) -> u64 {
        self.vocabulary.div_ceil(VOCAB_PADDING) * VOCAB_PADDING
    }

    /// Width of the queries and of the attention's output: heads x head_dim.
    fn q_width(&self) -> u64 {
        self.heads * self.head_dim
    }

    fn kv_hidden(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Values of one token's keys and values as attention's core reads
    /// them: the KV heads' (K and V), or MLA's up-projected heads (keys of
    /// the no-position and rotary widths, values of theirs).
    pub fn kv_values_per_token(&self) -> u64 {
        match self.mla {
            Some(mla) => {
                self.heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
            }
            None => 2 * self.kv_hidden(),
        }
    }

    /// The attention's matrices and what it keeps, per token: Q, K and V
    /// of the heads (K and V of the KV heads) and the output projection; or
    /// DeepSeek's latent attention, its down projections whole on every
    /// shard (as Megatron-LM's MLA duplicates them) and the up projections
    /// and the output's split by heads.
    fn attention_sizes(&self) -> AttentionSizes {
        let h = self.hidden as f64;
        let Some(mla) = self.mla else {
            let (q, kv) = (self.q_width() as f64, self.kv_hidden() as f64);
            return AttentionSizes {
                split_params: 2.0 * h * q + 2.0 * h * kv,
                whole_params: 0.0,
                norm_params: 0.0,
                qkv_stored: q + 2.0 * kv,
                output_stored: q,
                whole_stored: 0.0,
            };
        };
        let a = self.heads as f64;
        let (r_q, r_kv) = (mla.q_lora_rank as f64, mla.kv_lora_rank as f64);
        let (qk, rope, v) = (
            (mla.qk_nope_head_dim + mla.qk_rope_head_dim) as f64,
            mla.qk_rope_head_dim as f64,
            mla.v_head_dim as f64,
        );
        let (q_split, q_whole) = if mla.q_lora_rank > 0 {
            (r_q * a * qk, h * r_q)
        } else {
            (h * a * qk, 0.0)
        };
        AttentionSizes {
            split_params: q_split + r_kv * a * (mla.qk_nope_head_dim as f64 + v) + a * v * h,
            whole_params: q_whole + h * (r_kv + rope),
            norm_params: r_q + r_kv,
            qkv_stored: 2.0 * a * qk + a * v,
            output_stored: a * v,
            whole_stored: 2.0 * (r_q + r_kv) + rope,
        }
    }

    /// Whether block `block` (from 0) runs the experts: every block of a
    /// mixture-of-experts model after its dense first ones.
    pub fn has_experts(&self, block: u64) -> bool {
        self.moe.is_some_and(|m| block >= m.dense_blocks)
    }

    /// The routed experts of a block that has them (`model/experts.rs`'s
    /// pattern), at `s` tokens a sample and activations of `value_bytes`,
    /// routing balanced; None for a dense model. One rule for the analytic
    /// profiles (bf16) and the runtime's mixture-of-experts model
    /// (`transformer_splits`, fp32).
    pub fn expert_pattern(&self, s: f64, value_bytes: f64) -> Option<ExpertPattern> {
        let moe = self.moe?;
        let (params, _) = self.block_params(true);
        let routed = moe.experts as f64 * self.mlp_matrix_params(moe.expert_ffn);
        Some(ExpertPattern {
            count: moe.experts as u32,
            per_token: moe.experts_per_token as u32,
            param_fraction: routed / params,
            // Each token's k copies of its hidden state.
            all_to_all_bytes_per_sample: s
                * (moe.experts_per_token * self.hidden) as f64
                * value_bytes,
            // The split pattern's gather of the hidden state into the MLP
            // and scatter of its output (one of its two calls a pass),
            // which shared experts still need.
            split_gather_bytes_per_sample: if moe.shared_ffn == 0 {
                s * self.hidden as f64 * value_bytes
            } else {
                0.0
            },
            // The routed experts' FLOPs over the block's, forward.
            compute_fraction: 2.0
                * s
                * (moe.experts_per_token as f64 * self.mlp_matrix_params(moe.expert_ffn))
                / self.block_fwd_flops(s, true),
            imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            routing_groups: moe.routing_groups,
        })
    }

    /// The matrices of an MLP of `width` columns: up (and gate) and down.
    fn mlp_matrix_params(&self, width: u64) -> f64 {
        let matrices = if self.gated_mlp { 3.0 } else { 2.0 };
        matrices * self.hidden as f64 * width as f64
    }

    /// A block's MLP parameters, the dense one or (`experts`) the mixture
    /// of experts: (all of them, those each token multiplies, the router's).
    fn mlp_params(&self, experts: bool) -> (f64, f64, f64) {
        match self.moe.filter(|_| experts) {
            None => {
                let dense = self.mlp_matrix_params(self.ffn);
                (dense, dense, 0.0)
            }
            Some(moe) => {
                let expert = self.mlp_matrix_params(moe.expert_ffn);
                let shared = self.mlp_matrix_params(moe.shared_ffn);
                let router = (self.hidden * moe.experts) as f64;
                (
                    moe.experts as f64 * expert + shared + router,
                    moe.experts_per_token as f64 * expert + shared + router,
                    router,
                )
            }
        }
    }

    /// The MLP columns one token passes through: the dense MLP's, or its
    /// routed experts' and the shared experts'.
    fn mlp_inner_per_token(&self, experts: bool) -> u64 {
        match self.moe.filter(|_| experts) {
            None => self.ffn,
            Some(moe) => moe.experts_per_token * moe.expert_ffn + moe.shared_ffn,
        }
    }

    /// Parameters of one block's matrices, and of what stays whole when it
    /// is split (norms, the router, and the biases added after a
    /// row-parallel matrix).
    fn block_params(&self, experts: bool) -> (f64, f64) {
        let (h, q, kv) = (
            self.hidden as f64,
            self.q_width() as f64,
            self.kv_hidden() as f64,
        );
        let sizes = self.attention_sizes();
        let attention = sizes.split_params + sizes.whole_params;
        let (mlp, _, router) = self.mlp_params(experts);
        let (norms, split_biases, whole_biases) = if self.biases {
            (4.0 * h, q + 2.0 * kv + self.ffn as f64, 2.0 * h)
        } else {
            (2.0 * h + sizes.norm_params, 0.0, 0.0)
        };
        (
            attention + mlp + norms + split_biases + whole_biases,
            norms + whole_biases + router + sizes.whole_params,
        )
    }

    /// Forward FLOPs of one block for one sample of `s` tokens: twice the
    /// parameters each token multiplies, and QK^T and AV over all s x s
    /// pairs (causal masking not subtracted, as Megatron-LM counts).
    fn block_fwd_flops(&self, s: f64, experts: bool) -> f64 {
        let core = match self.mla {
            None => 4.0 * s * s * self.q_width() as f64,
            Some(mla) => {
                let per_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim;
                2.0 * s * s * (self.heads * per_head) as f64
            }
        };
        self.block_weight_flops(s, experts) + core
    }

    /// Of a block's forward FLOPs, the products with its weight matrices
    /// (of a mixture of experts, those of the experts a token is routed to,
    /// the shared ones and the router): the backward's weight gradient (W
    /// of a zero-bubble split) costs as much again; QK^T and AV multiply
    /// activations and have none.
    fn block_weight_flops(&self, s: f64, experts: bool) -> f64 {
        let sizes = self.attention_sizes();
        let (_, active, _) = self.mlp_params(experts);
        2.0 * s * (sizes.split_params + sizes.whole_params + active)
    }

    /// Bytes one block keeps for its backward, per sample, and the part
    /// every shard keeps whole: the inputs and outputs of both norms (8sh);
    /// split are Q, K and V, the attention output and its softmax
    /// statistics, the MLP's inner activations, and where the attention
    /// runs unfused the s x s probabilities of every head (FlashAttention
    /// keeps none). A mixture of experts keeps its routed experts' inner
    /// activations, and whole on every shard each token's copies for its
    /// experts (k s h) and the router's probabilities (fp32).
    fn block_stored_bytes(
        &self,
        s: f64,
        value_bytes: f64,
        (kernel, experts): (AttentionKernel, bool),
    ) -> (f64, f64) {
        let (h, a) = (self.hidden as f64, self.heads as f64);
        // The two hidden dropouts' masks stay whole too.
        let masks = if self.hidden_dropout {
            2.0 * s * h * MASK
        } else {
            0.0
        };
        let routing = match self.moe.filter(|_| experts) {
            Some(moe) => {
                s * (moe.experts_per_token as f64 * h * value_bytes + moe.experts as f64 * FP32)
            }
            None => 0.0,
        };
        let sizes = self.attention_sizes();
        let whole =
            4.0 * s * h * value_bytes + masks + routing + s * sizes.whole_stored * value_bytes;
        let attention = s * sizes.qkv_stored * value_bytes
            + s * sizes.output_stored * value_bytes
            + s * a * FP32;
        let inner = self.mlp_inner_per_token(experts) as f64;
        let mlp = if self.gated_mlp { 3.0 } else { 2.0 } * s * inner * value_bytes;
        let probabilities = self.attention_core_stored_bytes(s, value_bytes, kernel);
        (whole + attention + probabilities + mlp, whole)
    }

    /// What the attention core keeps beyond Q, K and V, per sample: unfused,
    /// the probabilities, and where they are dropped, the dropped ones and
    /// the mask (Korthikanti et al.'s 5as^2); FlashAttention, nothing of s^2.
    /// Selective re-computation drops exactly this and re-runs the core.
    fn attention_core_stored_bytes(
        &self,
        s: f64,
        value_bytes: f64,
        kernel: AttentionKernel,
    ) -> f64 {
        let a = self.heads as f64;
        match kernel {
            AttentionKernel::Flash => 0.0,
            AttentionKernel::Unfused if self.attention_dropout => {
                a * s * s * (2.0 * value_bytes + MASK)
            }
            AttentionKernel::Unfused => a * s * s * value_bytes,
        }
    }
}

impl MlaConfig {
    /// DeepSeek's keys (`kv_lora_rank`, `q_lora_rank`, `qk_nope_head_dim`,
    /// `qk_rope_head_dim`, `v_head_dim`); None where the config gives no
    /// `kv_lora_rank`.
    fn from_json(obj: &serde_json::Map<String, Value>) -> Result<Option<MlaConfig>> {
        let number = |key: &str, what: &str| whole_number(obj, &[key], what);
        let Some(kv_lora_rank) = number("kv_lora_rank", "the keys' and values' latent width")?
        else {
            return Ok(None);
        };
        let required = |key: &str, what: &str| {
            number(key, what)?.ok_or_else(|| {
                Error::field(
                    key,
                    format!("is missing: latent attention (kv_lora_rank) needs {what}"),
                )
            })
        };
        Ok(Some(MlaConfig {
            q_lora_rank: number("q_lora_rank", "the queries' latent width")?.unwrap_or(0),
            kv_lora_rank,
            qk_nope_head_dim: required(
                "qk_nope_head_dim",
                "a head's query and key width without positions",
            )?,
            qk_rope_head_dim: required("qk_rope_head_dim", "a head's rotary query and key width")?,
            v_head_dim: required("v_head_dim", "a head's value width")?,
        }))
    }
}

impl MoeConfig {
    /// The experts of a Hugging Face config: Mixtral's keys
    /// (`num_local_experts`, its `intermediate_size` each expert's width),
    /// Qwen3-MoE's (`num_experts`, `moe_intermediate_size`, and
    /// `intermediate_size` for dense blocks) or DeepSeek's
    /// (`n_routed_experts`, `n_shared_experts`, `first_k_dense_replace`);
    /// None where the config names no experts. `ffn`: its dense MLP width.
    fn from_json(
        obj: &serde_json::Map<String, Value>,
        ffn: u64,
        blocks: u64,
    ) -> Result<Option<MoeConfig>> {
        let number = |keys: &[&str], what: &str| whole_number(obj, keys, what);
        let Some(experts) = number(
            &["num_local_experts", "num_experts", "n_routed_experts"],
            "the routed experts",
        )?
        else {
            return Ok(None);
        };
        let experts_per_token = number(
            &["num_experts_per_tok"],
            "the experts each token is routed to",
        )?
        .ok_or_else(|| {
            Error::field(
                "num_experts_per_tok",
                "is missing: a mixture of experts needs the experts each token is routed to",
            )
        })?;
        if u32::try_from(experts).is_err() {
            return Err(Error::field(
                "num_experts",
                format!(
                    "value {experts} is more experts than dapple counts (at most {})",
                    u32::MAX
                ),
            ));
        }
        if experts_per_token > experts {
            return Err(Error::field(
                "num_experts_per_tok",
                format!("value {experts_per_token} is more than the {experts} routed experts"),
            ));
        }
        let expert_ffn =
            number(&["moe_intermediate_size"], "an expert's MLP width")?.unwrap_or(ffn);
        let shared_ffn = match number(
            &["shared_expert_intermediate_size"],
            "the shared expert's MLP width",
        )? {
            Some(width) => width,
            None => {
                let shared = first_given(
                    obj,
                    &["n_shared_experts"],
                    Value::as_u64,
                    "a whole number (the shared experts)",
                )?;
                shared.unwrap_or(0) * expert_ffn
            }
        };
        let dense_blocks = first_given(
            obj,
            &["first_k_dense_replace"],
            Value::as_u64,
            "a whole number (the dense first blocks)",
        )?
        .unwrap_or(0);
        if dense_blocks > blocks {
            return Err(Error::field(
                "first_k_dense_replace",
                format!("value {dense_blocks} is more than the {blocks} blocks"),
            ));
        }
        let every_block = |key: &str, fine: &dyn Fn(&Value) -> bool| {
            match obj.get(key) {
            Some(v) if !v.is_null() && !fine(v) => Err(Error::field(
                key,
                format!("value {v}: the generator places experts in every block after the dense first ones"),
            )),
            _ => Ok(()),
        }
        };
        let routing_groups = routing_groups(obj, experts, experts_per_token)?;
        every_block("decoder_sparse_step", &|v| v.as_u64() == Some(1))?;
        every_block("moe_layer_freq", &|v| v.as_u64() == Some(1))?;
        every_block("mlp_only_layers", &|v| {
            v.as_array().is_some_and(Vec::is_empty)
        })?;
        Ok(Some(MoeConfig {
            experts,
            experts_per_token,
            expert_ffn,
            shared_ffn,
            dense_blocks,
            routing_groups,
        }))
    }
}

/// Group-limited routing of a Hugging Face config (DeepSeek's `n_group`
/// and `topk_group`): None where it names none or one group.
fn routing_groups(
    obj: &serde_json::Map<String, Value>,
    experts: u64,
    experts_per_token: u64,
) -> Result<Option<RoutingGroups>> {
    let number = |keys: &[&str], what: &str| whole_number(obj, keys, what);
    Ok(match number(&["n_group"], "the routing groups")? {
        None | Some(1) => None,
        Some(groups) => {
            let per_token = number(&["topk_group"], "the groups a token's experts come from")?
                .unwrap_or(groups);
            if groups > experts || !experts.is_multiple_of(groups) {
                return Err(Error::field(
                    "n_group",
                    format!(
                        "value {groups} must divide the {experts} routed experts into equal groups"
                    ),
                ));
            }
            if per_token > groups || per_token * (experts / groups) < experts_per_token {
                return Err(Error::field(
                    "topk_group",
                    format!(
                        "value {per_token} must be at most the {groups} groups, and its groups must hold the {experts_per_token} experts a token takes"
                    ),
                ));
            }
            Some(RoutingGroups {
                groups: groups as u32,
                per_token: per_token as u32,
            })
        }
    })
}

/// The whole number >= 1 the first of `keys` gives (`first_given`).
fn whole_number(
    obj: &serde_json::Map<String, Value>,
    keys: &[&str],
    what: &str,
) -> Result<Option<u64>> {
    first_given(
        obj,
        keys,
        |v| v.as_u64().filter(|&n| n > 0),
        &format!("a whole number >= 1 ({what})"),
    )
}

/// Whether a dropout probability among `keys` is above 0: the first key
/// given, else 0.1 where `default_on` (GPT-2's defaults), else 0.
fn probability(
    obj: &serde_json::Map<String, Value>,
    keys: &[&str],
    default_on: bool,
) -> Result<bool> {
    let p = first_given(
        obj,
        keys,
        |v| v.as_f64().filter(|p| (0.0..1.0).contains(p)),
        "a dropout probability in [0, 1)",
    )?;
    Ok(p.map_or(default_on, |p| p > 0.0))
}

/// The value of the first of `keys` the config gives (null counts as not
/// given) as `parse` reads it, or an error naming that key where `parse`
/// does not take it (`what` it must be); None where no key is given.
fn first_given<T>(
    obj: &serde_json::Map<String, Value>,
    keys: &[&str],
    parse: impl Fn(&Value) -> Option<T>,
    what: &str,
) -> Result<Option<T>> {
    for key in keys {
        match obj.get(*key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                return parse(v)
                    .map(Some)
                    .ok_or_else(|| Error::field(*key, format!("value {v} must be {what}")));
            }
        }
    }
    Ok(None)
}

/// Each layer's operators, timed on a GPU (`model/kernels.rs`); the list, and
/// what it leaves out, is in docs/cost-model.md ("Transformer profiles").
impl TransformerConfig {
    pub fn head_dim(&self) -> u64 {
        self.head_dim
    }

    /// The lookup reads its rows and writes the output (GPT: and adds the
    /// positions', reading two and writing one); its backward adds the
    /// gradient into the rows, all of it the weight's gradient. Every
    /// shard of a vocabulary split writes the whole output.
    fn embedding_times(&self, gpu: &GpuType, tokens: u64) -> PassTimes {
        let h = self.hidden;
        let per_token = 2 * h + if self.positions.is_some() { 3 * h } else { 0 };
        // The lookup (GPT: two, and their sum).
        let kernels = if self.positions.is_some() { 3 } else { 1 };
        let mut times = PassTimes::default();
        times.add_replicated(gpu, BF16 * (tokens * per_token) as f64, kernels);
        times.weight = times.bwd;
        times
    }

    /// A block on one of `t` shards at `b` samples of `seq` tokens: QKV,
    /// the attention's output projection, the MLP's up (and gate, one
    /// product) and down projections, each forward, input gradient and
    /// weight gradient; the attention core; and, per token in bf16, the
    /// two norms (each reads and writes h) and residual adds (each reads
    /// 2h, writes h), every shard's whole, and the MLP's activation
    /// (SwiGLU reads 2f / t, writes f / t; GeLU reads and writes f / t) and
    /// rotary positions on Q and K, split. With `experts`, the MLP is the
    /// mixture's (`moe_mlp_times`).
    fn block_times(
        &self,
        gpu: &GpuType,
        (attention, experts): (AttentionKernel, bool),
        (b, seq): (u32, u64),
        t: u64,
    ) -> Result<PassTimes> {
        let tokens = u64::from(b) * seq;
        let h = self.hidden;
        let mut times = PassTimes::default();
        let (core_head_dim, rotary) = self.add_attention_products(&mut times, gpu, tokens, t);
        let activation_bytes = match self.moe.filter(|_| experts) {
            None => self.add_mlp(&mut times, gpu, (tokens, 1), self.ffn / t),
            Some(moe) => self.add_moe_mlp(&mut times, gpu, tokens, (&moe, t)),
        };
        let heads = u64::from(b) * self.heads / t;
        let (fwd, bwd) = attention_ms(
            gpu,
            attention,
            (heads, seq, core_head_dim),
            self.attention_dropout,
        )?;
        times.fwd += fwd;
        times.bwd += bwd;
        times.attention_core = fwd + bwd;
        let (fwd_kernels, bwd_kernels) = attention_kernels(attention, self.attention_dropout);
        times.fwd_kernels += fwd_kernels;
        times.bwd_kernels += bwd_kernels;
        if attention == AttentionKernel::Unfused {
            // Selective re-computation runs the unfused core again; the
            // fused one keeps nothing it would drop.
            times.selective = fwd;
        }
        // Two norms and two residual adds, a kernel each.
        times.add_replicated(gpu, BF16 * (tokens * 10 * h) as f64, 4);
        if self.hidden_dropout {
            // Fused with the residual adds, each dropout writes a one-byte mask.
            times.add_replicated(gpu, (tokens * 2 * h) as f64 * MASK, 0);
        }
        // The MLP's activation, and rotary positions on Q and K.
        let kernels = 1 + if rotary > 0 { 2 } else { 0 };
        times.add_memory_bound(
            gpu,
            activation_bytes + BF16 * (tokens * rotary) as f64,
            kernels,
        );
        Ok(times)
    }

    /// The attention's products on one of `t` shards (`attention_sizes`):
    /// QKV and the output projection; or MLA's down projections (whole on
    /// every shard), its latents' norms (whole), its up projections and the
    /// output's. Returns the head width its core runs at (MLA: the mean of
    /// the queries' and keys' and the values', which keeps QK^T's and AV's
    /// FLOPs) and the values a token's rotary positions read and write.
    fn add_attention_products(
        &self,
        times: &mut PassTimes,
        gpu: &GpuType,
        tokens: u64,
        t: u64,
    ) -> (u64, u64) {
        let h = self.hidden;
        let Some(mla) = self.mla else {
            let (q, kv) = (self.q_width() / t, self.kv_hidden() / t);
            times.add_weight_product(gpu, tokens, q + 2 * kv, h);
            times.add_weight_product(gpu, tokens, h, q);
            let rotary = if self.positions.is_none() {
                2 * (q + kv)
            } else {
                0
            };
            return (self.head_dim(), rotary);
        };
        let heads = self.heads / t;
        let (qk, rope, v) = (
            mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        );
        if mla.q_lora_rank > 0 {
            times.add_whole_product(gpu, tokens, mla.q_lora_rank, h);
            times.add_weight_product(gpu, tokens, heads * qk, mla.q_lora_rank);
        } else {
            times.add_weight_product(gpu, tokens, heads * qk, h);
        }
        times.add_whole_product(gpu, tokens, mla.kv_lora_rank + rope, h);
        times.add_weight_product(
            gpu,
            tokens,
            heads * (mla.qk_nope_head_dim + v),
            mla.kv_lora_rank,
        );
        times.add_weight_product(gpu, tokens, h, heads * v);
        let latents = mla.q_lora_rank + mla.kv_lora_rank;
        times.add_replicated(gpu, BF16 * (tokens * 2 * latents) as f64, 2);
        ((qk + v) / 2, 2 * (heads * rope + rope))
    }

    /// `groups` MLPs of `inner` columns each (a shard's) over `rows`
    /// tokens each: their up (and gate) and down products, several MLPs
    /// (routed experts) as one grouped product; returns the bytes their
    /// activation moves, which the caller times with the block's other
    /// such operators.
    fn add_mlp(
        &self,
        times: &mut PassTimes,
        gpu: &GpuType,
        (rows, groups): (u64, u64),
        inner: u64,
    ) -> f64 {
        if rows == 0 || inner == 0 || groups == 0 {
            return 0.0;
        }
        let (up, activation) = if self.gated_mlp {
            (2 * inner, 3 * inner)
        } else {
            (inner, 2 * inner)
        };
        times.add_grouped_product(gpu, groups, rows, up, self.hidden);
        times.add_grouped_product(gpu, groups, rows, self.hidden, inner);
        BF16 * (groups * rows * activation) as f64
    }

    /// A mixture of experts on one of `t` shards (each expert's columns
    /// split t ways, Megatron-LM's expert tensor parallelism at t): the
    /// router's product, whole on every shard; each routed expert's MLP
    /// over an even share of the tokens' k copies (routing balanced, an
    /// assumption: docs/cost-model.md); the shared experts' over every
    /// token; and the copies' dispatch (each read and written) and combine
    /// (k read, one written) in bf16, whole on every shard.
    fn add_moe_mlp(
        &self,
        times: &mut PassTimes,
        gpu: &GpuType,
        tokens: u64,
        (moe, t): (&MoeConfig, u64),
    ) -> f64 {
        let h = self.hidden;
        times.add_whole_product(gpu, tokens, moe.experts, h);
        let copies = tokens * moe.experts_per_token;
        // Every expert's products in one grouped product (Megatron-LM's
        // --moe-grouped-gemm), each expert over copies / E tokens rounded
        // up (at most a row more than its share).
        let rows = copies.div_ceil(moe.experts);
        let mut activation_bytes =
            self.add_mlp(times, gpu, (rows, moe.experts), moe.expert_ffn / t);
        // What holding E experts takes over holding one with every copy:
        // under expert parallelism a GPU holds E / e of them.
        let (mut all, mut one) = (PassTimes::default(), PassTimes::default());
        self.add_mlp(&mut all, gpu, (rows, moe.experts), moe.expert_ffn / t);
        self.add_mlp(&mut one, gpu, (copies, 1), moe.expert_ffn / t);
        times.experts_held_fwd += (all.fwd - one.fwd).max(0.0);
        times.experts_held_bwd += (all.bwd - one.bwd).max(0.0);
        activation_bytes += self.add_mlp(times, gpu, (tokens, 1), moe.shared_ffn / t);
        // The router's top-k and the copies' permutation and its reverse.
        times.add_replicated(gpu, BF16 * ((3 * copies + tokens) * h) as f64, 3);
        activation_bytes
    }

    /// The head on one of `t` shards: the final norm (reads and writes h,
    /// whole on every shard), the projection onto the padded vocabulary's
    /// V / t columns, and the loss: the logits cast to fp32 (reading 2
    /// and writing 4 bytes each) and read by the cross-entropy (4).
    fn head_times(&self, gpu: &GpuType, tokens: u64, t: u64) -> PassTimes {
        let (h, columns) = (self.hidden, self.padded_vocabulary() / t);
        let mut times = PassTimes::default();
        times.add_weight_product(gpu, tokens, columns, h);
        times.add_replicated(gpu, BF16 * (tokens * 2 * h) as f64, 1);
        // The cast to fp32 and the cross-entropy.
        times.add_memory_bound(gpu, 10.0 * (tokens * columns) as f64, 2);
        times
    }
}

/// A profile of `config` (called `model`) trained at `options`.
pub fn transformer_profile(
    model: &str,
    config: &TransformerConfig,
    options: &TransformerOptions,
) -> Result<Profile> {
    let gpu = gpu_type(&options.gpu).map_err(|e| e.under("gpu"))?;
    check_options(options)?;
    let s = options.seq_len as f64;
    let attention =
        options
            .attention
            .unwrap_or(if AttentionKernel::Flash.check_runs_on(gpu).is_ok() {
                AttentionKernel::Flash
            } else {
                AttentionKernel::Unfused
            });
    let timing = match options.efficiency {
        Some(efficiency) => Timing::Efficiency {
            flops_per_ms: gpu.bf16_tflops * 1e9 * efficiency,
        },
        None => {
            // A kernel that does not run on this GPU is refused here, once.
            attention.check_runs_on(gpu)?;
            Timing::Operators { gpu, attention }
        }
    };
    let maker = LayerMaker {
        config,
        s,
        seq_len: options.seq_len,
        timing,
        attention,
        micro_batch_sizes: &options.micro_batch_sizes,
        expert_imbalance: options.expert_imbalance,
        dispatcher: options.dispatcher,
        host_ms_per_kernel: match timing {
            Timing::Efficiency { .. } => 0.0,
            Timing::Operators { .. } => options.host_us_per_kernel / 1e3,
        },
    };
    // The blocks of a kind are alike: one is timed, the others are its
    // copies (a mixture-of-experts model's dense first blocks are the other kind).
    let dense = maker.block(false)?;
    let with_experts = match config.moe {
        Some(_) => Some(maker.block(true)?),
        None => None,
    };
    let blocks = (0..config.blocks).map(|i| Layer {
        name: format!("block_{i}"),
        ..match (&with_experts, config.has_experts(i)) {
            (Some(block), true) => block,
            _ => &dense,
        }
        .clone()
    });
    let layers: Vec<Layer> = std::iter::once(maker.embedding()?)
        .chain(blocks)
        .chain(std::iter::once(maker.lm_head()?))
        .collect();
    let with_experts_count = config.moe.map_or(0, |m| config.blocks - m.dense_blocks);
    let fwd_flops = (config.blocks - with_experts_count) as f64 * config.block_fwd_flops(s, false)
        + with_experts_count as f64 * config.block_fwd_flops(s, true)
        + head_fwd_flops(config, s);
    let parameter_state = ParameterState {
        weight_bytes: BF16,
        gradient_bytes: options.gradients.bytes(),
        master_weight_bytes: FP32,
        optimizer_bytes: 2.0 * FP32,
    };
    // Operator by operator, Adam's step is a memory-bound operator over
    // every parameter; the efficiency rule (before issue 45) had none.
    let optimizer_step_ms = options.efficiency.is_none().then(|| {
        let params: f64 = layers.iter().map(|l| l.param_bytes as f64).sum::<f64>() / BF16;
        memory_bound_ms(gpu, params * parameter_state.step_bytes())
    });
    let profile = Profile {
        optimizer_step_ms,
        optimizer_step_bytes: None,
        dtype: None,
        allocator_reserved_factor: None,
        format: crate::formats::format::PROFILE.name.into(),
        schema_version: crate::formats::format::PROFILE.version,
        model: model.into(),
        source: Some(source(model, gpu, options, attention)),
        device: Some(gpu.name.into()),
        optimizer: "adam".into(),
        layers,
        other_devices: Vec::new(),
        parameter_state: Some(parameter_state),
        // Forward and backward (twice the forward): the work MFU counts.
        model_flops_per_sample: Some(3.0 * fwd_flops),
    };
    profile.validate()?;
    Ok(profile)
}

fn check_options(options: &TransformerOptions) -> Result<()> {
    if options.seq_len == 0 {
        return Err(Error::field("seq_len", "value 0 must be >= 1"));
    }
    if let Some(efficiency) = options.efficiency {
        if !(efficiency > 0.0 && efficiency <= 1.0) {
            return Err(Error::field(
                "efficiency",
                format!(
                    "value {efficiency} must be in (0, 1]: the share of the GPU's peak the layers reach"
                ),
            ));
        }
    }
    let host = options.host_us_per_kernel;
    if !(host.is_finite() && host >= 0.0) {
        return Err(Error::field(
            "host_us_per_kernel",
            format!("value {host} must be a finite number >= 0: the host's time to issue one kernel, us"),
        ));
    }
    let imbalance = options.expert_imbalance;
    if !(imbalance.is_finite() && imbalance >= 1.0) {
        return Err(Error::field(
            "expert_imbalance",
            format!("value {imbalance} must be a finite number >= 1: the busiest GPU's routed tokens over the mean"),
        ));
    }
    let sizes = &options.micro_batch_sizes;
    if sizes.is_empty() || sizes.contains(&0) || sizes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::field(
            "micro_batch_sizes",
            format!("value {sizes:?} must be ascending whole numbers >= 1"),
        ));
    }
    Ok(())
}

fn source(
    model: &str,
    gpu: &GpuType,
    options: &TransformerOptions,
    attention: AttentionKernel,
) -> String {
    let times = match options.efficiency {
        Some(efficiency) => format!(
            "times = FLOPs / ({efficiency} x the {} bf16 peak of {} TFLOP/s)",
            gpu.name, gpu.bf16_tflops
        ),
        None => format!(
            "times operator by operator on {} ({} attention): matrix products by their tiles and waves at {} of {} TFLOP/s, \
             memory-bound operators and Adam's step at {} GB/s, each pass at least its kernels issued at {} us each, \
             each shard at its own shapes",
            gpu.name,
            attention.name(),
            SUSTAINED_SHARE,
            gpu.kernels.gemm_tflops,
            gpu.kernels.hbm_gb_per_s,
            options.host_us_per_kernel
        ),
    };
    let gradients = match options.gradients {
        GradientPrecision::Bf16 => "",
        GradientPrecision::Fp32 => "; gradients accumulated and reduced in fp32",
    };
    format!(
        "analytic, not measured: {model} at sequence length {}, {times}{gradients}; \
         bytes, FLOPs and operators as docs/cost-model.md (Transformer profiles) says",
        options.seq_len
    )
}

fn divisor(what: &str, count: u64) -> Divisor {
    Divisor {
        what: what.into(),
        count,
    }
}

/// How a generated profile times its layers.
#[derive(Clone, Copy)]
enum Timing {
    /// FLOPs at one rate (the user's efficiency of the bf16 peak).
    Efficiency { flops_per_ms: f64 },
    /// Operator by operator, each by its shape on the GPU (`model/kernels.rs`).
    Operators {
        gpu: &'static GpuType,
        attention: AttentionKernel,
    },
}

/// The kinds of layer a transformer profile has.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LayerKind {
    Embedding,
    /// A block, with the mixture of experts or its dense MLP.
    Block {
        experts: bool,
    },
    Head,
}

impl LayerKind {
    fn is_block(self) -> bool {
        matches!(self, LayerKind::Block { .. })
    }
}

/// One layer's times at one micro-batch size and split degree, ms: the
/// forward, the backward and, of the backward, the weight gradient.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
struct PassTimes {
    fwd: f64,
    bwd: f64,
    weight: f64,
    /// Forward and backward of the operators a split leaves whole on every
    /// shard (norms, residual adds, the lookup, the loss's norm).
    replicated: f64,
    /// Of the forward, what selective re-computation runs again (the
    /// unfused attention core).
    selective: f64,
    /// Of the forward and backward, what grows with the routed experts a
    /// GPU holds (`Measurement::experts_held_fwd_ms`).
    experts_held_fwd: f64,
    experts_held_bwd: f64,
    /// Of the forward and backward, the attention core's: what context
    /// parallelism's exchange of keys and values runs beside.
    attention_core: f64,
    /// Kernels each pass launches: what the host issues, one at a time.
    fwd_kernels: f64,
    bwd_kernels: f64,
}

impl PassTimes {
    /// A weight's product of `tokens` rows in, `outputs` columns out, over
    /// `inputs`: its forward, its input gradient and its weight gradient.
    /// Returns its forward's and backward's time together.
    fn add_weight_product(&mut self, gpu: &GpuType, tokens: u64, outputs: u64, inputs: u64) -> f64 {
        self.add_grouped_product(gpu, 1, tokens, outputs, inputs)
    }

    /// `groups` such products of as many rows each (one weight each: the
    /// routed experts), run as one grouped kernel whose tiles share the
    /// SMs' waves (`Gemm::batch`), as TransformerEngine's GroupedLinear
    /// runs them.
    fn add_grouped_product(
        &mut self,
        gpu: &GpuType,
        groups: u64,
        tokens: u64,
        outputs: u64,
        inputs: u64,
    ) -> f64 {
        let product = |m: u64, n: u64, k: u64| {
            Gemm {
                m,
                n,
                k,
                batch: groups,
            }
            .ms(gpu)
        };
        let fwd = product(tokens, outputs, inputs);
        let weight = product(inputs, outputs, tokens);
        let bwd = product(tokens, inputs, outputs) + weight;
        self.fwd += fwd;
        self.bwd += bwd;
        self.weight += weight;
        self.fwd_kernels += 1.0;
        self.bwd_kernels += 2.0;
        fwd + bwd
    }

    /// The same, for a product every shard of a split runs whole.
    fn add_whole_product(&mut self, gpu: &GpuType, tokens: u64, outputs: u64, inputs: u64) {
        self.replicated += self.add_weight_product(gpu, tokens, outputs, inputs);
    }

    /// `kernels` memory-bound operators that move `bytes` forward; their
    /// backward reads the output's gradient and the saved input and writes
    /// the input's gradient: twice the traffic (an assumption,
    /// docs/cost-model.md), a kernel each.
    fn add_memory_bound(&mut self, gpu: &GpuType, bytes: f64, kernels: u32) {
        let ms = memory_bound_ms(gpu, bytes);
        self.fwd += ms;
        self.bwd += 2.0 * ms;
        self.fwd_kernels += f64::from(kernels);
        self.bwd_kernels += f64::from(kernels);
    }

    /// The same, for operators every shard of a split runs whole.
    fn add_replicated(&mut self, gpu: &GpuType, bytes: f64, kernels: u32) {
        self.add_memory_bound(gpu, bytes, kernels);
        self.replicated += 3.0 * memory_bound_ms(gpu, bytes);
    }

    /// Each pass no shorter than its host takes to issue its kernels
    /// (`host_ms_per_kernel` each): an eager runtime issues them one at a
    /// time, and a GPU that runs them faster waits for the next. The
    /// weight gradient keeps its share of the backward.
    fn issued_at(mut self, host_ms_per_kernel: f64) -> PassTimes {
        let fwd = self.fwd.max(self.fwd_kernels * host_ms_per_kernel);
        let bwd = self.bwd.max(self.bwd_kernels * host_ms_per_kernel);
        if self.bwd > 0.0 {
            self.weight = (self.weight * bwd / self.bwd).min(bwd);
        }
        (self.fwd, self.bwd) = (fwd, bwd);
        self
    }

    /// The forward and backward together, the operators every shard
    /// would run whole on 1/`sequence_split` of the tokens (sequence
    /// parallelism; 1: none), issued at `host_ms_per_kernel`.
    fn sequence_split_ms(&self, sequence_split: u64, host_ms_per_kernel: f64) -> f64 {
        let total = self.fwd + self.bwd;
        let saved = if total > 0.0 {
            self.replicated * (1.0 - 1.0 / sequence_split as f64) / total
        } else {
            0.0
        };
        let split = PassTimes {
            fwd: self.fwd * (1.0 - saved),
            bwd: self.bwd * (1.0 - saved),
            ..*self
        }
        .issued_at(host_ms_per_kernel);
        split.fwd + split.bwd
    }
}

/// Kernels the attention core launches each pass: FlashAttention's one;
/// unfused, the two products and the softmax forward, their four
/// gradients' products and the softmax's backward, and the probabilities'
/// dropout each pass where it drops.
fn attention_kernels(kernel: AttentionKernel, dropout: bool) -> (f64, f64) {
    let dropped = if dropout { 1.0 } else { 0.0 };
    match kernel {
        AttentionKernel::Flash => (1.0, 1.0),
        AttentionKernel::Unfused => (3.0 + dropped, 5.0 + dropped),
    }
}

/// The layers of one profile: `config` at `s` tokens a sample, timed as
/// `timing` says at each micro-batch size.
struct LayerMaker<'a> {
    config: &'a TransformerConfig,
    s: f64,
    seq_len: u64,
    timing: Timing,
    attention: AttentionKernel,
    micro_batch_sizes: &'a [u32],
    expert_imbalance: f64,
    dispatcher: TokenDispatcher,
    /// What the runtime's host takes to issue one kernel, ms (`PassTimes::issued_at`).
    host_ms_per_kernel: f64,
}

impl LayerMaker<'_> {
    /// The profile's patterns: bf16 activations, the vocabulary padded as
    /// Megatron-LM pads it.
    fn splits(&self) -> SplitMaker<'_> {
        SplitMaker {
            config: self.config,
            s: self.s,
            value_bytes: BF16,
            attention: self.attention,
            vocabulary: self.config.padded_vocabulary(),
            vocabulary_what: "vocabulary entries (padded to a multiple of 128)",
            // Megatron-LM's: `--sequence-parallel` (its head gathers the
            // sequence after the final norm, which this pattern keeps whole).
            sequence_parallel: true,
        }
    }

    /// A layer's times at `b` samples on one of `t` shards: its forward
    /// FLOPs (`flops.0`, of which `flops.1` multiply weights) at the user's
    /// rate (linear in the batch, the backward twice the forward, its
    /// weight gradient as many FLOPs as the forward's weight products), or
    /// its operators each by its shape.
    fn times(&self, kind: LayerKind, flops: (f64, f64), b: u32, t: u64) -> Result<PassTimes> {
        match self.timing {
            Timing::Efficiency { flops_per_ms } => {
                let fwd = f64::from(b) * flops.0 / flops_per_ms;
                let unfused_core = kind.is_block() && self.attention == AttentionKernel::Unfused;
                // A block's FLOPs that multiply no weight are its attention core's.
                let core = if kind.is_block() {
                    f64::from(b) * (flops.0 - flops.1) / flops_per_ms
                } else {
                    0.0
                };
                Ok(PassTimes {
                    fwd,
                    bwd: 2.0 * fwd,
                    weight: f64::from(b) * flops.1 / flops_per_ms,
                    replicated: 0.0,
                    selective: if unfused_core { core } else { 0.0 },
                    attention_core: 3.0 * core,
                    // FLOPs at one rate: holding more experts takes no longer.
                    ..PassTimes::default()
                })
            }
            Timing::Operators { gpu, attention } => {
                let tokens = u64::from(b) * self.seq_len;
                Ok(match kind {
                    LayerKind::Embedding => self.config.embedding_times(gpu, tokens),
                    LayerKind::Block { experts } => {
                        self.config
                            .block_times(gpu, (attention, experts), (b, self.seq_len), t)?
                    }
                    LayerKind::Head => self.config.head_times(gpu, tokens, t),
                })
            }
        }
    }

    /// A layer's measurements from its `times` at each micro-batch size,
    /// stored and output bytes per sample.
    fn measurements(
        &self,
        kind: LayerKind,
        times: &[PassTimes],
        (stored, activation): (f64, f64),
    ) -> Vec<Measurement> {
        let selective_per_sample = if kind.is_block() {
            self.config
                .attention_core_stored_bytes(self.s, BF16, self.attention)
        } else {
            0.0
        };
        self.micro_batch_sizes
            .iter()
            .zip(times)
            .map(|(&b, times)| {
                let selective = f64::from(b) * selective_per_sample;
                Measurement {
                    backward_working_bytes: None,
                    recompute_fwd_ms: None,
                    selective_stored_bytes: (selective > 0.0).then(|| selective.round() as u64),
                    selective_recompute_ms: (selective > 0.0).then_some(times.selective),
                    experts_held_fwd_ms: (times.experts_held_fwd > 0.0)
                        .then_some(times.experts_held_fwd),
                    experts_held_bwd_ms: (times.experts_held_bwd > 0.0)
                        .then_some(times.experts_held_bwd),
                    bwd_weight_ms: Some(times.weight),
                    loss_stored_bytes: None,
                    batch_size: b,
                    fwd_ms: times.fwd,
                    bwd_ms: times.bwd,
                    activation_bytes: (f64::from(b) * activation).round() as u64,
                    stored_activation_bytes: Some((f64::from(b) * stored).round() as u64),
                }
            })
            .collect()
    }

    /// `pattern` with the share of the layer's time every shard spends
    /// whole (operators a split does not divide), at the smallest
    /// micro-batch size (`smallest`, its times); FLOPs at one rate divide
    /// whole (share 0).
    fn with_replicated_compute(mut pattern: SplitPattern, smallest: &PassTimes) -> SplitPattern {
        let total = smallest.fwd + smallest.bwd;
        pattern.replicated_compute_fraction = if total > 0.0 {
            (smallest.replicated / total).clamp(0.0, 1.0)
        } else {
            0.0
        };
        pattern
    }

    /// A layer of `kind` named `name` with its parameter bytes, forward
    /// FLOPs, stored and output bytes per sample, and split pattern.
    fn layer(
        &self,
        (name, kind): (String, LayerKind),
        param_bytes: f64,
        flops: (f64, f64),
        (stored, activation): (f64, f64),
        split: SplitPattern,
    ) -> Result<Layer> {
        // Each micro-batch size timed once.
        let times = self
            .micro_batch_sizes
            .iter()
            .map(|&b| {
                Ok(self
                    .times(kind, flops, b, 1)?
                    .issued_at(self.host_ms_per_kernel))
            })
            .collect::<Result<Vec<PassTimes>>>()?;
        let mut split = Self::with_replicated_compute(split, &times[0]);
        split.shard_compute = self.shard_compute(kind, flops, &split, &times)?;
        Ok(Layer {
            weight_copy_bytes: None,
            name,
            kind: kind.is_block().then(|| BLOCK_KIND.into()),
            param_bytes: param_bytes as u64,
            inputs: None,
            measurements: self.measurements(kind, &times, (stored, activation)),
            split: vec![split],
            experts: None,
            context: Some(self.context_pattern(kind, &times[0])),
        })
    }

    /// A shard's time over the whole layer's (`whole`, at each micro-batch
    /// size), each timed operator by operator at the shard's own shapes, at
    /// every degree up to `MAX_TIMED_SPLIT_DEGREE` that `pattern` allows;
    /// none where the layers run at one rate (FLOPs divide whole).
    fn shard_compute(
        &self,
        kind: LayerKind,
        flops: (f64, f64),
        pattern: &SplitPattern,
        whole: &[PassTimes],
    ) -> Result<Vec<ShardCompute>> {
        if matches!(self.timing, Timing::Efficiency { .. }) {
            return Ok(Vec::new());
        }
        let mut table = Vec::new();
        for degree in (2..=MAX_TIMED_SPLIT_DEGREE).filter(|&t| pattern.allows(t)) {
            for (&b, whole) in self.micro_batch_sizes.iter().zip(whole) {
                let total = whole.fwd + whole.bwd;
                if total <= 0.0 {
                    continue;
                }
                let shard = self.times(kind, flops, b, u64::from(degree))?;
                let sequence_split = if pattern.sequence_parallel {
                    u64::from(degree)
                } else {
                    1
                };
                table.push(ShardCompute {
                    degree,
                    batch_size: b,
                    factor: shard.sequence_split_ms(1, self.host_ms_per_kernel) / total,
                    sequence_parallel_factor: shard
                        .sequence_split_ms(sequence_split, self.host_ms_per_kernel)
                        / total,
                });
            }
        }
        Ok(table)
    }

    /// How the layer's sequence is cut over GPUs (`model/context.rs`): every
    /// layer works token by token but a block's attention, which passes
    /// its keys and values (bf16, whole heads: MLA's up-projected ones)
    /// around the ring beside its core's share of the layer's time (at the
    /// smallest micro-batch size, `smallest`).
    fn context_pattern(&self, kind: LayerKind, smallest: &PassTimes) -> ContextPattern {
        let total = smallest.fwd + smallest.bwd;
        let (kv_bytes_per_sample, attention_compute_fraction) = if kind.is_block() {
            let kv_values_per_token = self.config.kv_values_per_token() as f64;
            (
                self.s * kv_values_per_token * BF16,
                if total > 0.0 {
                    (smallest.attention_core / total).clamp(0.0, 1.0)
                } else {
                    0.0
                },
            )
        } else {
            (0.0, 0.0)
        };
        ContextPattern {
            sequence_length: self.seq_len,
            kv_bytes_per_sample,
            attention_compute_fraction,
        }
    }

    /// Token and (GPT) position embeddings; split over the vocabulary, each
    /// shard looks up its own rows and an AllReduce sums the output. A
    /// lookup: no FLOPs worth counting; it keeps the token ids.
    fn embedding(&self) -> Result<Layer> {
        let (config, s) = (self.config, self.s);
        let h = config.hidden as f64;
        let tokens = config.padded_vocabulary() as f64 * h;
        let positions = config.positions.map_or(0.0, |p| p as f64 * h);
        self.layer(
            ("embedding".into(), LayerKind::Embedding),
            (tokens + positions) * BF16,
            (0.0, 0.0),
            (s * TOKEN_ID, s * h * BF16),
            self.splits().embedding(),
        )
    }

    /// A block (named by the caller), with the mixture of experts where
    /// `experts`: Megatron-LM's split, attention heads and MLP columns then
    /// rows, an AllReduce of the block's output after each (2 forward, 2
    /// backward).
    fn block(&self, experts: bool) -> Result<Layer> {
        let (config, s) = (self.config, self.s);
        let (params, _) = config.block_params(experts);
        let (stored, _) = config.block_stored_bytes(s, BF16, (self.attention, experts));
        let mut layer = self.layer(
            ("block".into(), LayerKind::Block { experts }),
            params * BF16,
            (
                config.block_fwd_flops(s, experts),
                config.block_weight_flops(s, experts),
            ),
            (stored, s * config.hidden as f64 * BF16),
            self.splits().block(experts),
        )?;
        layer.experts = config
            .expert_pattern(s, BF16)
            .filter(|_| experts)
            .map(|pattern| ExpertPattern {
                imbalance: self.expert_imbalance,
                dispatcher: self.dispatcher,
                ..pattern
            });
        Ok(layer)
    }

    /// The final norm, the output projection and the loss. Split over the
    /// vocabulary with a distributed softmax (Whale's SP1): forward, each
    /// token's maximum and sum are reduced (two fp32 numbers); backward, the
    /// input's gradient. The logits are kept in fp32 for the loss; its
    /// output is the loss, one number per token.
    fn lm_head(&self) -> Result<Layer> {
        let (config, s) = (self.config, self.s);
        let h = config.hidden as f64;
        let norm = if config.biases { 2.0 * h } else { h };
        let projection = config.padded_vocabulary() as f64 * h;
        let whole_stored = 2.0 * s * h * BF16;
        let logits = s * config.padded_vocabulary() as f64 * FP32;
        let flops = head_fwd_flops(config, s);
        self.layer(
            ("lm_head".into(), LayerKind::Head),
            (norm + projection) * BF16,
            (flops, flops),
            (whole_stored + logits, s * FP32),
            self.splits().lm_head(),
        )
    }
}

/// The ways a transformer's layers split over t GPUs (what a profile's
/// `split` lists): the embedding over the vocabulary, a block Megatron-LM's
/// way, the LM head over the vocabulary with a distributed softmax (SP1).
/// The one rule for both the analytic profiles (bf16, padded vocabulary)
/// and a runtime model's (`transformer_splits`: its own value size and
/// vocabulary, which is what its shards divide).
struct SplitMaker<'a> {
    config: &'a TransformerConfig,
    /// Tokens per sample.
    s: f64,
    /// Bytes of one activation value (2 for bf16, 4 for fp32).
    value_bytes: f64,
    attention: AttentionKernel,
    /// Vocabulary entries the embedding and the head are split over.
    vocabulary: u64,
    vocabulary_what: &'a str,
    /// The embedding and blocks may run with sequence parallelism (the
    /// runtime the profile is for has it).
    sequence_parallel: bool,
}

impl SplitMaker<'_> {
    fn vocabulary_divisor(&self) -> Divisor {
        divisor(self.vocabulary_what, self.vocabulary)
    }

    /// Each shard looks up its own rows of the token embedding (the
    /// position embedding is replicated) and an AllReduce sums the output.
    fn embedding(&self) -> SplitPattern {
        let h = self.config.hidden as f64;
        let tokens = self.vocabulary as f64 * h;
        let positions = self.config.positions.map_or(0.0, |p| p as f64 * h);
        SplitPattern {
            name: "vocabulary-parallel embedding".into(),
            divides: vec![self.vocabulary_divisor()],
            fwd_allreduce_bytes_per_sample: self.s * h * self.value_bytes,
            bwd_allreduce_bytes_per_sample: 0.0,
            replicated_param_fraction: positions / (tokens + positions),
            replicated_stored_fraction: 1.0,
            replicated_compute_fraction: 0.0,
            allreduce_calls_per_pass: 1,
            // Under sequence parallelism Megatron-LM reduce-scatters the
            // output instead, at an AllReduce's price: its lookup and
            // token ids change nothing worth a shard's count.
            sequence_parallel: false,
            shard_compute: Vec::new(),
        }
    }

    /// Attention heads and MLP columns (each expert's, where `experts`),
    /// then rows: an AllReduce of the block's output after each (2
    /// forward, 2 backward).
    fn block(&self, experts: bool) -> SplitPattern {
        let (config, s) = (self.config, self.s);
        let h = config.hidden as f64;
        let (params, whole_params) = config.block_params(experts);
        let (stored, whole_stored) =
            config.block_stored_bytes(s, self.value_bytes, (self.attention, experts));
        SplitPattern {
            name: "megatron-block".into(),
            divides: vec![
                divisor("attention heads", config.heads),
                divisor("KV heads", config.kv_heads),
            ],
            fwd_allreduce_bytes_per_sample: 2.0 * s * h * self.value_bytes,
            bwd_allreduce_bytes_per_sample: 2.0 * s * h * self.value_bytes,
            replicated_param_fraction: whole_params / params,
            replicated_stored_fraction: whole_stored / stored,
            replicated_compute_fraction: 0.0,
            // One after the attention, one after the MLP.
            allreduce_calls_per_pass: 2,
            sequence_parallel: self.sequence_parallel,
            shard_compute: Vec::new(),
        }
    }

    /// Forward, each token's maximum and sum are reduced (two fp32
    /// numbers); backward, the input's gradient. The logits are kept in
    /// fp32 for the loss.
    fn lm_head(&self) -> SplitPattern {
        let (config, s) = (self.config, self.s);
        let h = config.hidden as f64;
        let norm = if config.biases { 2.0 * h } else { h };
        let projection = self.vocabulary as f64 * h;
        let whole_stored = 2.0 * s * h * self.value_bytes;
        let logits = s * self.vocabulary as f64 * FP32;
        SplitPattern {
            name: "vocabulary-parallel head with distributed softmax (SP1)".into(),
            divides: vec![self.vocabulary_divisor()],
            fwd_allreduce_bytes_per_sample: 2.0 * s * FP32,
            bwd_allreduce_bytes_per_sample: s * h * self.value_bytes,
            replicated_param_fraction: norm / (norm + projection),
            replicated_stored_fraction: whole_stored / (whole_stored + logits),
            replicated_compute_fraction: 0.0,
            allreduce_calls_per_pass: 1,
            sequence_parallel: false,
            shard_compute: Vec::new(),
        }
    }
}

/// The sharding patterns of a model's embedding, each block and LM head.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerSplits {
    pub embedding: SplitPattern,
    pub block: SplitPattern,
    pub lm_head: SplitPattern,
    /// A block's routed experts, where the config has a mixture of them.
    pub block_experts: Option<ExpertPattern>,
}

/// The patterns of a model the runtime runs (`planner/runtime/models.py`'s
/// GPT): `seq_len` tokens a sample, activations of `value_bytes` each,
/// the vocabulary as it is (the runtime's shards divide it unpadded).
pub fn transformer_splits(
    config: &TransformerConfig,
    seq_len: u64,
    value_bytes: f64,
) -> TransformerSplits {
    let maker = SplitMaker {
        config,
        s: seq_len as f64,
        value_bytes,
        // torch's scaled-dot-product attention keeps no s x s probabilities on CUDA.
        attention: AttentionKernel::Flash,
        vocabulary: config.vocabulary,
        vocabulary_what: "vocabulary entries",
        // dapple's runtime shards heads and columns, not the sequence.
        sequence_parallel: false,
    };
    TransformerSplits {
        embedding: maker.embedding(),
        block: maker.block(config.moe.is_some()),
        lm_head: maker.lm_head(),
        block_experts: config.expert_pattern(seq_len as f64, value_bytes),
    }
}

fn head_fwd_flops(config: &TransformerConfig, s: f64) -> f64 {
    2.0 * s * config.hidden as f64 * config.vocabulary as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::gpus::gpu_type;
    use crate::cost::shape::{MemorySums, Recompute, StageShape};
    use crate::model::profile::LayerCosts;

    fn options(gpu: &str) -> TransformerOptions {
        TransformerOptions {
            gpu: gpu.into(),
            seq_len: 4096,
            micro_batch_sizes: vec![1, 2],
            efficiency: Some(0.5),
            attention: None,
            expert_imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            gradients: GradientPrecision::Bf16,
            host_us_per_kernel: HOST_US_PER_KERNEL,
        }
    }

    #[test]
    fn llama_2_70b_has_its_published_parameter_count() {
        let c = TransformerConfig::named("llama-2-70b").unwrap();
        assert_eq!(
            (c.hidden, c.ffn, c.heads, c.kv_heads, c.blocks, c.vocabulary),
            (8192, 28672, 64, 8, 80, 32000)
        );
        let p = transformer_profile("llama-2-70b", &c, &options("a100-80gb")).unwrap();
        let params: u64 = p.layers.iter().map(|l| l.param_bytes).sum::<u64>() / 2;
        // 68.98e9 by the published architecture (embedding and head untied).
        assert!((params as f64 - 68.98e9).abs() < 0.01e9, "{params}");
        assert_eq!(p.layers.len(), 82);
        assert_eq!(p.device.as_deref(), Some("A100-80GB"));
        // At an efficiency (the rule before issue 45) no step is timed;
        // operator by operator, Adam's step moves 28 bytes a parameter at
        // A100's 1,759 GB/s: 1.10 s over the whole model, a GPU's share of
        // it in a plan.
        assert_eq!(p.optimizer_step_ms, None);
        let p =
            transformer_profile("llama-2-70b", &c, &by_operator("a100-80gb", 4096, None)).unwrap();
        let step_ms = p.optimizer_step_ms.unwrap();
        assert!(
            (step_ms - params as f64 * 28.0 / 1759e6).abs() < 1e-9,
            "{step_ms}"
        );
        assert!((step_ms - 1098.0).abs() < 1.0, "{step_ms}");
    }

    #[test]
    fn fp32_gradients_are_twice_the_bytes_held_reduced_and_read_by_adam() {
        let c = TransformerConfig::named("llama-2-70b").unwrap();
        let at = |gradients| {
            let options = TransformerOptions {
                gradients,
                ..by_operator("a100-80gb", 4096, None)
            };
            transformer_profile("llama-2-70b", &c, &options).unwrap()
        };
        let (bf16, fp32) = (at(GradientPrecision::Bf16), at(GradientPrecision::Fp32));
        let state = |p: &Profile| p.parameter_state.unwrap();
        assert_eq!(state(&bf16).gradient_bytes, 2.0);
        assert_eq!(state(&fp32).gradient_bytes, 4.0);
        // The weights, their master copy and Adam's moments as before.
        assert_eq!(state(&fp32).weight_bytes, state(&bf16).weight_bytes);
        assert_eq!(state(&fp32).optimizer_bytes, state(&bf16).optimizer_bytes);
        // What replicas reduce, layer by layer: twice the bytes.
        let (b, f) = (LayerCosts::new(&bf16), LayerCosts::new(&fp32));
        let n = bf16.layers.len();
        assert_eq!(f.gradient_bytes(0, n), 2.0 * b.gradient_bytes(0, n));
        // Adam reads 2 bytes a parameter more: 30 where it read 28.
        let step = |p: &Profile| p.optimizer_step_ms.unwrap();
        assert!((step(&fp32) / step(&bf16) - 30.0 / 28.0).abs() < 1e-12);
        assert!(fp32
            .source
            .as_deref()
            .unwrap()
            .contains("gradients accumulated and reduced in fp32"));
        assert!(!bf16.source.as_deref().unwrap().contains("fp32"));
    }

    /// (all, active) parameters of a generated profile: every layer's, and
    /// of its model FLOPs a token's (the FLOPs' weight products / 2s).
    fn parameter_counts(name: &str) -> (f64, f64) {
        let c = TransformerConfig::named(name).unwrap();
        let p = transformer_profile(name, &c, &options("h100")).unwrap();
        let all = p.layers.iter().map(|l| l.param_bytes as f64).sum::<f64>() / BF16;
        let s = 4096.0;
        let with_experts = (0..c.blocks).filter(|&i| c.has_experts(i)).count() as f64;
        let per_token = (with_experts * c.block_weight_flops(s, true)
            + (c.blocks as f64 - with_experts) * c.block_weight_flops(s, false)
            + head_fwd_flops(&c, s))
            / (2.0 * s);
        // The embedding multiplies nothing; its rows count as active.
        let embedding = p.layers[0].param_bytes as f64 / BF16;
        (all, per_token + embedding)
    }

    #[test]
    fn mixtures_of_experts_have_their_published_parameter_counts() {
        // Each model card's totals and parameters active per token:
        // Mixtral 8x7B (Mistral AI, "Mixtral of experts", 2024: 46.7B and
        // 12.9B), Qwen3-30B-A3B (30.5B and 3.3B) and Qwen3-235B-A22B (235B
        // and 22B; Qwen3 technical report, Table 2). Qwen3's per-head
        // q and k norms (2 x 128 values a block) are left out.
        for (name, total, active) in [
            ("mixtral-8x7b", 46.7e9, 12.9e9),
            ("qwen3-30b-a3b", 30.5e9, 3.3e9),
            ("qwen3-235b-a22b", 235e9, 22e9),
            // DeepSeek-V3's report: 671B, 37B activated per token (its
            // multi-token prediction module, 14B more, left out).
            ("deepseek-v3", 671e9, 37e9),
        ] {
            let (all, per_token) = parameter_counts(name);
            assert!((all / total - 1.0).abs() < 0.01, "{name}: {all}");
            assert!(
                (per_token / active - 1.0).abs() < 0.02,
                "{name}: {per_token}"
            );
        }
        // A dense model's active parameters are all of them but its norms'.
        let (all, per_token) = parameter_counts("llama-2-7b");
        assert!((per_token / all - 1.0).abs() < 1e-4, "{per_token} {all}");
    }

    #[test]
    fn a_mixture_of_experts_keeps_its_routed_copies_and_times_each_expert() {
        let c = TransformerConfig::named("mixtral-8x7b").unwrap();
        let moe = c.moe.unwrap();
        assert_eq!(
            (
                moe.experts,
                moe.experts_per_token,
                moe.expert_ffn,
                moe.shared_ffn
            ),
            (8, 2, 14336, 0)
        );
        let (s, h) = (4096.0, 4096.0);
        let (dense_stored, dense_whole) =
            c.block_stored_bytes(s, BF16, (AttentionKernel::Flash, false));
        let (stored, whole) = c.block_stored_bytes(s, BF16, (AttentionKernel::Flash, true));
        // Whole on every shard besides the dense block's: two copies of each
        // token (k s h bf16) and the router's 8 fp32 probabilities a token.
        assert_eq!(whole - dense_whole, s * (2.0 * h * BF16 + 8.0 * FP32));
        // The MLP's inner activations: a token's two experts' (3 x 2 x 14336) for one.
        assert_eq!(
            stored - dense_stored - (whole - dense_whole),
            3.0 * s * 14336.0 * BF16
        );
        // By operator on an H100, a block of two experts of 14336 columns per
        // token runs longer than a dense block of one 14336-wide MLP, and
        // shorter than a dense block of 8 such (the experts' products, one
        // grouped product of 8 over an eighth of the tokens' copies each,
        // run about as efficiently as a dense one).
        let gpu = gpu_type("h100").unwrap();
        let at = |experts| {
            c.block_times(gpu, (AttentionKernel::Flash, experts), (1, 4096), 1)
                .unwrap()
        };
        let (dense, routed) = (at(false), at(true));
        assert!(routed.fwd > dense.fwd, "{routed:?} {dense:?}");
        let mlp = |inner: u64| {
            let mut t = PassTimes::default();
            c.add_mlp(&mut t, gpu, (4096, 1), inner);
            t.fwd
        };
        assert!(
            routed.fwd - dense.fwd < mlp(7 * 14336),
            "{}",
            routed.fwd - dense.fwd
        );
    }

    #[test]
    fn routed_experts_run_as_one_grouped_product() {
        // Eight experts of 512 tokens each fill the same tiles and waves as
        // one product of 4096 tokens (512 rows are four 128-row tiles), so
        // their forward takes as long; eight products one after another
        // would pay eight launches each (the up and the down products) and
        // fill no wave better.
        let c = TransformerConfig::named("mixtral-8x7b").unwrap();
        let gpu = gpu_type("h100").unwrap();
        let fwd = |rows_groups: (u64, u64)| {
            let mut t = PassTimes::default();
            c.add_mlp(&mut t, gpu, rows_groups, 14336);
            t.fwd
        };
        let whole = fwd((4096, 1));
        assert!((fwd((512, 8)) - whole).abs() < 1e-12 * whole);
        let floors = 14.0 * crate::model::kernels::GEMM_FLOOR_MS;
        assert!(8.0 * fwd((512, 1)) - whole >= floors - 1e-12 * whole);
    }

    #[test]
    fn a_mixture_of_experts_records_what_expert_parallelism_spreads_and_exchanges() {
        let c = TransformerConfig::named("mixtral-8x7b").unwrap();
        let p = transformer_profile("mixtral-8x7b", &c, &options("h100")).unwrap();
        let block = &p.layers[1];
        let experts = block
            .experts
            .as_ref()
            .expect("Mixtral's blocks have experts");
        assert_eq!((experts.count, experts.per_token), (8, 2));
        // One all-to-all of a sample: its 4096 tokens' two copies of 4096
        // values in bf16, 64 MiB.
        assert_eq!(
            experts.all_to_all_bytes_per_sample,
            4096.0 * 2.0 * 4096.0 * 2.0
        );
        // The routed experts' weights: 8 experts of three 4096 x 14336
        // matrices, in bf16 (97% of the block; the attention, router and
        // norms the rest).
        let routed = 8.0 * 3.0 * 4096.0 * 14336.0 * 2.0;
        assert!((experts.param_fraction * block.param_bytes as f64 - routed).abs() < 1.0);
        assert!((0.97..0.98).contains(&experts.param_fraction));
        // Without shared experts, the split block's gather into its MLP
        // (one of its two collectives, 4096 tokens of 4096 values in bf16)
        // is what spread experts exchange instead; DeepSeek-V3's shared
        // expert still needs it.
        let split = &block.split[0];
        assert_eq!(split.allreduce_calls_per_pass, 2);
        assert_eq!(
            experts.split_gather_bytes_per_sample,
            split.fwd_allreduce_bytes_per_sample / 2.0
        );
        assert_eq!(experts.split_gather_bytes_per_sample, 4096.0 * 4096.0 * 2.0);
        // The routed experts' share of the block's forward FLOPs: two
        // experts of three 4096 x 14336 products a token.
        let routed = 2.0 * 4096.0 * (2.0 * 3.0 * 4096.0 * 14336.0);
        assert_eq!(
            experts.compute_fraction,
            routed / c.block_fwd_flops(4096.0, true)
        );
        assert!((0.75..0.9).contains(&experts.compute_fraction));
        // Balanced unless the options say otherwise.
        assert_eq!(experts.imbalance, 1.0);
        let skewed = TransformerOptions {
            expert_imbalance: 1.3,
            dispatcher: TokenDispatcher::AllToAll,
            ..options("h100")
        };
        let skewed = transformer_profile("mixtral-8x7b", &c, &skewed).unwrap();
        assert_eq!(skewed.layers[1].experts.as_ref().unwrap().imbalance, 1.3);
        let bad = TransformerOptions {
            expert_imbalance: 0.9,
            dispatcher: TokenDispatcher::AllToAll,
            ..options("h100")
        };
        let error = transformer_profile("mixtral-8x7b", &c, &bad).unwrap_err();
        assert!(error
            .to_string()
            .contains("expert_imbalance: value 0.9 must be a finite number >= 1"));
        let deepseek = TransformerConfig::named("deepseek-v3").unwrap();
        let deepseek = transformer_profile("deepseek-v3", &deepseek, &options("h100")).unwrap();
        let shared = deepseek
            .layers
            .iter()
            .find_map(|l| l.experts.as_ref())
            .unwrap();
        assert_eq!(shared.split_gather_bytes_per_sample, 0.0);
        // DeepSeek-V3 routes a token to 4 of 8 groups of 32 experts
        // (`n_group`, `topk_group`); the dispatcher is the options'.
        assert_eq!(
            shared.routing_groups,
            Some(RoutingGroups {
                groups: 8,
                per_token: 4
            })
        );
        assert_eq!(shared.dispatcher, TokenDispatcher::AllToAll);
        let deepep = TransformerOptions {
            dispatcher: TokenDispatcher::DeepEp,
            ..options("h100")
        };
        let deepep = transformer_profile("mixtral-8x7b", &c, &deepep).unwrap();
        assert_eq!(
            deepep.layers[1].experts.as_ref().unwrap().dispatcher,
            TokenDispatcher::DeepEp
        );
        // Neither the embedding, nor the head, nor a dense model's blocks.
        assert!(p.layers[0].experts.is_none() && p.layers.last().unwrap().experts.is_none());
        let dense = TransformerConfig::named("llama-2-7b").unwrap();
        let dense = transformer_profile("llama-2-7b", &dense, &options("h100")).unwrap();
        assert!(dense.layers.iter().all(|l| l.experts.is_none()));
    }

    #[test]
    fn a_mixture_records_what_holding_its_experts_takes() {
        let by_operator = |gpu: &str, seq_len: u64| TransformerOptions {
            efficiency: None,
            seq_len,
            ..options(gpu)
        };
        // Mixtral's 8 experts of 1024 copies each (2 of 4096 tokens) fill
        // the SMs' waves as one expert of all 8192 would: holding 8 takes
        // little more than holding one.
        let c = TransformerConfig::named("mixtral-8x7b").unwrap();
        let p = transformer_profile("mixtral-8x7b", &c, &by_operator("h100", 4096)).unwrap();
        let m = &p.layers[1].measurements[0];
        let held = m.experts_held_fwd_ms.unwrap_or(0.0);
        assert!(held < 0.05 * m.fwd_ms, "{held} of {}", m.fwd_ms);
        // An M6-MoE-1T stand-in's block: 2400 experts for 1024 copies (2
        // of 512 tokens), one row each, reads 2400 experts' weights where
        // one expert would take every copy: most of its forward.
        let m6 = TransformerConfig::from_json(
            r#"{"model_type": "mixtral", "hidden_act": "gelu", "hidden_size": 1024,
                "intermediate_size": 4224, "num_attention_heads": 16, "num_key_value_heads": 16,
                "num_hidden_layers": 2, "vocab_size": 50000, "max_position_embeddings": 512,
                "num_local_experts": 2400, "num_experts_per_tok": 2}"#,
        )
        .unwrap();
        let p = transformer_profile("m6", &m6, &by_operator("v100-32gb", 512)).unwrap();
        let m = &p.layers[1].measurements[0];
        let gpu = gpu_type("v100-32gb").unwrap();
        let (mut all, mut one) = (PassTimes::default(), PassTimes::default());
        m6.add_mlp(&mut all, gpu, (1, 2400), 4224);
        m6.add_mlp(&mut one, gpu, (1024, 1), 4224);
        assert_eq!(m.experts_held_fwd_ms, Some(all.fwd - one.fwd));
        assert_eq!(m.experts_held_bwd_ms, Some(all.bwd - one.bwd));
        assert!(
            all.fwd - one.fwd > 0.5 * m.fwd_ms,
            "{} of {}",
            all.fwd - one.fwd,
            m.fwd_ms
        );
        // FLOPs at one rate: no part grows with the experts held.
        let p = transformer_profile("mixtral-8x7b", &c, &options("h100")).unwrap();
        assert!(p.layers[1].measurements[0].experts_held_fwd_ms.is_none());
    }

    #[test]
    fn a_moe_config_names_its_bad_field() {
        let base = |extra: &str| {
            format!(
                r#"{{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100{extra}}}"#
            )
        };
        let error = |extra: &str| {
            TransformerConfig::from_json(&base(extra))
                .unwrap_err()
                .to_string()
        };
        assert!(error(r#", "num_experts": 4, "num_experts_per_tok": 5"#)
            .contains("num_experts_per_tok: value 5 is more than the 4 routed experts"));
        assert!(error(r#", "num_experts": 4"#).contains("num_experts_per_tok: is missing"));
        assert!(
            error(r#", "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0]"#)
                .contains("mlp_only_layers: value [0]")
        );
        assert!(error(r#", "kv_lora_rank": 512"#)
            .contains("qk_nope_head_dim: is missing: latent attention (kv_lora_rank) needs"));
        assert!(error(
            r#", "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 3"#
        )
        .contains("first_k_dense_replace: value 3 is more than the 2 blocks"));
        assert!(
            error(r#", "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 3"#)
                .contains("n_group: value 3 must divide the 8 routed experts into equal groups")
        );
        assert!(error(
            r#", "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 1"#
        )
        .contains("topk_group: value 1 must be at most the 4 groups, and its groups must hold the 4 experts"));
        // DeepSeek's keys: shared experts of the routed ones' width, dense first blocks.
        let c = TransformerConfig::from_json(&base(
            r#", "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1"#,
        ))
        .unwrap();
        assert_eq!(
            c.moe,
            Some(MoeConfig {
                experts: 4,
                experts_per_token: 2,
                expert_ffn: 32,
                shared_ffn: 32,
                dense_blocks: 1,
                routing_groups: None,
            })
        );
        assert!(!c.has_experts(0) && c.has_experts(1));
    }

    #[test]
    fn gpt3_flops_per_sample_follow_megatrons_formula() {
        // Narayanan et al. 2021, eq. (3): 72 B s l h^2 (1 + s / 6h + V / 12lh) per iteration.
        let c = TransformerConfig::named("gpt3-175b").unwrap();
        let mut o = options("a100-80gb");
        o.seq_len = 2048;
        let p = transformer_profile("gpt3-175b", &c, &o).unwrap();
        let (s, l, h, v) = (2048.0, 96.0, 12288.0, 50257.0);
        let megatron = 72.0 * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
        let ours = p.model_flops_per_sample.unwrap();
        assert!((ours / megatron - 1.0).abs() < 1e-12, "{ours} {megatron}");
    }

    #[test]
    fn a_block_runs_at_the_efficiency_of_the_peak() {
        let c = TransformerConfig::named("llama-2-7b").unwrap();
        let p = transformer_profile("llama-2-7b", &c, &options("h100")).unwrap();
        let m = &p.layers[1].measurements[1];
        let flops = c.block_fwd_flops(4096.0, false) * 2.0;
        assert!((m.fwd_ms - flops / (989.5e12 * 0.5) * 1e3).abs() < 1e-9);
        assert_eq!(m.bwd_ms, 2.0 * m.fwd_ms);
        // Its weight gradient: the weight products' FLOPs, the forward's
        // but for QK^T and AV (4 s^2 h).
        let weights = flops - 2.0 * 4.0 * 4096.0 * 4096.0 * c.hidden as f64;
        let w = m.bwd_weight_ms.unwrap();
        assert!((w - weights / (989.5e12 * 0.5) * 1e3).abs() < 1e-9);
        assert_eq!(m.activation_bytes, 2 * 4096 * 4096 * 2);
    }

    fn by_operator(
        gpu: &str,
        seq_len: u64,
        attention: Option<AttentionKernel>,
    ) -> TransformerOptions {
        TransformerOptions {
            gpu: gpu.into(),
            seq_len,
            micro_batch_sizes: vec![1, 4],
            efficiency: None,
            attention,
            expert_imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            gradients: GradientPrecision::Bf16,
            host_us_per_kernel: HOST_US_PER_KERNEL,
        }
    }

    #[test]
    fn a_block_timed_by_operator_is_its_products_attention_and_memory_traffic() {
        // GPT-3's block on A100 at one sample of 2048 tokens, unfused.
        let c = TransformerConfig::named("gpt3-175b").unwrap();
        let o = by_operator("a100", 2048, Some(AttentionKernel::Unfused));
        let p = transformer_profile("gpt3-175b", &c, &o).unwrap();
        let m = &p.layers[1].measurements[0];
        let a100 = gpu_type("a100").unwrap();
        let (h, f, tokens) = (12288, 4 * 12288, 2048);
        let products = [
            (tokens, 3 * h, h),
            (tokens, h, h),
            (tokens, f, h),
            (tokens, h, f),
        ];
        let forward: f64 = products
            .iter()
            .map(|&(m, n, k)| Gemm::new(m, n, k).ms(a100))
            .sum();
        let weight: f64 = products
            .iter()
            .map(|&(m, n, k)| Gemm::new(k, n, m).ms(a100))
            .sum();
        let (attention_fwd, _) =
            attention_ms(a100, AttentionKernel::Unfused, (96, 2048, 128), true).unwrap();
        // Norms and residual adds 10h, GeLU 2f, bf16 per token, and the
        // hidden dropouts' one-byte masks 2h (GPT-2's configs drop 0.1).
        assert!(c.hidden_dropout && c.attention_dropout);
        let memory = (2 * tokens * (10 * h + 2 * f) + tokens * 2 * h) as f64 / 1759e6;
        assert!(
            (m.fwd_ms - (forward + attention_fwd + memory)).abs() < 1e-9,
            "{}",
            m.fwd_ms
        );
        assert!((m.bwd_weight_ms.unwrap() - weight).abs() < 1e-9);
        // The products run at about 0.78 of the peak in full waves (0.898
        // of 271.2 of 312 TFLOP/s): the block about 0.7.
        let flops = c.block_fwd_flops(2048.0, false);
        let share = flops / (m.fwd_ms * 1e9) / 312.0;
        assert!((0.6..0.78).contains(&share), "{share}");
        // The norms and residual adds are what a split leaves whole.
        let replicated = p.layers[1].split[0].replicated_compute_fraction;
        let whole = 3.0 * (2 * tokens * 10 * h + tokens * 2 * h) as f64 / 1759e6;
        assert!(
            (replicated - whole / (m.fwd_ms + m.bwd_ms)).abs() < 1e-12,
            "{replicated}"
        );
        let flash = transformer_profile("gpt3-175b", &c, &by_operator("a100", 2048, None)).unwrap();
        let kept = |p: &Profile| p.layers[1].measurements[0].stored_activation_bytes.unwrap();
        // Unfused attention keeps every head's probabilities, dropped and
        // not, and the mask: 5 bytes a score (Korthikanti et al.'s 5as^2).
        assert_eq!(kept(&p) - kept(&flash), 96 * 2048 * 2048 * 5);
    }

    /// GPT-3 175B at 2048 tokens on A100, unfused attention with dropout,
    /// as Korthikanti et al. ran it.
    fn gpt3_unfused_on_a100() -> Profile {
        let c = TransformerConfig::named("gpt3-175b").unwrap();
        transformer_profile(
            "gpt3-175b",
            &c,
            &by_operator("a100", 2048, Some(AttentionKernel::Unfused)),
        )
        .unwrap()
    }

    #[test]
    fn a_gpt_block_keeps_korthikantis_activations_and_llama_drops_nothing() {
        // Korthikanti et al. (arXiv 2205.05198), eq. (1): a block without
        // sequence parallelism keeps s b h (34 + 5 a s / h) bytes; dapple
        // also keeps the softmax's fp32 statistics (4 s a).
        let p = gpt3_unfused_on_a100();
        let (s, h, a) = (2048u64, 12288u64, 96u64);
        let kept = p.layers[1].measurements[0].stored_activation_bytes.unwrap();
        assert_eq!(kept, s * h * 34 + 5 * a * s * s + 4 * s * a);
        let llama = TransformerConfig::named("llama-2-7b").unwrap();
        assert!(!llama.hidden_dropout && !llama.attention_dropout);
        let e = TransformerConfig::from_json(
            r#"{"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100, "attn_pdrop": 1.5}"#,
        )
        .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("attn_pdrop"));
        let off = TransformerConfig::from_json(
            r#"{"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100, "resid_pdrop": 0.0}"#,
        )
        .unwrap();
        assert!(!off.hidden_dropout && off.attention_dropout);
    }

    #[test]
    fn a_shard_keeps_korthikantis_activations_with_sequence_parallelism_and_selective_recompute() {
        // Korthikanti et al. (arXiv 2205.05198), eqs. (2) and (3) and
        // Section 5: at t-way tensor parallelism a block keeps
        // s b h (10 + 24/t + 5 a s / (h t)) bytes, with sequence
        // parallelism s b h / t (34 + 5 a s / h), and with selective
        // re-computation as well 34 s b h / t; dapple's softmax statistics
        // (4 s a, split by heads) come on top.
        let p = gpt3_unfused_on_a100();
        let layers = LayerCosts::new(&p);
        let (s, h, a, t) = (2048.0, 12288.0, 96.0, 8.0);
        let stats = 4.0 * s * a / t;
        let whole = layers.stored_bytes_per_sample_of_layer(1);
        let kept = |sp: bool| layers.shard(1, 8, sp).unwrap().stored_factor * whole;
        let close = |x: f64, y: f64| (x / y - 1.0).abs() < 1e-12;
        let plain = s * h * (10.0 + 24.0 / t + 5.0 * a * s / (h * t)) + stats;
        assert!(close(kept(false), plain), "{} {plain}", kept(false));
        let sequence = s * h / t * (34.0 + 5.0 * a * s / h) + stats;
        assert!(close(kept(true), sequence), "{} {sequence}", kept(true));
        let selective = kept(true) - layers.selective_stored_bytes_per_sample_of_layer(1) / t;
        assert!(close(selective, 34.0 * s * h / t + stats), "{selective}");
        // The same through a one-block stage's memory: per micro-batch in
        // flight, what a shard of the block keeps under selective re-computation.
        let mut sums = MemorySums::default();
        let shard = layers.shard(1, 8, true).unwrap();
        sums.add_layer(&layers, 1, (Some(&shard), 1.0), (1, 1, 1), (8, 1));
        let shape = StageShape {
            tensor_parallel: 8,
            sequence_parallel: true,
            recompute: Recompute::Selective,
            ..StageShape::PLAIN
        };
        let memory = sums.memory(&layers, &shape, 0.0);
        assert!(
            close(memory.per_micro_batch_bytes, selective),
            "{}",
            memory.per_micro_batch_bytes
        );
        // Its attention core re-runs in the backward: the profile's share.
        let m = &p.layers[1].measurements[0];
        assert!(
            m.selective_recompute_ms.unwrap() > 0.0 && m.selective_recompute_ms < Some(m.fwd_ms)
        );
    }

    #[test]
    fn a_shard_is_timed_at_its_own_shapes_and_runs_slower_than_a_t_th_of_the_whole() {
        // A 3,072-wide GPT block (24 heads) on A100, unfused, 1,024 tokens a
        // sample: cut 8 ways, its products are 384 (QKV 1,152) columns wide
        // and fill a few of the 108 SMs, and it still launches every kernel.
        let c = TransformerConfig::from_json(
            r#"{"n_embd": 3072, "n_head": 24, "n_layer": 2, "vocab_size": 50257, "n_positions": 1024}"#,
        )
        .unwrap();
        let options = TransformerOptions {
            micro_batch_sizes: vec![1, 8],
            ..by_operator("a100", 1024, Some(AttentionKernel::Unfused))
        };
        let p = transformer_profile("gpt-3072", &c, &options).unwrap();
        let block = &p.layers[1];
        let whole = |k: usize| block.measurements[k].fwd_ms + block.measurements[k].bwd_ms;
        let pattern = &block.split[0];
        let maker = LayerMaker {
            config: &c,
            s: 1024.0,
            seq_len: 1024,
            timing: Timing::Operators {
                gpu: gpu_type("a100").unwrap(),
                attention: AttentionKernel::Unfused,
            },
            attention: AttentionKernel::Unfused,
            micro_batch_sizes: &options.micro_batch_sizes,
            expert_imbalance: 1.0,
            dispatcher: TokenDispatcher::AllToAll,
            host_ms_per_kernel: HOST_US_PER_KERNEL / 1e3,
        };
        let flops = (0.0, 0.0);
        let kind = LayerKind::Block { experts: false };
        for (k, b) in [1u32, 8].into_iter().enumerate() {
            let shard = maker
                .times(kind, flops, b, 8)
                .unwrap()
                .issued_at(HOST_US_PER_KERNEL / 1e3);
            let own = shard.fwd + shard.bwd;
            let entry = pattern
                .shard_compute
                .iter()
                .find(|e| e.degree == 8 && e.batch_size == b)
                .unwrap();
            // The table holds the shard's own time over the whole layer's.
            assert!(
                (entry.factor * whole(k) - own).abs() < 1e-9 * own,
                "{} {own}",
                entry.factor * whole(k)
            );
            assert!(
                own > whole(k) / 8.0,
                "b={b}: {own} against {}",
                whole(k) / 8.0
            );
            // The cost reads it at the stage's micro-batch size.
            assert_eq!(pattern.shard_at(8, false, b).compute_factor, entry.factor);
        }
        // One sample a micro-batch runs its shard far below the whole's
        // rate: at least 1.2 times a t-th of the whole (0.18 by the tile
        // rule, against 1/8).
        let f = pattern.shard_at(8, false, 1).compute_factor;
        assert!(f > 1.2 / 8.0, "{f}");
        // Between timed sizes, linear in the size; the search's floor is the least.
        let (f1, f8) = (
            pattern.shard_at(8, false, 1).compute_factor,
            pattern.shard_at(8, false, 8).compute_factor,
        );
        let f4 = pattern.shard_at(8, false, 4).compute_factor;
        assert!((f4 - (f1 + 3.0 / 7.0 * (f8 - f1))).abs() < 1e-12);
        assert_eq!(pattern.shard(8, false).compute_factor, f1.min(f8));
        // Sequence parallelism runs the norms and residual adds on 1/8 of the tokens.
        assert!(pattern.shard_at(8, true, 8).compute_factor < f8);
    }

    #[test]
    fn a_pass_takes_no_less_than_its_host_issues_its_kernels_in() {
        let c = TransformerConfig::from_json(
            r#"{"n_embd": 256, "n_head": 4, "n_layer": 2, "vocab_size": 1000, "n_positions": 128}"#,
        )
        .unwrap();
        let at = |host_us: f64| {
            let options = TransformerOptions {
                host_us_per_kernel: host_us,
                ..by_operator("a100", 128, Some(AttentionKernel::Unfused))
            };
            transformer_profile("tiny", &c, &options).unwrap().layers[1].measurements[0].clone()
        };
        let (gpu, slow) = (at(0.0), at(1000.0));
        // A tiny block: 4 products, 4 attention kernels (dropout on), 4
        // norms and adds and the activation forward; 8, 6 and 5 backward.
        assert_eq!((slow.fwd_ms, slow.bwd_ms), (13.0, 19.0));
        assert!(gpu.fwd_ms < 1.0 && gpu.bwd_ms < 1.0);
        let weight_share = gpu.bwd_weight_ms.unwrap() / gpu.bwd_ms;
        assert!((slow.bwd_weight_ms.unwrap() / slow.bwd_ms - weight_share).abs() < 1e-12);
        let e = transformer_profile(
            "tiny",
            &c,
            &TransformerOptions {
                host_us_per_kernel: -1.0,
                ..by_operator("a100", 128, None)
            },
        )
        .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("host_us_per_kernel"));
    }

    #[test]
    fn a_small_micro_batch_runs_less_of_the_peak_than_a_large_one() {
        let c = TransformerConfig::named("llama-2-7b").unwrap();
        let p = transformer_profile("llama-2-7b", &c, &by_operator("h100", 1024, None)).unwrap();
        let block = &p.layers[1].measurements;
        assert!(
            block[1].fwd_ms < 4.0 * block[0].fwd_ms,
            "{} {}",
            block[0].fwd_ms,
            block[1].fwd_ms
        );
        assert!(p
            .source
            .as_deref()
            .unwrap()
            .contains("operator by operator on H100-80GB (flash attention)"));
    }

    #[test]
    fn flash_attention_is_refused_where_none_was_measured_and_unfused_is_the_default_there() {
        let c = TransformerConfig::named("llama-2-7b").unwrap();
        let o = by_operator("v100", 1024, Some(AttentionKernel::Flash));
        let e = transformer_profile("llama-2-7b", &c, &o).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("attention"));
        let p = transformer_profile("llama-2-7b", &c, &by_operator("v100", 1024, None)).unwrap();
        assert!(p.source.as_deref().unwrap().contains("(unfused attention)"));
    }

    #[test]
    fn the_head_keeps_the_logits_in_fp32() {
        let c = TransformerConfig::named("llama-2-7b").unwrap();
        let p = transformer_profile("llama-2-7b", &c, &options("h100")).unwrap();
        let head = p.layers.last().unwrap();
        let logits = 4096 * 32000 * 4;
        assert_eq!(
            head.measurements[0].stored_activation_bytes,
            Some(logits + 2 * 4096 * 4096 * 2)
        );
    }

    #[test]
    fn a_config_past_the_most_blocks_names_its_field() {
        let config = |blocks: u64| {
            format!(r#"{{"n_embd": 128, "n_head": 4, "n_layer": {blocks}, "vocab_size": 500}}"#)
        };
        assert!(TransformerConfig::from_json(&config(MAX_BLOCKS)).is_ok());
        // The sixth fuzz campaign's config: 2^31 blocks aborted the command.
        let e = TransformerConfig::from_json(&config(1 << 31)).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("n_layer"));
        assert!(
            e.message
                .contains("value 2147483648 is over the 100000 blocks"),
            "{e}"
        );
    }

    #[test]
    fn a_config_without_a_needed_field_names_it() {
        let e = TransformerConfig::from_json(r#"{"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 256}"#)
            .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("num_attention_heads"));
        assert!(e.message.contains("is missing"), "{e}");
        let e = TransformerConfig::named("llama-9").unwrap_err();
        assert!(e.message.contains("shipped: gpt3-175b, llama-2-7b"), "{e}");
        let e = transformer_profile(
            "x",
            &TransformerConfig::named("llama-2-7b").unwrap(),
            &options("tpu-v5"),
        )
        .unwrap_err();
        assert_eq!(e.field.as_deref(), Some("gpu"));
    }
}
