"""Run a ``dapple.plan`` on CPU processes with torch.distributed (gloo).

One process per device the plan uses. Rank r is the position of its device id
in the sorted list of all used device ids; it holds one replica of one stage.
Every rank builds the whole model from the same seed and keeps
``layers[layer_start:layer_end]`` of its stage, so all replicas start equal.

Per iteration (one global batch):

- the global batch is split into M micro-batches of ``micro_batch_size``
  consecutive samples; a micro-batch entering a stage with r replicas is split
  into r contiguous slices, the first ``mbs % r`` of ``ceil(mbs / r)`` samples
  and the rest of ``floor(mbs / r)`` (``largest_slice`` / ``smallest_slice``
  in ``cost.rs``); replica j takes slice j;
- each stage runs its schedule (:mod:`planner.runtime.schedule`); between
  stage s and s+1 every sender sends each receiver exactly the samples their
  slices share (point-to-point, shape header first), and gradients go back
  the same way;
- the last stage's loss on a slice of n samples is ``loss_fn(out, tgt) * n /
  global_batch`` (``loss_reduction="mean"``) or ``loss_fn(out, tgt) /
  global_batch`` (``"sum"``), so the accumulated gradient is that of the mean
  loss over the global batch;
- then each stage's gradients are summed over its replicas (AllReduce on a
  process group per stage) and one optimizer step (SGD or Adam) is taken.

Sends are non-blocking (``isend``) and waited for at the end of the
iteration; receives block. Since every rank follows its stage's schedule,
which the lock-step check of ``schedule.validate`` proves deadlock-free, every
receive is eventually matched. Tags separate micro-batches and directions.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.checkpoint import checkpoint

from .memory import PeakMemory, return_freed_memory
from .schedule import plan_schedule

# ----------------------------------------------------------------------------
# Layout: ranks, stages, slices


def slice_ranges(n: int, replicas: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of ``n`` samples over ``replicas``:
    sizes differ by at most one, largest first."""
    if replicas < 1:
        raise ValueError("a stage needs at least one replica")
    big, extra = divmod(n, replicas)
    out, start = [], 0
    for j in range(replicas):
        size = big + (1 if j < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Layout:
    """Who does what: ``stage_ranks[s]`` lists the ranks of stage s by
    replica index; ``rank_of_device`` maps device id -> rank."""

    stage_ranks: list[list[int]]
    layer_ranges: list[tuple[int, int]]
    rank_of_device: dict[int, int]
    micro_batch_size: int
    micro_batches: int
    schedule: list[list[tuple[str, int]]]

    @property
    def world_size(self) -> int:
        return len(self.rank_of_device)

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches

    def where(self, rank: int) -> tuple[int, int]:
        """(stage, replica index) of ``rank``."""
        for s, ranks in enumerate(self.stage_ranks):
            if rank in ranks:
                return s, ranks.index(rank)
        raise ValueError(f"rank {rank} is not in the plan")

    def slices(self, stage: int) -> list[tuple[int, int]]:
        return slice_ranges(self.micro_batch_size, len(self.stage_ranks[stage]))


def layout_of(plan_data: dict) -> Layout:
    stages = plan_data["stages"]
    if not stages:
        raise ValueError("plan has no stages")
    devices = [int(d) for st in stages for d in st["devices"]]
    if len(set(devices)) != len(devices):
        raise ValueError("a device is used by more than one stage (or twice by one)")
    rank_of_device = {d: r for r, d in enumerate(sorted(devices))}
    stage_ranks = [[rank_of_device[int(d)] for d in st["devices"]] for st in stages]
    layer_ranges = [(int(st["layer_start"]), int(st["layer_end"])) for st in stages]
    for i, (a, b) in enumerate(layer_ranges):
        if a >= b:
            raise ValueError(f"stage {i}: empty layer range {a}..{b}")
        if i and layer_ranges[i - 1][1] != a:
            raise ValueError(f"stage {i} does not start where stage {i - 1} ends")
    if layer_ranges[0][0] != 0:
        raise ValueError("the first stage must start at layer 0")
    mbs, m = int(plan_data["micro_batch_size"]), int(plan_data["micro_batches"])
    gbs = plan_data.get("inputs", {}).get("global_batch_size")
    if gbs is not None and gbs != mbs * m:
        raise ValueError(f"micro_batch_size {mbs} x micro_batches {m} != global_batch_size {gbs}")
    for i, ranks in enumerate(stage_ranks):
        if not ranks:
            raise ValueError(f"stage {i} has no devices")
        if mbs // len(ranks) < 1:
            raise ValueError(f"stage {i}: {len(ranks)} replicas for micro-batches of {mbs}")
    return Layout(stage_ranks, layer_ranges, rank_of_device, mbs, m, plan_schedule(plan_data))


# ----------------------------------------------------------------------------
# Model and training helpers


def build_layers(layers_factory: Callable[[], Any], seed: int) -> list[nn.Module]:
    """The model's layers as modules, built after ``torch.manual_seed(seed)``.

    ``layers_factory()`` may return a ModelSpec-like object with ``.layers``,
    a list of ``(name, module)`` pairs, a list of modules, or an
    ``nn.Sequential``."""
    torch.manual_seed(seed)
    return _layers_of(layers_factory())


def _layers_of(made: Any) -> list[nn.Module]:
    made = getattr(made, "layers", made)
    return [item[1] if isinstance(item, tuple) else item for item in made]


def _make_optimizer(params, optimizer: str, lr: float):
    params = list(params)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr) if params else None
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr) if params else None
    raise ValueError(f"unknown optimizer {optimizer!r}; use sgd or adam")


