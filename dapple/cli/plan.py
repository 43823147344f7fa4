"""``dapple plan``: search the best plan for a profile on a topology."""

from __future__ import annotations

import rich_click as click

from dapple import planner
from dapple.planner.files import check_writable, path_text
from dapple.planner.limits import DEFAULT_MAX_SEARCH_GIB, DEFAULT_MAX_SEARCH_MACHINES, DEFAULT_MAX_SEARCH_STEPS, MAX_SEARCH_GIB

from .options import (
    FILE_PATH,
    check_chunks_go_with,
    chunked_kinds,
    count_option_type,
    global_batch_size_or_default,
    json_option,
    max_passes_option,
    profile_option,
    reports_errors,
    topology_option,
    warmup_policy_option,
)
from .progress import quiet_option, working
from .render import plan_table


# plan --help in panels, each a screen at most (issue 68); a test lists them.
PANELS = {
    "Inputs": ["--profile", "--topology", "--global-batch-size", "--for"],
    "Search space": ["--search-space", "--stage-shapes", "--min-micro-batch-size", "--refine"],
    "Memory": ["--max-shard-level", "--max-context-parallel"],
    "Schedule": ["--schedule", "--chunks", "--warmup-policy"],
    "Overlap (--for sets its runtime's)": ["--overlap-grad-reduce", "--overlap-param-gather"],
    "Hints (Whale's; docs/hints.md)": ["--stages", "--micro-batches", "--pin-cut", "--replicate", "--split", "--from-layout"],
    "Work limits (exit 9 past them)": ["--max-search-gib", "--max-search-steps", "--max-search-machines", "--max-passes"],
    "Output": ["--out", "--json", "--quiet", "--help"],
}


def panels(f):
    for name in reversed(PANELS):
        f = click.option_panel(name, options=PANELS[name])(f)
    return f


@click.command("plan")
@panels
@profile_option
@topology_option
@click.option(
    "--global-batch-size",
    type=count_option_type(),
    default=None,
    help="Samples per iteration. Default: the profile's largest measured batch size times the number of GPUs.",
)
@warmup_policy_option
@click.option("--min-micro-batch-size", type=count_option_type(), default=None,
              help="Smallest per-GPU slice of a micro-batch. Default: the profile's smallest measured batch size.")
@click.option("--search-space", type=click.Choice(planner.SEARCH_SPACES), default=planner.SEARCH_SPACES[0], show_default=True,
              help="full: every replication and placement; machine-aligned: a divisor of a machine, whole machines, "
              "or an even share of every machine in use; auto: full up to 16 GPUs.")
@click.option("--stage-shapes", type=click.Choice(planner.STAGE_SHAPES), default=planner.STAGE_SHAPES[0],
              show_default=True,
              help="all: a stage may split its layers (tensor parallelism), shard its state (ZeRO), spread its "
                   "experts and re-compute its forward; auto: all where the profile's layers say how, else plain; "
                   "plain: replicas only (DAPPLE's space).")
@click.option("--max-shard-level", type=click.IntRange(0, 3), default=1, show_default=True,
              help="The highest sharding level a stage may take: 0 none, 1 the optimizer state (ZeRO-1), 2 and the "
                   "gradients (ZeRO-2), 3 and the weights (ZeRO-3, FSDP); 2 and 3 make large searches slower "
                   "(docs/cost-model.md, \"Sharding\").")
@click.option("--max-context-parallel", type=count_option_type(), default=None,
              help="The most GPUs a stage may cut each sample's sequence over (context parallelism, where the "
                   "profile says how, as `dapple profile transformer`'s do); 1: none. Default 16: higher make "
                   "searches on thousands of GPUs slower (docs/cost-model.md, \"Context parallelism\").")
@click.option("--max-search-gib", type=click.FloatRange(min=0, min_open=True, max=MAX_SEARCH_GIB), default=None,
              help=f"Most memory the search's tables may take, in GiB (default {DEFAULT_MAX_SEARCH_GIB:g}); past it "
                   "the search stops with exit 9.")
