"""Plans for the runtime the user has (``dapple plan --for``,
``planner.plan(..., target=...)``): the fastest plan that target runs as it
is, beside the free plan's time, so the user sees what the runtime costs.

What a target runs is what ``dapple export`` writes for it without
``--approximate`` (``docs/export.md``; the export's own refusals are the
rule, so it lives in one place): Megatron-LM and DeepSpeed one tensor and
one data-parallel degree for every stage, ZeRO-1 and re-computation on all
stages or none, 1F1B with K_i = min(S - i, M), uneven stages only as layer
boundaries; torchtitan the same shapes under any synchronous kind of one
stage a rank, and no re-computation of whole stages; torch's runtime
(``torch``: dapple's own runtime, and the schedule CSV) any synchronous
plan whose stages are replicated and split alike, without sequence
parallelism or selective re-computation, its experts spread only over
replicas (``runtime/layout.py``'s refusals are the rule).

The candidates are the free search's plan, the search for the target's
schedule alone, and the fastest of Megatron-LM's uniform shapes that the
target runs (``baseline_plans("megatron")``: every (t, p, d) and
micro-batch size, with and without ZeRO-1 and re-computation); the fastest
that the target takes is the plan. Every candidate, the free plan's too, is
costed with the communication the target hides behind computation
(``TARGET_OVERLAP``), so that the cost beside it is that of the shapes the
runtime takes, not of its overlap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .compare import baseline_plans
from .errors import DappleError, IncompatibleInputsError, InvalidInputError
from .export.deepspeed import deepspeed_partition
from .export.megatron import megatron_arguments
from .export.torchtitan import torchtitan_config
from .plan import GRAD_REDUCE_OVERLAPS, Plan, plan as free_plan
from .profile import Profile
from .runtime.layout import Layout
from .topology import Topology

#: The runtimes ``--for`` plans for.
TARGETS: tuple[str, ...] = ("megatron", "deepspeed", "torchtitan", "torch")
#: The schedule each target's own search asks for (Megatron-LM's and
#: DeepSpeed's 1F1B is early backward at policy A's depths), and the
#: highest sharding level it runs beside a pipeline: ZeRO-1 (Megatron-LM's
#: distributed optimizer, DeepSpeed's pipeline engine, torchtitan's FSDP
#: under torch's pipeline stages, dapple's runtime; ``docs/export.md``);
#: DeepSpeed's pipeline engine cuts no sequence; dapple's runtime cuts
#: every stage's alike (its layout refuses neighbours that differ).
TARGET_SEARCH = {
    "megatron": {"schedule": "early-backward-1f1b", "warmup_policy": "A", "max_shard_level": 1},
    "deepspeed": {"schedule": "early-backward-1f1b", "warmup_policy": "A", "max_shard_level": 1,
                  "max_context_parallel": 1},
    "torchtitan": {"schedule": "early-backward-1f1b", "max_shard_level": 1},
    "torch": {"schedule": "early-backward-1f1b", "max_shard_level": 1},
}


#: What each target hides behind computation (``docs/cost-model.md``,
#: "Overlap"): Megatron-LM with ``--overlap-grad-reduce`` and
#: ``--overlap-param-gather``, which its export writes; torchtitan's FSDP
#: reduce-scatters each stage's gradients behind its backward and gathers
#: its weights ahead of the forward (DDP overlaps a single stage's);
#: DeepSpeed's pipeline engine and dapple's runtime reduce a pipeline's
#: gradients after its backward (DAPPLE's model).
_HIDING_BOTH = {"overlap_grad_reduce": "every-stage", "overlap_param_gather": True}
_DAPPLES = {"overlap_grad_reduce": GRAD_REDUCE_OVERLAPS[0], "overlap_param_gather": False}
TARGET_OVERLAP = {"megatron": _HIDING_BOTH, "torchtitan": _HIDING_BOTH, "deepspeed": _DAPPLES, "torch": _DAPPLES}


@dataclass(frozen=True)
class ForTarget:
    """The plan for ``target``, and the free plan's time beside it."""

    plan: Plan
    target: str
    #: The free search's simulated iteration (None where it found none).
    free_ms: float | None
    #: Each candidate the target refused, as (what it was, why).
    refused: tuple[tuple[str, str], ...]

    @property
    def cost(self) -> float | None:
        """How much slower the target's plan is than the free one (1.0: not)."""
        return None if self.free_ms is None else self.plan.iteration_ms / self.free_ms


