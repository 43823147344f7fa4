"""DAPPLE's plan against the usual alternatives, all run in the simulator."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from . import _core
from .errors import DappleError, naming_keyword
from .limits import check_count
from .plan import GRAD_REDUCE_OVERLAPS, Plan, chunked, evaluate, plan, shape_label
from .profile import Profile
from .simulation import simulate
from .topology import Topology

#: The baseline strategies, by name (the core's table).
BASELINES: tuple[str, ...] = _core.BASELINES


def baseline(
    kind: str,
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
    warmup_policy: str = "auto",
) -> Plan:
    """The plan of a baseline strategy (one of ``BASELINES``) at the
    micro-batch size (and, under warm-up policy auto, the warm-up depths)
    whose simulated iteration is shortest and fits: data parallelism on every GPU; GPipe and
    straight pipelines with balanced blocks of layers, one GPU per stage;
    PipeDream's planner (its asynchronous objective), run synchronously.
    :func:`baseline_plans`' first, found without simulating the micro-batch
    sizes formula (2)'s bound rules out."""
    prof, topo, gbs, min_mbs = _inputs(profile, topology, global_batch_size, min_micro_batch_size)
    return Plan(_core.baseline_plan(kind, prof.core, topo.core, gbs, min_micro_batch_size=min_mbs,
                                    warmup_policy=warmup_policy))


def baseline_plans(
    kind: str,
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
    warmup_policy: str = "auto",
    overlap_grad_reduce: str = GRAD_REDUCE_OVERLAPS[0],
    overlap_param_gather: bool = False,
) -> list[Plan]:
    """Every plan of a baseline strategy that fits, fastest first
    (:func:`baseline` is the first): megatron's are each uniform shape at
    each micro-batch size. The overlap arguments: what the runtime hides
    behind computation, as :func:`dapple.planner.plan.plan` takes them."""
    prof, topo, gbs, min_mbs = _inputs(profile, topology, global_batch_size, min_micro_batch_size)
    return [Plan(core) for core in _core.baseline_plans(
        kind, prof.core, topo.core, gbs, min_micro_batch_size=min_mbs, warmup_policy=warmup_policy,
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather)]


#: megatron_plan's keywords that name a plan field of the same name.
MEGATRON_KEYWORDS = ("tensor_parallel", "pipeline_parallel", "micro_batch_size", "shard_level", "expert_parallel",
                     "expert_tensor_parallel", "context_parallel", "recompute", "offload")


def megatron_plan(
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    micro_batch_size: int,
    shard_level: int = 0,
    reshard_after_forward: bool = False,
    sequence_parallel: bool = False,
    recompute: str = "none",
    overlap_grad_reduce: str = GRAD_REDUCE_OVERLAPS[0],
    overlap_param_gather: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    offload: str = "none",
    context_parallel: int = 1,
) -> Plan:
    """One Megatron-LM layout as a run used it, costed: ``tensor_parallel``
    shards, ``pipeline_parallel`` stages of equal blocks, each sample's
    sequence cut over ``context_parallel`` split groups
    (``--context-parallel-size``), the GPUs left over as replicas, ``micro_batch_size`` samples a replica per micro-batch,
    sharded to ``shard_level`` (0 none, 1 the optimizer state as Megatron-LM's
    distributed optimizer, 2 and the gradients, 3 and the weights, freed after
    each forward where ``reshard_after_forward``: ``docs/cost-model.md``,
    "Sharding"), sequence parallelism or not (t > 1) and re-computation
    (``"none"``, ``"full"``, ``"per-layer"`` or ``"selective"``) on every
    stage, the routed experts of the stages that have some spread over
    ``expert_parallel`` replicas (``--expert-model-parallel-size``), each
    expert's columns split ``expert_tensor_parallel`` ways (None: t;
    ``--expert-tensor-parallel-size``), the optimizer on the GPUs or
    offloaded to host memory (``offload``: "none" or "optimizer";
    ``--optimizer-cpu-offload``), 1F1B,
    on a runtime that hides what the overlap arguments say
    (as :func:`dapple.planner.plan.plan` takes them; Megatron-LM's
    ``--overlap-grad-reduce`` is "every-stage"). Its estimate is given
    whether or not it fits memory (``plan.estimate["fits_memory"]``)."""
    prof, topo, gbs, _ = _inputs(profile, topology, global_batch_size, None)
    try:
        core = _core.megatron_plan(
            prof.core, topo.core, gbs, tensor_parallel=check_count("tensor_parallel", tensor_parallel),
            pipeline_parallel=check_count("pipeline_parallel", pipeline_parallel),
            micro_batch_size=check_count("micro_batch_size", micro_batch_size), shard_level=shard_level,
            reshard_after_forward=reshard_after_forward,
            sequence_parallel=sequence_parallel, recompute=recompute, overlap_grad_reduce=overlap_grad_reduce,
            overlap_param_gather=overlap_param_gather, expert_parallel=check_count("expert_parallel", expert_parallel),
            expert_tensor_parallel=(None if expert_tensor_parallel is None
                                    else check_count("expert_tensor_parallel", expert_tensor_parallel)),
            offload=offload, context_parallel=check_count("context_parallel", context_parallel),
        )
        return evaluate(Plan(core), prof)
    except DappleError as e:
        # The core checks the plan it builds by its fields; the caller typed keywords.
        raise naming_keyword(e, MEGATRON_KEYWORDS) from None