@click.option("--max-search-steps", type=count_option_type(), default=None,
              help=f"Most steps (a stage costed, or put in front of a partial plan) the search takes at one "
                   f"micro-batch size (default {DEFAULT_MAX_SEARCH_STEPS:,}, a few seconds); past it, that size's "
                   "other layouts are left to the bounded walk and the plan is the best found (said on stderr); "
                   "exit 9 where none was.")
@click.option("--max-search-machines", type=count_option_type(), default=None,
              help=f"Most machines a search takes (default {DEFAULT_MAX_SEARCH_MACHINES:,}: 16384x1 plans in 15 s "
                   "on 2 cores, 30000x1 in a minute); a larger topology is refused at once with exit 9.")
@click.option("--refine/--no-refine", default=True, show_default=True,
              help="Improve the chosen plan by local moves (a stage boundary by a layer; GPUs swapped, handed "
                   "over or left idle), each kept where it simulates faster, up to 64 GPUs; --no-refine: the "
                   "search space's own plan.")
@click.option("--schedule", type=click.Choice(("auto", *planner.SCHEDULE_KINDS)), default="auto", show_default=True,
              help="auto: the fastest of early backward, ZB-H1, ZB-H2 and the chunked kinds on the layouts the "
                   "search ranked (no chunked ones under layout hints), never slower than any of them named alone; "
                   "not gpipe (never faster than early backward) or the asynchronous kinds. A synchronous kind: "
                   f"that kind alone (chunked, {chunked_kinds()}: the layers cut into chunks a rank; "
                   "docs/schedules.md). An asynchronous kind: the uniform pipeline with the fastest steady state "
                   "(docs/xpipe.md).")
@click.option("--chunks", type=count_option_type(), default=None,
              help="Chunks (stages) a rank for a chunked --schedule. Default: the fastest count up to 8 "
                   "(a V-shaped kind, zb-v or dualpipev: 2).")
@click.option("--stages", type=count_option_type(), default=None,
              help="Hint: exactly this many pipeline stages (Whale's num_task_graph; docs/hints.md).")
@click.option("--micro-batches", type=count_option_type(), default=None,
              help="Hint: exactly this many micro-batches per iteration (Whale's num_micro_batch).")
@click.option("--pin-cut", "pin_cuts", multiple=True, metavar="LAYER",
              help="Hint: a stage starts at this layer (index or layer name). Repeatable.")
@click.option("--replicate", multiple=True, metavar="START..END[:N]",
              help="Hint: layers START..END (end excluded) form one unsplit stage, of N replicas where given "
                   "(Whale's replicate). Repeatable.")
@click.option("--split", multiple=True, metavar="START..END:T",
              help="Hint: layers START..END form one stage split T ways (Whale's split). Repeatable.")
@click.option("--from-layout", default=None, metavar="LAYOUT",
              help="Hint: the stages of a Megatron-LM --pipeline-model-parallel-layout string, e.g. 'Et*15|t*17L', "
                   "so that the layout run today is costed (docs/export.md).")
@click.option("--overlap-grad-reduce", type=click.Choice(planner.GRAD_REDUCE_OVERLAPS),
              default=planner.GRAD_REDUCE_OVERLAPS[0], show_default=True,
              help="Which stages reduce their gradients behind their backward: data-parallel: a plan of one plain "
                   "stage only (DAPPLE's); every-stage: each stage, behind its last backward (Megatron-LM's "
                   "--overlap-grad-reduce, FSDP); none (docs/cost-model.md, \"Overlap\").")
@click.option("--overlap-param-gather", is_flag=True,
              help="ZeRO-1 stages gather their updated weights behind the next forward (Megatron-LM's "
                   "--overlap-param-gather).")
