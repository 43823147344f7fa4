"""A plan's schedule, exported as torch's CSV (``dapple export --to
torch-csv``), runs on torch's own pipeline runtime
(``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``, gloo
on CPU) and trains as dapple's runtime trains the plan: the same losses,
the same parameters after a step. What torch needs besides the CSV
(docs/schedules.md): each rank's stage module, the micro-batch count and
the loss function."""

from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from dapple.planner.runtime.launcher import run_plan  # noqa: E402
from dapple.planner.runtime.training import build_layers, prefixed_state  # noqa: E402
from test_runtime import FAST, deep_layers, layout_plan, make_batches, max_diff, mse, tiny_layers  # noqa: E402

LR = 0.1
SEED = 0  # dapple's default model seed, as build_layers takes it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_rank(rank, world, port, csv_path, layer_ranges, micro_batches, batch, out_dir):
    """One rank of torch's runtime: its stage of the model, one step of the
    CSV's schedule, then SGD; its parameters and (last rank) losses saved."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import _PipelineStageBase

    # torch 2.9 warms up each pair of neighbouring stages by sending an
    # int64 tensor into a float32 receive (_get_init_p2p_neighbors_ops):
    # NCCL lets it pass, gloo aborts on the size. The warm-up only opens
    # NCCL's communicators, so on gloo it is left out.
    _PipelineStageBase._get_init_p2p_neighbors_ops = lambda self: []
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layers = build_layers(tiny_layers, SEED)
        start, end = layer_ranges[rank]
        module = nn.Sequential(*layers[start:end])
        # The stage's micro-batch shapes given, not inferred at run time.
        x, y = batch
        example = nn.Sequential(*layers[:start])(x[: len(x) // micro_batches])
        stage = PipelineStage(module, rank, world, torch.device("cpu"),
                              input_args=example.detach(), output_args=module(example).detach())
        # torch 2.9's runtime divides the gradients by M after a whole
        # backward (B) but not after a W: the loss is divided by M here and
        # the runtime's own scaling turned off, right for both.
        schedule = _PipelineScheduleRuntime([stage], micro_batches, loss_fn=lambda out, y: mse(out, y) / micro_batches,
                                            scale_grads=False)
        schedule._load_csv(csv_path)
        losses: list = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        torch.save({"params": prefixed_state(layers[start:end], start), "losses": [float(v) for v in losses]},
                   f"{out_dir}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["zb-h1", "early-backward-1f1b"])
def test_an_exported_csv_runs_on_torchs_runtime_as_dapple_runs_the_plan(kind, tmp_path):
    stages = [(0, 1, [0]), (1, 2, [1]), (2, 4, [2]), (4, 5, [3])]
    plan = layout_plan(2, stages, kind=kind)
    csv_path = tmp_path / "schedule.csv"
    csv_path.write_text(plan.pipeline_order().to_csv())
    batches = make_batches(1)
    ours = run_plan(plan, tiny_layers, mse, batches, 1, LR, **FAST)
    mp.start_processes(_torch_rank, nprocs=len(stages), start_method="fork",
                       args=(len(stages), _free_port(), str(csv_path), [(a, b) for a, b, _ in stages],
                             plan.micro_batches, batches[0], str(tmp_path)))
    saved = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(len(stages))]
    theirs = {k: v for s in saved for k, v in s["params"].items()}
    # torch's losses are per micro-batch of equal size, each divided by M:
    # their sum is the step's mean.
    losses = saved[-1]["losses"]
    assert len(losses) == plan.micro_batches
    assert sum(losses) == pytest.approx(ours.losses[0], abs=1e-6)
    assert max_diff(theirs, ours.params) < 1e-6
    # The step moved the weights: the comparison is of gradients, not of the start.
    start = prefixed_state(build_layers(tiny_layers, SEED), 0)
    assert max_diff(theirs, start) > 1e-4


def _chunked_torch_rank(rank, world, port, csv_path, chunks, stage_ranks, micro_batches, batch, out_dir):
    """One rank of torch's runtime holding several stages (``chunks``:
    (stage, layer_start, layer_end) of each): one step of the CSV's order,
    then SGD; its parameters and (last stage's rank) losses saved."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import _PipelineStageBase

    _PipelineStageBase._get_init_p2p_neighbors_ops = lambda self: []  # as in _torch_rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layers = build_layers(deep_layers, SEED)
        x, y = batch
        stages, mine = [], [(s, a, b) for s, (a, b) in enumerate(chunks) if stage_ranks[s] == rank]
        for s, a, b in mine:
            module = nn.Sequential(*layers[a:b])
            example = nn.Sequential(*layers[:a])(x[: len(x) // micro_batches])
            stages.append(PipelineStage(module, s, len(chunks), torch.device("cpu"),
                                        input_args=example.detach(), output_args=module(example).detach()))
        schedule = _PipelineScheduleRuntime(stages, micro_batches, loss_fn=lambda out, y: mse(out, y) / micro_batches,
                                            scale_grads=False)
        # The order's own stage-to-rank map (torch assumes looped stages).
        mapping = dict(enumerate(stage_ranks))
        schedule.stage_index_to_group_rank = mapping
        for stage in stages:
            stage.stage_index_to_group_rank = mapping
        schedule._load_csv(csv_path)
        losses: list = []
        first, last = stage_ranks[0] == rank, stage_ranks[-1] == rank
        schedule.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
        params = {}
        for s, a, b in mine:
            with torch.no_grad():
                for p in nn.Sequential(*layers[a:b]).parameters():
                    if p.grad is not None:
                        p -= LR * p.grad
            params.update(prefixed_state(layers[a:b], a))
        torch.save({"params": params, "losses": [float(v) for v in losses]}, f"{out_dir}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-v"])
def test_a_chunked_plans_csv_runs_on_torchs_runtime_as_dapple_runs_the_plan(kind, tmp_path):
    # Four ranks of two chunks each, cut by dapple from a 4-stage plan of a
    # 9-layer model: torch's runtime on the exported CSV ends the step with
    # the loss and parameters dapple's runtime ends the chunked plan's.
    from dapple import planner
    from test_runtime import deep_profile

    plan = layout_plan(3, [(0, 2, [0]), (2, 4, [1]), (4, 6, [2]), (6, 9, [3])])
    chunked = planner.chunked(plan, deep_profile(), kind, 2)
    chunks = [(s["layer_start"], s["layer_end"]) for s in chunked.stages]
    stage_ranks = chunked.core.stage_ranks
    assert len(chunks) == 8 and chunks[-1][1] == 9 and sorted(set(stage_ranks)) == [0, 1, 2, 3]
    csv_path = tmp_path / "schedule.csv"
    csv_path.write_text(chunked.pipeline_order().to_csv())
    batches = make_batches(1)
    ours = run_plan(chunked, deep_layers, mse, batches, 1, LR, **FAST)
    mp.start_processes(_chunked_torch_rank, nprocs=4, start_method="fork",
                       args=(4, _free_port(), str(csv_path), chunks, stage_ranks, plan.micro_batches, batches[0],
                             str(tmp_path)))
    saved = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=True) for r in range(4)]
    theirs = {k: v for s in saved for k, v in s["params"].items()}
    losses = saved[stage_ranks[-1]]["losses"]
    assert len(losses) == plan.micro_batches
    assert sum(losses) == pytest.approx(ours.losses[0], abs=1e-6)
    assert max_diff(theirs, ours.params) < 1e-6
    start = prefixed_state(build_layers(deep_layers, SEED), 0)
    assert max_diff(theirs, start) > 1e-4