def _scaled_loss(loss_fn, out, tgt, n: int, gbs: int, reduction: str):
    loss = loss_fn(out, tgt)
    if reduction == "mean":
        return loss * (n / gbs)
    if reduction == "sum":
        return loss / gbs
    raise ValueError(f"unknown loss_reduction {reduction!r}; use mean or sum")


def prefixed_state(layers: list[nn.Module], first_index: int) -> dict[str, torch.Tensor]:
    """State of ``layers`` keyed ``"<global layer index>.<name>"`` as
    ``nn.Sequential(*all_layers).state_dict()`` would."""
    out = {}
    for i, layer in enumerate(layers):
        for k, v in layer.state_dict().items():
            out[f"{first_index + i}.{k}"] = v.detach().to("cpu", copy=True)
    return out


def train_single_process(
    layers_factory,
    loss_fn,
    batches,
    steps: int | None = None,
    lr: float = 0.1,
    optimizer: str = "sgd",
    seed: int = 0,
    loss_reduction: str = "mean",
) -> dict[str, torch.Tensor]:
    """Reference: plain training of the whole model on the global batches
    (loss = mean over each global batch), returning the Sequential state."""
    layers = build_layers(layers_factory, seed)
    model = nn.Sequential(*layers)
    opt = _make_optimizer(model.parameters(), optimizer, lr)
    steps = len(batches) if steps is None else steps
    for it in range(steps):
        x, y = batches[it % len(batches)]
        opt.zero_grad(set_to_none=False)
        loss = _scaled_loss(loss_fn, model(x), y, x.shape[0], x.shape[0], loss_reduction)
        loss.backward()
        opt.step()
    return prefixed_state(layers, 0)


class SeededBatches:
    """``steps`` global batches made on demand by ``model_factory().make_batch(
    batch_size, generator)`` from one ``torch.Generator`` seeded with ``seed``:
    batch i is the i-th one drawn, so a run resumed at step s sees the batches
    of an uninterrupted run (the skipped ones are regenerated and dropped).
    Picklable when ``model_factory`` is."""

    def __init__(self, model_factory: Callable[[], Any], batch_size: int, steps: int, seed: int = 0):
        self.model_factory = model_factory
        self.batch_size = batch_size
        self.steps = steps
        self.seed = seed
        self._make = None
        self._gen = None
        self._next = 0
        self._last = None

    def __len__(self) -> int:
        return self.steps

    def use_maker(self, make_batch: Callable | None) -> None:
        """Draw batches with ``make_batch`` from a model this process has
        built already, instead of building another one on first use."""
        if self._make is None and make_batch is not None:
            self._make = make_batch

    def __getstate__(self):
        d = dict(self.__dict__)
        d.update(_make=None, _gen=None, _next=0, _last=None)
        return d

    def __getitem__(self, i: int):
        if not 0 <= i < self.steps:
            raise IndexError(i)
        if self._make is None:
            self._make = self.model_factory().make_batch
        if self._gen is None or i < self._next - 1:
            self._gen = torch.Generator().manual_seed(self.seed)
            self._next, self._last = 0, None
        while self._next <= i:
            self._last = self._make(self.batch_size, self._gen)
            self._next += 1
        return self._last


