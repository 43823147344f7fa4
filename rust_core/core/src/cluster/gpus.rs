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
    /// What its kernels reach, for operator-level layer times (`model/kernels.rs`).
    pub kernels: KernelFigures,
    /// What NCCL's collectives reach on the usual server, where measured.
    pub collectives: Option<CollectiveFigures>,
    /// The usual server's host side, for offloading (`cost/offload.rs`).
    pub host: HostFigures,
}

/// What one GPU has of its server's host: the copy rate of its host link,
/// and its share of the server's CPU cores and memory (each figure naming
/// its source in `sources`, as `KernelFigures`'). Offloaded optimizer
/// state lives in this memory and is stepped on these cores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostFigures {
    /// Copies between the GPU and pinned host memory, GB/s each way (the
    /// slower of the two directions where both were measured).
    pub copy_gb_per_s: f64,
    /// The server's CPU cores over its GPUs.
    pub cpu_cores_per_gpu: f64,
    /// The server's memory over its GPUs, GiB.
    pub memory_gib_per_gpu: f64,
    /// The server's memory bandwidth over its GPUs, GB/s: the peak of its
    /// sockets' memory channels (a CPU's Adam is bound by it).
    pub memory_gb_per_s_per_gpu: f64,
    pub sources: &'static [(&'static str, &'static str)],
}

/// DGX-1 (V100): PCIe 3.0 x16 per GPU, 2 x 20-core Xeon E5-2698 v4, 512 GB.
const DGX1_HOST: HostFigures = HostFigures {
    copy_gb_per_s: 16.0,
    cpu_cores_per_gpu: 40.0 / 8.0,
    memory_gib_per_gpu: 512.0 / 8.0,
    memory_gb_per_s_per_gpu: 2.0 * 76.8 / 8.0,
    sources: &[
        ("copy_gb_per_s", "assumed: the PCIe 3.0 x16 line rate (16 GB/s); no record measures V100 copies"),
        ("cpu_cores_per_gpu", "assumed: DGX-1 datasheet, 2 x Intel Xeon E5-2698 v4 (20 cores each) for 8 GPUs"),
        ("memory_gib_per_gpu", "assumed: DGX-1 datasheet, 512 GB system memory for 8 GPUs"),
        ("memory_gb_per_s_per_gpu", "assumed: Intel's E5-2698 v4 specification, 4 channels of DDR4-2400 (76.8 GB/s) a socket"),
    ],
};

/// DGX A100: PCIe 4.0 x16 per GPU, 2 x 64-core EPYC 7742; 1 TB (320 GB
/// model) or 2 TB (640 GB model).
const fn dgx_a100_host(memory_tb: f64) -> HostFigures {
    HostFigures {
        copy_gb_per_s: 25.13,
        cpu_cores_per_gpu: 128.0 / 8.0,
        memory_gib_per_gpu: memory_tb * 1024.0 / 8.0,
        memory_gb_per_s_per_gpu: 2.0 * 204.8 / 8.0,
        sources: &[
            ("copy_gb_per_s", "P2: NVIDIA/nvbandwidth issue #42, host_to_device_memcpy_sm on A100-SXM4-40GB (PCIe Gen4 x16), 512 MiB-1 GiB"),
            ("cpu_cores_per_gpu", "assumed: DGX A100 datasheet, 2 x AMD EPYC 7742 (64 cores each) for 8 GPUs"),
            ("memory_gib_per_gpu", "assumed: DGX A100 datasheet, 1 TB system memory with 8 A100-40GB, 2 TB with 8 A100-80GB"),
            ("memory_gb_per_s_per_gpu", "assumed: AMD's EPYC 7742 specification, 8 channels of DDR4-3200 (204.8 GB/s) a socket"),
        ],
    }
}

