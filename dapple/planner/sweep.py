"""How many GPUs, and of which type: one model planned on a range of
cluster sizes and GPU types, each size's plan turned into the time and the
GPU-hours (and, at the user's prices, the money) that training a token
budget takes.

    result = sweep(profile, [8, 16, 32], train_tokens=10**12, tokens_per_batch=2**21)
    for point in result.points:
        print(point.gpus, point.train_hours, point.gpu_hours)

The arithmetic, one rule a function below: an iteration trains the global
batch's samples of ``tokens_per_sample`` tokens; training takes the
iterations that reach the budget, rounded up (the last one is whole); its
hours are those iterations at the plan's simulated iteration time; GPU-hours
are those hours on every GPU of the cluster (idle ones too: they are
rented), and the cost is the GPU-hours at the user's price. No price is
shipped: a price is the user's input or there is none.

What is reused between sizes: each GPU type's profile is built and checked
once, and every worker process parses it once. What is not: each size runs
its own search from scratch (the core's search keeps no state between
calls, and a smaller cluster's plan bounds nothing on a larger one), so a
sweep takes the sum of its sizes' planning times, over the processes that
plan them side by side (``jobs``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import IncompatibleInputsError, InfeasibleError, InvalidInputError, LimitExceededError
from .limits import check_count
from .plan import Plan
from .profile import Profile
from .targets import plan as plan_for_size
from .topology import GPU_TYPES

#: The knee's rule (:func:`knee`): a step to a larger size is still worth it
#: while it keeps at least this share of the added GPUs' ideal speed-up.
KNEE_EFFICIENCY = 0.5

#: Why a size has no plan, as a row rather than the sweep's end: no plan
#: fits, the batch does not go with the GPUs, or the size is over a search
#: limit. Any other error (a bad option) is every size's and ends the sweep.
ROW_ERRORS = (InfeasibleError, IncompatibleInputsError, LimitExceededError)

MS_PER_HOUR = 3.6e6


# The arithmetic, one rule a function.

def tokens_per_iteration(global_batch_size: int, tokens_per_sample: int) -> int:
    """Tokens one iteration trains: the global batch's samples, whole."""
    return global_batch_size * tokens_per_sample


def global_batch_for_tokens(tokens_per_batch: int, tokens_per_sample: int) -> int:
    """The global batch, in samples, nearest to ``tokens_per_batch`` tokens
    (the planner splits whole samples): at least one."""
    return max(1, round(tokens_per_batch / tokens_per_sample))


def tokens_per_s(tokens_per_iteration: int, iteration_ms: float) -> float:
    """Tokens trained a second at one iteration each ``iteration_ms``."""
    return tokens_per_iteration / (iteration_ms / 1000.0)


