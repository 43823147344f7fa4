"""One rank once its process group is up: its stage's layers (sharded over
its split group when the stage splits) and optimizer (ZeRO-1 over its
replica group when the stage shards it; built afresh or resumed from a
checkpoint), its process groups, its peers and its transport
(:class:`RankSetup`, made by :func:`open_rank`), and the collectives on
them: the gradient AllReduce among a stage's replicas and the checkpoint
every rank saves."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .config import Job, check_model
from .context_parallel import ContextGroup, cut_sequences
from .data import SeededBatches
from .experts import ExpertGroup, expert_parameters, spread_layers
from .fully_sharded import fully_shard_stage, load_whole_state, whole_state
from .memory import PeakMemory
from .tensor_parallel import SplitGroup, shard_layers
from .training import Precision, layers_of, local_optimizer, stage_optimizer
from .transport import PointToPoint, StageLinks


def log_line(text: str) -> None:
    """Writes one line to stderr in a single write. Ranks started by torchrun
    share one stderr; print() writes the text and its newline separately, so
    another rank's line could land between them (as CI once saw)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def silence_stdout() -> None:
    """Point this process's stdout (the file descriptor, which C++ writes
    to as well) at /dev/null. gloo prints "[Gloo] Rank r is connected to n
    peer ranks" there for every group it connects; a worker writes nothing
    else to stdout (its lines go to stderr, ``log_line``), and the notices
    are noise on a run's output and a second line where a command must fail
    in one."""
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def init_process_group(device: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the run's process group: gloo on the CPU; NCCL on CUDA, bound to
    the rank's own GPU (``device_id``: NCCL otherwise guesses it, warns, and
    may pick the wrong one)."""
    bound = {"device_id": rank_device(device, rank)} if device == "cuda" else {}
    dist.init_process_group(backend(device), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **bound)


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank``: the CPU, or the GPU of its local rank
    (``LOCAL_RANK`` under torchrun, the rank itself for local processes)."""
    if device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if local >= torch.cuda.device_count():
        raise ValueError(f"rank {rank} needs GPU {local}, only {torch.cuda.device_count()} visible")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def allreduce_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group``, as one flat tensor."""
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


@dataclass
class RankSetup:
    """What one rank holds once its process group is up: its stage's layers
    and optimizer, its peers and its transport."""

    rank: int
    stage: int
    replica: int
    #: This rank's shard of its replica (0 when the stage does not split).
    shard: int
    first: bool
    last: bool
    layer_range: tuple[int, int]
    dev: torch.device
    layers: list[nn.Module]
    module: nn.Module
    params: list[nn.Parameter]
    opt: Any
    #: The ranks holding this rank's shard in every replica of the stage:
    #: its gradient AllReduce (and ZeRO-1) group; None for one replica.
    group: Any
    #: The ranks this rank's layers are sharded over (None: not split).
    split: SplitGroup | None
    #: The ranks its replica's sequences are cut over (None: not cut).
    context: ContextGroup | None
    comm: PointToPoint
    links: StageLinks
    #: Samples [lo, hi) of every micro-batch this replica computes.
    lo: int
    hi: int
    meter: PeakMemory
    slow: float
    #: The run's dtype on this rank: autocast, and fp16's loss scale.
    precision: Precision
    #: The backward re-runs the stage's forward (the stage's recompute,
    #: or ``--recompute``).
    recompute: bool = False
    #: It re-runs a layer at a time, each layer's input kept (the stage's
    #: per-layer re-computation; ``--recompute`` checkpoints the stage whole).
    recompute_per_layer: bool = False
    #: The loss of a split last stage, from its shard of the logits (the
    #: head's distributed softmax); None: the run's loss function.
    loss_fn: Callable | None = None
    #: Saved state beyond the model and the optimizer, from the checkpoint
    #: resumed (None when starting afresh).
    resumed: dict | None = None
    #: Where the stage spreads its experts: the routed experts this rank
    #: holds (of ``params``), and the ranks holding the same ones in the
    #: other expert groups (None: no other), over which their gradients
    #: are summed instead of over the replica group.
    expert_params: list[nn.Parameter] = field(default_factory=list)
    expert_group: Any = None
    #: The stage is under FSDP (sharding levels 2 and 3 over its replicas):
    #: it saves and loads its state whole (``fully_sharded.whole_state``).
    fully_sharded: bool = False

    def computed(self, work):
        """``work()``, made ``slow`` times longer when the experiment asks."""
        if self.slow == 1.0:
            return work()
        t0 = time.perf_counter()
        result = work()
        time.sleep((self.slow - 1.0) * (time.perf_counter() - t0))
        return result

    def reduce_gradients(self, skip: bool = False) -> bool:
        """Sum the stage's gradients over its replicas (a routed expert's
        over the ranks holding the same one); False when there is nothing
        to reduce (one replica, or the testing hook ``skip``)."""
        if skip or (self.group is None and self.expert_group is None):
            return False
        experts = {id(p) for p in self.expert_params}
        if self.group is not None:
            allreduce_grads([p for p in self.params if id(p) not in experts], self.group)
        if self.expert_group is not None:
            allreduce_grads(self.expert_params, self.expert_group)
        return True

    def prepare_step(self) -> None:
        """Give a parameter without a gradient a zero one, for the step."""
        if self.opt is not None:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def release_gradients(self) -> None:
        for p in self.params:
            p.grad = None

    def saved(self) -> dict:
        """This stage's part of its rank's checkpoint (a sharded stage's
        gathered whole: every rank of its group saves together)."""
        model, optimizer = (whole_state(self.module, self.opt) if self.fully_sharded
                            else (self.module.state_dict(), optimizer_state(self.opt)))
        return {"stage": self.stage, "layer_range": list(self.layer_range), "model": model, "optimizer": optimizer}


def step_optimizers(stages: Sequence[RankSetup]) -> None:
    """One optimizer step of every stage the rank holds (one, or a chunked
    plan's chunks), on the gradients accumulated (zeros for a parameter
    without one; under fp16 unscaled, and skipped on every rank and chunk
    together where one overflowed), then the gradients are let go."""
    for stage in stages:
        stage.prepare_step()
    stages[0].precision.step_all([stage.opt for stage in stages])
    for stage in stages:
        stage.release_gradients()


def save_checkpoint(stages: Sequence[RankSetup], checkpoint_dir: str, done: int, **extra) -> None:
    """Save the rank's stages after ``done`` steps, in one file; rank 0
    marks the step complete once every rank has saved."""
    from . import checkpoint as ckpt

    rank = stages[0].rank
    ckpt.save_rank(checkpoint_dir, done, rank, {
        "step": done,
        "rank": rank,
        "stages": [stage.saved() for stage in stages],
        "loss_scaler": stages[0].precision.state_dict(),
        **extra,
    })
    dist.barrier()  # every rank's file is on disk
    if rank == 0:
        ckpt.write_latest(checkpoint_dir, done)


def _resume(module: nn.Module, opt, job: Job, rank: int, stage: int, layer_range: tuple[int, int],
            fully_sharded: bool) -> dict | None:
    """Load this rank's ``stage`` from the checkpoint the job resumes, if
    any (a sharded stage's whole state sharded again); the rank's whole
    saved file, or None."""
    config = job.config
    if not config.start_step:
        return None
    from . import checkpoint as ckpt

    resumed = ckpt.load_rank(config.checkpoint_dir, config.start_step, rank)
    saved = {entry["stage"]: entry for entry in resumed["stages"]}
    entry = saved.get(stage)
    if resumed["step"] != config.start_step or entry is None or tuple(entry["layer_range"]) != layer_range:
        held = [entry["layer_range"] for entry in resumed["stages"]]
        raise ValueError(
            f"checkpoint step {config.start_step} rank {rank} holds layers {held} at step {resumed['step']}, "
            f"this plan gives the rank layers {list(layer_range)} as stage {stage}"
        )
    if fully_sharded:
        load_whole_state(module, opt, entry["model"], entry["optimizer"])
    else:
        module.load_state_dict(entry["model"])
        if opt is not None:
            local_optimizer(opt).load_state_dict(entry["optimizer"])
    return resumed


def optimizer_state(opt) -> dict | None:
    return local_optimizer(opt).state_dict() if opt is not None else None


@dataclass(frozen=True)
class RankGroups:
    """A rank's process groups: its replica group, split group and context
    group (the same for a chunked plan's chunks of one rank), and by stage,
    where the stage spreads its experts, its expert group and the group
    holding its experts (None where that is the rank alone)."""

    replica: Any
    split: SplitGroup | None
    context: ContextGroup | None
    experts: dict[int, ExpertGroup]
    expert_replicas: dict[int, Any]


def _member_of(lists, rank: int) -> tuple[Any, int, int] | None:
    """A process group of each list of ranks with more than one (every rank
    makes every one: ``new_group`` is collective) and, where ``rank`` is in a
    list, its (group, index there, size), the group None where it is alone;
    None where it is in none."""
    mine = None
    for ranks in map(list, lists):
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = (group, ranks.index(rank), len(ranks))
    return mine


def _process_groups(lay, rank: int) -> RankGroups:
    """Every stage's replica groups, then its split groups, its context
    groups, its expert groups and the groups holding the same experts,
    made by every rank in that order (``new_group`` is collective)."""
    replica_group = split = context = None
    experts: dict[int, ExpertGroup] = {}
    expert_replicas: dict[int, Any] = {}
    for i, stage in enumerate(lay.stages):
        if found := _member_of(stage.replica_groups, rank):
            replica_group = found[0]
        if (found := _member_of(stage.split_groups, rank)) and found[0] is not None:
            split = SplitGroup(*found)
        if stage.context_parallel > 1 and (found := _member_of(stage.context_groups, rank)):
            context = ContextGroup(*found)
        if stage.expert_parallel == 1:
            continue
        if found := _member_of(stage.expert_groups, rank):
            experts[i] = ExpertGroup(*found)
        if (found := _member_of(stage.expert_replica_groups, rank)) and found[0] is not None:
            expert_replicas[i] = found[0]
    return RankGroups(replica_group, split, context, experts, expert_replicas)


def _stage_layers(job: Job, stage: int, groups: RankGroups) -> tuple[list[nn.Module], Callable | None]:
    """This rank's layers of ``stage`` (its shards of them when the stage
    splits, its part of the experts where it spreads them, computing its
    tokens where it cuts sequences), and the loss of a split last stage."""
    lay, config = job.layout, job.config
    a, b = lay.layer_ranges[stage]
    made = config.layers_factory()
    all_layers = layers_of(made)
    if isinstance(config.batches, SeededBatches):
        config.batches.use_maker(getattr(made, "make_batch", None))
    check_model(lay, all_layers, (getattr(made, "config", None) or {}).get("seq"))
    layers = all_layers[a:b]
    del all_layers, made  # the other stages' layers are not this rank's to keep
    if stage in groups.experts:
        layers = spread_layers(layers, groups.experts[stage])
    split = groups.split
    if split is not None:
        layers = shard_layers(layers, split)
    if groups.context is not None:
        cut_sequences(layers, groups.context)
    if split is None or stage < len(lay.stages) - 1:
        return layers, None
    loss = getattr(layers[-1], "parallel_loss", None)
    if loss is None:
        raise ValueError(f"stages[{stage}].tensor_parallel: the last layer's shard has no parallel_loss")
    return layers, loss


def open_rank(rank: int, job: Job) -> RankSetup:
    """This rank's stage (its first, where it holds several): :func:`open_stages`."""
    return open_stages(rank, job)[0]


def open_stages(rank: int, job: Job) -> list[RankSetup]:
    """Build this rank's stages (one, or a chunked plan's chunks of its
    rank, in stage order; each from the checkpoint when resuming), its
    process groups and its peers; the process group must be up. The
    stages share the rank's groups, device, transport and dtype."""
    lay, config = job.layout, job.config
    groups = _process_groups(lay, rank)
    dev = rank_device(config.device, rank)
    comm = PointToPoint(dev, rank, len(lay.stages) - 1)
    precision = Precision.for_rank(config.dtype, dev)
    shared = (groups, dev, comm, precision)
    return [_open_stage(rank, job, stage, position, shared) for stage, position in lay.positions(rank)]


def _open_stage(rank: int, job: Job, stage: int, position: int, shared) -> RankSetup:
    """Stage ``stage`` of ``rank``, replica entry ``position``: its layers
    (built from the run's seed, as one process would build the model),
    optimizer and links."""
    lay, config = job.layout, job.config
    groups, dev, comm, precision = shared
    replica_group, split = groups.replica, groups.split
    stage_layout = lay.stages[stage]
    me = stage_layout.replicas[position]
    a, b = lay.layer_ranges[stage]
    torch.manual_seed(config.seed)
    layers, loss_fn = _stage_layers(job, stage, groups)
    module = nn.Sequential(*layers).to(dev)
    # Levels 2 and 3: FSDP reduces the gradients and keeps the shards.
    fsdp = stage_layout.shard_level >= 2 and replica_group is not None
    if fsdp:
        fully_shard_stage(module, replica_group, dev, reshard_after_forward=stage_layout.reshard_after_forward)
    params = [p for p in module.parameters() if p.requires_grad]
    held_experts = expert_parameters(layers)
    expert_params = [p for p in params if id(p) in held_experts]
    # The routed experts a rank holds step apart from the rest: their
    # state is sharded (ZeRO-1) over the ranks holding the same ones.
    parts = [([p for p in params if id(p) not in held_experts], replica_group),
             (expert_params, groups.expert_replicas.get(stage))]
    opt = stage_optimizer(parts, config.optimizer, config.lr, shard=stage_layout.shard_level == 1,
                          offload=stage_layout.offload_optimizer)
    resumed = _resume(module, opt, job, rank, stage, (a, b), fsdp)
    # fp16's loss scale resumes with the weights (a checkpoint of another dtype has none).
    precision.load_state_dict((resumed or {}).get("loss_scaler"))
    peers = [[(p.rank, (p.start, p.end)) for p in side]
             for side in (me.receives_from, me.sends_to, me.gradients_to, me.gradients_from)]
    return RankSetup(
        rank=rank,
        stage=stage,
        replica=me.replica,
        shard=me.shard,
        first=stage == 0,
        last=stage == len(lay.stages) - 1,
        layer_range=(a, b),
        dev=dev,
        layers=layers,
        module=module,
        params=params,
        expert_params=expert_params,
        opt=opt,
        group=None if fsdp else replica_group,
        fully_sharded=fsdp,
        split=split,
        context=groups.context,
        expert_group=groups.expert_replicas.get(stage),
        comm=comm,
        links=StageLinks(comm, peers[0], peers[1], me.start, grads_to=peers[2], grads_from=peers[3], stage=stage),
        lo=me.start,
        hi=me.end,
        # The peak of the training iterations, from the size after the stage
        # and its optimizer were built (Adam's state arrives with the first step).
        meter=PeakMemory(cuda=dev.type == "cuda"),
        slow=config.slowdown.get(rank, 1.0),
        precision=precision,
        recompute=config.recompute or stage_layout.recompute,
        recompute_per_layer=stage_layout.recompute_per_layer and not config.recompute,
        loss_fn=loss_fn,
        resumed=resumed,
    )