/// DGX H100, H200 and B200: PCIe 5.0 x16 per GPU, 2 x 56-core Xeon, 2 TB.
const HOPPER_HOST: HostFigures = HostFigures {
    copy_gb_per_s: 55.06,
    cpu_cores_per_gpu: 112.0 / 8.0,
    memory_gib_per_gpu: 2048.0 / 8.0,
    memory_gb_per_s_per_gpu: 2.0 * 307.2 / 8.0,
    sources: &[
        ("copy_gb_per_s", "P1: stas00/ml-engineering@744d01e network/README.md, nvbandwidth on 8 x H200 (PCIe Gen5 x16), device_to_host 55.06 GB/s (host_to_device 55.43); DGX H100 and B200 have the same link"),
        ("cpu_cores_per_gpu", "assumed: DGX H100/H200 datasheets, 2 x Intel Xeon Platinum 8480C (56 cores each); DGX B200, 2 x Xeon Platinum 8570 (56 each); for 8 GPUs"),
        ("memory_gib_per_gpu", "assumed: DGX H100/H200/B200 datasheets, 2 TB system memory for 8 GPUs"),
        ("memory_gb_per_s_per_gpu", "assumed: Intel's Xeon Platinum 8480C specification, 8 channels of DDR5-4800 (307.2 GB/s) a socket"),
    ],
};

/// What NCCL's AllReduce reaches on one GPU type's usual server, measured
/// (each figure naming its record of public measurements in `sources`): the
/// cost model prices a collective at these shares of the topology's link
/// rates (`cost.rs`, `LinkShare`), not at the line rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveFigures {
    /// AllReduce bus bandwidth inside one machine of all its GPUs, by
    /// message size: (bytes, GB/s), ascending (busbw = algbw x 2(n-1)/n,
    /// nccl-tests' definition).
    pub intra_allreduce_bus_gb_per_s: &'static [(u64, f64)],
    /// All-gather bus bandwidth inside one machine of all its GPUs, by the
    /// gathered whole's size (busbw = algbw x (n-1)/n), where measured;
    /// else the AllReduce's (a ring AllReduce is a reduce-scatter and an
    /// all-gather in turn, each at the ring's bus bandwidth).
    pub intra_all_gather_bus_gb_per_s: Option<&'static [(u64, f64)]>,
    /// The same of the reduce-scatter, by the scattered whole's size.
    pub intra_reduce_scatter_bus_gb_per_s: Option<&'static [(u64, f64)]>,
    /// AllReduce bus bandwidth measured on n of one machine's GPUs, by
    /// message size, (n, curve) for each n measured: a group of n GPUs of a
    /// machine runs at its own n's curve (NCCL's rings and channels change
    /// with the GPUs: on A100 1 MiB takes 44 us over 2 and 93 over 8),
    /// others at `intra_allreduce_bus_gb_per_s`.
    pub intra_allreduce_bus_by_gpus: &'static [(u32, &'static [(u64, f64)])],
    /// The NVLink line rate those were measured on, GB/s a GPU and direction.
    pub intra_line_gb_per_s: f64,
    /// Share of a network card's line rate NCCL reaches with large messages.
    pub network_share: f64,
    /// Where each figure comes from: (field, source), as `KernelFigures`'.
    pub sources: &'static [(&'static str, &'static str)],
}

const MIB: u64 = 1 << 20;