@click.option("--for", "target", type=click.Choice(planner.TARGETS), default=None,
              help="Plan for this runtime: the fastest plan that `dapple export --to` it writes without "
                   "--approximate (torch: torch's schedule CSV), with the free plan's time beside it "
                   "(docs/export.md).")
@click.option("--out", "out_path", type=FILE_PATH, default=None, help="Write the plan JSON here.")
@json_option
@quiet_option
@max_passes_option
@reports_errors
def plan_command(
    profile_path,
    topology,
    global_batch_size,
    warmup_policy,
    min_micro_batch_size,
    search_space,
    stage_shapes,
    max_shard_level,
    max_context_parallel,
    max_search_gib,
    max_search_steps,
    max_search_machines,
    refine,
    schedule,
    chunks,
    stages,
    micro_batches,
    pin_cuts,
    replicate,
    split,
    from_layout,
    overlap_grad_reduce,
    overlap_param_gather,
    target,
    out_path,
    as_json,
    quiet,
):
    """Find the plan with the shortest simulated iteration time."""
    check_chunks_go_with(chunks, schedule)
    if out_path is not None:
        check_writable(out_path)  # before the search, not after it
    profile = planner.Profile.load(profile_path)
    topo = planner.Topology.resolve(topology)
    global_batch_size, batch_note = global_batch_size_or_default(global_batch_size, profile, topo)
    options = dict(
        warmup_policy=warmup_policy,
        min_micro_batch_size=min_micro_batch_size,
        search_space=search_space,
        stage_shapes=stage_shapes,
        max_shard_level=max_shard_level,
        max_context_parallel=max_context_parallel,
        schedule=schedule,
        chunks=chunks,
        max_search_gib=max_search_gib,
        max_search_steps=max_search_steps,
        max_search_machines=max_search_machines,
        refine=refine,
        stages=stages,
        micro_batches=micro_batches,
        pin_cuts=pin_cuts,
        replicate=replicate,
        split=split,
        from_layout=from_layout,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
    )
    for_target = None
    with working(f"planning {profile.model} on {topo.name}" + (f" for {target}" if target else ""), quiet):
        if target is None:
            result = planner.plan(profile, topo, global_batch_size, **options)
        else:
            for_target = planner.plan_for(target, profile, topo, global_batch_size, **options)
            result = for_target.plan
    if out_path is not None:
        result.save(out_path)
    if as_json:
        click.echo(result.text, nl=False)
    else:
        plan_table(result, profile)
    if out_path is not None:
        click.echo(f"plan written to {path_text(out_path)}", err=True)
    if batch_note:
        click.echo(batch_note, err=True)
    if for_target is not None:
        say_target_cost(for_target)
    stats = result.search_stats
    if stats is not None:
        click.echo(
            f"searched micro-batch sizes {stats.micro_batch_sizes}: {stats.states} states, {stats.stages_costed} stages costed",
            err=True,
        )
        if stats.abandoned_micro_batch_sizes:
            limit = DEFAULT_MAX_SEARCH_STEPS if max_search_steps is None else max_search_steps
            optimal = (result.data.get("selection") or {}).get("optimal") is True
            click.echo(
                f"note: at micro-batch sizes {stats.abandoned_micro_batch_sizes} the search stopped at its limit of "
                f"{limit} steps per size (--max-search-steps); their other layouts were walked within the walk's "
                f"budget, so the plan is {'still' if optimal else 'not'} proven optimal",
                err=True,
            )


def say_target_cost(made: planner.ForTarget) -> None:
    """What planning for the runtime cost: its plan's time against the free
    plan's, and why the free plan was not taken where it was not."""
    if made.free_ms is None:
        return
    line = (f"for {made.target}: {made.plan.iteration_ms:.1f} ms, the free plan {made.free_ms:.1f} ms "
            f"({made.cost:.3f}x)")
    free_refused = [why for what, why in made.refused if what == "the free plan"]
    if free_refused:
        line += f"; the free plan was refused: {free_refused[0]}"
    click.echo(line, err=True)