def _inputs(profile, topology, global_batch_size: int, min_micro_batch_size: int | None):
    """The profile, topology and sample counts of a call, each checked."""
    gbs = check_count("global_batch_size", global_batch_size)
    if min_micro_batch_size is not None:
        min_micro_batch_size = check_count("min_micro_batch_size", min_micro_batch_size)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    return prof, Topology.resolve(topology), gbs, min_micro_batch_size


def layout_plan(
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    stages: list[tuple[int, int, list[int]]],
    *,
    schedule: str = "early-backward-1f1b",
    warmup_policy: str = "auto",
    min_micro_batch_size: int | None = None,
) -> Plan:
    """Any layout (another planner's, a paper's): ``stages`` as
    ``(layer_start, layer_end, devices)`` each, as the plan it runs fastest
    as, the micro-batch size (and, under warm-up policy auto, the warm-up
    depths) whose simulated iteration is shortest and fits, costed the way
    a baseline is. Raises InfeasibleError when no size fits."""
    prof, topo, gbs, min_mbs = _inputs(profile, topology, global_batch_size, min_micro_batch_size)
    return Plan(
        _core.layout_plan(
            prof.core, topo.core, gbs, [(s, e, list(d)) for s, e, d in stages], schedule=schedule,
            warmup_policy=warmup_policy, min_micro_batch_size=min_mbs,
        )
    )


@dataclass(frozen=True)
class Row:
    strategy: str
    shape: str | None
    micro_batches: int | None
    micro_batch_size: int | None
    schedule: str | None
    simulated_ms: float | None
    estimated_ms: float | None
    speedup: float | None
    peak_memory_bytes: float | None
    error: str | None = None
    #: Each stage's ``shape_label`` ("t4×r2 zero"; "" for a plain stage).
    stage_shapes: list[str] | None = None
    #: Every stage re-ran its forward in its backward in this row's simulation.
    recompute: bool | None = None
    #: Every stage's simulated peak within its GPUs' memory.
    fits_memory: bool | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def compare(
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    min_micro_batch_size: int | None = None,
    warmup_policy: str = "auto",
    searched: Plan | None = None,
) -> list[Row]:
    """One row per strategy: DAPPLE's searched plan and its layout run as
    each other kind the search chooses among (``"dapple as zb-h1"``), data parallelism
    without and with AllReduce overlap, GPipe, a straight pipeline,
    PipeDream's planner and the other baselines; then the plan of the
    baseline ``_core.ASYNCHRONOUS_ROWS_ON`` (GPipe's) with every stage
    re-computing, and each asynchronous schedule (``ASYNCHRONOUS_SCHEDULES``)
    run on that same plan without and with re-computation, as the XPipe
    paper runs every method on one partition: each asynchronous row reads
    against the GPipe row with the same re-computation. Times are simulated
    iterations (an asynchronous schedule's steady-state time per
    mini-batch; its formula (2) bound is None); speedups are over one GPU
    running every micro-batch in turn; ``fits_memory`` says whether the row
    fits (a row simulated on another's plan may not). ``warmup_policy`` applies to
    DAPPLE's plan and to every early-backward baseline. ``searched``: the result of
    :func:`planner.plan` for the same inputs, when the caller has it already
    (the search is the expensive part)."""
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    topo = Topology.resolve(topology)
    # No layout fits at all: say so now, not after each strategy has searched.
    _core.check_memory_floor(prof.core, topo.core, check_count("global_batch_size", global_batch_size),
                             min_micro_batch_size=None if min_micro_batch_size is None
                             else check_count("min_micro_batch_size", min_micro_batch_size))

    def make(kind: str) -> Plan:
        if kind == "dapple":
            return plan(
                prof, topo, global_batch_size, min_micro_batch_size=min_micro_batch_size, warmup_policy=warmup_policy
            )
        return baseline(
            kind, prof, topo, global_batch_size, min_micro_batch_size=min_micro_batch_size, warmup_policy=warmup_policy
        )

    # (row name, strategy, AllReduce overlap): the data-parallel plan is
    # simulated twice, without and with overlap, from one search.
    candidates = [("dapple", "dapple", True), ("data-parallel (no overlap)", "data-parallel", False)]
    candidates += [(kind, kind, True) for kind in BASELINES]
    made: dict[str, Plan | DappleError] = {"dapple": searched} if searched is not None else {}
    rows = []
    for name, kind, overlap in candidates:
        if kind not in made:
            try:
                made[kind] = make(kind)
            except DappleError as e:
                # This strategy has no plan for these inputs (or none within
                # a work limit, such as its micro-batches' passes, or one
                # its own rule cannot form); the others may: a row with its
                # reason. Where every row fails, the inputs are the problem.
                made[kind] = e
        p = made[kind]
        if isinstance(p, DappleError):
            rows.append(Row(name, None, None, None, None, None, None, None, None, error=str(p)))
            continue
        rows.append(_row(name, p, simulate(p, prof, overlap_allreduce=overlap), p.estimate["latency_ms"]))
    if all(r.error for r in rows):
        raise made["dapple"]  # no strategy has a plan: the inputs are the problem
    searched_plan = made["dapple"]
    if isinstance(searched_plan, Plan) and searched_plan.core.schedule_kind in _core.CHUNKED_SCHEDULES:
        # The other kinds run a layout of one stage a rank: the search's for
        # early backward, which the search cut into the chosen chunks or
        # ranked beside the layout it cut.
        try:
            searched_plan = plan(prof, topo, global_batch_size, min_micro_batch_size=min_micro_batch_size,
                                 warmup_policy=warmup_policy, schedule=_core.SEARCHED_SCHEDULES[0])
        except DappleError as e:
            searched_plan = e
    rows[1:1] = _as_other_kinds(searched_plan, made["dapple"], prof)
    rows += _on_one_plan(made.get(_core.ASYNCHRONOUS_ROWS_ON), prof)
    return rows


