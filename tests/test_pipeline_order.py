"""The core's pipeline orders against torch.distributed.pipelining's own
schedule classes, action by action, and in torch's CSV notation."""

import pickle

import pytest

from dapple.planner._core import PipelineOrder, StageAction

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def torch_order(cls, ranks: int, micro_batches: int, chunks: int) -> list[list[str]]:
    """The pipeline order torch's schedule class builds in its constructor,
    made without stage modules or a process group (only the attributes its
    order depends on), its empty slots left out."""
    sch = object.__new__(cls)
    sch.pp_group_size = ranks
    sch._n_microbatches = micro_batches
    sch.n_local_stages = chunks
    sch.num_stages = sch._num_stages = ranks * chunks
    sch.number_of_rounds = max(1, micro_batches // ranks)
    sch.microbatches_per_round = micro_batches // sch.number_of_rounds
    sch.pipeline_order = {r: sch._calculate_single_rank_operations(r) for r in range(ranks)}
    if cls is schedules.ScheduleInterleavedZeroBubble:
        sch.pipeline_order = sch._add_bubbles_to_actions(ranks * chunks)
    return [[str(a) for a in sch.pipeline_order[r] if a is not None] for r in range(ranks)]


def ours(order: PipelineOrder) -> list[list[str]]:
    return [[str(a) for a in row] for row in order.rank_actions]


# (ranks, micro-batches) torch accepts: micro-batches split into equal rounds.
SHAPES = [(2, 2), (2, 4), (3, 3), (3, 6), (4, 4), (4, 6), (4, 8), (4, 12), (8, 8), (8, 16)]


@pytest.mark.parametrize("ranks,micro_batches", SHAPES)
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_interleaved_1f1b_equals_torchs(ranks, micro_batches, chunks):
    order = PipelineOrder.interleaved_1f1b(ranks, micro_batches, chunks)
    assert ours(order) == torch_order(schedules.ScheduleInterleaved1F1B, ranks, micro_batches, chunks)


@pytest.mark.parametrize("ranks,micro_batches", SHAPES)
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_interleaved_zero_bubble_equals_torchs(ranks, micro_batches, chunks):
    order = PipelineOrder.interleaved_zero_bubble(ranks, micro_batches, chunks)
    assert ours(order) == torch_order(schedules.ScheduleInterleavedZeroBubble, ranks, micro_batches, chunks)


@pytest.mark.parametrize("ranks,micro_batches", SHAPES + [(4, 2), (4, 7), (3, 1)])
def test_zbv_equals_torchs(ranks, micro_batches):
    order = PipelineOrder.zbv(ranks, micro_batches)
    assert ours(order) == torch_order(schedules.ScheduleZBVZeroBubble, ranks, micro_batches, 2)
    assert order.stage_ranks == [torch_rank for _, torch_rank in sorted(
        torch.distributed.pipelining._utils.generate_stage_to_rank_mapping(ranks, 2 * ranks, style="v").items())]


@pytest.mark.parametrize("ranks,micro_batches", [(1, 2), (2, 4), (2, 5), (3, 6), (3, 9), (4, 8), (4, 11), (8, 16),
                                                 (8, 24)])
def test_dualpipev_equals_torchs(ranks, micro_batches):
    order = PipelineOrder.dualpipev(ranks, micro_batches)
    sch = object.__new__(schedules.ScheduleDualPipeV)
    sch.pp_group_size, sch._n_microbatches = ranks, micro_batches
    theirs = [[str(a) for a in sch._calculate_single_rank_operations(r) if a is not None] for r in range(ranks)]
    assert order.rank_cells() == theirs
    assert order.stage_ranks == PipelineOrder.zbv(ranks, micro_batches).stage_ranks  # the same V


def test_every_csv_cell_parses_with_torch_and_loads_back():
    for order in (PipelineOrder.interleaved_1f1b(4, 8, 2), PipelineOrder.zbv(4, 8), PipelineOrder.dualpipev(4, 8),
                  PipelineOrder.zb_h2(4, 8)):
        text = order.to_csv()
        for row in text.splitlines():
            for cell in row.split(","):
                assert str(schedules._Action.from_str(cell)) == cell
        assert PipelineOrder.from_csv(text, order.micro_batches) == order


def test_a_micro_batch_count_torch_cannot_round_is_refused_in_one_line():
    with pytest.raises(ValueError, match="equal rounds"):
        PipelineOrder.interleaved_1f1b(4, 9, 2)


def test_stage_actions_are_typed_and_pickle():
    a = StageAction.parse("3I12")
    assert (a.stage, a.computation, a.micro_batch) == (3, "I", 12)
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(ValueError):
        StageAction.parse("3X12")