/// nccl-tests' AllReduce on 2 to 8 A100s of one machine (vTrain's tables:
/// `CollectiveFigures::intra_allreduce_bus_by_gpus`), bus GB/s by size.
const A100_ALLREDUCE_BY_GPUS: [(u32, &[(u64, f64)]); 7] = [
    (
        2,
        &[
            (MIB, 23.72),
            (2 * MIB, 39.25),
            (4 * MIB, 68.55),
            (8 * MIB, 96.53),
            (16 * MIB, 127.16),
            (32 * MIB, 145.88),
            (64 * MIB, 165.81),
            (128 * MIB, 175.77),
            (256 * MIB, 184.39),
            (512 * MIB, 189.15),
            (1024 * MIB, 197.28),
        ],
    ),
    (
        3,
        &[
            (MIB, 21.88),
            (2 * MIB, 39.49),
            (4 * MIB, 70.58),
            (8 * MIB, 107.99),
            (16 * MIB, 144.34),
            (32 * MIB, 167.87),
            (64 * MIB, 178.86),
            (128 * MIB, 192.66),
            (256 * MIB, 200.40),
            (512 * MIB, 206.48),
            (1024 * MIB, 211.88),
        ],
    ),
    (
        4,
        &[
            (MIB, 30.60),
            (2 * MIB, 56.44),
            (4 * MIB, 81.37),
            (8 * MIB, 107.74),
            (16 * MIB, 140.11),
            (32 * MIB, 177.09),
            (64 * MIB, 185.11),
            (128 * MIB, 201.61),
            (256 * MIB, 208.73),
            (512 * MIB, 216.48),
            (1024 * MIB, 221.86),
        ],
    ),
    (
        5,
        &[
            (MIB, 26.73),
            (2 * MIB, 54.85),
            (4 * MIB, 85.36),
            (8 * MIB, 108.42),
            (16 * MIB, 135.01),
            (32 * MIB, 166.62),
            (64 * MIB, 188.95),
            (128 * MIB, 201.33),
            (256 * MIB, 210.85),
            (512 * MIB, 218.25),
            (1024 * MIB, 224.48),
        ],
    ),
    (
        6,
        &[
            (MIB, 23.94),
            (2 * MIB, 46.85),
            (4 * MIB, 84.68),
            (8 * MIB, 110.34),
            (16 * MIB, 137.63),
            (32 * MIB, 183.97),
            (64 * MIB, 197.70),
            (128 * MIB, 199.58),
            (256 * MIB, 211.45),
            (512 * MIB, 222.55),
            (1024 * MIB, 227.01),
        ],
    ),
    (
        7,
        &[
            (MIB, 23.06),
            (2 * MIB, 45.94),
            (4 * MIB, 85.42),
            (8 * MIB, 107.03),
            (16 * MIB, 126.36),
            (32 * MIB, 172.84),
            (64 * MIB, 191.77),
            (128 * MIB, 200.53),
            (256 * MIB, 210.04),
            (512 * MIB, 224.14),
            (1024 * MIB, 226.89),
        ],
    ),
    (
        8,
        &[
            (MIB, 19.78),
            (2 * MIB, 39.36),
            (4 * MIB, 76.62),
            (8 * MIB, 109.30),
            (16 * MIB, 126.33),
            (32 * MIB, 163.97),
            (64 * MIB, 202.52),
            (128 * MIB, 202.13),
            (256 * MIB, 217.25),
            (512 * MIB, 224.15),
            (1024 * MIB, 229.35),
        ],
    ),
];

/// 8 x A100 SXM, NVLink 3 and NVSwitch (C1: nccl-tests all_reduce_perf -g 8).
const A100_COLLECTIVES: CollectiveFigures = CollectiveFigures {
    intra_allreduce_bus_gb_per_s: &[
        (32 * 1024, 1.31),
        (MIB, 18.0),
        (4 * MIB, 72.33),
        (8 * MIB, 109.93),
        (64 * MIB, 171.54),
        (128 * MIB, 176.92),
        (512 * MIB, 222.72),
        (1024 * MIB, 229.04),
        (16384 * MIB, 234.89),
    ],
    // No all-gather or reduce-scatter sweep of A100 is published (C1 is
    // AllReduce only): they run at the AllReduce's ring bus bandwidth, as
    // H200's do without NVLS (C3: 361.4 and 362.9 GB/s against 367.2).
    intra_all_gather_bus_gb_per_s: None,
    intra_reduce_scatter_bus_gb_per_s: None,
    intra_allreduce_bus_by_gpus: &A100_ALLREDUCE_BY_GPUS,
    intra_line_gb_per_s: 300.0,
    network_share: 24.0 / 25.0,
    sources: &[
        ("intra_allreduce_bus_gb_per_s", "C1: stas00/ml-engineering@744d01e network/README.md, nccl-tests all_reduce_perf on 8 x A100 NVLink3/NVSwitch"),
        ("intra_allreduce_bus_by_gpus", "VIA-Research/vTrain@f8dda84 data/nccl-tests AR_GPU{2..8}_1M_1024M_LUT.csv (shipped in shared/reference/vtrain-single-node/allreduce-a100/), nccl-tests all_reduce_perf fp32 on 2-8 A100s of one machine, out of place, read at the powers of two from 1 MiB to 1 GiB"),
        ("intra_line_gb_per_s", "assumed: the A100 datasheet's 600 GB/s NVLink, one direction"),
        ("network_share", "C8b: NVIDIA/nccl-tests issues #160, #252, about 24 GB/s a 200 Gb/s HDR NIC (25 GB/s)"),
    ],
};

