"""The cost model's operators against the GPU at hand: one command, a few minutes.

    python benchmarks/gpu_kernels.py --device cuda --out benchmarks/results/gpu_kernels-h200.json

On the lent GPU it times, with CUDA events (the median of ``--repeats``
after ``--warmup`` launches, each on its own fresh inputs of random
normal values; torch's default cuBLAS through ``torch.matmul``):

- **bf16 matrix products** by shape: a square sweep (256 to 16384), and the
  products of the transformer blocks that ``docs/published-runs.md`` prices
  (GPT-3 175B, Megatron's 530B and Llama-3-405B at t = 8, Llama-2-70B at
  t = 4, a 3.6B GPT at t = 1), forward and both backward products, at the
  runs' micro-batch tokens (1 x 2048, 1 x 8192, ...);
- **the attention core** as ``torch.nn.functional.scaled_dot_product_attention``
  runs it in bf16 (FlashAttention where torch has it), causal, forward and
  forward + backward, at the heads, sequence and head width of those runs;
- **HBM bandwidth**: a device-to-device copy of 2 GiB (bytes read plus
  written over the time).

Each row gives the measured time and throughput beside ``_core.gemm_ms``'s
(or the kernel figures') prediction for the catalog's GPU type
(``--gpu``, default: the one whose name the device reports) and their
ratio. The rows are a check of the rule and a measured table to cite;
nothing here sets a constant by itself (docs/cost-model.md says which
figure comes from where).

``--device cpu`` runs a few small shapes in fp32 on the CPU, so that the
script can be tried where no GPU is (its timings mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Transformer blocks priced in docs/published-runs.md: (name, hidden, ffn
# hidden, heads, kv heads, head width, tensor-parallel degree, sequence,
# gated MLP).
BLOCKS = [
    ("gpt3-175b-t8", 12288, 49152, 96, 96, 128, 8, 2048, False),
    ("megatron-530b-t8", 20480, 81920, 128, 128, 160, 8, 2048, False),
    ("llama3-405b-t8", 16384, 53248, 128, 8, 128, 8, 8192, True),
    ("llama2-70b-t4", 8192, 28672, 64, 8, 128, 4, 4096, True),
    ("gpt-3.6b-t1", 3072, 12288, 32, 32, 96, 1, 2048, False),
]
SQUARES = [256, 512, 1024, 2048, 4096, 8192, 16384]
MICRO_BATCHES = [1, 2, 4]


def block_products(hidden, ffn, heads, kv_heads, head_dim, t, seq, gated, micro_batch):
    """(label, m, n, k) of one block's forward products and their backward
    ones: the activation gradient (m x k over n) and the weight gradient
    (k x n over m) of each forward m x n over k."""
    tokens = micro_batch * seq
    qkv_out = (heads + 2 * kv_heads) * head_dim // t
    up_out = (2 if gated else 1) * ffn // t
    forward = [("qkv", tokens, qkv_out, hidden), ("attn_out", tokens, hidden, heads * head_dim // t),
               ("mlp_up", tokens, up_out, hidden), ("mlp_down", tokens, hidden, ffn // t)]
    rows = []
    for label, m, n, k in forward:
        rows += [(f"{label}.fwd", m, n, k), (f"{label}.dgrad", m, k, n), (f"{label}.wgrad", k, n, m)]
    return rows


def timed_ms(torch, device, launch, warmup, repeats):
    """Median ms of `launch()` over `repeats`, after `warmup` launches."""
    for _ in range(warmup):
        launch()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        launch()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def gemm_rows(torch, args, dtype, gpu, core):
    shapes = [("square", n, n, n) for n in (SQUARES if args.device == "cuda" else [64, 128])]
    for name, *block in (BLOCKS if args.device == "cuda" else BLOCKS[-1:]):
        for micro_batch in (MICRO_BATCHES if args.device == "cuda" else [1]):
            for label, m, n, k in block_products(*block, micro_batch):
                if args.device == "cpu":
                    m, n, k = max(m // 64, 1), max(n // 64, 1), max(k // 64, 1)
                shapes.append((f"{name}.b{micro_batch}.{label}", m, n, k))
    rows, seen = [], {}
    for label, m, n, k in shapes:
        if (m, n, k) in seen:
            seen[(m, n, k)]["labels"].append(label)
            continue
        a = torch.randn(m, k, device=args.device, dtype=dtype)
        b = torch.randn(k, n, device=args.device, dtype=dtype)
        ms = timed_ms(torch, args.device, lambda: torch.matmul(a, b), args.warmup, args.repeats)
        del a, b
        model_ms = core.gemm_ms(gpu, m, n, k)
        row = {"labels": [label], "m": m, "n": n, "k": k, "measured_ms": round(ms, 5),
               "measured_tflops": round(2 * m * n * k / ms / 1e9, 1), "model_ms": round(model_ms, 5),
               "model_over_measured": round(model_ms / ms, 3)}
        seen[(m, n, k)] = row
        rows.append(row)
        print(f"gemm {m}x{n}x{k}: {ms:.4f} ms ({row['measured_tflops']} TFLOP/s), "
              f"model {model_ms:.4f} ms, ratio {row['model_over_measured']}", file=sys.stderr, flush=True)
    return rows


def attention_rows(torch, args, dtype):
    functional = torch.nn.functional
    shapes = []
    for name, hidden, _ffn, heads, kv_heads, head_dim, t, seq, _gated in BLOCKS:
        if args.device == "cpu":
            heads, seq = max(heads // 16, 1), 128
        shapes.append((name, heads // t if args.device == "cuda" else heads, seq, head_dim))
    rows = []
    for name, heads, seq, head_dim in shapes:
        q, k, v = (torch.randn(1, heads, seq, head_dim, device=args.device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        forward = lambda: functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        grad = torch.randn(1, heads, seq, head_dim, device=args.device, dtype=dtype)

        def forward_backward():
            forward().backward(grad)

        fwd_ms = timed_ms(torch, args.device, forward, args.warmup, args.repeats)
        step_ms = timed_ms(torch, args.device, forward_backward, args.warmup, args.repeats)
        # Causal: half the score matrix; forward 2 products, backward 5
        # (FlashAttention-2's count, its recomputed scores included).
        fwd_flops = 2 * 2 * heads * seq * seq * head_dim / 2
        rows.append({"model": name, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": True,
                     "fwd_ms": round(fwd_ms, 5), "fwd_bwd_ms": round(step_ms, 5),
                     "fwd_tflops": round(fwd_flops / fwd_ms / 1e9, 1),
                     "fwd_bwd_tflops": round(fwd_flops * 3.5 / step_ms / 1e9, 1)})
        print(f"attention {name}: fwd {fwd_ms:.3f} ms, fwd+bwd {step_ms:.3f} ms "
              f"({rows[-1]['fwd_bwd_tflops']} TFLOP/s)", file=sys.stderr, flush=True)
        del q, k, v, grad
    return rows


def copy_row(torch, args):
    count = (1 << 30) if args.device == "cuda" else (1 << 22)
    source = torch.empty(count, device=args.device, dtype=torch.bfloat16).normal_()
    target = torch.empty_like(source)
    ms = timed_ms(torch, args.device, lambda: target.copy_(source), args.warmup, args.repeats)
    moved = 2 * source.numel() * source.element_size()
    return {"bytes_read_and_written": moved, "ms": round(ms, 5), "gb_per_s": round(moved / ms / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu", help="catalog GPU type to predict for (default: from the device's name)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import torch

    from dapple.planner import GPU_TYPES, _core

    started = time.perf_counter()
    if args.device == "cuda":
        device_name = torch.cuda.get_device_name(0)
        properties = torch.cuda.get_device_properties(0)
        sm_count = properties.multi_processor_count
        dtype = torch.bfloat16
    else:
        device_name, sm_count, dtype = "cpu", None, torch.float32
    gpu = args.gpu or next((name for name in GPU_TYPES if name.lower().split("-")[0] in device_name.lower()),
                           "H100-80GB")
    kernels = GPU_TYPES[gpu]["kernels"]
    results = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name, "sm_count": sm_count, "torch": torch.__version__,
        "cuda": getattr(torch.version, "cuda", None), "catalog_gpu": gpu,
        "catalog_kernels": {key: kernels[key] for key in ("sm_count", "hbm_gb_per_s", "gemm_tflops",
                                                          "flash_attention_tflops")},
        "load_average_before": list(os.getloadavg()), "warmup": args.warmup, "repeats": args.repeats,
    }
    results["copy"] = copy_row(torch, args)
    print(f"copy: {results['copy']['gb_per_s']} GB/s", file=sys.stderr, flush=True)
    results["gemm"] = gemm_rows(torch, args, dtype, gpu, _core)
    results["attention"] = attention_rows(torch, args, dtype)
    ratios = [row["model_over_measured"] for row in results["gemm"]]
    results["gemm_median_model_over_measured"] = round(statistics.median(ratios), 3)
    results["gemm_within_10_percent"] = sum(0.9 <= r <= 1.1 for r in ratios)
    results["load_average_after"] = list(os.getloadavg())
    results["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, args.out)
    print(f"{len(ratios)} products: model over measured median {results['gemm_median_model_over_measured']}, "
          f"{results['gemm_within_10_percent']} within 10%; {results['wall_s']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
