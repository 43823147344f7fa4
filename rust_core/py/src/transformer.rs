use dapple_core::cluster::gpus::GPU_TYPES;
use dapple_core::model::experts::TokenDispatcher;
use dapple_core::model::kernels::AttentionKernel;
use dapple_core::model::transformer::{
    transformer_profile as generate, transformer_splits as splits_of, GradientPrecision, MoeConfig,
    TransformerConfig, TransformerOptions, HOST_US_PER_KERNEL, MODELS,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::profile::PyProfile;
use crate::{to_py_err, with_source};

/// A profile of a transformer without a GPU: from a shipped config `name`,
/// or from a Hugging Face `config.json`'s `text` (`source` names its file
/// in errors); `model` is the name it records.
#[pyfunction]
#[pyo3(signature = (*, model, gpu, seq_len, micro_batch_sizes, efficiency=None, attention=None, expert_imbalance=1.0, dispatcher="all-to-all", gradients="bf16", host_us_per_kernel=None, name=None, text=None, source=None))]
#[allow(clippy::too_many_arguments)]
fn transformer_profile(
    model: &str,
    gpu: String,
    seq_len: u64,
    micro_batch_sizes: Vec<u32>,
    efficiency: Option<f64>,
    attention: Option<&str>,
    expert_imbalance: f64,
    dispatcher: &str,
    gradients: &str,
    host_us_per_kernel: Option<f64>,
    name: Option<&str>,
    text: Option<&str>,
    source: Option<&str>,
) -> PyResult<PyProfile> {
    let config = match (name, text) {
        (Some(name), _) => TransformerConfig::named(name),
        (None, Some(text)) => TransformerConfig::from_json(text),
        (None, None) => Err(dapple_core::Error::invalid(
            "give a shipped config name or a config.json's text",
        )),
    }
    .map_err(|e| to_py_err(with_source(e, source)))?;
    let options = TransformerOptions {
        gpu,
        seq_len,
        micro_batch_sizes,
        efficiency,
        attention: attention
            .map(AttentionKernel::parse)
            .transpose()
            .map_err(|e| to_py_err(e.under("attention")))?,
        expert_imbalance,
        dispatcher: TokenDispatcher::parse(dispatcher)
            .map_err(|e| to_py_err(e.under("dispatcher")))?,
        gradients: GradientPrecision::parse(gradients)
            .map_err(|e| to_py_err(e.under("gradients")))?,
        host_us_per_kernel: host_us_per_kernel.unwrap_or(HOST_US_PER_KERNEL),
    };
    let p = generate(model, &config, &options).map_err(|e| to_py_err(with_source(e, source)))?;
    Ok(PyProfile::new(p, None))
}

/// The sharding patterns (a profile layer's `split`, as plain data) of a
/// runtime model's `embedding`, each `block` and `lm_head`: a GPT-2 style
/// transformer (biases, LayerNorm, GeLU MLP of `ffn` columns, learned
/// positions) at `seq_len` tokens a sample, activations of `value_bytes`;
/// with `experts` > 0 its blocks' MLP is a mixture of `experts` routed
/// experts of `expert_ffn` columns, `experts_per_token` a token, and the
/// dict also holds their pattern (`block_experts`, a profile layer's
/// `experts`).
#[pyfunction]
#[pyo3(signature = (*, hidden, ffn, heads, vocabulary, positions, seq_len, value_bytes, experts=0, experts_per_token=0, expert_ffn=0))]
#[allow(clippy::too_many_arguments)]
fn transformer_splits<'py>(
    py: Python<'py>,
    hidden: u64,
    ffn: u64,
    heads: u64,
    vocabulary: u64,
    positions: u64,
    seq_len: u64,
    value_bytes: f64,
    experts: u64,
    experts_per_token: u64,
    expert_ffn: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let config = TransformerConfig {
        hidden,
        ffn,
        heads,
        kv_heads: heads,
        head_dim: hidden / heads,
        blocks: 1,
        vocabulary,
        positions: Some(positions),
        gated_mlp: false,
        biases: true,
        // The runtime's GPT has no dropout.
        hidden_dropout: false,
        attention_dropout: false,
        moe: (experts > 0).then_some(MoeConfig {
            experts,
            experts_per_token,
            expert_ffn,
            shared_ffn: 0,
            dense_blocks: 0,
            routing_groups: None,
        }),
        mla: None,
    };
    let splits = splits_of(&config, seq_len, value_bytes);
    let out = PyDict::new(py);
    for (name, pattern) in [
        ("embedding", &splits.embedding),
        ("block", &splits.block),
        ("lm_head", &splits.lm_head),
    ] {
        out.set_item(name, crate::convert::to_python(py, pattern)?)?;
    }
    if let Some(experts) = &splits.block_experts {
        out.set_item("block_experts", crate::convert::to_python(py, experts)?)?;
    }
    Ok(out)
}