/// H100's all-gather and reduce-scatter (C7), by the whole's size.
const H100_ALL_GATHER: &[(u64, f64)] = &[(MIB, 29.5), (64 * MIB, 274.9), (2048 * MIB, 351.7)];
const H100_REDUCE_SCATTER: &[(u64, f64)] = &[(MIB, 44.9), (64 * MIB, 268.6), (2048 * MIB, 329.1)];

/// 8 x H100 SXM, NVLink 4 (C7: XLA's collectives over NCCL on one host).
const H100_COLLECTIVES: CollectiveFigures = CollectiveFigures {
    intra_allreduce_bus_gb_per_s: &[(MIB, 35.3), (64 * MIB, 309.2), (2048 * MIB, 402.4)],
    intra_all_gather_bus_gb_per_s: Some(H100_ALL_GATHER),
    intra_reduce_scatter_bus_gb_per_s: Some(H100_REDUCE_SCATTER),
    intra_allreduce_bus_by_gpus: &[],
    intra_line_gb_per_s: 450.0,
    network_share: 47.0 / 50.0,
    sources: &[
        ("intra_allreduce_bus_gb_per_s", "C7: openxla/xla@e97611c4 xla/service/gpu/model/collective_interpolator_data.h, all-reduce on 8 x H100 (XLA over NCCL, f32 buffers)"),
        ("intra_all_gather_bus_gb_per_s", "C7: openxla/xla@e97611c4 xla/service/gpu/model/collective_interpolator_data.h, all-gather on 8 x H100 (XLA over NCCL, f32 buffers)"),
        ("intra_reduce_scatter_bus_gb_per_s", "C7: openxla/xla@e97611c4 xla/service/gpu/model/collective_interpolator_data.h, reduce-scatter on 8 x H100 (XLA over NCCL, f32 buffers)"),
        ("intra_line_gb_per_s", "assumed: the H100 datasheet's 900 GB/s NVLink, one direction"),
        ("network_share", "C8a: NVIDIA/nccl-tests issue #290, 46-48 GB/s a 400 Gb/s NDR NIC (50 GB/s)"),
    ],
};

