"""Human-readable tables for plans, on stdout."""

from __future__ import annotations


from rich.console import Console
from rich.table import Table

from dapple.planner import Plan, Profile
from dapple.planner.plan import SHAPE_KEY, device_ranges, shape_label

GIB = float(1 << 30)
MIB = float(1 << 20)


def console(fit: Table | None = None) -> Console:
    """Plain text 120 columns wide, so output can be diffed and grepped; on
    a terminal, ``fit`` takes the terminal's width and wraps its cells
    (its columns fold rather than cut their text), and piped it takes the
    width it needs to print every cell on one line."""
    if fit is None:
        return Console(highlight=False, soft_wrap=True, width=120)
    out = Console(highlight=False, soft_wrap=True)
    if out.is_terminal:
        return out
    natural = Console(width=100_000).measure(fit).maximum
    return Console(highlight=False, soft_wrap=True, width=max(120, natural))


def plan_table(plan: Plan, profile: Profile | None) -> None:
    out = console()
    est = plan.estimate or {}
    blocks = plan.blocks_per_stage(profile) if profile is not None else None
    inputs = plan.data["inputs"]
    out.print(
        f"{inputs['model']} on {inputs['topology']['name']}, global batch {inputs['global_batch_size']}: "
        f"{plan.layout}, {plan.micro_batching}, "
        f"schedule {plan.core.schedule_kind} (warm-up policy {plan.core.warmup_policy})"
    )
    if blocks and any(blocks):
        out.print("split (model layers per stage): " + ":".join(str(b) for b in blocks))
    t = Table(show_edge=False, pad_edge=False)
    columns = ["stage", "layers", "GPUs", "K", "fwd ms", "bwd ms", "allreduce ms", "bubble ms", "memory GiB", "placement"]
    shapes = [shape_label(s) for s in plan.stage_shapes]
    shaped = any(shapes)
    if shaped:
        columns.insert(3, "shape")
    for col in columns:
        t.add_column(col, justify="left" if col in ("layers", "GPUs", "placement", "shape") else "right")
    for i, s in enumerate(plan.stages):
        e = est["stages"][i] if est else {}
        names = ""
        if profile is not None:
            first = profile.layers[s["layer_start"]]["name"]
            last = profile.layers[s["layer_end"] - 1]["name"]
            names = f" ({_short(first)} .. {_short(last)})"
        bubble = e.get("bubble_ms")
        t.add_row(
            str(i),
            f"{s['layer_start']}-{s['layer_end'] - 1}{names}",
            f"{len(s['devices'])}: {device_ranges(s['devices'])}",
            *([shapes[i] or "plain"] if shaped else []),
            str(s["warmup_micro_batches"]),
            f"{e.get('fwd_ms', 0):.2f}",
            f"{e.get('bwd_ms', 0):.2f}",
            f"{e.get('exposed_allreduce_ms', 0):.2f}",
            "-" if bubble is None else f"{bubble:.1f}",
            f"{e.get('memory_bytes', 0) / GIB:.2f} / {e.get('memory_limit_bytes', 0) / GIB:.0f}",
            s.get("placement") or "",
        )
    out.print(t)
    if shaped:
        out.print(f"shape {SHAPE_KEY}")
    if est and est.get("memory"):
        out.print(memory_table(est["memory"], est["stages"]))
    if est:
        for i, tr in enumerate(est["transfers"]):
            out.print(f"transfer {i}->{i + 1}: {tr['bytes'] / 1e6:.2f} MB per micro-batch, {tr['fwd_ms']:.2f} ms each way")
        out.print(
            f"iteration {plan.iteration_ms:.1f} ms (simulated); speedup {est['speedup']:.2f}x over one GPU, "
            f"{est['samples_per_second']:.1f} samples/s, "
            + (f"MFU {est['mfu']:.3f}, " if est.get("mfu") is not None else "")
            + f"peak memory {est['peak_memory_bytes'] / GIB:.2f} GiB"
            + ("" if est["fits_memory"] else "  ** DOES NOT FIT IN MEMORY **")
        )
        out.print(
            f"formula (2) lower bound {est['latency_ms']:.1f} ms = warm-up {est['warmup_ms']:.1f} "
            f"+ steady {est['steady_ms']:.1f} + ending {est['ending_ms']:.1f} "
            f"(pivot {est['pivot']['kind']} {est['pivot']['index']})"
        )
        selection_lines(out, plan)
        if est["paper_pivot"] != est["pivot"]:
            out.print(
                f"note: the paper's Algorithm 1 picks {est['paper_pivot']['kind']} {est['paper_pivot']['index']} "
                f"as pivot, giving {est['paper_latency_ms']:.1f} ms; the largest formula value is used"
            )
        used = sum(len(s["devices"]) for s in plan.stages)
        total = plan.topology.num_devices
        if used < total:
            out.print(f"note: the plan leaves {total - used} of {total} GPUs idle")