/// A catalog figure's sources, (field, source) pairs, as a dict.
fn sources_dict<'py>(py: Python<'py>, sources: &[(&str, &str)]) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (field, source) in sources {
        dict.set_item(*field, *source)?;
    }
    Ok(dict)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(transformer_profile, m)?)?;
    m.add_function(wrap_pyfunction!(transformer_splits, m)?)?;
    let py = m.py();
    m.add("HOST_US_PER_KERNEL", HOST_US_PER_KERNEL)?;
    m.add(
        "MODEL_CONFIGS",
        crate::names(py, MODELS.iter().map(|(name, _)| *name).collect())?,
    )?;
    let gpus = PyDict::new(py);
    for g in &GPU_TYPES {
        let figures = PyDict::new(py);
        figures.set_item("aliases", g.aliases.to_vec())?;
        figures.set_item("memory_bytes", g.memory_bytes)?;
        figures.set_item("bf16_tflops", g.bf16_tflops)?;
        figures.set_item("fp32_tflops", g.fp32_tflops)?;
        figures.set_item("nvlink_gbps", g.nvlink_gbps)?;
        figures.set_item("pcie_gbps", g.pcie_gbps)?;
        figures.set_item("network_gbps_per_gpu", g.network_gbps_per_gpu)?;
        figures.set_item("server", g.server)?;
        figures.set_item("source", g.source)?;
        let k = &g.kernels;
        let kernels = PyDict::new(py);
        kernels.set_item("sm_count", k.sm_count)?;
        kernels.set_item("hbm_gb_per_s", k.hbm_gb_per_s)?;
        kernels.set_item("gemm_tflops", k.gemm_tflops)?;
        kernels.set_item("flash_attention_tflops", k.flash_attention_tflops.to_vec())?;
        kernels.set_item("sources", sources_dict(py, k.sources)?)?;
        figures.set_item("kernels", kernels)?;
        let collectives = match &g.collectives {
            Some(c) => {
                let d = PyDict::new(py);
                d.set_item(
                    "intra_allreduce_bus_gb_per_s",
                    c.intra_allreduce_bus_gb_per_s.to_vec(),
                )?;
                d.set_item(
                    "intra_all_gather_bus_gb_per_s",
                    c.intra_all_gather_bus_gb_per_s.map(<[_]>::to_vec),
                )?;
                d.set_item(
                    "intra_reduce_scatter_bus_gb_per_s",
                    c.intra_reduce_scatter_bus_gb_per_s.map(<[_]>::to_vec),
                )?;
                let by_gpus = PyDict::new(py);
                for &(gpus, curve) in c.intra_allreduce_bus_by_gpus {
                    by_gpus.set_item(gpus, curve.to_vec())?;
                }
                d.set_item("intra_allreduce_bus_by_gpus", by_gpus)?;
                d.set_item("intra_line_gb_per_s", c.intra_line_gb_per_s)?;
                d.set_item("network_share", c.network_share)?;
                d.set_item("sources", sources_dict(py, c.sources)?)?;
                Some(d)
            }
            None => None,
        };
        figures.set_item("collectives", collectives)?;
        let h = &g.host;
        let host = PyDict::new(py);
        host.set_item("copy_gb_per_s", h.copy_gb_per_s)?;
        host.set_item("cpu_cores_per_gpu", h.cpu_cores_per_gpu)?;
        host.set_item("memory_gib_per_gpu", h.memory_gib_per_gpu)?;
        host.set_item("memory_gb_per_s_per_gpu", h.memory_gb_per_s_per_gpu)?;
        host.set_item("sources", sources_dict(py, h.sources)?)?;
        figures.set_item("host", host)?;
        gpus.set_item(g.name, figures)?;
    }
    m.add("GPU_TYPES", gpus)?;
    Ok(())
}