/// 8 x H200, NVLink 4 (C2: torch.distributed all_reduce, NCCL 2.27.7, NVLS from 2 MiB).
const H200_COLLECTIVES: CollectiveFigures = CollectiveFigures {
    intra_allreduce_bus_gb_per_s: &[
        (32 * 1024, 1.44),
        (MIB, 39.93),
        (4 * MIB, 107.16),
        (16 * MIB, 219.89),
        (64 * MIB, 346.51),
        (256 * MIB, 436.15),
        (1024 * MIB, 463.58),
        (16384 * MIB, 482.26),
    ],
    // NVLS speeds H200's AllReduce past the ring's line rate, not its
    // all-gather or reduce-scatter (C3, at 16 GiB: 361.4 and 362.9 GB/s
    // against the AllReduce's 480): H100's curves on the same NVLink 4
    // switch stand for them (C7 reaches 351.7 and 329.1 at 2 GiB).
    intra_all_gather_bus_gb_per_s: Some(H100_ALL_GATHER),
    intra_reduce_scatter_bus_gb_per_s: Some(H100_REDUCE_SCATTER),
    intra_allreduce_bus_by_gpus: &[],
    intra_line_gb_per_s: 450.0,
    network_share: 47.0 / 50.0,
    sources: &[
        ("intra_allreduce_bus_gb_per_s", "C2: stas00/ml-engineering@744d01e network/README.md, all_reduce_bench.py on 8 x H200 (NVLS above 2 MiB: past the ring's line rate)"),
        ("intra_all_gather_bus_gb_per_s", "assumed: H100's (C7: openxla/xla@e97611c4, all-gather on 8 x H100), the same NVLink 4 switch; C3 (stas00/ml-engineering@744d01e, nccl-tests on 8 x H200) measured 361.4 GB/s at 16 GiB"),
        ("intra_reduce_scatter_bus_gb_per_s", "assumed: H100's (C7: openxla/xla@e97611c4, reduce-scatter on 8 x H100), the same NVLink 4 switch; C3 (stas00/ml-engineering@744d01e, nccl-tests on 8 x H200) measured 362.9 GB/s at 16 GiB"),
        ("intra_line_gb_per_s", "assumed: the H200 datasheet's 900 GB/s NVLink, one direction"),
        ("network_share", "C8a: NVIDIA/nccl-tests issue #290, 46-48 GB/s a 400 Gb/s NDR NIC (50 GB/s)"),
    ],
};

/// What one GPU type's kernels reach, measured (each figure from a record of
/// public measurements, named in `sources`), for timing a layer operator by
/// operator (`model/kernels.rs`): none is derived from the training runs that
/// dapple's estimates are checked against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelFigures {
    /// Streaming multiprocessors: a matrix product's tiles run in waves of this many.
    pub sm_count: u32,
    /// The memory bandwidth a memory-bound kernel reaches, in GB/s (bytes),
    /// a STREAM-like triad where one was measured.
    pub hbm_gb_per_s: f64,
    /// bf16 (V100: fp16) throughput of a large, well-shaped matrix product
    /// (the maximum achievable matmul FLOPS, "MAMF"): full waves, whole tiles.
    pub gemm_tflops: f64,
    /// FlashAttention's forward-and-backward throughput, causal (FLOPs
    /// counted halved, as its kernels skip the masked half), by sequence
    /// length: (tokens, TFLOP/s), ascending. Empty where no FlashAttention
    /// kernel runs on the type (FlashAttention-2 needs Ampere or later).
    pub flash_attention_tflops: &'static [(u64, f64)],
    /// Where each figure comes from: (field, source). A source opens with
    /// the id of its record in the shared hardware measurements
    /// (`reference/hardware-measurements.json`, which names the primary
    /// source) or with "assumed:" and the reason.
    pub sources: &'static [(&'static str, &'static str)],
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
    (kernels, collectives, host): (KernelFigures, Option<CollectiveFigures>, HostFigures),
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
        kernels,
        collectives,
        host,
    }
}

const H200_SOURCE: &str =
    "NVIDIA H200 datasheet (SXM: 141 GB, 1,979 TFLOPS bf16 with sparsity, 67 fp32, NVLink \
     900 GB/s); DGX H200 datasheet (8 x 400 Gb/s NDR InfiniBand)";
const B200_SOURCE: &str =
    "NVIDIA HGX B200 datasheet, per GPU (8 GPUs: 1.44 TB, 36 PFLOPS bf16 with sparsity, \
     600 TFLOPS fp32, NVLink 1.8 TB/s each); DGX B200 datasheet (8 x 400 Gb/s ConnectX-7)";

const V100_KERNELS: KernelFigures = KernelFigures {
    sm_count: 80,
    hbm_gb_per_s: 814.0,
    gemm_tflops: 95.0,
    flash_attention_tflops: &[],
    sources: &[
        (
            "sm_count",
            "assumed: NVIDIA Tesla V100 datasheet (80 SMs); no record gives it",
        ),
        (
            "hbm_gb_per_s",
            "M5: te42kyfo/gpu-benches@1c36d50 gpu-stream/v100.txt, triad",
        ),
        (
            "gemm_tflops",
            "G6c: mli/transformers-benchmarks@04df81d README.md, best square fp16 matmul on V100",
        ),
        (
            "flash_attention_tflops",
            "assumed: none; FlashAttention-2 runs on Ampere and later (arXiv 2307.08691)",
        ),
    ],
};

