//! GPU types by name: memory, peak throughput and the links of the server
//! each usually comes in, with the public source of every figure. Topology
//! specs name a type (`64x8-a100-80gb`); MFU divides by its peak.
//!
//! Figures are the vendor's datasheet numbers: dense tensor-core peaks (half
//! the "with sparsity" figure), NVLink per GPU and direction (half the
//! datasheet's bidirectional total), memory as the marketed size in GiB
//! (what `nvidia-smi` reports is within 2% of it). The V100's NVLink is the
//! DAPPLE paper's measured "up to 130 GB/s" (Table III), which untyped specs
//! have always used; its datasheet total is 300 GB/s.

use crate::error::{Error, Result};

const GIB: u64 = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuType {
    /// The name topologies and profiles write, e.g. "A100-80GB".
    pub name: &'static str,
    /// Other names a spec may use (lower case), e.g. "h100".
    pub aliases: &'static [&'static str],
    pub memory_bytes: u64,
    /// Dense bf16 tensor-core peak; the V100 has no bf16, so its fp16 peak
    /// (what mixed precision runs at on it).
    pub bf16_tflops: f64,
    /// Plain fp32 peak (no TF32).
    pub fp32_tflops: f64,
    /// NVLink bandwidth of one GPU, one direction.
    pub nvlink_gbps: f64,
    /// The host link of one GPU, one direction (x16 at its PCIe generation).
    pub pcie_gbps: f64,
    /// The usual server's network, per GPU (one NIC per GPU on DGX A100
    /// and later).
    pub network_gbps_per_gpu: f64,
    /// The server the link figures are from.
    pub server: &'static str,
    pub source: &'static str,
}

const V100_SOURCE: &str = "NVIDIA Tesla V100 datasheet (SXM2: 125 TFLOPS fp16 tensor, 15.7 fp32); NVLink as measured in \
     the DAPPLE paper, Table III (130 GB/s); DGX-1 datasheet (4 x 100 Gb/s EDR InfiniBand per 8 GPUs)";
const A100_SOURCE: &str =
    "NVIDIA A100 datasheet (SXM: 312 TFLOPS bf16 dense, 19.5 fp32, NVLink 600 GB/s, PCIe gen4); \
     DGX A100 datasheet (8 x 200 Gb/s HDR InfiniBand)";
const H100_SOURCE: &str =
    "NVIDIA H100 datasheet (SXM: 1,979 TFLOPS bf16 with sparsity, 67 fp32, NVLink 900 GB/s, \
     PCIe gen5); DGX H100 datasheet (8 x 400 Gb/s NDR InfiniBand)";

/// One row of the table below, in its column order.
#[allow(clippy::too_many_arguments)]
const fn row(
    name: &'static str,
    aliases: &'static [&'static str],
    memory_gib: u64,
    (bf16_tflops, fp32_tflops): (f64, f64),
    (nvlink_gbps, pcie_gbps, network_gbps_per_gpu): (f64, f64, f64),
    server: &'static str,
    source: &'static str,
) -> GpuType {
    GpuType {
        name,
        aliases,
        memory_bytes: memory_gib * GIB,
        bf16_tflops,
        fp32_tflops,
        nvlink_gbps,
        pcie_gbps,
        network_gbps_per_gpu,
        server,
        source,
    }
}

const H200_SOURCE: &str =
    "NVIDIA H200 datasheet (SXM: 141 GB, 1,979 TFLOPS bf16 with sparsity, 67 fp32, NVLink \
     900 GB/s); DGX H200 datasheet (8 x 400 Gb/s NDR InfiniBand)";
const B200_SOURCE: &str =
    "NVIDIA HGX B200 datasheet, per GPU (8 GPUs: 1.44 TB, 36 PFLOPS bf16 with sparsity, \
     600 TFLOPS fp32, NVLink 1.8 TB/s each); DGX B200 datasheet (8 x 400 Gb/s ConnectX-7)";