# ----------------------------------------------------------------------------
# Point-to-point

_HEADER = 9  # [dtype code, ndim, up to 7 dims]
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def _tag(m: int, backward: bool, part: int) -> int:
    # part 0: header, 1: data. Distinct per (micro-batch, direction).
    return m * 4 + (2 if backward else 0) + part


class _Comm:
    def __init__(self, device: torch.device):
        self.device = device  # NCCL moves only tensors on the rank's GPU, headers too
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.recv_s = 0.0  # time spent blocked in receives

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        t0 = time.perf_counter()
        dist.recv(t, src, tag=tag)
        self.recv_s += time.perf_counter() - t0

    def send(self, t: torch.Tensor, dst: int, m: int, backward: bool, header: bool):
        t = t.detach().contiguous()
        if header:
            if t.dim() > _HEADER - 2:
                raise ValueError(f"tensors of {t.dim()} dimensions cannot cross a stage")
            h = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim()),
                             dtype=torch.int64, device=self.device)
            self.pending.append((dist.isend(h, dst, tag=_tag(m, backward, 0)), h))
        self.pending.append((dist.isend(t, dst, tag=_tag(m, backward, 1)), t))

    def recv_with_header(self, src: int, m: int, backward: bool) -> torch.Tensor:
        h = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        self._recv(h, src, _tag(m, backward, 0))
        header = h.tolist()
        shape = header[2 : 2 + header[1]]
        t = torch.empty(shape, dtype=_DTYPES[header[0]], device=self.device)
        self._recv(t, src, _tag(m, backward, 1))
        return t

    def recv_into(self, t: torch.Tensor, src: int, m: int, backward: bool) -> None:
        self._recv(t, src, _tag(m, backward, 1))

    def wait_all(self):
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


# ----------------------------------------------------------------------------
# Worker


@dataclass
class _Job:
    plan_data: dict
    layers_factory: Callable
    loss_fn: Callable
    batches: list
    steps: int
    lr: float
    optimizer: str = "sgd"
    seed: int = 0
    loss_reduction: str = "mean"
    skip_allreduce: bool = False  # testing hook: must break equivalence
    out_dir: str | None = None
    threads: int = 1
    start_step: int = 0  # resume: the step the checkpoint in checkpoint_dir holds
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    log: bool = False  # rank 0 prints one line per iteration to stderr; workers' stdout goes to stderr
    timeout_s: float = 30.0
    recompute: bool = False  # keep only each stage's input; re-run the stage's forward in its backward
    exact_memory: bool = False  # see memory.return_freed_memory
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)