/// FlashAttention-2 on A100 80GB SXM4, forward and backward, causal, head
/// dimension 64, by sequence length (A2: arXiv 2307.08691 Fig. 4(c)).
const A100_FLASH: [(u64, f64); 6] = [
    (512, 88.0),
    (1024, 119.0),
    (2048, 140.0),
    (4096, 156.0),
    (8192, 165.0),
    (16384, 171.0),
];

const A100_KERNEL_SOURCES: [(&str, &str); 4] = [
    ("sm_count", "G11: stas00/ml-engineering@744d01e training/performance/README.md (A100: 108 SMs)"),
    ("hbm_gb_per_s", "M1 (80GB) / M2 (40GB): te42kyfo/gpu-benches@1c36d50 gpu-stream/a100_80.txt, a100_40.txt, triad"),
    ("gemm_tflops", "G1: stas00/ml-engineering@744d01e compute/accelerator/README.md, MAMF of A100 SXM bf16 (the 40GB part has the same chip and clocks)"),
    ("flash_attention_tflops", "A2: arXiv 2307.08691 Fig. 4(c), FlashAttention-2 forward and backward, causal, head dimension 64"),
];

const HOPPER_KERNEL_SOURCES: [(&str, &str); 4] = [
    ("sm_count", "G11: stas00/ml-engineering@744d01e training/performance/README.md (H100/H200: 132 SMs)"),
    ("hbm_gb_per_s", "M6 / M4: H100 from M6, deepseek-ai/FlashMLA@066b5ba README.md (H800 SXM5, the same HBM3 at 3.35 TB/s, in a memory-bound kernel; no STREAM run on H100 SXM is published); H200 from M4, te42kyfo/gpu-benches@1c36d50 gpu-stream/h200.txt, triad"),
    ("gemm_tflops", "G3: stas00/ml-engineering@744d01e compute/accelerator/README.md, MAMF of H100 SXM bf16 (its table: H200 the same)"),
    ("flash_attention_tflops", "A8: stas00/ml-engineering@744d01e insights/when-to-upgrade-gpus/README.md, FlashAttention-3 in training Llama-3.1-8B at 8K, causal, on H200 (the same compute as H100)"),
];

const B200_KERNELS: KernelFigures = KernelFigures {
    sm_count: 148,
    hbm_gb_per_s: 7200.0,
    gemm_tflops: 1807.0,
    flash_attention_tflops: &[(8192, 1016.0)],
    sources: &[
        ("sm_count", "assumed: 148 SMs as NVIDIA's Blackwell architecture brief gives; no record gives it"),
        ("hbm_gb_per_s", "assumed: 0.9 of the 8 TB/s datasheet figure, the share H800 reached (M6); no record measures B200"),
        ("gemm_tflops", "assumed: H100's MAMF share of its peak (G3: 794.5 / 989.5 = 0.803) times B200's 2,250; no record measures B200"),
        ("flash_attention_tflops", "assumed: H200's in-training FlashAttention-3 share of its peak (A8: 447 / 989.5 = 0.452) times B200's 2,250"),
    ],
};

const fn kernels(
    sm_count: u32,
    hbm_gb_per_s: f64,
    gemm_tflops: f64,
    flash_attention_tflops: &'static [(u64, f64)],
    sources: &'static [(&'static str, &'static str)],
) -> KernelFigures {
    KernelFigures {
        sm_count,
        hbm_gb_per_s,
        gemm_tflops,
        flash_attention_tflops,
        sources,
    }
}