/// Every known type; the first is the paper's GPU, the type of untyped specs.
/// Columns: name, spec names, GiB, (bf16, fp32 TFLOP/s), (NVLink, PCIe,
/// network per GPU in Gbit/s), server, source.
#[rustfmt::skip]
pub const GPU_TYPES: [GpuType; 7] = [
    row("V100-16GB", &["v100-16gb", "v100"], 16, (125.0, 15.7), (1040.0, 128.0, 50.0), "DGX-1", V100_SOURCE),
    row("V100-32GB", &["v100-32gb"], 32, (125.0, 15.7), (1040.0, 128.0, 50.0), "DGX-1", V100_SOURCE),
    row("A100-40GB", &["a100-40gb"], 40, (312.0, 19.5), (2400.0, 256.0, 200.0), "DGX A100", A100_SOURCE),
    row("A100-80GB", &["a100-80gb", "a100"], 80, (312.0, 19.5), (2400.0, 256.0, 200.0), "DGX A100", A100_SOURCE),
    row("H100-80GB", &["h100-80gb", "h100"], 80, (989.5, 67.0), (3600.0, 512.0, 400.0), "DGX H100", H100_SOURCE),
    row("H200", &["h200", "h200-141gb"], 141, (989.5, 67.0), (3600.0, 512.0, 400.0), "DGX H200", H200_SOURCE),
    row("B200", &["b200", "b200-180gb"], 180, (2250.0, 75.0), (7200.0, 512.0, 400.0), "DGX B200", B200_SOURCE),
];

/// The type of untyped specs and topologies: the paper's V100-16GB.
pub fn default_gpu() -> &'static GpuType {
    &GPU_TYPES[0]
}

/// The known type named `name` (its name or an alias, any case), if any.
pub fn find_gpu(name: &str) -> Option<&'static GpuType> {
    let lower = name.trim().to_ascii_lowercase();
    GPU_TYPES
        .iter()
        .find(|g| g.name.to_ascii_lowercase() == lower || g.aliases.contains(&lower.as_str()))
}

/// The known type named `name`, or an error that lists the known ones.
pub fn gpu_type(name: &str) -> Result<&'static GpuType> {
    find_gpu(name).ok_or_else(|| {
        Error::invalid(format!(
            "unknown GPU type {name:?}; known types: {}",
            known_gpu_types()
        ))
    })
}

/// The known types' names, for messages.
pub fn known_gpu_types() -> String {
    GPU_TYPES
        .iter()
        .map(|g| g.name)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_find_their_type_in_any_case() {
        assert_eq!(gpu_type("A100-80GB").unwrap().name, "A100-80GB");
        assert_eq!(gpu_type("a100").unwrap().name, "A100-80GB");
        assert_eq!(gpu_type(" H100 ").unwrap().memory_bytes, 80 << 30);
        assert_eq!(gpu_type("v100-32gb").unwrap().memory_bytes, 32 << 30);
        assert_eq!(default_gpu().name, "V100-16GB");
    }

    #[test]
    fn an_unknown_type_lists_the_known_ones() {
        let e = gpu_type("A100-81GB").unwrap_err();
        assert_eq!(
            e.to_string(),
            "unknown GPU type \"A100-81GB\"; known types: V100-16GB, V100-32GB, A100-40GB, A100-80GB, \
             H100-80GB, H200, B200"
        );
    }

    #[test]
    fn no_alias_is_taken_twice_and_every_figure_is_positive() {
        let mut seen = std::collections::HashSet::new();
        for g in &GPU_TYPES {
            assert!(seen.insert(g.name.to_ascii_lowercase()), "{}", g.name);
            for a in g.aliases {
                assert_eq!(*a, a.to_ascii_lowercase());
                assert!(
                    seen.insert(a.to_string()) || *a == g.name.to_ascii_lowercase(),
                    "{a}"
                );
            }
            let figures = [
                g.bf16_tflops,
                g.fp32_tflops,
                g.nvlink_gbps,
                g.pcie_gbps,
                g.network_gbps_per_gpu,
            ];
            assert!(
                figures.iter().all(|&x| x > 0.0) && g.memory_bytes > 0,
                "{}",
                g.name
            );
            assert!(g.bf16_tflops > g.fp32_tflops);
        }
    }
}