def _backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank``: the CPU, or the GPU of its local rank
    (``LOCAL_RANK`` under torchrun, the rank itself for local processes)."""
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if local >= torch.cuda.device_count():
        raise ValueError(f"rank {rank} needs GPU {local}, only {torch.cuda.device_count()} visible")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _allreduce_grads(params: list[nn.Parameter], group) -> None:
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def _run_rank(rank: int, job: _Job) -> dict[str, Any]:
    """The training loop of one rank; the process group must be up.
    Returns ``{"state", "trace", "peak_in_flight"}``: the stage's final
    state, the actions run in the first iteration (``"F0"``, ``"B0"``, ...,
    ``"AR"``, ``"OPT"``) and the most micro-batches whose activations were
    held at once."""
    lay = layout_of(job.plan_data)
    stage, replica = lay.where(rank)
    n_stages = len(lay.stage_ranks)
    first, last = stage == 0, stage == n_stages - 1
    a, b = lay.layer_ranges[stage]

    torch.manual_seed(job.seed)
    made = job.layers_factory()
    all_layers = _layers_of(made)
    if isinstance(job.batches, SeededBatches):
        job.batches.use_maker(getattr(made, "make_batch", None))
    if lay.layer_ranges[-1][1] != len(all_layers):
        raise ValueError(
            f"the plan's stages end at layer {lay.layer_ranges[-1][1]}, the model has {len(all_layers)}"
        )
    layers = all_layers[a:b]
    del all_layers, made  # the other stages' layers are not this rank's to keep
    dev = _rank_device(job.device, rank)
    module = nn.Sequential(*layers).to(dev)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = _make_optimizer(params, job.optimizer, job.lr)
    if job.start_step:
        from . import checkpoint as ckpt

        saved = ckpt.load_rank(job.checkpoint_dir, job.start_step, rank)
        if saved["step"] != job.start_step or tuple(saved["layer_range"]) != (a, b):
            raise ValueError(
                f"checkpoint step {job.start_step} rank {rank} holds layers {saved['layer_range']} "
                f"at step {saved['step']}, this plan gives the rank layers {(a, b)}"
            )
        module.load_state_dict(saved["model"])
        if opt is not None:
            opt.load_state_dict(saved["optimizer"])

    # Process groups: created by every rank, in stage order.
    groups = [dist.new_group(ranks) if len(ranks) > 1 else None for ranks in lay.stage_ranks]
    group = groups[stage]

    mbs, gbs = lay.micro_batch_size, lay.global_batch_size
    my_range = lay.slices(stage)[replica]
    prev = (
        [(lay.stage_ranks[stage - 1][k], ov) for k, r in enumerate(lay.slices(stage - 1))
         if (ov := overlap(r, my_range))]
        if not first else []
    )
    nxt = (
        [(lay.stage_ranks[stage + 1][k], ov) for k, r in enumerate(lay.slices(stage + 1))
         if (ov := overlap(r, my_range))]
        if not last else []
    )
    comm = _Comm(dev)
    lo, hi = my_range
    trace: list[str] = []
    peak = 0
    iteration_ms: list[float] = []
    losses: list[float] = []
    compute_s = bubble_s = 0.0
    # Where each iteration's time went on this rank (see RunResult.metrics).
    phase_ms: dict[str, list[float]] = {
        k: [] for k in ("compute", "recv_wait", "send_wait", "allreduce", "optimizer", "end_sync")
    }
    fail_rank = os.environ.get("DAPPLE_TEST_FAIL_RANK")
    fail_step = int(os.environ.get("DAPPLE_TEST_FAIL_STEP", "1"))
    # The peak of the training iterations, from the size after the stage and
    # its optimizer were built (Adam's state arrives with the first step).
    meter = PeakMemory(cuda=dev.type == "cuda")

    for it in range(job.start_step, job.steps):
        if fail_rank is not None and int(fail_rank) == rank and it + 1 == fail_step:
            raise RuntimeError(f"injected failure at step {it + 1} (DAPPLE_TEST_FAIL_RANK)")
        dist.barrier()
        t_start = time.perf_counter()
        comm.recv_s = 0.0
        loss_sum = 0.0
        x_all, y_all = job.batches[it % len(job.batches)]
        if x_all.shape[0] != gbs:
            raise ValueError(f"batch {it} has {x_all.shape[0]} samples, the plan needs {gbs}")
        for p in params:
            p.grad = None
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        for kind, m in lay.schedule[stage]:
            base = m * mbs
            if it == 0:
                trace.append(f"{kind}{m}")
            if kind == "F":
                if first:
                    x = x_all[base + lo : base + hi].to(dev)
                else:
                    parts = [comm.recv_with_header(src, m, False) for src, _ in prev]
                    x = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
                    if x.is_floating_point():
                        x.requires_grad_(True)
                    inputs[m] = x
                if job.recompute:
                    # Stage-level re-computation (GPipe's, and DAPPLE's Table
                    # VI): only the stage input is kept; the backward re-runs
                    # the forward, restoring the RNG state it started with.
                    out = checkpoint(module, x, use_reentrant=False)
                else:
                    out = module(x)
                if last:
                    y = y_all[base + lo : base + hi].to(dev)
                    outputs[m] = _scaled_loss(job.loss_fn, out, y, hi - lo, gbs, job.loss_reduction)
                    loss_sum += float(outputs[m].detach())
                else:
                    for dst, (s0, s1) in nxt:
                        comm.send(out[s0 - lo : s1 - lo], dst, m, False, header=True)
                    outputs[m] = out
                peak = max(peak, len(outputs))
            else:
                out = outputs.pop(m)
                if last:
                    grad = None
                else:
                    grad = torch.empty_like(out)
                    for src, (s0, s1) in nxt:
                        piece = torch.empty_like(out[s0 - lo : s1 - lo])
                        comm.recv_into(piece, src, m, True)
                        grad[s0 - lo : s1 - lo] = piece
                if out.requires_grad:
                    out.backward(grad)
                if not first:
                    x = inputs.pop(m)
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    for dst, (s0, s1) in prev:
                        comm.send(g[s0 - lo : s1 - lo], dst, m, True, header=False)
        t_schedule_end = time.perf_counter()
        comm.wait_all()
        t_sent = time.perf_counter()
        if group is not None and not job.skip_allreduce:
            _allreduce_grads(params, group)
            if it == 0:
                trace.append("AR")
        t_reduced = time.perf_counter()
        if it == 0:
            trace.append("OPT")
        if opt is not None:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
        t_stepped = time.perf_counter()
        # The iteration ends when every rank is done; the sum of the last
        # stage's scaled losses is the mean loss over the global batch.
        total = torch.tensor([loss_sum], dtype=torch.float64, device=dev)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        t_end = time.perf_counter()
        elapsed = t_end - t_start
        for name, seconds in (
            ("compute", t_schedule_end - t_start - comm.recv_s),
            ("recv_wait", comm.recv_s),
            ("send_wait", t_sent - t_schedule_end),
            ("allreduce", t_reduced - t_sent),
            ("optimizer", t_stepped - t_reduced),
            ("end_sync", t_end - t_stepped),
        ):
            phase_ms[name].append(seconds * 1e3)
        iteration_ms.append(elapsed * 1e3)
        losses.append(float(total[0]))
        bubble_s += comm.recv_s
        compute_s += elapsed - comm.recv_s
        if job.log and rank == 0:
            print(f"step {it + 1}/{job.steps} loss {losses[-1]:.6f} {elapsed * 1e3:.1f} ms", file=sys.stderr, flush=True)
        done = it + 1
        if job.checkpoint_dir and job.checkpoint_every and done % job.checkpoint_every == 0:
            from . import checkpoint as ckpt

            ckpt.save_rank(job.checkpoint_dir, done, rank, {
                "step": done,
                "rank": rank,
                "stage": stage,
                "layer_range": [a, b],
                "model": module.state_dict(),
                "optimizer": opt.state_dict() if opt is not None else None,
            })
            dist.barrier()  # every rank's file is on disk
            if rank == 0:
                ckpt.write_latest(job.checkpoint_dir, done)
    metrics = {
        "stage": stage,
        "replica": replica,
        "iteration_ms": iteration_ms,
        "losses": losses,
        "compute_ms": compute_s * 1e3,
        "bubble_ms": bubble_s * 1e3,
        "phase_ms": phase_ms,
        "peak_memory_bytes": meter.peak_bytes(),
        "memory_before_bytes": meter.baseline_bytes,
        "memory_source": meter.source,
    }
    return {"state": prefixed_state(layers, a), "trace": trace, "peak_in_flight": peak, "metrics": metrics}


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel kill this worker when the process that started
    it dies, so a killed `dapple run` leaves no worker training on (and
    writing checkpoints) behind it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1  # linux/prctl.h
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker(rank: int, world_size: int, port: int, job: _Job, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    if job.log:
        # Keep the parent's stdout for its own output: gloo prints connection
        # notices there.
        sys.stdout.flush()
        os.dup2(2, 1)
    torch.set_num_threads(job.threads)
    if job.exact_memory:
        return_freed_memory()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(_backend(job.device), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=job.timeout_s))
    try:
        result = _run_rank(rank, job)
        torch.save(result, os.path.join(job.out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    """True in a process torchrun (or another launcher speaking its
    protocol) started: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are all set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _run_this_rank(lay: Layout, job: _Job) -> RunResult | None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != lay.world_size:
        raise ValueError(
            f"torchrun started {world_size} processes (WORLD_SIZE) but the plan uses {lay.world_size} devices"
        )
    torch.set_num_threads(job.threads)
    if job.exact_memory:
        return_freed_memory()
    # As in _worker: gloo prints connection notices on stdout, which is for
    # rank 0's summary only, so stdout goes to stderr while the run lasts
    # (for good on the other ranks).
    saved_stdout = None
    if job.log:
        sys.stdout.flush()
        saved_stdout = os.dup(1) if rank == 0 else None
        os.dup2(2, 1)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(_backend(job.device), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=job.timeout_s))
    try:
        try:
            result = _run_rank(rank, job)
        except Exception as e:  # noqa: BLE001 - any failure of this rank ends the run, named
            raise WorkerFailed(rank, f"{type(e).__name__}: {_last_line(str(e))}") from e
        gathered: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
    finally:
        if owns_group:
            dist.destroy_process_group()
        if saved_stdout is not None:
            sys.stdout.flush()
            os.dup2(saved_stdout, 1)
            os.close(saved_stdout)
    if rank != 0:
        return None
    return _result_of(lay, dict(enumerate(gathered)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunResult:
    """``params``: the trained model, ``"<layer index>.<name>"`` -> tensor,
    taken from replica 0 of each stage. ``per_rank``: each rank's stage state.
    ``stage_of_rank``: rank -> (stage, replica). ``trace``: rank -> actions
    run in the first iteration (``"F0"``, ``"B0"``, ..., ``"AR"`` when the
    stage is replicated, ``"OPT"``). ``peak_in_flight``: rank -> most
    micro-batches whose activations the rank held at once.

    ``metrics``: rank -> ``{"stage", "replica", "iteration_ms", "losses",
    "compute_ms", "bubble_ms", "phase_ms", "peak_memory_bytes",
    "memory_before_bytes", "memory_source"}``. ``iteration_ms`` runs from
    a barrier to the end of the loss reduction. ``phase_ms`` splits each
    iteration into lists, one value an iteration: ``compute`` (the schedule's
    forwards and backwards, less the waits in receives), ``recv_wait`` (the
    waits: bubbles and transfers), ``send_wait`` (waiting for the
    iteration's sends to finish), ``allreduce`` (the stage's gradients),
    ``optimizer`` (the step) and ``end_sync`` (the loss reduction that ends
    the iteration). ``compute_ms`` and ``bubble_ms`` are the totals over
    the iterations of the iteration time outside receives and inside them."""

    params: dict[str, torch.Tensor]
    per_rank: dict[int, dict[str, torch.Tensor]]
    stage_of_rank: dict[int, tuple[int, int]]
    trace: dict[int, list[str]]
    peak_in_flight: dict[int, int]
    metrics: dict[int, dict] = field(default_factory=dict)

    def replicas_agree(self, atol: float = 0.0) -> bool:
        by_stage: dict[int, list[dict]] = {}
        for r, (s, _) in self.stage_of_rank.items():
            by_stage.setdefault(s, []).append(self.per_rank[r])
        for states in by_stage.values():
            for other in states[1:]:
                for k, v in states[0].items():
                    if not torch.allclose(v, other[k], rtol=0, atol=atol):
                        return False
        return True


def _collect(lay: Layout, out_dir: str) -> RunResult:
    return _result_of(lay, {
        r: torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
        for r in range(lay.world_size)
    })


def _result_of(lay: Layout, loaded: dict[int, dict]) -> RunResult:
    per_rank = {r: v["state"] for r, v in loaded.items()}
    params: dict[str, torch.Tensor] = {}
    for ranks in lay.stage_ranks:
        params.update(per_rank[ranks[0]])
    return RunResult(
        params=params,
        per_rank=per_rank,
        stage_of_rank={r: lay.where(r) for r in range(lay.world_size)},
        trace={r: v["trace"] for r, v in loaded.items()},
        peak_in_flight={r: v["peak_in_flight"] for r, v in loaded.items()},
        metrics={r: v.get("metrics", {}) for r, v in loaded.items()},
    )


def run_plan(
    plan_data: dict,
    layers_factory: Callable[[], Any],
    loss_fn: Callable,
    batches: list,
    steps: int,
    lr: float,
    world_size: int | None = None,
    *,
    optimizer: str = "sgd",
    seed: int = 0,
    loss_reduction: str = "mean",
    threads: int = 1,
    out_dir: str | None = None,
    skip_allreduce: bool = False,
    start_method: str = "spawn",
    start_step: int = 0,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    log: bool = False,
    timeout_s: float = 30.0,
    recompute: bool = False,
    exact_memory: bool = False,
    device: str = "cpu",
) -> RunResult | None:
    """Train for ``steps`` iterations following ``plan_data`` (a ``dapple.plan``
    dict; needs ``stages[*].layer_start/layer_end/devices``, optionally
    ``warmup_micro_batches``, ``micro_batch_size``, ``micro_batches``,
    ``schedule.kind``), on one gloo process per used device.

    ``batches``: global batches ``(inputs, targets)`` of
    ``micro_batch_size * micro_batches`` samples along dim 0; iteration i uses
    ``batches[i % len(batches)]``. ``layers_factory`` (picklable, e.g. a
    module-level function) builds the model; called after
    ``torch.manual_seed(seed)`` on every rank. ``loss_fn(output, target)``
    is the loss of a slice, a mean over its samples (``loss_reduction="mean"``)
    or a sum (``"sum"``). ``optimizer``: ``"sgd"`` or ``"adam"``.

    ``start_step``: resume from the checkpoint of that step in
    ``checkpoint_dir`` (see :mod:`planner.runtime.checkpoint`) and run
    iterations ``start_step .. steps-1``. ``checkpoint_every`` K > 0 saves
    every rank's stage after each K-th step. ``log``: rank 0 prints a line
    per iteration to stderr (and workers' stdout goes to stderr). A test
    hook: ``DAPPLE_TEST_FAIL_RANK=r`` (with ``DAPPLE_TEST_FAIL_STEP=n``, default
    1) in the environment makes rank r raise before step n. ``timeout_s``: gloo's timeout for collectives
    and receives.

    ``device``: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL; rank r on GPU r, or on
    GPU ``LOCAL_RANK`` under torchrun; local processes are then spawned).
    The CUDA path has not run on a GPU yet: this machine has none.

    ``recompute``: keep only each stage's input during the forward and re-run
    the stage's forward in its backward (``torch.utils.checkpoint``); the
    result is the same up to rounding. ``exact_memory``: make each worker's C
    allocator return freed memory at once, so the measured peak memory
    (:mod:`planner.runtime.memory`) follows the live tensors; slower.

    Launched normally, spawns the processes, watches them, and returns a
    :class:`RunResult`; if a worker raises or dies, the others are stopped
    and :class:`WorkerFailed` names the rank.
    Launched by torchrun (:func:`launched_by_torchrun`), runs this process's
    rank only and returns the result on rank 0 (``None`` elsewhere), gathered
    over the process group; torchrun watches the processes. A rank that
    raises raises :class:`WorkerFailed` naming itself.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: use cpu or cuda")
    lay = layout_of(plan_data)
    if world_size is not None and world_size != lay.world_size:
        raise ValueError(f"world_size {world_size} but the plan uses {lay.world_size} devices")
    job = _Job(
        plan_data=plan_data,
        layers_factory=layers_factory,
        loss_fn=loss_fn,
        batches=batches,
        steps=steps,
        lr=lr,
        optimizer=optimizer,
        seed=seed,
        loss_reduction=loss_reduction,
        skip_allreduce=skip_allreduce,
        threads=threads,
        start_step=start_step,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        log=log,
        timeout_s=timeout_s,
        recompute=recompute,
        exact_memory=exact_memory,
        device=device,
    )

    if launched_by_torchrun():
        return _run_this_rank(lay, job)

    if device == "cuda":
        if torch.cuda.device_count() < lay.world_size:
            raise ValueError(f"the plan uses {lay.world_size} devices, {torch.cuda.device_count()} GPUs are visible")
        start_method = "spawn"  # CUDA does not survive fork
    with tempfile.TemporaryDirectory(prefix="dapple-run-") as tmp:
        job.out_dir = out_dir or tmp
        port = _free_port()
        context = mp.start_processes(
            _worker,
            args=(lay.world_size, port, job, os.getpid()),
            nprocs=lay.world_size,
            join=False,
            start_method=start_method,
        )
        _watch(context)
        return _collect(lay, job.out_dir)


class WorkerFailed(RuntimeError):
    """A worker process raised or died; ``rank`` names it, ``reason`` says how."""

    def __init__(self, rank: int, reason: str):
        super().__init__(f"rank {rank} failed: {reason}")
        self.rank = rank
        self.reason = reason


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown error"


def _watch(context) -> None:
    """Poll the workers once a second until all exit. On the first failure
    (torch stops the others in ``join``) raise WorkerFailed; whatever happens,
    no worker outlives this call."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    try:
        while not context.join(timeout=1):
            pass
    except ProcessRaisedException as e:
        raise WorkerFailed(e.error_index, _last_line(str(e))) from None
    except ProcessExitedException as e:
        code = e.exit_code
        how = f"killed by signal {e.signal_name}" if code is not None and code < 0 else f"exited with code {code}"
        raise WorkerFailed(e.error_index, f"process {e.pid} {how}") from None
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 5
        for p in context.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