def iterations_to_train(train_tokens: int, tokens_per_iteration: int) -> int:
    """Iterations that train at least ``train_tokens``: the quotient rounded
    up, since the last iteration runs whole."""
    return -(-train_tokens // tokens_per_iteration)


def train_hours(iterations: int, iteration_ms: float) -> float:
    """Hours that ``iterations`` of ``iteration_ms`` each take."""
    return iterations * iteration_ms / MS_PER_HOUR


def gpu_hours(train_hours: float, gpus: int) -> float:
    """GPU-hours of training on every GPU of the cluster for ``train_hours``."""
    return train_hours * gpus


def cost_usd(gpu_hours: float, usd_per_gpu_hour: float) -> float:
    """What ``gpu_hours`` cost at the user's price a GPU-hour."""
    return gpu_hours * usd_per_gpu_hour


def step_efficiency(smaller_hours: float, smaller_gpus: int, larger_hours: float, larger_gpus: int) -> float:
    """The share of the added GPUs' ideal speed-up that a step from a
    smaller to a larger cluster keeps: (speed-up - 1) / (GPU ratio - 1).
    1: time to train fell as the GPUs grew (8 to 16 GPUs halved it); 0: it
    did not fall; below 0: the larger cluster trains slower."""
    speedup = smaller_hours / larger_hours
    return (speedup - 1.0) / (larger_gpus / smaller_gpus - 1.0)


# The points.

@dataclass(frozen=True)
class SweepPoint:
    """One cluster of the sweep, its plan and what training the budget on it
    takes; ``plan`` is None, and ``why_not`` says why, where it has no plan."""

    gpu_type: str
    machines: int
    gpus_per_machine: int
    #: The topology spec it was planned on (``64x8-h100``).
    topology: str
    global_batch_size: int
    tokens_per_iteration: int
    plan: Plan | None
    why_not: str | None = None
    iterations: int | None = None
    iteration_ms: float | None = None
    tokens_per_s: float | None = None
    #: Model FLOPs utilisation (the plan's ``estimate.mfu``); None where the
    #: profile gives no FLOPs.
    mfu: float | None = None
    train_hours: float | None = None
    gpu_hours: float | None = None
    usd_per_gpu_hour: float | None = None
    cost_usd: float | None = None
    #: :func:`step_efficiency` from the previous size of its GPU type that
    #: has a plan; None for the first.
    step_efficiency: float | None = None

    @property
    def gpus(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def layout(self) -> str | None:
        return None if self.plan is None else self.plan.layout

    def to_dict(self) -> dict:
        keys = ("gpu_type", "machines", "gpus_per_machine", "gpus", "topology", "global_batch_size",
                "tokens_per_iteration", "layout", "iterations", "iteration_ms", "tokens_per_s", "mfu", "train_hours",
                "gpu_hours", "usd_per_gpu_hour", "cost_usd", "step_efficiency", "why_not")
        return {key: getattr(self, key) for key in keys}


def planned_point(gpu_type: str, machines: int, gpus_per_machine: int, topology: str, global_batch_size: int,
                  tokens_per_sample: int, train_tokens: int, plan: Plan, usd_per_gpu_hour: float | None) -> SweepPoint:
    """The point of a size with a plan, every figure from the rules above."""
    per_iteration = tokens_per_iteration(global_batch_size, tokens_per_sample)
    iterations = iterations_to_train(train_tokens, per_iteration)
    hours = train_hours(iterations, plan.iteration_ms)
    gpu_h = gpu_hours(hours, machines * gpus_per_machine)
    return SweepPoint(
        gpu_type=gpu_type, machines=machines, gpus_per_machine=gpus_per_machine, topology=topology,
        global_batch_size=global_batch_size, tokens_per_iteration=per_iteration, plan=plan,
        iterations=iterations, iteration_ms=plan.iteration_ms,
        tokens_per_s=tokens_per_s(per_iteration, plan.iteration_ms), mfu=(plan.estimate or {}).get("mfu"),
        train_hours=hours, gpu_hours=gpu_h, usd_per_gpu_hour=usd_per_gpu_hour,
        cost_usd=None if usd_per_gpu_hour is None else cost_usd(gpu_h, usd_per_gpu_hour),
    )


def with_step_efficiencies(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """``points`` (of one GPU type, by size), each with its step efficiency
    from the previous one that has a plan."""
    out, previous = [], None
    for point in points:
        if point.plan is not None and previous is not None:
            point = dataclasses.replace(point, step_efficiency=step_efficiency(
                previous.train_hours, previous.gpus, point.train_hours, point.gpus))
        out.append(point)
        previous = point if point.plan is not None else previous
    return out


def knee(points: Sequence[SweepPoint], knee_efficiency: float = KNEE_EFFICIENCY) -> SweepPoint | None:
    """The knee of one GPU type's points (by size, step efficiencies set):
    the largest size up to which every step from the smallest size with a
    plan kept at least ``knee_efficiency`` of the added GPUs' ideal speed-up
    (:func:`step_efficiency`; the default 0.5: a doubling at least 1.5
    times as fast). Past it, more GPUs buy less than that share. None where
    fewer than two sizes have a plan (no step to judge)."""
    planned = [p for p in points if p.plan is not None]
    if len(planned) < 2:
        return None
    found = planned[0]
    for point in planned[1:]:
        if point.step_efficiency < knee_efficiency:
            break
        found = point
    return found


def cheapest(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """The cheapest points: with prices, the one of lowest cost over every
    GPU type; without, each GPU type's of fewest GPU-hours (GPU-hours of
    different types are not one currency). Ties go to the shorter time to
    train, then to fewer GPUs."""
    planned = [p for p in points if p.plan is not None]
    if not planned:
        return []
    if planned[0].cost_usd is not None:
        return [min(planned, key=lambda p: (p.cost_usd, p.train_hours, p.gpus))]
    gpu_types = dict.fromkeys(p.gpu_type for p in planned)
    return [min((p for p in planned if p.gpu_type == t), key=lambda p: (p.gpu_hours, p.train_hours, p.gpus))
            for t in gpu_types]


@dataclass(frozen=True)
class Sweep:
    """Every point of a sweep, by GPU type (in the order given) then size,
    with the inputs that every point shares."""

    model: str
    points: tuple[SweepPoint, ...]
    global_batch_size: int
    tokens_per_sample: int
    train_tokens: int
    knee_efficiency: float

    @property
    def gpu_types(self) -> list[str]:
        return list(dict.fromkeys(p.gpu_type for p in self.points))

    @property
    def knees(self) -> list[SweepPoint]:
        """Each GPU type's knee (:func:`knee`), where it has one."""
        found = (knee([p for p in self.points if p.gpu_type == t], self.knee_efficiency) for t in self.gpu_types)
        return [k for k in found if k is not None]

    @property
    def cheapest(self) -> list[SweepPoint]:
        return cheapest(self.points)

    def notes(self, point: SweepPoint) -> list[str]:
        """"knee" and "cheapest" where the point is one."""
        return [name for name, chosen in (("knee", self.knees), ("cheapest", self.cheapest))
                if any(point is c for c in chosen)]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "global_batch_size": self.global_batch_size,
            "tokens_per_sample": self.tokens_per_sample,
            "tokens_per_iteration": tokens_per_iteration(self.global_batch_size, self.tokens_per_sample),
            "train_tokens": self.train_tokens,
            "knee_efficiency": self.knee_efficiency,
            "points": [{**p.to_dict(), "notes": self.notes(p)} for p in self.points],
        }


# The figures as text, alike in the table and on the plot, so that a
# reader can find one in the other.

def duration_unit(hours: float) -> tuple[str, str, float]:
    """The unit a time to train is read in, as (symbol, name, hours in
    one): minutes under an hour, hours under two days, else days."""
    if hours < 1:
        return "min", "minutes", 1 / 60
    if hours < 48:
        return "h", "hours", 1.0
    return "d", "days", 24.0


def duration_text(hours: float) -> str:
    symbol, _, unit_hours = duration_unit(hours)
    return f"{hours / unit_hours:,.1f} {symbol}"


def amount_text(value: float) -> str:
    """A count of GPU-hours: whole from 1,000, else three figures."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def usd_text(usd: float) -> str:
    return f"${usd:,.0f}" if usd >= 1000 else f"${usd:.2f}"


# Inputs.

def gpu_type_name(name: str) -> str:
    """The catalog's name of a GPU type given by name or spec name, in any
    case (``h100`` -> ``H100-80GB``)."""
    wanted = name.strip().lower()
    for canonical, figures in GPU_TYPES.items():
        if wanted == canonical.lower() or wanted in figures["aliases"]:
            return canonical
    raise InvalidInputError(f"GPU type {name!r} is none of {', '.join(GPU_TYPES)}")


def topology_spec(machines: int, gpus_per_machine: int, gpu_type: str) -> str:
    """The spec of ``machines`` machines of ``gpus_per_machine`` GPUs of a
    catalog type, with the links of its usual server (``64x8-h100-80gb``)."""
    return f"{machines}x{gpus_per_machine}-{GPU_TYPES[gpu_type]['aliases'][0]}"


def recorded_sequence_length(profile: Profile) -> int | None:
    """The tokens of one sample that a profile's layers record (their
    ``context.sequence_length``, which `dapple profile transformer` writes),
    or None where none does."""
    lengths = {layer["context"]["sequence_length"] for layer in profile.layers if layer.get("context")}
    if len(lengths) > 1:
        raise InvalidInputError(f"profile {profile.model!r}: its layers record sequence lengths {sorted(lengths)}")
    return lengths.pop() if lengths else None


def sweep_tokens_per_sample(profiles: Sequence[Profile], tokens_per_sample: int | None) -> int:
    """The tokens of one sample: the profiles' recorded sequence length, or
    ``tokens_per_sample`` where they record none."""
    recorded = {recorded_sequence_length(p) for p in profiles} - {None}
    if len(recorded) > 1:
        raise IncompatibleInputsError(f"the profiles record sequence lengths {sorted(recorded)}; sweep one at a time")
    if recorded:
        length = recorded.pop()
        if tokens_per_sample is not None and tokens_per_sample != length:
            raise IncompatibleInputsError(f"tokens a sample {tokens_per_sample}: the profile records a sequence "
                                          f"of {length}")
        return length
    if tokens_per_sample is None:
        raise InvalidInputError(f"profile {profiles[0].model!r} records no sequence length; give the tokens a sample")
    return tokens_per_sample


def profile_gpu_type(profile: Profile) -> str:
    """The GPU type a profile's times are of (its ``device``), by catalog name."""
    device = profile.devices[0]
    if device is None:
        raise InvalidInputError(f"profile {profile.model!r} names no GPU type (field device); a sweep plans each "
                                "profile on clusters of its GPU type")
    return gpu_type_name(device)


def check_prices(prices: Mapping[str, float], gpu_types: Sequence[str]) -> dict[str, float]:
    """Prices a GPU-hour by catalog name: one for every GPU type swept,
    each finite and at least 0, none for a type not swept."""
    by_type = {}
    for name, usd in prices.items():
        gpu_type = gpu_type_name(name)
        if not (math.isfinite(usd) and usd >= 0):
            raise InvalidInputError(f"price of {gpu_type}: {usd} USD a GPU-hour is not a number >= 0")
        if gpu_type not in gpu_types:
            raise InvalidInputError(f"price of {gpu_type}: the sweep plans no {gpu_type} "
                                    f"(it plans {', '.join(gpu_types)})")
        by_type[gpu_type] = usd
    missing = [t for t in gpu_types if t not in by_type]
    if missing:
        raise InvalidInputError(f"no price for {', '.join(missing)}; give one for every GPU type swept, or none")
    return by_type


# Planning the sizes.

def sweep(
    profiles: Profile | Sequence[Profile],
    machine_counts: Sequence[int],
    train_tokens: int,
    *,
    gpus_per_machine: int = 8,
    global_batch_size: int | None = None,
    tokens_per_batch: int | None = None,
    tokens_per_sample: int | None = None,
    usd_per_gpu_hour: Mapping[str, float] | None = None,
    knee_efficiency: float = KNEE_EFFICIENCY,
    jobs: int = 1,
    on_point: Callable[[SweepPoint], None] | None = None,
    **options,
) -> Sweep:
    """Plan ``profiles`` (one a GPU type: each is planned on clusters of its
    own ``device``) on ``machine_counts`` machines of ``gpus_per_machine``
    GPUs, at one global batch for every size (``global_batch_size``
    samples, or the samples nearest to ``tokens_per_batch`` tokens), and
    cost training ``train_tokens`` tokens on each (the module's docstring
    says how). ``tokens_per_sample``: the tokens of one sample, for a
    profile that records no sequence length. ``usd_per_gpu_hour``: the
    user's price of each GPU type swept (by name or spec name), or None for
    no cost. ``knee_efficiency``: the knee's rule (:func:`knee`).
    ``options``: :func:`dapple.planner.plan`'s, for every size.

    ``jobs`` > 1 plans that many sizes at a time, each in a process of its
    own (started afresh, not forked: the core's thread pool does not
    survive a fork).
    ``on_point`` is called with each point as its size is planned, in the
    order they finish. A size without a plan is a point saying why
    (``ROW_ERRORS``); other errors end the sweep."""
    profiles = [profiles] if isinstance(profiles, Profile) else list(profiles)
    if not profiles:
        raise InvalidInputError("no profile to sweep")
    counts = sorted({check_count("machine_counts", m) for m in machine_counts})
    if not counts:
        raise InvalidInputError("no machine count to sweep")
    check_count("gpus_per_machine", gpus_per_machine)
    if not isinstance(train_tokens, int) or train_tokens < 1:
        raise InvalidInputError(f"train tokens {train_tokens!r}: give a whole number of tokens >= 1")
    if not 0 < knee_efficiency <= 1:
        raise InvalidInputError(f"knee efficiency {knee_efficiency}: give a share in (0, 1]")
    gpu_types = [profile_gpu_type(p) for p in profiles]
    doubled = sorted({t for t in gpu_types if gpu_types.count(t) > 1})
    if doubled:
        raise InvalidInputError(f"two profiles of {', '.join(doubled)}: give one profile a GPU type")
    sample_tokens = sweep_tokens_per_sample(
        profiles, None if tokens_per_sample is None else check_count("tokens_per_sample", tokens_per_sample))
    if (global_batch_size is None) == (tokens_per_batch is None):
        raise InvalidInputError("give the global batch in samples or in tokens, one of them")
    gbs = check_count("global_batch_size", global_batch_size if global_batch_size is not None
                      else global_batch_for_tokens(tokens_per_batch, sample_tokens))
    prices = check_prices(usd_per_gpu_hour, gpu_types) if usd_per_gpu_hour is not None else {}

    sizes = [(k, m) for k in range(len(profiles)) for m in counts]
    specs = {(k, m): topology_spec(m, gpus_per_machine, gpu_types[k]) for k, m in sizes}

    def point_of(size: tuple[int, int], plan_text: str | None, why_not: str | None) -> SweepPoint:
        k, m = size
        if plan_text is None:
            return SweepPoint(gpu_type=gpu_types[k], machines=m, gpus_per_machine=gpus_per_machine,
                              topology=specs[size], global_batch_size=gbs,
                              tokens_per_iteration=tokens_per_iteration(gbs, sample_tokens), plan=None, why_not=why_not)
        return planned_point(gpu_types[k], m, gpus_per_machine, specs[size], gbs, sample_tokens, train_tokens,
                             Plan.from_json(plan_text), prices.get(gpu_types[k]))

    found: dict[tuple[int, int], SweepPoint] = {}

    def done(size, plan_text, why_not) -> None:
        found[size] = point_of(size, plan_text, why_not)
        if on_point is not None:
            on_point(found[size])

    workers = max(1, min(jobs, len(sizes)))
    if workers == 1:
        for size in sizes:
            done(size, *plan_one(profiles[size[0]], specs[size], gbs, options))
    else:
        _plan_in_processes(profiles, sizes, specs, gbs, options, workers, done)

    points = []
    for k in range(len(profiles)):
        points += with_step_efficiencies([found[(k, m)] for m in counts])
    return Sweep(model=profiles[0].model, points=tuple(points), global_batch_size=gbs,
                 tokens_per_sample=sample_tokens, train_tokens=train_tokens, knee_efficiency=knee_efficiency)


def plan_one(profile: Profile, spec: str, global_batch_size: int, options: dict) -> tuple[str | None, str | None]:
    """One size's plan as JSON text (what crosses between processes: the
    core's objects do not pickle), or None and why it has none."""
    try:
        return plan_for_size(profile, spec, global_batch_size, **options).text, None
    except ROW_ERRORS as e:
        return None, str(e)


def _plan_in_processes(profiles, sizes, specs, gbs, options, workers, done) -> None:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                                initargs=([p.text for p in profiles],)) as pool:
        futures = {pool.submit(_plan_in_worker, size[0], specs[size], gbs, options): size for size in sizes}
        try:
            for future in concurrent.futures.as_completed(futures):
                done(futures[future], *future.result())
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


#: A worker process's profiles, parsed once when it starts.
_WORKER_PROFILES: list[Profile] = []


def _start_worker(profile_texts: list[str]) -> None:
    # The worker's core keeps its thread pool of every core, though the
    # workers then share the cores: the search's plan depends on its thread
    # count (it simulates a batch of candidates a thread), and a sweep's
    # plans are to be `dapple plan`'s.
    _WORKER_PROFILES[:] = [Profile.from_json(text) for text in profile_texts]


def _plan_in_worker(profile_index: int, spec: str, global_batch_size: int, options: dict):
    return plan_one(_WORKER_PROFILES[profile_index], spec, global_batch_size, options)
