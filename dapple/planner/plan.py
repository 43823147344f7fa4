"""Plans (format ``dapple.plan``): search, evaluate, load and save."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from . import _core
from .errors import IncompatibleInputsError
from .fileobject import FileObject
from .hints import read_hints
from .limits import check_count, check_search_gib, check_search_machines
from .profile import Profile
from .topology import Topology


#: Warm-up policies, the default first: "auto" (K_i searched per stage), "A", "B".
WARMUP_POLICIES: tuple[str, ...] = _core.WARMUP_POLICIES
#: Search spaces, the default first (see :func:`plan`).
SEARCH_SPACES: tuple[str, ...] = _core.SEARCH_SPACES
STAGE_SHAPES: tuple[str, ...] = _core.STAGE_SHAPES
#: Which stages reduce their gradients behind their backward, the default
#: (DAPPLE's: a data-parallel plan only) first (``docs/cost-model.md``, "Overlap").
GRAD_REDUCE_OVERLAPS: tuple[str, ...] = _core.GRAD_REDUCE_OVERLAPS


@dataclass(frozen=True)
class SearchStats:
    micro_batch_sizes: list[int]
    states: int
    stages_costed: int
    #: Sizes whose DP run passed ``max_search_steps`` and stopped.
    abandoned_micro_batch_sizes: list[int]


@dataclass(frozen=True)
class Plan(FileObject):
    """A plan: the core's own object (``core``), checked for its format
    when read. ``search_stats`` says how much work the search that made it did."""

    core_class = _core.Plan
    core: _core.Plan
    search_stats: SearchStats | None = None

    @property
    def path(self) -> str | None:
        """The file it was read from."""
        return self.core.source

    @property
    def stages(self) -> list[dict]:
        return self.data["stages"]

    @property
    def estimate(self) -> dict | None:
        return self.data.get("estimate")

    @property
    def iteration_ms(self) -> float | None:
        """Simulated time of one iteration: the plan's headline and what the
        planner minimises (formula (2), ``estimate["latency_ms"]``, is its
        lower bound). None for a plan without an estimate; version 1 plans,
        which were not simulated, give their formula value."""
        return self.core.iteration_ms

    @property
    def micro_batch_size(self) -> int:
        return self.core.micro_batch_size

    @property
    def micro_batches(self) -> int:
        return self.core.micro_batches

    @property
    def shape(self) -> str:
        """Replication per stage, e.g. ``"8:8"``; ``"16"`` is data parallelism."""
        return self.core.shape

    @property
    def kind(self) -> str:
        """``"data parallel"`` (one stage on every GPU, split or not),
        ``"straight"`` or ``"hybrid"``."""
        return self.core.layout_kind

    @property
    def layout(self) -> str:
        """The layout as its stages hold it, for headers and titles
        (``layout_label``): "t32×r1", "pp16 × (t8×c2×r4)", "data parallel 32"."""
        return layout_label(self.stage_shapes, self.core.stage_ranks if self.core.chunks > 1 else None)

    @property
    def micro_batching(self) -> str:
        """The micro-batches as a header says them: "4 micro-batches of 64
        samples (2 a replica)". A micro-batch is what one pass through the
        pipeline carries; each stage's replicas share it, and runtimes'
        ``--micro-batch-size`` (Megatron-LM's, DeepSpeed's, torchtitan's)
        is the share of one replica (issue 68)."""
        text = f"{counted(self.micro_batches, 'micro-batch')} of {counted(self.micro_batch_size, 'sample')}"
        replicas = sorted({shape.replicas for shape in self.stage_shapes})
        if replicas == [1]:
            return text
        shares = [f"{self.micro_batch_size / r:g}" for r in replicas]
        return text + (f" ({shares[0]} a replica)" if len(shares) == 1 else f" ({' or '.join(shares)} a replica, by stage)")

    @property
    def overlap(self) -> tuple[str, bool]:
        """What the plan's runtime hides behind computation
        (``schedule.overlap``): which stages reduce their gradients behind
        their backward (``GRAD_REDUCE_OVERLAPS``), and whether ZeRO-1 stages
        gather their weights behind the next forward."""
        return self.core.overlap_grad_reduce, self.core.overlap_param_gather

    @property
    def topology(self) -> Topology:
        """The cluster the plan was made for."""
        return Topology(self.core.topology)

    @cached_property
    def stage_shapes(self) -> list[_core.StageShape]:
        """Each stage's split degree, replicas, ZeRO-1, re-computation and
        split groups, as the core reads them from the plan (once: pictures
        read them stage by stage)."""
        return self.core.stage_shapes()

    def blocks_per_stage(self, profile: Profile) -> list[int]:
        """The model's own layers (profile layers of kind "block") per stage."""
        return self.core.blocks_per_stage(profile.core)

    def pipeline_order(self) -> _core.PipelineOrder:
        """The order torch's pipelining would run the plan by, one pipeline
        rank per stage (``to_csv()`` is torch's schedule CSV); raises
        ``IncompatibleInputsError`` where torch cannot run the plan as it is
        (stages replicated or split unevenly, uneven slices, an
        asynchronous schedule)."""
        return self.core.pipeline_order()


#: What the words of ``shape_label`` mean, for a line under a table.
SHAPE_KEY = ("tT\u00d7rR: layers split T ways on each of R replicas; tT\u00d7cC\u00d7rR: each sample's sequence cut "
             "over C split groups of a replica (context parallelism); sp: sequence parallelism; eE: the routed "
             "experts over groups of E replicas (eE/etN: each expert split N ways, not T); zero: ZeRO-1 over the replicas "
             "(zero2: ZeRO-2; zero3: ZeRO-3 or FSDP, kept: the weights kept from the forward to the backward); "
             "off: the optimizer offloaded to host memory; rc: full re-computation (rc "
             "per-layer: a layer at a time; rc selective: the attention core alone)")


def shape_label(shape: _core.StageShape) -> str:
    """A stage's shape in a few characters, e.g. "t8×r2 zero rc" (see
    ``SHAPE_KEY``); "" for a plain stage, so that the pictures and tables
    of plain plans stay as they were before stages had shapes."""
    if shape.is_plain:
        return ""
    context = f"c{shape.context_parallel}\u00d7" if shape.context_parallel > 1 else ""
    parts = [f"t{shape.tensor_parallel}\u00d7{context}r{shape.replicas}"]
    if shape.sequence_parallel:
        parts.append("sp")
    if shape.expert_parallel > 1:
        parts.append(f"e{shape.expert_parallel}" + (f"/et{shape.expert_tensor_parallel}"
                     if shape.expert_tensor_parallel != shape.tensor_parallel else ""))
    if shape.shard_level:
        level = "zero" if shape.shard_level == 1 else f"zero{shape.shard_level}"
        parts.append(level if shape.shard_level < 3 or shape.reshard_after_forward else f"{level} kept")
    if shape.offload != "none":
        parts.append("off")
    if shape.recompute != "none":
        parts.append("rc" if shape.recompute == "full" else f"rc {shape.recompute}")
    return " ".join(parts)


def stage_shapes_text(labels: list[str]) -> str:
    """Stage labels (``shape_label``) with runs of alike stages joined:
    "s0-3 t4×r2 zero" for four alike stages, "s0 t8×r1; s1-2 plain"."""
    runs: list[tuple[int, int, str]] = []
    for i, label in enumerate(labels):
        if runs and runs[-1][2] == label:
            runs[-1] = (runs[-1][0], i, label)
        else:
            runs.append((i, i, label))
    return "; ".join(f"s{a}{'' if a == b else f'-{b}'} {label or 'plain'}" for a, b, label in runs)


def layout_label(shapes: list[_core.StageShape], stage_ranks: list[int] | None = None) -> str:
    """A plan's layout in a few words, as its stages hold it: "data parallel
    32" only for one plain stage of 32 replicas; "t32×r1" for one stage
    split 32 ways; "pp16 × (t8×c2×r4)" for 16 alike stages ("pp4" for a
    straight pipeline, "pp32 × (r512)" for 32 plain stages of 512
    replicas); "pp3: s0 r4; s1-2 r2" where the stages differ. A chunked
    plan's stages are told by rank (``stage_ranks``: each stage's rank),
    with "v=N" for its N chunks a rank ("t32×r1 (v=7)": one rank group,
    its layers in 7 chunks)."""
    ranks_of = stage_ranks or list(range(len(shapes)))
    ranks = max(ranks_of) + 1
    first_on_rank = {}
    for stage, rank in enumerate(ranks_of):
        first_on_rank.setdefault(rank, stage)
    chunks = len(shapes) // ranks
    shapes = [shapes[first_on_rank[r]] for r in range(ranks)]
    labels = [shape_label(s) or (f"r{s.replicas}" if s.replicas > 1 else "") for s in shapes]
    virtual = f" (v={chunks})" if chunks > 1 else ""
    if ranks == 1:
        whole = labels[0] if not shapes[0].is_plain else f"data parallel {shapes[0].replicas}"
        return whole + virtual
    if len(set(labels)) == 1:
        return f"pp{ranks}{virtual}" + (f" × ({labels[0]})" if labels[0] else "")
    return f"pp{ranks}{virtual}: " + stage_shapes_text([label or "r1" for label in labels])


def counted(k: int, word: str) -> str:
    """"1 micro-batch" / "4 micro-batches": a count with its noun, plural
    where it is not one."""
    plural = word + ("es" if word.endswith(("ch", "sh", "s", "x")) else "s")
    return f"{k} {word if k == 1 else plural}"


def device_ranges(ids: list[int]) -> str:
    """Compact device list: [0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, d in enumerate(ids):
        if start is None:
            start = d
        if i + 1 == len(ids) or ids[i + 1] != d + 1:
            parts.append(str(start) if start == d else f"{start}-{d}")
            start = None
    return ",".join(parts)


#: :func:`plan`'s options that only the synchronous search takes, with
#: their defaults (each a name table's first where it has one).
_SEARCH_ONLY_DEFAULTS = {
    "warmup_policy": WARMUP_POLICIES[0], "search_space": SEARCH_SPACES[0], "stage_shapes": STAGE_SHAPES[0],
    "max_shard_level": 1, "max_context_parallel": None, "micro_batch_sizes": None, "max_search_gib": None,
    "max_search_steps": None, "refine": True, "stages": None, "micro_batches": None, "pin_cuts": (),
    "replicate": (), "split": (), "from_layout": None, "chunks": None,
    "overlap_grad_reduce": GRAD_REDUCE_OVERLAPS[0], "overlap_param_gather": False,
}


def _refuse_search_options(schedule: str, options: dict) -> None:
    """An error naming the first of ``options`` (by name) that
    ``_SEARCH_ONLY_DEFAULTS`` names, given other than its default: they are
    the synchronous search's, not asynchronous planning's."""
    for name, default in _SEARCH_ONLY_DEFAULTS.items():
        value = tuple(options[name]) if isinstance(default, tuple) else options[name]
        if value != default:
            raise IncompatibleInputsError(
                f"{name}: value {value!r} applies to the synchronous search, not to planning for "
                f"schedule {schedule} (uniform pipelines by their steady state)"
            )


def _checked_counts(**counts):
    """:func:`plan`'s optional counts (by name), each checked where given; a
    list element by element."""
    def checked(name, value):
        if isinstance(value, (list, tuple)):
            return [check_count(f"{name}[{i}]", b) for i, b in enumerate(value)]
        return check_count(name, value)
    return [None if value is None else checked(name, value) for name, value in counts.items()]


def plan(
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    warmup_policy: str = "auto",
    min_micro_batch_size: int | None = None,
    micro_batch_sizes: list[int] | None = None,
    search_space: str = "auto",
    stage_shapes: str = "auto",
    max_shard_level: int = 1,
    max_context_parallel: int | None = None,
    schedule: str | None = None,
    chunks: int | None = None,
    max_search_gib: float | None = None,
    max_search_steps: int | None = None,
    max_search_machines: int | None = None,
    refine: bool = True,
    stages: int | None = None,
    micro_batches: int | None = None,
    pin_cuts: Iterable[int | str] = (),
    replicate: Iterable[str] = (),
    split: Iterable[str] = (),
    from_layout: str | None = None,
    overlap_grad_reduce: str = GRAD_REDUCE_OVERLAPS[0],
    overlap_param_gather: bool = False,
) -> Plan:
    """Search the plan with the shortest simulated iteration that fits in memory.

    ``profile``: a Profile or a profile JSON path. ``topology``: a Topology,
    a spec such as ``"2x8-nvlink"``, a preset ``"A"``/``"B"``/``"C"`` or a
    topology JSON path. Raises :class:`dapple.planner.errors.InfeasibleError` when no
    plan fits in memory, with the smallest memory need found.
    ``warmup_policy``: "auto" (each stage's warm-up depth K_i searched), or
    the fixed "A" (K_i = S - i) or "B" (K_i = 2(S - i) - 1).
    ``search_space``: "full" (every replication and placement), "machine-
    aligned" (stages of a divisor of a machine, whole machines, or an even
    share of every machine in use) or "auto" (full up to 16 GPUs).
    ``stage_shapes``: "all" (each stage may split its layers over t GPUs,
    shard its state over its replicas up to ``max_shard_level`` (ZeRO-1 by
    default, up to 3; ``docs/cost-model.md``, "Sharding") and re-compute its forward, each
    chosen per stage), "auto" (all where the profile says how layers split,
    else plain) or "plain" (replicas only: DAPPLE's space).
    ``max_context_parallel``: the most GPUs a stage may cut each sample's
    sequence over (context parallelism, where the profile's layers say how;
    ``docs/cost-model.md``, "Context parallelism"); None: 16 (the core's
    default), 1: none. ``selection``
    says how the plan was chosen (``docs/cost-model.md``).
    ``schedule``: None or "auto", the fastest of ``SEARCHED_SCHEDULES`` (the chunked ones left out
    under layout hints) on the layouts the search ranked (``docs/schedules.md``); a synchronous kind
    to plan for it alone (a chunked one, ``CHUNKED_SCHEDULES``, cuts the layouts' ranks into ``chunks``
    chunks each, or the fastest count up to 8); an asynchronous kind: the uniform pipeline of fastest
    steady state within memory (``docs/xpipe.md``), the search's options refused with it.
    ``max_search_gib``: most memory the search's tables may take (default
    ``limits.DEFAULT_MAX_SEARCH_GIB``); past it the search stops with a
    :class:`dapple.planner.errors.LimitExceededError` saying how far it got.
    ``max_search_steps``: most steps (a stage costed, or put in front of one
    partial plan) the DP may take at one micro-batch size (default
    ``limits.DEFAULT_MAX_SEARCH_STEPS``); past it that size's run stops, its
    best complete plans so far are candidates, its other layouts are left to
    the walk (within its budget), and the plan is the best found (``search_stats.abandoned_micro_batch_sizes``
    names them; ``selection.optimal`` says whether the walk still proved it).
    ``max_search_machines``: most machines searched (``limits.DEFAULT_MAX_SEARCH_MACHINES``).
    ``refine``: improve the chosen plan by local moves (a stage boundary by
    a layer, GPUs swapped, handed over or left idle), each kept when it
    simulates faster, and again from its layout placed anew by the paper's
    policies, up to 64 GPUs; the plan may then lie outside the search
    space (``selection.refined_from_ms``). False: the space's plan.
    ``stages``, ``micro_batches``, ``pin_cuts``, ``replicate``, ``split``,
    ``from_layout``: Whale's hints, constraints the search stays exact under
    (``docs/hints.md``, :func:`dapple.planner.hints.read_hints`).
    ``overlap_grad_reduce`` (``GRAD_REDUCE_OVERLAPS``), ``overlap_param_gather``:
    what the runtime hides behind computation, as every plan is costed and
    records it (``schedule.overlap``; ``docs/cost-model.md``, "Overlap").
    """
    options = dict(locals())
    gbs = check_count("global_batch_size", global_batch_size)
    min_micro_batch_size, micro_batch_sizes, max_search_steps, max_context_parallel = _checked_counts(
        min_micro_batch_size=min_micro_batch_size, micro_batch_sizes=micro_batch_sizes,
        max_search_steps=max_search_steps, max_context_parallel=max_context_parallel)
    max_search_bytes = None if max_search_gib is None else int(check_search_gib("max_search_gib", max_search_gib) * 2**30)
    prof, topo = profile if isinstance(profile, Profile) else Profile.load(profile), Topology.resolve(topology)
    if schedule in _core.ASYNCHRONOUS_SCHEDULES:  # (no search: no limit on machines)
        _refuse_search_options(schedule, options)
        return Plan(_core.asynchronous_plan(schedule, prof.core, topo.core, gbs,
                                            min_micro_batch_size=min_micro_batch_size))
    check_search_machines(topo.name, topo.core.num_machines, max_search_machines)
    core, (sizes, states, costed, abandoned) = _core.search(
        prof.core, topo.core, gbs, warmup_policy=warmup_policy, min_micro_batch_size=min_micro_batch_size,
        micro_batch_sizes=micro_batch_sizes, search_space=search_space, stage_shapes=stage_shapes,
        max_shard_level=max_shard_level, max_context_parallel=max_context_parallel,
        max_search_bytes=max_search_bytes, max_search_steps=max_search_steps,
        refine=refine, schedule=schedule,
        chunks=None if chunks is None else check_count("chunks", chunks),
        overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=overlap_param_gather,
        **read_hints(prof, stages=stages, micro_batches=micro_batches, pin_cuts=pin_cuts, replicate=replicate,
                     split=split, from_layout=from_layout).as_search_options(),
    )
    return Plan(core, SearchStats(list(sizes), states, costed, list(abandoned)))


def evaluate(plan: Plan | str | os.PathLike, profile: Profile | str | os.PathLike) -> Plan:
    """Cost any plan (hand-written or from another planner) with the same
    model the search uses; returns the plan with a fresh estimate."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    return Plan(_core.evaluate(p.core, prof.core))


def chunked(
    plan: Plan | str | os.PathLike, profile: Profile | str | os.PathLike, schedule: str, chunks: int | None = None
) -> Plan:
    """``plan``'s ranks (one stage each) running chunked ``schedule``
    (``CHUNKED_SCHEDULES``: "interleaved-1f1b", "interleaved-zero-bubble",
    "zb-v", "dualpipev"): the model's layers cut again into ranks x
    ``chunks`` consecutive chunks balanced by the ranks' speeds, chunk s on
    the rank the order puts it on with that rank's devices and shape;
    without ``chunks``, the fastest count up to 8 (the V-shaped kinds, zb-v
    and dualpipev: 2) that fits. Costed."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    count = None if chunks is None else check_count("chunks", chunks)
    return Plan(_core.chunked_plan(p.core, prof.core, schedule, count))


def choose_warmups(plan: Plan | str | os.PathLike, profile: Profile | str | os.PathLike) -> Plan | None:
    """``plan`` (any early-backward or GPipe layout) run as early backward
    under warm-up policy ``auto``, with the K_i per stage that simulate
    fastest within memory, costed; None when no depths fit in memory."""
    p = plan if isinstance(plan, Plan) else Plan.load(plan)
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    core = _core.choose_warmups(p.core, prof.core)
    return None if core is None else Plan(core)