/// Every known type; the first is the paper's GPU, the type of untyped specs.
/// Columns: name, spec names, GiB, (bf16, fp32 TFLOP/s), (NVLink, PCIe,
/// network per GPU in Gbit/s), server, source, kernel figures.
#[rustfmt::skip]
pub const GPU_TYPES: [GpuType; 7] = [
    row("V100-16GB", &["v100-16gb", "v100"], 16, (125.0, 15.7), (1040.0, 128.0, 50.0), "DGX-1", V100_SOURCE, (V100_KERNELS, None, DGX1_HOST)),
    row("V100-32GB", &["v100-32gb"], 32, (125.0, 15.7), (1040.0, 128.0, 50.0), "DGX-1", V100_SOURCE, (V100_KERNELS, None, DGX1_HOST)),
    row("A100-40GB", &["a100-40gb"], 40, (312.0, 19.5), (2400.0, 256.0, 200.0), "DGX A100", A100_SOURCE,
        (kernels(108, 1363.0, 271.2, &A100_FLASH, &A100_KERNEL_SOURCES), Some(A100_COLLECTIVES), dgx_a100_host(1.0))),
    row("A100-80GB", &["a100-80gb", "a100"], 80, (312.0, 19.5), (2400.0, 256.0, 200.0), "DGX A100", A100_SOURCE,
        (kernels(108, 1759.0, 271.2, &A100_FLASH, &A100_KERNEL_SOURCES), Some(A100_COLLECTIVES), dgx_a100_host(2.0))),
    row("H100-80GB", &["h100-80gb", "h100"], 80, (989.5, 67.0), (3600.0, 512.0, 400.0), "DGX H100", H100_SOURCE,
        (kernels(132, 3000.0, 794.5, &[(8192, 447.0)], &HOPPER_KERNEL_SOURCES), Some(H100_COLLECTIVES), HOPPER_HOST)),
    row("H200", &["h200", "h200-141gb"], 141, (989.5, 67.0), (3600.0, 512.0, 400.0), "DGX H200", H200_SOURCE,
        (kernels(132, 3534.0, 794.5, &[(8192, 447.0)], &HOPPER_KERNEL_SOURCES), Some(H200_COLLECTIVES), HOPPER_HOST)),
    row("B200", &["b200", "b200-180gb"], 180, (2250.0, 75.0), (7200.0, 512.0, 400.0), "DGX B200", B200_SOURCE, (B200_KERNELS, None, HOPPER_HOST)),
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
    fn every_kernel_figure_names_its_source_and_is_below_the_peak() {
        for g in &GPU_TYPES {
            let k = &g.kernels;
            for field in [
                "sm_count",
                "hbm_gb_per_s",
                "gemm_tflops",
                "flash_attention_tflops",
            ] {
                assert!(
                    k.sources
                        .iter()
                        .any(|(f, s)| *f == field && !s.trim().is_empty()),
                    "{} {field}",
                    g.name
                );
            }
            assert!(k.sm_count > 0 && k.hbm_gb_per_s > 0.0, "{}", g.name);
            assert!(
                k.gemm_tflops > 0.0 && k.gemm_tflops < g.bf16_tflops,
                "{}",
                g.name
            );
            let flash = k.flash_attention_tflops;
            assert!(flash.windows(2).all(|w| w[0].0 < w[1].0), "{}", g.name);
            assert!(
                flash.iter().all(|&(_, t)| t > 0.0 && t < g.bf16_tflops),
                "{}",
                g.name
            );
        }
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
            let h = &g.host;
            assert!(h.copy_gb_per_s > 0.0 && h.copy_gb_per_s <= g.pcie_gbps / 8.0);
            assert!(h.cpu_cores_per_gpu > 0.0 && h.memory_gib_per_gpu > 0.0);
            assert!(h.memory_gb_per_s_per_gpu > 0.0);
            for field in [
                "copy_gb_per_s",
                "cpu_cores_per_gpu",
                "memory_gib_per_gpu",
                "memory_gb_per_s_per_gpu",
            ] {
                assert!(
                    h.sources.iter().any(|(f, _)| *f == field),
                    "{} {field}",
                    g.name
                );
            }
        }
    }
}
