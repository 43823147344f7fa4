"""What a run is asked to do (:class:`RunConfig`, built by ``dapple run`` or
by :func:`launcher.run_plan`), the checks a run passes before any process
starts (:func:`check_run`, the only copy, used by both), and what each rank
is handed (:class:`Job`). No torch here, so the command line checks a run
before importing it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import _core
from ..errors import IncompatibleInputsError, InvalidInputError
from ..plan import Plan
from ..precision import PRECISIONS
from .layout import Layout
from .optimizers import check_optimizer
from .schedule import run_lists, run_schedule, run_segments

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class RunConfig:
    """A run's model, data and options: everything besides the plan.

    ``batches``: global batches ``(inputs, targets)`` of ``micro_batch_size *
    micro_batches`` samples along dim 0; step i uses ``batches[i %
    len(batches)]``. ``layers_factory`` (picklable, e.g. a module-level
    function) builds the model; called after ``torch.manual_seed(seed)`` on
    every rank. ``loss_fn(output, target)`` is the loss of a slice, a mean
    over its samples (``loss_reduction="mean"``) or a sum (``"sum"``).
    """

    layers_factory: Callable[[], Any]
    loss_fn: Callable
    batches: Any
    steps: int
    lr: float
    #: The processes the caller expects; checked against the plan's.
    world_size: int | None = None
    #: A name of ``optimizers.OPTIMIZERS``.
    optimizer: str = "sgd"
    seed: int = 0
    loss_reduction: str = "mean"
    #: torch threads per worker.
    threads: int = 1
    #: Where workers leave their results (a temporary folder when None).
    out_dir: str | None = None
    #: Testing hook: skip the gradient AllReduce (must break equivalence).
    skip_allreduce: bool = False
    #: How local workers start: "spawn", or "fork" (Linux, faster).
    start_method: str = "spawn"
    #: Resume from the checkpoint of this step in ``checkpoint_dir`` and run
    #: steps ``start_step .. steps-1``.
    start_step: int = 0
    checkpoint_dir: str | None = None
    #: K > 0 saves every rank's stage after each K-th step.
    checkpoint_every: int = 0
    #: Rank 0 prints a line per step to stderr (workers' stdout goes there too).
    log: bool = False
    #: gloo's timeout for collectives and receives.
    timeout_s: float = 30.0
    #: Keep only each stage's input during the forward and re-run the
    #: stage's forward in its backward (``torch.utils.checkpoint``).
    recompute: bool = False
    #: Make each worker's C allocator return freed memory at once, so the
    #: measured peak follows the live tensors (``memory.py``); slower.
    exact_memory: bool = False
    #: "cpu" (gloo) or "cuda" (NCCL; rank r on GPU r, or GPU ``LOCAL_RANK``
    #: under torchrun).
    device: str = "cpu"
    #: Experiment only, ``{rank: factor}``: that rank's forwards and
    #: backwards take ``factor`` times as long (it sleeps the difference),
    #: so one machine can stand for GPUs of unequal speed.
    slowdown: dict[int, float] = field(default_factory=dict)
    #: An asynchronous kind (``_core.ASYNCHRONOUS_SCHEDULES``) to train with
    #: instead of the plan's synchronous schedule; None: the plan's own
    #: (asynchronous when the plan was made for one, ``schedule.run_schedule``).
    schedule: str | None = None
    #: K > 0: score the model on its factory's validation split after
    #: every K-th step (``evaluation.py``).
    eval_every: int = 0
    #: What the forwards and the loss compute in (``PRECISIONS``): "fp32",
    #: or "bf16" and "fp16" under ``torch.autocast``, fp16 with loss
    #: scaling (``training.Precision``).
    dtype: str = "fp32"

    def for_plan(self, plan: Plan) -> "RunConfig":
        """This config with the schedule the run of ``plan`` trains with."""
        return dataclasses.replace(self, schedule=run_schedule(plan.core, self.schedule))


def check_run(config: RunConfig, layout: Layout, *, visible_gpus: int | None = None) -> None:
    """Refuse a run that cannot start, before any process does: the device,
    the steps, the processes, the schedule and its optimizer, the dtype, the
    slowed ranks, and (``visible_gpus``, when the caller starts the processes on
    this machine) the GPUs. ``config`` has its schedule resolved
    (:meth:`RunConfig.for_plan`)."""
    if config.device not in DEVICES:
        raise InvalidInputError(f"device {config.device!r}: use {' or '.join(DEVICES)}")
    if not 0 <= config.start_step < config.steps:
        raise InvalidInputError(f"nothing to run: start_step {config.start_step} is not below steps {config.steps}")
    if config.world_size is not None and config.world_size != layout.world_size:
        raise InvalidInputError(f"world_size {config.world_size} but the plan uses {layout.world_size} devices")
    if config.schedule is not None and config.schedule not in _core.ASYNCHRONOUS_SCHEDULES:
        raise InvalidInputError(
            f"schedule {config.schedule!r} is not one of {', '.join(_core.ASYNCHRONOUS_SCHEDULES)}")
    check_optimizer(config.schedule, config.optimizer)
    check_dtype(config, layout)
    check_chunked(config, layout)
    if any(r >= layout.world_size for r in config.slowdown):
        raise InvalidInputError(f"rank {max(config.slowdown)} is not a rank of the plan (0..{layout.world_size - 1})",
                                field="slowdown")
    if config.device == "cuda" and visible_gpus is not None and visible_gpus < layout.world_size:
        raise IncompatibleInputsError(
            f"the plan uses {layout.world_size} devices, this machine shows {visible_gpus} GPUs")


def check_chunked(config: RunConfig, layout: Layout) -> None:
    """A rank that holds several stages (a chunked plan's) runs them in
    synchronous steps: an asynchronous schedule's passes replay one stage's
    weight versions a rank (docs/schedules.md)."""
    if config.schedule is None or all(len(layout.positions(r)) == 1 for r in range(layout.world_size)):
        return
    raise IncompatibleInputsError(f"schedule {config.schedule}: the plan's ranks hold several stages each, which "
                                  "dapple's runtime runs in synchronous steps only; plan with --schedule "
                                  "early-backward-1f1b or zb-h1 for it")


def check_dtype(config: RunConfig, layout: Layout) -> None:
    """A known dtype; fp16 under an asynchronous schedule on one process
    only. fp16's loss scaling skips a step whose gradients overflow, on every
    rank at once (``training.Precision.for_rank``): an asynchronous
    schedule's ranks update at different mini-batches, with no step they take
    together to agree on."""
    if config.dtype not in PRECISIONS:
        raise InvalidInputError(f"dtype {config.dtype!r}: use {', '.join(PRECISIONS)}", field="dtype")
    if config.dtype == "fp16" and config.schedule is not None and layout.world_size > 1:
        raise InvalidInputError(
            f"dtype 'fp16' with schedule {config.schedule} on {layout.world_size} processes: loss scaling skips "
            f"an overflowing step on every rank together, and an asynchronous schedule has no step its ranks "
            f"take together; use bf16, or one process", field="dtype")


def check_model(layout: Layout, layers: list, seq: int | None, model: str = "the model") -> None:
    """The model's ``layers`` (of sequences of ``seq`` tokens, where it
    names a length) can run the plan: its layer count, and the layers of
    each stage that splits, spreads experts or cuts sequences."""
    check_layer_count(layout, len(layers), model)
    check_split_layers(layout, layers, model)
    check_expert_layers(layout, layers, model)
    check_context_layers(layout, layers, seq, model)


def check_layer_count(layout: Layout, n_layers: int, model: str = "the model") -> None:
    """The plan's stages must end at the model's last layer."""
    end = layout.layer_ranges[-1][1]
    if end != n_layers:
        raise IncompatibleInputsError(f"the plan's stages end at layer {end}, {model} has {n_layers} layers")


def check_split_layers(layout: Layout, layers: list, model: str = "the model") -> None:
    """Every layer of a split stage (t > 1) declares how it splits
    (``split_patterns``, ``shard``: see ``tensor_parallel.py``) in a pattern
    t can split. A stage whose layers split only in part would run the
    others data parallel over all its GPUs with a bridge (Whale's collocated
    hybrid), which the runtime does not run: refused by the plan's field."""
    for i, stage in enumerate(layout.stages):
        t = stage.tensor_parallel
        for index in range(stage.layer_start, stage.layer_end) if t > 1 else ():
            layer = layers[index]
            patterns = getattr(layer, "split_patterns", None) or []
            if not patterns or not callable(getattr(layer, "shard", None)):
                raise IncompatibleInputsError(
                    f"field stages[{i}].tensor_parallel: value {t}: layer {index} of {model} declares no split "
                    f"pattern, and dapple run splits a stage only when all its layers split (no collocated "
                    f"data-parallel layers beside split ones)")
            if not any(all(d["count"] % t == 0 for d in p.get("divides", [])) for p in patterns):
                counts = ", ".join(f"{d['count']} {d['what']}" for p in patterns for d in p.get("divides", []))
                raise IncompatibleInputsError(
                    f"field stages[{i}].tensor_parallel: value {t} cannot split layer {index} of {model} "
                    f"(its shards divide {counts})")


