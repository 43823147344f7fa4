"""Per-stage action orders of a plan, mirroring ``rust_core/core/src/schedule.rs``.

Each stage's list holds ``("F", m)`` and ``("B", m)`` actions; the gradient
AllReduce and the optimizer step that end every list in the Rust generator
are left to the executor. Every replica of a stage runs the same list on its
slice of each micro-batch.

- early-backward (DAPPLE 1F1B): stage i runs K_i forwards, then alternates
  one backward and one forward until the forwards run out, then the
  remaining backwards.
- GPipe: F0 .. F(M-1), then B(M-1) .. B0 on every stage.

Plain Python, no torch.
"""

from __future__ import annotations

Action = tuple[str, int]

EARLY_BACKWARD = "early-backward-1f1b"
GPIPE = "gpipe"


def _check_shape(num_stages: int, micro_batches: int) -> None:
    if num_stages < 1 or micro_batches < 1:
        raise ValueError(
            f"a schedule needs at least one stage and one micro-batch, "
            f"got {num_stages} and {micro_batches}"
        )


def early_backward(num_stages: int, micro_batches: int, warmup: list[int]) -> list[list[Action]]:
    """Early-backward 1F1B with warm-up depth ``warmup[i]`` = K_i, each in 1..=M."""
    _check_shape(num_stages, micro_batches)
    if len(warmup) != num_stages:
        raise ValueError(f"{len(warmup)} warm-up depths given for {num_stages} stages")
    lists = []
    for stage, k in enumerate(warmup):
        if not 1 <= k <= micro_batches:
            raise ValueError(f"stage {stage}: warm-up depth {k} is not in 1..={micro_batches}")
        actions: list[Action] = [("F", m) for m in range(k)]
        for m in range(micro_batches):
            actions.append(("B", m))
            if m + k < micro_batches:
                actions.append(("F", m + k))
        lists.append(actions)
    validate(lists, micro_batches)
    return lists


def gpipe(num_stages: int, micro_batches: int) -> list[list[Action]]:
    """GPipe: all forwards in order, then all backwards in reverse order."""
    _check_shape(num_stages, micro_batches)
    one = [("F", m) for m in range(micro_batches)] + [
        ("B", m) for m in reversed(range(micro_batches))
    ]
    return [list(one) for _ in range(num_stages)]


def warmup_depth(policy: str, stages_from_here: int, micro_batches: int) -> int:
    """K_i of warm-up policy ``A`` (min(S-i, M)) or ``B`` (min(2(S-i)-1, M))."""
    if policy == "A":
        return min(stages_from_here, micro_batches)
    if policy == "B":
        return min(2 * stages_from_here - 1, micro_batches)
    raise ValueError(f"unknown warm-up policy {policy!r}; use A or B")


def plan_schedule(plan_data: dict) -> list[list[Action]]:
    """The action lists of a ``dapple.plan`` dict, one per stage.

    Early-backward uses each stage's ``warmup_micro_batches`` when present,
    else the plan's ``schedule.warmup_policy`` (default ``A``).
    """
    stages = plan_data["stages"]
    m = int(plan_data["micro_batches"])
    sched = plan_data.get("schedule") or {}
    kind = sched.get("kind", EARLY_BACKWARD)
    if kind == GPIPE:
        return gpipe(len(stages), m)
    if kind != EARLY_BACKWARD:
        raise ValueError(f"value {kind!r} is not a schedule; use {EARLY_BACKWARD} or {GPIPE}")
    policy = sched.get("warmup_policy", "A")
    warmup = [
        int(st["warmup_micro_batches"])
        if "warmup_micro_batches" in st
        else warmup_depth(policy, len(stages) - i, m)
        for i, st in enumerate(stages)
    ]
    return early_backward(len(stages), m, warmup)


def validate(lists: list[list[Action]], micro_batches: int) -> None:
    """Each list runs every F and B of 0..M once, B_m after F_m; and a
    lock-step run of all stages (F_m waits for F_m on the stage before, B_m
    for B_m on the stage after) finishes without deadlock."""
    for s, actions in enumerate(lists):
        seen: set[Action] = set()
        for a in actions:
            kind, m = a
            if kind not in ("F", "B") or not 0 <= m < micro_batches:
                raise ValueError(f"stage {s}: bad action {a}")
            if a in seen:
                raise ValueError(f"stage {s}: duplicate action {kind}{m}")
            if kind == "B" and ("F", m) not in seen:
                raise ValueError(f"stage {s}: B{m} comes before F{m}")
            seen.add(a)
        if len(seen) != 2 * micro_batches:
            raise ValueError(f"stage {s}: {2 * micro_batches - len(seen)} actions missing")
    n = len(lists)
    nxt = [0] * n
    done: set[tuple[int, Action]] = set()
    while True:
        ran, stuck = [], []
        for s, actions in enumerate(lists):
            if nxt[s] >= len(actions):
                continue
            a = actions[nxt[s]]
            src = s - 1 if a[0] == "F" and s > 0 else s + 1 if a[0] == "B" and s + 1 < n else None
            if src is not None and (src, a) not in done:
                stuck.append(f"stage {s} waits at {a[0]}{a[1]} for stage {src}")
            else:
                ran.append((s, a))
        if not ran:
            if stuck:
                raise ValueError("deadlock: " + "; ".join(stuck))
            return
        for s, a in ran:
            nxt[s] += 1
            done.add((s, a))


def format_schedule(lists: list[list[Action]]) -> str:
    """``stage 0: F0 F1 B0 ...`` lines, as the Rust ``Display``, without AR/OPT."""
    return "\n".join(
        f"stage {s}: " + " ".join(f"{k}{m}" for k, m in actions) for s, actions in enumerate(lists)
    )
