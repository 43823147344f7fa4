"""One rank's loop under an asynchronous schedule (XPipe, PipeDream's weight
stashing, SpecTrain, asynchronous without prediction; docs/xpipe.md).

The rank runs its stage's action list over many mini-batches without a
flush: forwards of later mini-batches cross backwards of earlier ones, and
after each mini-batch's last backward the stage reduces its gradients over
its replicas (``AR``) and steps its optimizer (``OPT``). The core's table
(``Plan.pass_weights``) says which weights each pass uses: the live ones, a
version stashed at its forward, or a prediction ``s`` updates ahead made by
the mini-batch's first pass in that direction (its bellwether) and cached
for the others.

Every forward runs without autograd and keeps only the stage input; the
backward re-runs the forward on its own weights (with the forward's random
state) and differentiates that, so a backward may use other weights than
its forward. Gradients, whatever weights they were computed on, accumulate
into the live parameters, which the optimizer updates.

A run is cut into segments at every checkpoint and evaluation step; each
segment is one asynchronous list, so the pipeline drains at its end (a
checkpoint holds no micro-batch in flight, and an evaluation scores one
version of every stage).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.func import functional_call

from .. import _core
from .evaluation import evaluate
from .prediction import PREDICTORS
from .schedule import Pass, segments
from .training import prefixed_state, scaled_loss
from .worker import Job, RankSetup, allreduce_grads


def run_asynchronous(ctx: RankSetup, job: Job) -> dict[str, Any]:
    """Train ``job.start_step .. job.steps`` under ``job.schedule``; returns
    what ``worker.run_rank`` returns, with per-mini-batch ``iteration_ms``
    (from one update of this rank to the next) and, on the last stage, the
    partial losses of its slices."""
    predictor = None
    name = _core.SCHEDULE_PREDICTORS.get(job.schedule)
    if name is not None and ctx.opt is not None:
        predictor = PREDICTORS[name](ctx.params, ctx.opt)
        if ctx.resumed is not None and ctx.resumed.get("predictor") is not None:
            predictor.load_state_dict(ctx.resumed["predictor"])
    names = [n for n, p in ctx.module.named_parameters() if p.requires_grad]
    iteration_ms: list[float] = []
    losses: list[float] = []
    trace: list[str] = []
    peak = 0
    compute_s = aside_s = 0.0
    ctx.comm.recv_s = 0.0
    t_run = time.perf_counter()
    evaluations: list[dict] = []
    for a, b in segments(job.start_step, job.steps, job.checkpoint_every, job.eval_every):
        seg_losses, seg_ms, seg_peak, seg_compute = _segment(ctx, job, a, job.passes[b - a][ctx.stage], predictor,
                                                             names, trace if a == job.start_step else None)
        iteration_ms += seg_ms
        losses += seg_losses
        peak = max(peak, seg_peak)
        compute_s += seg_compute
        t_aside = time.perf_counter()  # scoring and saving are not training time
        if job.eval_every and b % job.eval_every == 0:
            evaluated = evaluate(ctx, job, b)
            if evaluated is not None:
                evaluations.append(evaluated)
        if job.checkpoint_dir and job.checkpoint_every and b % job.checkpoint_every == 0:
            ctx.save_checkpoint(job, b, predictor=predictor.state_dict() if predictor is not None else None)
        aside_s += time.perf_counter() - t_aside
    total_s = time.perf_counter() - t_run - aside_s
    metrics = {
        "stage": ctx.stage,
        "replica": ctx.replica,
        "iteration_ms": iteration_ms,
        "losses": losses if ctx.last else [],
        "compute_ms": compute_s * 1e3,
        "bubble_ms": max(total_s - compute_s, 0.0) * 1e3,
        "phase_ms": {},
        "peak_memory_bytes": ctx.meter.peak_bytes(),
        "memory_before_bytes": ctx.meter.baseline_bytes,
        "memory_source": ctx.meter.source,
        "asynchronous": True,
        "evaluations": evaluations,
    }
    return {"state": prefixed_state(ctx.layers, ctx.layer_range[0]), "trace": trace, "peak_in_flight": peak,
            "metrics": metrics}


def _segment(ctx: RankSetup, job: Job, first_step: int, passes: list[Pass], predictor, names: list[str],
             trace: list[str] | None):
    """Run one segment's list (mini-batches ``first_step`` on) to its end.
    Returns (loss per mini-batch, ms per mini-batch, most micro-batches in
    flight, seconds computing)."""
    lay = job.layout
    m_count, mbs, gbs = lay.micro_batches, lay.micro_batch_size, lay.global_batch_size
    lo, hi = ctx.lo, ctx.hi
    live = ctx.params
    # Versions a later backward uses after the live weights move past them,
    # and the last backward of each: PipeDream's stash.
    stash_needed, last_use = set(), {}
    for i, (kind, _, _, live_version, base, ahead) in enumerate(passes):
        if kind == "B" and ahead == 0 and base != live_version:
            stash_needed.add(base)
            last_use[base] = i
    stash: dict[int, list[torch.Tensor]] = {}
    cache: dict[tuple[int, int], list[torch.Tensor]] = {}
    left: dict[tuple[int, int], int] = {}  # passes of (mini-batch, direction) still to run here
    inputs: dict[int, torch.Tensor] = {}
    # The random state each forward started from (the CPU's, and the GPU's
    # on CUDA), so the backward's re-run draws the same dropout masks.
    rng: dict[int, tuple] = {}
    cuda = [ctx.dev] if ctx.dev.type == "cuda" else []
    batches: dict[int, Any] = {}
    loss_by_mini_batch: dict[int, float] = {}
    ms: list[float] = []
    peak, compute_s, version = 0, 0.0, 0
    for p in live:
        p.grad = None
    t_last = time.perf_counter()

    def batch(n: int):
        if n not in batches:
            x_all, y_all = job.batches[(first_step + n) % len(job.batches)]
            if x_all.shape[0] != gbs:
                raise ValueError(f"batch {first_step + n} has {x_all.shape[0]} samples, the plan needs {gbs}")
            batches[n] = (x_all, y_all)
        return batches[n]

    def weights(kind: str, n: int, live_version: int, base: int, ahead: int) -> list[torch.Tensor]:
        if ahead > 0 and predictor is None:
            return live  # a stage without parameters: nothing to predict
        if ahead > 0:
            key = (n, 0 if kind == "F" else 1)
            if key not in cache:  # the bellwether predicts for its mini-batch
                cache[key] = predictor.predict(ahead)
                left[key] = m_count
            left[key] -= 1
            w = cache[key]
            if left[key] == 0:
                del cache[key], left[key]
            return w
        if base != live_version:
            return stash[base]
        return live

    def run(w: list[torch.Tensor], x: torch.Tensor):
        return functional_call(ctx.module, dict(zip(names, w)), (x,))

    for i, (kind, t, n, live_version, base, ahead) in enumerate(passes):
        if trace is not None and version == 0:  # the actions up to the first update
            trace.append(kind if t is None else f"{kind}{t}")
        if kind == "AR":
            if ctx.group is not None and not job.skip_allreduce:
                allreduce_grads(live, ctx.group)
            continue
        if kind == "OPT":
            if predictor is not None:
                predictor.observe()
            if version in stash_needed:
                stash[version] = [p.detach().clone() for p in live]
            if ctx.opt is not None:
                for p in live:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                ctx.opt.step()
            for p in live:
                p.grad = None
            version += 1
            batches.pop(version - 1, None)
            ctx.comm.reap()
            now = time.perf_counter()
            ms.append((now - t_last) * 1e3)
            t_last = now
            continue
        j = t % m_count  # the micro-batch within its mini-batch
        base_sample = j * mbs
        w = weights(kind, n, live_version, base, ahead)
        t0, recv_before = time.perf_counter(), ctx.comm.recv_s
        if kind == "F":
            if ctx.first:
                x = batch(n)[0][base_sample + lo : base_sample + hi].to(ctx.dev)
            else:
                parts = [ctx.comm.recv_with_header(src, t, False) for src, _ in ctx.prev]
                x = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
            rng[t] = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda])
            with torch.no_grad():
                out = ctx.computed(lambda: run(w, x))
            if ctx.last:
                y = batch(n)[1][base_sample + lo : base_sample + hi].to(ctx.dev)
                loss = scaled_loss(job.loss_fn, out, y, hi - lo, gbs, job.loss_reduction)
                loss_by_mini_batch[n] = loss_by_mini_batch.get(n, 0.0) + float(loss)
            else:
                for dst, (s0, s1) in ctx.nxt:
                    ctx.comm.send(out[s0 - lo : s1 - lo], dst, t, False, header=True)
            inputs[t] = x
            peak = max(peak, len(inputs))
        else:
            x = inputs.pop(t)
            wants_input_grad = not ctx.first and x.is_floating_point()
            x = x.detach().requires_grad_(wants_input_grad)
            leaves = [v.detach().requires_grad_(True) for v in w]
            for leaf, p in zip(leaves, live):
                # Accumulate straight into the live gradient, parameter by
                # parameter during the backward, as autograd does for a
                # module's own parameters: no second set of gradients.
                leaf.grad = p.grad
            with torch.random.fork_rng(devices=cuda):
                cpu_state, gpu_states = rng.pop(t)
                torch.set_rng_state(cpu_state)
                for d, state in zip(cuda, gpu_states):
                    torch.cuda.set_rng_state(state, d)
                with torch.enable_grad():
                    out = ctx.computed(lambda: run(leaves, x))
                    if ctx.last:
                        y = batch(n)[1][base_sample + lo : base_sample + hi].to(ctx.dev)
                        out = scaled_loss(job.loss_fn, out, y, hi - lo, gbs, job.loss_reduction)
                        grad_out = None
                    else:
                        grad_out = torch.empty_like(out)
                        for src, (s0, s1) in ctx.nxt:
                            piece = torch.empty_like(out[s0 - lo : s1 - lo])
                            ctx.comm.recv_into(piece, src, t, True)
                            grad_out[s0 - lo : s1 - lo] = piece
            targets = leaves + ([x] if wants_input_grad else [])
            if out.requires_grad and targets:
                ctx.computed(lambda: torch.autograd.backward(out, grad_out, inputs=targets))
            for p, leaf in zip(live, leaves):
                p.grad = leaf.grad
            if not ctx.first:
                g = x.grad if wants_input_grad and x.grad is not None else torch.zeros_like(x)
                for dst, (s0, s1) in ctx.prev:
                    ctx.comm.send(g[s0 - lo : s1 - lo], dst, t, True, header=False)
            if last_use.get(base) == i:
                del stash[base]
        compute_s += time.perf_counter() - t0 - (ctx.comm.recv_s - recv_before)
        # Let go of this pass's weights and tensors before the next pass
        # makes its own (a prediction would otherwise exist twice).
        w = leaves = out = grad_out = x = None
    ctx.comm.wait_all()
    dist.barrier()  # the segment ends drained on every rank
    losses = [loss_by_mini_batch.get(n, 0.0) for n in range(len(ms))]
    return losses, ms, peak, compute_s