def check_expert_layers(layout: Layout, layers: list, model: str = "the model") -> None:
    """A stage that spreads experts (e > 1) has a layer that declares them
    (``expert_pattern``, ``spread``: see ``experts.py``), and e divides
    every such layer's experts."""
    for i, stage in enumerate(layout.stages):
        e = stage.expert_parallel
        if e == 1:
            continue
        field = f"field stages[{i}].expert_parallel: value {e}"
        with_experts = [index for index in range(stage.layer_start, stage.layer_end)
                        if getattr(layers[index], "expert_pattern", None)]
        if not with_experts:
            raise IncompatibleInputsError(f"{field}: no layer of the stage ({stage.layer_start}..{stage.layer_end}) "
                                          f"of {model} declares experts")
        for index in with_experts:
            layer = layers[index]
            count = layer.expert_pattern["count"]
            if not callable(getattr(layer, "spread", None)):
                raise IncompatibleInputsError(f"{field}: layer {index} of {model} cannot spread its experts (no spread)")
            if count % e:
                raise IncompatibleInputsError(f"{field} does not divide the {count} experts of layer {index} of {model}")


def check_context_layers(layout: Layout, layers: list, seq: int | None, model: str = "the model") -> None:
    """Every layer of a stage that cuts its sequences over c > 1 ranks
    declares a ``context``, and 2c divides the model's sequence length
    ``seq`` (where the model names one); refused by the plan's field
    otherwise."""
    for i, stage in enumerate(layout.stages):
        c = stage.context_parallel
        if c > 1 and seq is not None and seq % (2 * c):
            raise IncompatibleInputsError(
                f"field stages[{i}].context_parallel: value {c} cannot cut the {seq}-token sequences of {model} "
                f"into {2 * c} equal chunks")
        for index in range(stage.layer_start, stage.layer_end) if c > 1 else ():
            if not hasattr(layers[index], "context"):
                raise IncompatibleInputsError(
                    f"field stages[{i}].context_parallel: value {c}: layer {index} of {model} does not cut its "
                    "sequence (it declares no context); dapple run cuts the sequences of the shipped GPT models' "
                    "layers and BERT's embedding and blocks")


@dataclass
class Job:
    """Everything a rank needs to train: picklable, handed to launched
    workers. ``lists``: each stage's list of passes (``_core.Pass``), by its
    length in mini-batches (``schedule.run_lists``)."""

    config: RunConfig
    layout: Layout
    lists: dict[int, list[list[_core.Pass]]]

    @classmethod
    def of(cls, plan: Plan, config: RunConfig, layout: Layout) -> "Job":
        """The job of ``plan`` under ``config`` (its schedule resolved)."""
        lengths = {b - a for a, b in run_segments(config.start_step, config.steps, config.schedule,
                                                  config.checkpoint_every, config.eval_every)}
        return cls(config, layout, run_lists(plan.core, config.schedule, lengths))

    def segments(self) -> list[tuple[int, int]]:
        """The steps ``[a, b)`` of each list this job's ranks walk."""
        c = self.config
        return run_segments(c.start_step, c.steps, c.schedule, c.checkpoint_every, c.eval_every)