def refusal(plan: Plan, profile: Profile, target: str) -> str | None:
    """Why ``target`` cannot run ``plan`` as it is (the export's one-line
    refusal), or None where it can."""
    try:
        if target == "megatron":
            megatron_arguments(plan, profile)
        elif target == "deepspeed":
            deepspeed_partition(plan, profile)
        elif target == "torchtitan":
            try:
                torchtitan_config(plan, profile)
            except InvalidInputError:
                # The default module map does not name this profile's layers:
                # which modules hold a layer (`--module-map`) does not decide
                # what runs, the shape checked before it does.
                pass
        else:
            Layout.of(plan)  # dapple's runtime: its refusals first
            plan.pipeline_order()
    except IncompatibleInputsError as e:
        return str(e)
    return None


def plan_for(
    target: str,
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    free: Plan | None = None,
    **options,
) -> ForTarget:
    """The fastest plan ``target`` runs as it is, among the free search's,
    the search for the target's schedule and Megatron-LM's uniform shapes,
    each costed with the target's overlap (``TARGET_OVERLAP``, in place of
    the options' own). ``free``: the free plan of the same inputs and
    options under that overlap, where the caller has it already (the search
    is the expensive part). Raises
    ``IncompatibleInputsError`` (exit 4) where the target runs none of them,
    naming why each was refused."""
    if target not in TARGETS:
        raise IncompatibleInputsError(f"target {target!r} is none of {', '.join(TARGETS)}")
    prof = profile if isinstance(profile, Profile) else Profile.load(profile)
    topo = Topology.resolve(topology)
    options = {**options, **TARGET_OVERLAP[target]}
    if free is not None and free.overlap != tuple(TARGET_OVERLAP[target].values()):
        raise InvalidInputError(f"the free plan given for {target} hides {free.overlap}, not the target's "
                                f"{tuple(TARGET_OVERLAP[target].values())}")
    free = free if free is not None else free_plan(prof, topo, global_batch_size, **options)
    candidates = [("the free plan", free)]
    asked = {**options, **TARGET_SEARCH[target]}
    if asked != options:
        candidates.append((f"the plan searched for {asked['schedule']}", _or_error(
            lambda: free_plan(prof, topo, global_batch_size, **asked))))
    runs, refused = [], []
    for what, made in candidates:
        why = str(made) if isinstance(made, DappleError) else refusal(made, prof, target)
        if why is None:
            runs.append(made)
        else:
            refused.append((what, why))
    if not _hinted(options):
        uniform = _fastest_uniform_it_runs(prof, topo, global_batch_size, target, options.get("min_micro_batch_size"))
        if isinstance(uniform, Plan):
            runs.append(uniform)
        else:
            refused.append(("Megatron-LM's uniform shapes", uniform))
    if not runs:
        reasons = "; ".join(f"{what}: {why}" for what, why in refused)
        raise IncompatibleInputsError(f"no plan that {target} runs: {reasons}")
    best = min(runs, key=lambda p: p.iteration_ms)
    return ForTarget(plan=best, target=target, free_ms=free.iteration_ms, refused=tuple(refused))


def _fastest_uniform_it_runs(prof: Profile, topo: Topology, global_batch_size: int, target: str,
                             min_micro_batch_size: int | None) -> Plan | str:
    """The fastest of Megatron-LM's uniform shapes that fits and that
    ``target`` runs (not every target runs a re-computed one), or why none."""
    plans = _or_error(lambda: baseline_plans("megatron", prof, topo, global_batch_size,
                                             min_micro_batch_size=min_micro_batch_size, **TARGET_OVERLAP[target]))
    if isinstance(plans, DappleError):
        return str(plans)
    first_refusal = None
    for candidate in plans:
        why = refusal(candidate, prof, target)
        if why is None:
            return candidate
        first_refusal = first_refusal or why
    return f"none of the {len(plans)} that fit runs on {target}; the fastest: {first_refusal}"


def _or_error(make):
    """``make()``, or the dapple error it raised (that candidate's reason)."""
    try:
        return make()
    except DappleError as e:
        return e


def _hinted(options: dict) -> bool:
    """Whether the user's hints constrain the plan (the uniform shapes do
    not keep them)."""
    return any(options.get(k) for k in ("stages", "micro_batches", "pin_cuts", "replicate", "split", "from_layout"))


def plan(
    profile: Profile | str | os.PathLike,
    topology: Topology | str,
    global_batch_size: int,
    *,
    target: str | None = None,
    **options,
) -> Plan:
    """:func:`dapple.planner.plan.plan` (the search, every option as there),
    or with ``target`` (one of ``TARGETS``) the fastest plan that runtime
    runs as it is (:func:`plan_for`, which also gives the free plan's time)."""
    if target is None:
        return free_plan(profile, topology, global_batch_size, **options)
    return plan_for(target, profile, topology, global_batch_size, **options).plan