def _as_other_kinds(searched: Plan | DappleError, chosen: Plan | DappleError, prof: Profile) -> list[Row]:
    """DAPPLE's layout (``searched``, of one stage a rank) run as each other
    kind than the chosen plan's that the search chooses among
    (``SEARCHED_SCHEDULES``; a chunked one, ``CHUNKED_SCHEDULES``, with
    the ranks' layers cut again into the fastest count of chunks that
    fits, ``planner.chunked``); named ``"dapple as {kind}"``, one row per
    kind."""
    if not isinstance(searched, Plan) or not isinstance(chosen, Plan):
        return []
    rows = []
    for kind in _core.SEARCHED_SCHEDULES:
        if kind == chosen.core.schedule_kind:
            continue
        name = f"dapple as {kind}"
        try:
            if kind in _core.CHUNKED_SCHEDULES:
                run = chunked(searched, prof, kind)
                rows.append(_row(name, run, simulate(run, prof), None))
            else:
                rows.append(_row(name, searched, simulate(searched, prof, schedule=kind), None))
        except DappleError as e:  # the kind cannot run the plan's micro-batches, or none fits
            rows.append(Row(name, None, None, None, None, None, None, None, None, error=str(e)))
    return rows


def _on_one_plan(base: Plan | DappleError | None, prof: Profile) -> list[Row]:
    """The rows run on the plan of ``ASYNCHRONOUS_ROWS_ON`` (``on``): its
    own schedule with every stage re-computing (``"{on} rc"``), then each
    asynchronous kind without and with it (``"{kind} on {on}"``,
    ``"{kind} rc on {on}"``)."""
    on = _core.ASYNCHRONOUS_ROWS_ON
    runs = [(f"{on} rc", None, True)]
    for kind in _core.ASYNCHRONOUS_SCHEDULES:
        runs += [(f"{kind} on {on}", kind, False), (f"{kind} rc on {on}", kind, True)]
    rows = []
    for name, kind, recompute in runs:
        if not isinstance(base, Plan):
            rows.append(Row(name, None, None, None, None, None, None, None, None, error=f"no {on} plan: {base}"))
            continue
        try:
            sim = simulate(base, prof, schedule=kind, recompute=recompute)
        except DappleError as e:  # the steady state is over the work limit
            rows.append(Row(name, None, None, None, None, None, None, None, None, error=str(e)))
            continue
        rows.append(_row(name, base, sim, None))
    return rows


def _row(name: str, p: Plan, sim, estimated_ms: float | None) -> Row:
    """The row of plan ``p`` as simulated in ``sim``."""
    return Row(
        strategy=name,
        shape=p.shape,
        micro_batches=p.micro_batches,
        micro_batch_size=p.micro_batch_size,
        schedule=sim.schedule,
        simulated_ms=sim.iteration_ms,
        estimated_ms=estimated_ms,
        speedup=p.estimate["single_device_ms"] / sim.iteration_ms,
        peak_memory_bytes=sim.peak_memory_bytes,
        stage_shapes=[shape_label(s) for s in p.stage_shapes],
        recompute=sim.recompute,
        fits_memory=sim.fits_memory,
    )