def selection_lines(out: Console, plan: Plan) -> None:
    """How the planner chose ``plan``: against the search space's smallest
    bound, from beside the space where none of it fits, and refined."""
    sel = plan.data.get("selection")
    if sel and sel.get("lower_bound_ms"):
        # The bound is the space's; a refined plan may lie outside it.
        space_ms = sel.get("refined_from_ms") or sel["simulated_ms"]
        gap = (space_ms / sel["lower_bound_ms"] - 1.0) * 100.0
        verdict = (
            "no plan of the search space simulates faster (every plan whose bound is below it was simulated)"
            if sel.get("optimal")
            else "the fastest found: the search stopped at its budget before ruling out every other plan"
        )
        if space_ms < sel["lower_bound_ms"]:
            # A baseline's plan from outside the search space (Megatron's split degrees).
            out.print(
                f"chosen by simulation: the {sel.get('source')} candidate, outside the search space and "
                f"{-gap:.1f}% below the space's smallest bound ({sel['lower_bound_ms']:.1f} ms)"
            )
        else:
            out.print(
                f"chosen by simulation: {verdict}; the space's smallest bound is {sel['lower_bound_ms']:.1f} ms "
                f"({gap:.1f}% below the space's plan); layout from {sel.get('source', 'search')}"
            )
    elif sel and sel.get("space_fits") is False:
        out.print(
            f"chosen by simulation: the {sel.get('source')} candidate; no plan of the search space fits "
            "(docs/formats.md, selection)"
        )
    if sel and sel.get("refined_from_ms"):
        out.print(
            f"refined from {sel['refined_from_ms']:.1f} ms, the search space's best found "
            f"({(1.0 - plan.iteration_ms / sel['refined_from_ms']) * 100.0:.1f}% faster)"
        )


def memory_table(terms: list[dict], stages: list[dict]) -> Table:
    """Each stage's peak memory per GPU in its terms (the estimate's
    ``memory``), against what its GPU's allocator may hand out."""
    t = Table(title="peak memory per GPU, GiB", show_edge=False, pad_edge=False, title_justify="left")
    for col in ("stage", "model state", "in flight", "working", "other", "peak", "x reserve", "GPU"):
        t.add_column(col, justify="right")
    for i, (m, s) in enumerate(zip(terms, stages)):
        reserve = m["allocator_reserved_factor"]
        t.add_row(
            str(i),
            f"{m['model_state_bytes'] / GIB:.2f}",
            f"{m['micro_batches_in_flight']} x {m['per_micro_batch_bytes'] / GIB:.3f}",
            f"{m['working_bytes'] / GIB:.3f}",
            f"{m['other_bytes'] / GIB:.3f}",
            f"{m['peak_bytes'] / GIB:.2f}",
            "-" if reserve == 1 else f"{m['peak_bytes'] * reserve / GIB:.2f}",
            f"{s['memory_limit_bytes'] * reserve / GIB:.0f}",
        )
    return t


def _short(name: str, width: int = 24) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def calibration_table(calibration) -> None:
    """Per stage of ``dapple calibrate``: measured and predicted compute and
    peak memory, and the factors the profile took."""
    out = console()
    t = Table(show_edge=False, pad_edge=False)
    for col in ("stage", "layers", "compute ms", "predicted ms", "time x", "peak MiB", "predicted MiB",
                "memory x", "memory source"):
        t.add_column(col, justify="left" if col in ("layers", "memory source") else "right")
    for i, s in enumerate(calibration.stages):
        factor = s["memory_factor"]
        t.add_row(
            str(i),
            f"{s['layer_start']}-{s['layer_end'] - 1}",
            f"{s['measured_compute_ms']:.2f}",
            f"{s['predicted_compute_ms']:.2f}",
            f"{s['time_factor']:.3f}",
            f"{s['measured_peak_bytes'] / MIB:.1f}",
            f"{s['predicted_peak_bytes'] / MIB:.1f}",
            "-" if factor is None else f"{factor:.3f}",
            s["memory_source"],
        )
    out.print(t)
