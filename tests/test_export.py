"""``dapple export``: plans in the form other runtimes take."""

import pytest

from dapple import planner
from conftest import PROFILES, write_hand_plan

BERT = PROFILES / "bert-48-pbs-2.json"


def plan_file(tmp_path, dapple, topology, *extra):
    """BERT-48's plan of one stage a rank (early backward, unless ``extra`` names a kind)."""
    out = tmp_path / "plan.json"
    kind = () if "--schedule" in extra else ("--schedule", "early-backward-1f1b")
    r = dapple("plan", "--profile", BERT, "--topology", topology, "--global-batch-size", 64, "--out", out, *kind,
               *extra)
    assert r.returncode == 0, r.stderr
    return out


def test_torch_csv_is_the_plans_own_schedule_one_row_per_stage(tmp_path, dapple):
    path = plan_file(tmp_path, dapple, "A")  # 8:8, even replicas
    out = tmp_path / "schedule.csv"
    r = dapple("export", "--plan", path, "--to", "torch-csv", "--out", out)
    assert r.returncode == 0, r.stderr
    plan = planner.Plan.load(path)
    rows = [line.split(",") for line in out.read_text().splitlines()]
    # Each row is the stage's list (its warm-up depth K_i), AR and OPT left
    # to the caller, every action prefixed by its stage.
    expected = [[f"{i}{a}" for a in map(str, actions) if a[0] in "FB"] for i, actions in enumerate(plan.core.actions())]
    assert rows == expected
    assert [row.index(f"{i}B0") for i, row in enumerate(rows)] == [s["warmup_micro_batches"] for s in plan.stages]
    assert r.stdout == "" and "2 pipeline ranks" in r.stderr


def test_every_cell_parses_with_torchs_action_notation(tmp_path, dapple):
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    out = tmp_path / "schedule.csv"
    assert dapple("export", "--plan", plan_file(tmp_path, dapple, "A"), "--to", "torch-csv", "--out", out).returncode == 0
    for line in out.read_text().splitlines():
        for cell in line.split(","):
            assert str(schedules._Action.from_str(cell)) == cell


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_a_zero_bubble_plan_exports_its_split_backwards(tmp_path, dapple, kind):
    # BERT-48 on configuration B, one GPU a stage; torch's own checks pass
    # the order (ZB-H2, of no torch class, included) and its dry run of the
    # sends and receives finishes on every rank.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    path = plan_file(tmp_path, dapple, "B", "--schedule", kind)
    plan = planner.Plan.load(path)
    assert plan.core.schedule_kind == kind
    out = tmp_path / "schedule.csv"
    assert dapple("export", "--plan", path, "--to", "torch-csv", "--out", out).returncode == 0
    rows = [line.split(",") for line in out.read_text().splitlines()]
    s = len(plan.stages)
    assert len(rows) == s
    actions = {rank: [schedules._Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    for rank, row in actions.items():
        kinds = [str(a.computation_type) for a in row]
        assert kinds.count("F") == kinds.count("I") == kinds.count("W") == plan.micro_batches
        assert {a.stage_index for a in row} == {rank}
    schedules._validate_schedule(actions, s, s, plan.micro_batches)
    lowered = schedules._add_send_recv(actions, lambda stage: stage, s)
    assert set(schedules._simulate_comms_compute(lowered, lambda stage: stage, s)) == set(range(s))


@pytest.mark.parametrize("kind,chunks", [("interleaved-1f1b", 2), ("zb-v", 2), ("dualpipev", 2)])
def test_a_chunked_plan_exports_its_ranks_order_that_torch_validates(tmp_path, dapple, kind, chunks):
    # A 4-rank plan whose ranks hold two chunks each: one row per rank,
    # each action of the stage (chunk) the order puts there, every cell in
    # torch's notation; torch's own checks pass it and its dry run of the
    # sends and receives finishes on every rank.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    path = plan_file(tmp_path, dapple, "1x4-nvlink", "--stages", 4, "--schedule", kind, "--chunks", chunks)
    plan = planner.Plan.load(path)
    assert plan.core.schedule_kind == kind and plan.core.chunks == chunks and len(plan.stages) == 4 * chunks
    out = tmp_path / "schedule.csv"
    r = dapple("export", "--plan", path, "--to", "torch-csv", "--out", out)
    assert r.returncode == 0, r.stderr
    rows = [line.split(",") for line in out.read_text().splitlines()]
    actions = {rank: [schedules._Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    assert [str(a) for row in actions.values() for a in row] == [cell for row in rows for cell in row]
    stage_ranks = plan.core.stage_ranks
    for rank, row in actions.items():
        # DualPipeV's overlapped forward and backward: one cell of two actions.
        flat = [sub for a in row for sub in (a.sub_actions or (a,))]
        assert {a.stage_index for a in flat} == {s for s, r in enumerate(stage_ranks) if r == rank}
    m = plan.micro_batches
    schedules._validate_schedule(actions, 4, 4 * chunks, m)
    lowered = schedules._add_send_recv(actions, lambda stage: stage_ranks[stage], 4 * chunks)
    assert set(schedules._simulate_comms_compute(lowered, lambda stage: stage_ranks[stage], 4 * chunks)) == {0, 1, 2, 3}
    # The other targets refuse it in one line (exit 4); dapple's runtime too.
    for target in ("torchtitan", "deepspeed"):
        r = dapple("export", "--plan", path, "--to", target, "--out", tmp_path / f"x.{target}")
        assert r.returncode == 4 and r.stderr.count("\n") == 1 and "several stages" in r.stderr


@pytest.mark.parametrize("topology,extra,why", [
    ("B", ("--schedule", "early-backward-1f1b"), "stages replicated unevenly (1, 1, 2, 2, 2, 2, 2, 2, 2 by stage)"),
    ("A", ("--schedule", "xpipe"), "schedule xpipe is asynchronous"),
])
def test_what_torch_cannot_run_is_refused_in_one_line_and_nothing_written(tmp_path, dapple, topology, extra, why):
    path = plan_file(tmp_path, dapple, topology, *extra)
    out = tmp_path / "schedule.csv"
    r = dapple("export", "--plan", path, "--to", "torch-csv", "--out", out)
    assert r.returncode == 4, r.stderr
    assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


# ---- torchtitan, Megatron-LM, DeepSpeed ---------------------------------------
#
# Plans written by hand over a 4-block Llama (profile layers embedding,
# block_0 .. block_3, lm_head: 6), so every expected value below is worked
# out from the plan, not read back from the exporter.

import json
import subprocess
import tomllib

from dapple.planner import megatron_layout
from dapple.planner.errors import InvalidInputError
from conftest import assert_one_line_error

SMALL_LLAMA = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 256, "intermediate_size": 688,
               "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 1000}


@pytest.fixture
def llama(tmp_path, dapple):
    """The profile of a 4-block Llama: 6 layers."""
    config = tmp_path / "small-llama.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    profile = tmp_path / "small-llama-profile.json"
    r = dapple("profile", "transformer", "--config", config, "--gpu", "a100", "--seq-len", 128, "--out", profile)
    assert r.returncode == 0, r.stderr
    return profile


def hand_plan(tmp_path, profile, stages, *, micro_batch_size, micro_batches, warmups, kind=None, name="plan.json"):
    """A plan of ``stages``, each ``(layer_start, layer_end, devices, fields)``,
    on one 8-GPU A100 machine, with the micro-batching, schedule kind and
    warm-up depths given."""
    data = planner.layout_plan(str(profile), "1x8-a100-80gb", micro_batch_size * micro_batches,
                               [(s, e, d) for s, e, d, _ in stages]).data
    data.update(micro_batch_size=micro_batch_size, micro_batches=micro_batches)
    data["inputs"]["profile_path"] = str(profile)
    data["schedule"] = {"kind": kind or data["schedule"]["kind"], "warmup_policy": "auto"}
    for stage, (_, _, _, fields), k in zip(data["stages"], stages, warmups):
        stage.update(fields, warmup_micro_batches=k)
    return write_hand_plan(data, tmp_path / name)


SPLIT_ZERO = {"tensor_parallel": 2, "shard_level": 1}


def shaped(tmp_path, llama, **kw):
    """Two stages of 4 GPUs, each split 2 ways on 2 replicas with ZeRO-1; 4
    micro-batches of 8, K_i = 2, 1 (torch's and Megatron's 1F1B)."""
    stages = [(0, 3, [0, 1, 2, 3], SPLIT_ZERO), (3, 6, [4, 5, 6, 7], SPLIT_ZERO)]
    return hand_plan(tmp_path, llama, stages, micro_batch_size=8, micro_batches=4, warmups=[2, 1], **kw)


def test_torchtitan_gets_the_plans_degrees_batches_modules_and_its_own_order(tmp_path, dapple, llama):
    out = tmp_path / "job.toml"
    r = dapple("export", "--plan", shaped(tmp_path, llama), "--to", "torchtitan", "--out", out)
    assert r.returncode == 0, r.stderr
    csv = tmp_path / "job.schedule.csv"
    assert tomllib.loads(out.read_text()) == {
        # 32 samples a step over 2 data-parallel ranks; 8 a micro-batch over 2 replicas.
        "training": {"local_batch_size": 16, "global_batch_size": 32},
        "parallelism": {
            "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 2,
            "fsdp_reshard_after_forward": "never", "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2,
            "pipeline_parallel_schedule": "PipelineScheduleSingle", "pipeline_parallel_schedule_csv": str(csv),
            "pipeline_parallel_microbatch_size": 4,
            "module_fqns_per_model_part": [["tok_embeddings", "layers.0", "layers.1"],
                                           ["layers.2", "layers.3", "norm", "output"]],
        },
        "activation_checkpoint": {"mode": "none"},
    }
    # K_i = 2, 1 forwards before the first backward, then one of each.
    assert csv.read_text().splitlines() == ["0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3", "1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3"]
    assert r.stdout == ""
    assert "2 stages x tensor parallel 2 x data parallel 2 = 8 GPUs" in r.stderr and len(r.stderr.splitlines()) == 1


def test_a_single_stage_is_torchtitans_data_parallelism_with_gradient_accumulation(tmp_path, dapple, llama):
    # 8 plain replicas, 4 micro-batches of 16: DDP, 2 samples a replica, accumulated 4 times.
    plan = hand_plan(tmp_path, llama, [(0, 6, list(range(8)), {})], micro_batch_size=16, micro_batches=4, warmups=[1])
    out = tmp_path / "dp.toml"
    assert dapple("export", "--plan", plan, "--to", "torchtitan", "--out", out).returncode == 0
    assert tomllib.loads(out.read_text()) == {
        "training": {"local_batch_size": 2, "global_batch_size": 64},
        "parallelism": {"data_parallel_replicate_degree": 8, "data_parallel_shard_degree": 1,
                        "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1},
        "activation_checkpoint": {"mode": "none"},
    }
    assert not (tmp_path / "dp.schedule.csv").exists()


def test_torchtitans_config_manager_reads_the_toml(tmp_path, dapple, llama):
    # torchtitan 0.2.0 imports on the CPU with torch 2.9 (with tyro); its
    # later 0.2 releases need a newer torch, 0.3 reads no TOML.
    manager = pytest.importorskip("torchtitan.config.manager")
    out = tmp_path / "job.toml"
    assert dapple("export", "--plan", shaped(tmp_path, llama), "--to", "torchtitan", "--out", out).returncode == 0
    config = manager.ConfigManager().parse_args(["--job.config_file", str(out)])
    p = config.parallelism
    assert (p.pipeline_parallel_degree, p.tensor_parallel_degree, p.data_parallel_shard_degree,
            p.data_parallel_replicate_degree) == (2, 2, 2, 1)
    assert p.module_fqns_per_model_part[1] == ["layers.2", "layers.3", "norm", "output"]
    assert p.pipeline_parallel_schedule_csv == str(tmp_path / "job.schedule.csv")
    # torchtitan's micro-batch count (build_pipeline_schedule): local batch over micro-batch size.
    assert config.training.local_batch_size // p.pipeline_parallel_microbatch_size == 4
    assert config.activation_checkpoint.mode == "none"


def test_torch_lowers_and_dry_runs_the_schedule_csv(tmp_path, dapple, llama):
    # What torchtitan's _PipelineScheduleRuntime does with the CSV, in
    # torch's own functions: validate, add the sends and receives, dry-run.
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    out = tmp_path / "job.toml"
    assert dapple("export", "--plan", shaped(tmp_path, llama), "--to", "torchtitan", "--out", out).returncode == 0
    rows = [line.split(",") for line in (tmp_path / "job.schedule.csv").read_text().splitlines()]
    actions = {rank: [schedules._Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    schedules._validate_schedule(actions, 2, 2, 4)
    lowered = schedules._add_send_recv(actions, lambda stage: stage, 2)
    assert set(schedules._simulate_comms_compute(lowered, lambda stage: stage, 2)) == {0, 1}


def gpt_profile(tmp_path, n_blocks=4):
    """A profile with the layer names `dapple profile model` gives dapple's GPT."""
    names = ["embedding", *(f"block{i}" for i in range(n_blocks)), "lm_head"]
    layers = [{"name": n, **({"kind": "block"} if n.startswith("block") else {}), "param_bytes": 1000,
               "measurements": [{"batch_size": 1, "fwd_ms": 1.0, "bwd_ms": 2.0, "activation_bytes": 1000}]}
              for n in names]
    path = tmp_path / "gpt-profile.json"
    planner.Profile.from_dict({"model": "gpt", "layers": layers}).save(path)
    return path


def test_the_dapple_gpt_map_names_modules_of_dapples_gpt(tmp_path, dapple):
    models = pytest.importorskip("dapple.planner.runtime.models")
    profile = gpt_profile(tmp_path)
    plan = hand_plan(tmp_path, profile, [(0, 2, [0], {}), (2, 6, [1], {})], micro_batch_size=1, micro_batches=2,
                     warmups=[2, 1])
    out = tmp_path / "gpt.toml"
    r = dapple("export", "--plan", plan, "--to", "torchtitan", "--module-map", "dapple-gpt", "--out", out)
    assert r.returncode == 0, r.stderr
    parts = tomllib.loads(out.read_text())["parallelism"]["module_fqns_per_model_part"]
    assert parts == [["embedding", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "head"]]
    modules = dict(models.gpt(n_layers=4).model.named_modules())
    assert all(name in modules for part in parts for name in part)


def test_the_torchtitan_llama_map_names_modules_of_torchtitans_llama(tmp_path, dapple, llama):
    # Importing torchtitan's model needs its training dependencies too
    # (torchdata, datasets, tensorboard).
    model = pytest.importorskip("torchtitan.models.llama3.model.model")
    args = pytest.importorskip("torchtitan.models.llama3.model.args")
    import torch

    out = tmp_path / "job.toml"
    assert dapple("export", "--plan", shaped(tmp_path, llama), "--to", "torchtitan", "--out", out).returncode == 0
    parts = tomllib.loads(out.read_text())["parallelism"]["module_fqns_per_model_part"]
    with torch.device("meta"):
        llama_model = model.Transformer(args.TransformerModelArgs(dim=64, n_layers=4, n_heads=8, vocab_size=1000))
    modules = dict(llama_model.named_modules())
    assert all(name in modules for part in parts for name in part)


def test_a_module_map_file(tmp_path, dapple, llama):
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps({"about": "renamed", "modules": {"embedding": ["emb"], "block_{i}": ["h.{i}"],
                                                                     "lm_head": ["ln_f", "lm_head"]}}))
    out = tmp_path / "job.toml"
    r = dapple("export", "--plan", shaped(tmp_path, llama), "--to", "torchtitan", "--module-map", map_file,
               "--out", out)
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(out.read_text())["parallelism"]["module_fqns_per_model_part"] == [
        ["emb", "h.0", "h.1"], ["h.2", "h.3", "ln_f", "lm_head"]]
    map_file.write_text(json.dumps({"modules": {"embedding": "emb"}}))
    r = dapple("export", "--plan", shaped(tmp_path, llama), "--to", "torchtitan", "--module-map", map_file,
               "--out", out)
    assert_one_line_error(r, 3, "field modules.embedding", "'emb'")


def test_a_layer_no_map_names_is_refused_by_name(tmp_path, dapple):
    out = tmp_path / "job.toml"
    # A pipeline of plain replicas, which torchtitan shards (approximated):
    # the module map still refuses it.
    r = dapple("export", "--plan", plan_file(tmp_path, dapple, "A"), "--to", "torchtitan", "--out", out,
               "--approximate")
    assert_one_line_error(r, 4, "module map torchtitan-llama", "profile layer 'input_ids' matches no key")
    assert not out.exists()


def source_array(path) -> list[str]:
    """The words of the bash array the Megatron file sets, as bash reads them."""
    r = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\n" "${DAPPLE_MEGATRON_ARGS[@]}"', "-", str(path)],
                       capture_output=True, text=True, check=True)
    return r.stdout.splitlines()


def test_megatron_gets_the_layout_degrees_batches_and_distributed_optimizer(tmp_path, dapple, llama):
    out = tmp_path / "megatron.sh"
    r = dapple("export", "--plan", shaped(tmp_path, llama), "--to", "megatron", "--out", out)
    assert r.returncode == 0, r.stderr
    assert source_array(out) == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--pipeline-model-parallel-layout", "Ett|ttL", "--num-layers", "4",
        "--micro-batch-size", "4", "--global-batch-size", "32", "--use-distributed-optimizer",
        "--grad-reduce-in-bf16"]
    assert "launch 8 processes" in out.read_text()


def test_megatron_recomputes_each_stage_as_one_chunk(tmp_path, dapple, llama):
    # Megatron checkpoints a stage's transformer layers in chunks of N and
    # indexes past the stage's last layer unless N divides its count.
    rc = {"tensor_parallel": 2, "recompute": "full"}
    even = hand_plan(tmp_path, llama, [(0, 3, [0, 1], rc), (3, 6, [2, 3], rc)], micro_batch_size=2,
                     micro_batches=4, warmups=[2, 1])
    out = tmp_path / "megatron.sh"
    assert dapple("export", "--plan", even, "--to", "megatron", "--out", out).returncode == 0
    words = source_array(out)
    assert words[words.index("--pipeline-model-parallel-layout") + 1] == "Ett|ttL"
    # Two transformer layers a stage: one checkpoint a stage.
    assert words[-6:] == ["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "2"]
    assert "--use-distributed-optimizer" not in words
    # 1 and 3 layers: no N makes one chunk a stage; the divisor 1 only aloud.
    uneven = hand_plan(tmp_path, llama, [(0, 2, [0, 1], rc), (2, 5, [2, 3], rc), (5, 6, [4, 5], rc)], name="uneven.json",
                       micro_batch_size=2, micro_batches=4, warmups=[3, 2, 1])
    r = dapple("export", "--plan", uneven, "--to", "megatron", "--out", out)
    assert_one_line_error(r, 4, "Megatron-LM cannot express one re-computed checkpoint a stage over unequal "
                          "transformer layers (1, 3, 0 by stage)", "--recompute-num-layers 1")
    r = dapple("export", "--plan", uneven, "--to", "megatron", "--out", out, "--approximate")
    assert r.returncode == 0, r.stderr
    assert source_array(out)[-2:] == ["--recompute-num-layers", "1"]
    assert "approximated: one re-computed checkpoint a stage" in r.stderr


def test_megatron_cores_own_parser_reads_the_layouts_written(tmp_path, dapple, llama):
    layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    out = tmp_path / "megatron.sh"
    assert dapple("export", "--plan", shaped(tmp_path, llama), "--to", "megatron", "--out", out).returncode == 0
    words = source_array(out)
    text = words[words.index("--pipeline-model-parallel-layout") + 1]
    layout = layout_module.PipelineParallelLayerLayout(text, 2)
    layout.validate_layer_layout(num_layers=4, mtp_num_layers=None)
    assert [[t.name for t in stage[0]] for stage in layout.layout] == [
        ["embedding", "decoder", "decoder"], ["decoder", "decoder", "loss"]]


# Megatron's documented examples: its parser's docstring and its --help.
DOCUMENTED_LAYOUTS = [
    ("Et*3|(tt|)*29,m|L", [["E", "t", "t", "t"]] + [["t", "t"]] * 29 + [["m"], ["L"]]),
    ("E|(t|)*3,m|m||L", [["E"], ["t"], ["t"], ["t"], ["m"], ["m"], [], ["L"]]),
]


@pytest.mark.parametrize("text,stages", DOCUMENTED_LAYOUTS)
def test_megatrons_documented_layouts_parse_as_documented(text, stages):
    assert megatron_layout.parse_layout(text) == stages


@pytest.mark.parametrize("text", [t for t, _ in DOCUMENTED_LAYOUTS]
                         + ["Et*20|(t*20|)*3t*20L", "(Ett|)*2,tL", "E,t*2|t|L", "Et*0|t|L", "((t)*2|)*2"])
def test_layouts_parse_as_megatron_core_parses_them(text):
    layout_module = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    letters = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    try:
        theirs = layout_module.PipelineParallelLayerLayout.parse_str_to_list(text)
    except AssertionError:  # how Megatron refuses a character
        with pytest.raises(InvalidInputError):
            megatron_layout.parse_layout(text)
        return
    assert megatron_layout.parse_layout(text) == [[letters[t.name] for t in stage] for stage in theirs]


def test_format_layout_writes_runs_and_repeated_stages_compactly():
    stages = [["E", "t", "t", "t"]] + [["t", "t"]] * 29 + [["t", "L"]]
    assert megatron_layout.format_layout(stages) == "Et*3|(tt|)*29tL"
    assert megatron_layout.format_layout([["E", "t", "t"], ["t", "t", "L"]]) == "Ett|ttL"
    assert megatron_layout.format_layout([["E"], ["t"] * 20, ["t"] * 20, ["t"] * 20, ["L"]]) == "E|(t*20|)*3L"
    # A final run of equal stages keeps its last stage outside the group.
    assert megatron_layout.format_layout([["E", "t"]] + [["t", "t"]] * 5) == "Et|(tt|)*4tt"
    # Written out where that is shorter.
    assert megatron_layout.format_layout([["E", "t"]] + [["t", "t"]] * 3) == "Et|tt|tt|tt"


@pytest.fixture(scope="module")
def llama_7b():
    # 34 layers: embedding, 32 blocks, lm_head.
    return planner.transformer_profile("llama-2-7b", gpu="a100", seq_len=4096)


def test_plan_to_layout_to_stage_ranges_round_trips(llama_7b):
    ranges = [(0, 9), (9, 17), (17, 26), (26, 34)]
    assert megatron_layout.plan_layout(ranges, llama_7b) == "Et*8|t*8|t*9|t*7L"
    assert megatron_layout.stage_ranges("Et*8|t*8|t*9|t*7L", llama_7b) == ranges
    assert megatron_layout.stage_ranges("Et*15|t*17L", llama_7b) == [(0, 16), (16, 34)]
    # Leading zeros change no count, however many (Python's int reads no
    # more than 4,300 digits).
    assert megatron_layout.stage_ranges("Et*" + "0" * 5000 + "32L", llama_7b) == [(0, 34)]
    # The group ends each repeat with its "|": L is a stage of its own.
    assert megatron_layout.stage_ranges("E|(t*8|)*4L", llama_7b) == [
        (0, 1), (1, 9), (9, 17), (17, 25), (25, 33), (33, 34)]


@pytest.mark.parametrize("text,needles", [
    ("Et*8|t*8|t*9|t*6L", ["value 'Et*8|t*8|t*9|t*6L' holds 31 transformer layer (t)", "has 32"]),
    ("Et*16||t*16L", ["stage 1 is empty"]),
    ("Et*32|mL", ["holds 1 multi-token prediction layer (m)", "has 0"]),
    ("tEt*31|L", ["has t where", "layer 0 'embedding' (E)"]),
    ("Et*32|x|L", ["character 'x' is not a layout token"]),
    ("((t)*2|)*2", ["character '(' is not a layout token"]),
    ("Et*99999999999", ["unrolls to more than 1,000,000 characters"]),
    # Counts past the digits Python reads as an integer (4,300).
    ("Et*" + "9" * 5000, ["unrolls to more than 1,000,000 characters"]),
    ("E(t|)*" + "1" * 5000 + "L", ["unrolls to more than 1,000,000 characters"]),
])
def test_a_layout_that_does_not_fit_the_profile_is_one_line_naming_the_field(llama_7b, text, needles):
    with pytest.raises(InvalidInputError) as e:
        megatron_layout.stage_ranges(text, llama_7b, field="--from-layout")
    message = str(e.value)
    assert message.startswith("--from-layout: ") and "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_a_profile_other_than_a_transformer_has_no_layout(tmp_path, dapple):
    out = tmp_path / "megatron.sh"
    r = dapple("export", "--plan", plan_file(tmp_path, dapple, "A"), "--to", "megatron", "--out", out)
    assert_one_line_error(r, 3, "layers before the blocks", "Megatron's layout has one (E: embedding)")
    assert not out.exists()


def test_deepspeed_gets_parts_topology_and_config(tmp_path, dapple, llama):
    out = tmp_path / "deepspeed.json"
    assert dapple("export", "--plan", shaped(tmp_path, llama), "--to", "deepspeed", "--out", out).returncode == 0
    data = json.loads(out.read_text())
    assert {k: v for k, v in data.items() if k not in ("about", "model")} == {
        "num_layers": 6, "num_stages": 2, "parts": [0, 3, 6], "partition_method": "uniform",
        "topology": {"num_pp": 2, "num_mp": 2, "num_dp": 2}, "activation_checkpoint_interval": 0,
        "config": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
                   "zero_optimization": {"stage": 1}},
    }


def test_deepspeed_parts_other_than_uniform_name_no_method(tmp_path, dapple, llama):
    stages = [(0, 2, [0, 1], {"recompute": "full"}), (2, 6, [2, 3], {"recompute": "full"})]
    plan = hand_plan(tmp_path, llama, stages, micro_batch_size=4, micro_batches=2, warmups=[2, 1])
    out = tmp_path / "deepspeed.json"
    assert dapple("export", "--plan", plan, "--to", "deepspeed", "--out", out).returncode == 0
    data = json.loads(out.read_text())
    assert data["parts"] == [0, 2, 6] and "partition_method" not in data
    # One checkpoint over each stage: the most layers of a stage.
    assert data["activation_checkpoint_interval"] == 4
    assert data["config"] == {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                              "gradient_accumulation_steps": 2}


def test_deepspeeds_own_code_agrees_on_uniform_parts_and_its_1f1b_depths():
    utils = pytest.importorskip("deepspeed.runtime.utils")
    schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    from dapple.planner.export.deepspeed import uniform_parts

    for layers, stages in [(6, 2), (34, 4), (82, 6), (3, 5)]:
        assert uniform_parts(layers, stages) == utils.partition_uniform(layers, stages)
    # TrainSchedule runs min(S - i, M) forwards before stage i's first backward.
    for stages, micro_batches in [(3, 4), (4, 2), (5, 8)]:
        for stage in range(stages):
            kinds = [type(cmd).__name__ for step in schedule.TrainSchedule(micro_batches, stages, stage).steps()
                     for cmd in step if type(cmd).__name__ in ("ForwardPass", "BackwardPass")]
            assert kinds.index("BackwardPass") == min(stages - stage, micro_batches)


REPLICAS_2_4 = [(0, 3, [0, 1], {}), (3, 6, [2, 3, 4, 5], {})]
SPLIT_2_4 = [(0, 3, [0, 1, 2, 3], {"tensor_parallel": 2}), (3, 6, [4, 5, 6, 7], {"tensor_parallel": 4})]
ZERO_ONE_STAGE = [(0, 3, [0, 1], {"shard_level": 1}), (3, 6, [2, 3], {})]
RECOMPUTE_ONE_STAGE = [(0, 3, [0], {"recompute": "full"}), (3, 6, [1], {})]
SLICES = [(0, 3, [0, 1], {}), (3, 6, [2, 3], {"slices": [3, 5]})]


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed"])
@pytest.mark.parametrize("stages,feature,approximated", [
    (REPLICAS_2_4, "stages replicated unevenly (replicas 2, 4 by stage)", "the most common, 2, on every stage"),
    (SPLIT_2_4, "per-stage tensor parallelism (split degrees 2, 4 by stage)", "the most common, 2, on every stage"),
    (ZERO_ONE_STAGE, "sharding levels that differ by stage (sharding levels 1, 0 by stage)",
     "the most common, 1, on every stage"),
    (RECOMPUTE_ONE_STAGE, "re-computation on some stages only, or of two kinds (re-computation full, none by stage)",
     "the most common, full, on every stage"),
    (SLICES, "uneven slices on mixed GPUs (stage 1: 3, 5 samples)",
     "4 samples for each of 2 replicas (a global batch of 16)"),
], ids=["replicas", "split", "zero", "recompute", "slices"])
def test_what_a_target_cannot_express_is_refused_by_name_or_approximated_aloud(
        tmp_path, dapple, llama, target, stages, feature, approximated):
    plan = hand_plan(tmp_path, llama, stages, micro_batch_size=8, micro_batches=2, warmups=[2, 1])
    out = tmp_path / "out.txt"
    r = dapple("export", "--plan", plan, "--to", target, "--out", out)
    assert_one_line_error(r, 4, f"cannot express {feature}", f"--approximate writes {approximated}")
    assert list(tmp_path.glob("out*")) == []
    r = dapple("export", "--plan", plan, "--to", target, "--out", out, "--approximate")
    assert r.returncode == 0, r.stderr
    assert f"approximated: {feature} -> {approximated}" in r.stderr.splitlines()
    assert out.exists()


def test_approximated_degrees_are_what_the_file_says(tmp_path, dapple, llama):
    plan = hand_plan(tmp_path, llama, REPLICAS_2_4, micro_batch_size=8, micro_batches=2, warmups=[2, 1])
    out = tmp_path / "megatron.sh"
    assert dapple("export", "--plan", plan, "--to", "megatron", "--out", out, "--approximate").returncode == 0
    words = source_array(out)
    # 2 replicas: 4 samples each of the micro-batch of 8.
    assert words[words.index("--micro-batch-size") + 1] == "4"
    assert "launch 4 processes" in out.read_text()


@pytest.mark.parametrize("target", ["megatron", "deepspeed"])
@pytest.mark.parametrize("kind,warmups,feature,approximated", [
    ("gpipe", [4, 4], "schedule gpipe: it runs 1F1B (early-backward-1f1b) only", "its 1F1B, K_i = 2, 1"),
    ("zb-h1", [2, 1], "schedule zb-h1: it runs 1F1B (early-backward-1f1b) only", "its 1F1B, K_i = 2, 1"),
    (None, [1, 1], "warm-up depths K_i 1, 1 by stage: its 1F1B runs K_i = min(S - i, M)", "its 1F1B, K_i = 2, 1"),
])
def test_megatron_and_deepspeed_run_1f1b_only(tmp_path, dapple, llama, target, kind, warmups, feature, approximated):
    stages = [(0, 3, [0], {}), (3, 6, [1], {})]
    plan = hand_plan(tmp_path, llama, stages, micro_batch_size=2, micro_batches=4, warmups=warmups, kind=kind)
    out = tmp_path / "out.txt"
    r = dapple("export", "--plan", plan, "--to", target, "--out", out)
    assert_one_line_error(r, 4, feature, f"--approximate writes {approximated}")
    r = dapple("export", "--plan", plan, "--to", target, "--out", out, "--approximate")
    assert r.returncode == 0, r.stderr
    assert f"approximated: {feature.split(':')[0]} -> {approximated}" in r.stderr.splitlines()
    # torchtitan runs the plan's own order, whatever it is.
    assert dapple("export", "--plan", plan, "--to", "torchtitan", "--out", tmp_path / "job.toml").returncode == 0


def test_torchtitan_refuses_whole_stage_recomputation_which_it_checkpoints_per_block(tmp_path, dapple, llama):
    stages = [(0, 3, [0], {"recompute": "full"}), (3, 6, [1], {"recompute": "full"})]
    plan = hand_plan(tmp_path, llama, stages, micro_batch_size=2, micro_batches=4, warmups=[2, 1])
    out = tmp_path / "job.toml"
    r = dapple("export", "--plan", plan, "--to", "torchtitan", "--out", out)
    assert_one_line_error(r, 4, "cannot express re-computation of whole stages", "checkpoints each block")
    r = dapple("export", "--plan", plan, "--to", "torchtitan", "--out", out, "--approximate")
    assert r.returncode == 0, r.stderr
    assert "approximated: re-computation of whole stages -> full activation checkpointing (each block)" in r.stderr
    assert tomllib.loads(out.read_text())["activation_checkpoint"] == {"mode": "full"}


def test_per_layer_recomputation_is_each_targets_checkpoint_of_every_layer(tmp_path, dapple, llama):
    # Uneven stages (1 and 3 blocks) are no matter: every layer is its own checkpoint.
    rc = {"recompute": "per-layer"}
    stages = [(0, 2, [0], rc), (2, 6, [1], rc)]
    plan = hand_plan(tmp_path, llama, stages, micro_batch_size=2, micro_batches=4, warmups=[2, 1])
    sh = tmp_path / "megatron.sh"
    assert dapple("export", "--plan", plan, "--to", "megatron", "--out", sh).returncode == 0
    assert source_array(sh)[-6:] == ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"]
    toml = tmp_path / "job.toml"
    r = dapple("export", "--plan", plan, "--to", "torchtitan", "--out", toml)
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(toml.read_text())["activation_checkpoint"] == {"mode": "full"}
    ds = tmp_path / "deepspeed.json"
    assert dapple("export", "--plan", plan, "--to", "deepspeed", "--out", ds).returncode == 0
    assert json.loads(ds.read_text())["activation_checkpoint_interval"] == 1
    # Two kinds of re-computation in one plan: each target takes one for every stage.
    mixed = hand_plan(tmp_path, llama, [(0, 2, [0], rc), (2, 6, [1], {"recompute": "full"})], name="mixed.json",
                      micro_batch_size=2, micro_batches=4, warmups=[2, 1])
    r = dapple("export", "--plan", mixed, "--to", "megatron", "--out", sh)
    assert_one_line_error(r, 4, "re-computation on some stages only, or of two kinds (re-computation per-layer, full")


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed"])
def test_an_asynchronous_plan_is_refused_even_approximately(tmp_path, dapple, llama, target):
    stages = [(0, 3, [0], {}), (3, 6, [1], {})]
    path = hand_plan(tmp_path, llama, stages, micro_batch_size=2, micro_batches=4, warmups=[2, 1], kind="xpipe")
    out = tmp_path / "out.txt"
    for extra in ((), ("--approximate",)):
        r = dapple("export", "--plan", path, "--to", target, "--out", out, *extra)
        assert_one_line_error(r, 4, "cannot express schedule xpipe: it is asynchronous")
        assert not out.exists()


def test_torchtitans_two_files_are_written_both_or_neither(tmp_path, dapple, llama):
    (tmp_path / "job.schedule.csv").mkdir()
    out = tmp_path / "job.toml"
    r = dapple("export", "--plan", shaped(tmp_path, llama), "--to", "torchtitan", "--out", out)
    assert_one_line_error(r, 6, "job.schedule.csv: is a directory")
    assert not out.exists()


@pytest.mark.parametrize("args,needle", [
    (("--to", "megatron", "--module-map", "dapple-gpt"), "--module-map applies to --to torchtitan, not megatron"),
    (("--to", "torch-csv", "--approximate"), "--approximate applies to --to torchtitan and megatron and deepspeed"),
    (("--to", "torch-csv", "--profile", "p.json"), "--profile applies to --to torchtitan and megatron and deepspeed"),
])
def test_options_of_other_targets_are_usage_errors(tmp_path, dapple, llama, args, needle):
    r = dapple("export", "--plan", shaped(tmp_path, llama), "--out", tmp_path / "out", *args)
    assert_one_line_error(r, 2, needle)


ONE_STAGE = (0, 6, list(range(4)))


@pytest.mark.parametrize("fields, keys", [
    ({"shard_level": 3, "reshard_after_forward": True},
     {"data_parallel_shard_degree": 4, "fsdp_reshard_after_forward": "always"}),
    ({"shard_level": 3}, {"data_parallel_shard_degree": 4, "fsdp_reshard_after_forward": "never"}),
    ({}, {"data_parallel_replicate_degree": 4, "data_parallel_shard_degree": 1}),
], ids=["zero3", "zero3-kept", "ddp"])
def test_torchtitan_writes_the_sharding_level_it_runs_without_a_pipeline(tmp_path, dapple, llama, fields, keys):
    # One stage on 4 replicas, 2 micro-batches: torchtitan's gradient
    # accumulation runs FSDP's hooks with each, which is level 3.
    plan = hand_plan(tmp_path, llama, [(*ONE_STAGE, fields)], micro_batch_size=8, micro_batches=2, warmups=[1])
    out = tmp_path / "job.toml"
    r = dapple("export", "--plan", plan, "--to", "torchtitan", "--out", out)
    assert r.returncode == 0, r.stderr
    parallelism = tomllib.loads(out.read_text())["parallelism"]
    assert {k: parallelism[k] for k in keys} == keys
    manager = pytest.importorskip("torchtitan.config.manager")
    config = manager.ConfigManager().parse_args(["--job.config_file", str(out)])
    assert config.parallelism.fsdp_reshard_after_forward == keys.get("fsdp_reshard_after_forward", "default")


@pytest.mark.parametrize("target, stages, feature, approximated", [
    ("torchtitan", [(*ONE_STAGE, {"shard_level": 2})], "sharding level 2 (ZeRO-2)",
     "level 3 keeping the weights after the forward"),
    ("torchtitan", [(0, 3, [0, 1], {}), (3, 6, [2, 3], {})], "sharding level 0 (none) beside a pipeline",
     "level 1 (FSDP, fsdp_reshard_after_forward never)"),
    ("torchtitan", [(0, 3, [0, 1], {"shard_level": 3}), (3, 6, [2, 3], {"shard_level": 3})],
     "sharding level 3 (ZeRO-3 keeping the weights after the forward) beside a pipeline", "level 1"),
    ("megatron", [(0, 3, [0, 1], {"shard_level": 2}), (3, 6, [2, 3], {"shard_level": 2})],
     "sharding level 2 (ZeRO-2) beside a pipeline", "its distributed optimizer, level 1"),
    ("megatron", [(*ONE_STAGE, {"shard_level": 3})], "sharding level 3 (ZeRO-3 keeping the weights after the "
     "forward)", "level 3 gathering the weights again for the backward"),
    ("deepspeed", [(0, 3, [0, 1], {"shard_level": 3, "reshard_after_forward": True}),
                   (3, 6, [2, 3], {"shard_level": 3, "reshard_after_forward": True})],
     "sharding level 3 (ZeRO-3) beside a pipeline", "stage 1"),
    ("deepspeed", [(*ONE_STAGE, {"shard_level": 3})], "sharding level 3 (ZeRO-3 keeping the weights after the "
     "forward)", "stage 3 gathering them again for the backward"),
], ids=["titan-zero2", "titan-pipeline-zero0", "titan-pipeline-zero3", "megatron-pipeline-zero2",
        "megatron-zero3-kept", "deepspeed-pipeline-zero3", "deepspeed-zero3-kept"])
def test_a_sharding_level_a_target_does_not_run_is_refused_by_name(tmp_path, dapple, llama, target, stages,
                                                                    feature, approximated):
    warmups = [2, 1] if len(stages) == 2 else [1]
    plan = hand_plan(tmp_path, llama, stages, micro_batch_size=8, micro_batches=2, warmups=warmups)
    out = tmp_path / "out.txt"
    assert_one_line_error(dapple("export", "--plan", plan, "--to", target, "--out", out), 4,
                          f"cannot express {feature}", f"--approximate writes {approximated}")
    r = dapple("export", "--plan", plan, "--to", target, "--out", out, "--approximate")
    assert r.returncode == 0, r.stderr
    assert any(line.startswith(f"approximated: {feature} -> {approximated}") for line in r.stderr.splitlines())


@pytest.mark.parametrize("fields, zero_stage, megatron", [
    ({"shard_level": 1}, 1, ["--use-distributed-optimizer"]),
    ({"shard_level": 2}, 2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
                             "--no-gradient-accumulation-fusion", "--use-distributed-optimizer"]),
    ({"shard_level": 3, "reshard_after_forward": True}, 3,
     ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
      "--no-gradient-accumulation-fusion", "--use-distributed-optimizer"]),
], ids=["zero1", "zero2", "zero3"])
def test_deepspeed_and_megatron_write_the_plans_sharding_level(tmp_path, dapple, llama, fields, zero_stage, megatron):
    plan = hand_plan(tmp_path, llama, [(*ONE_STAGE, fields)], micro_batch_size=8, micro_batches=2, warmups=[1])
    out = tmp_path / "ds.json"
    assert dapple("export", "--plan", plan, "--to", "deepspeed", "--out", out).returncode == 0
    assert json.loads(out.read_text())["config"]["zero_optimization"] == {"stage": zero_stage}
    out = tmp_path / "megatron.sh"
    assert dapple("export", "--plan", plan, "--to", "megatron", "--out", out).returncode == 0
    words = source_array(out)
    start = words.index(megatron[0])
    assert words[start:start + len(megatron)] == megatron


def test_a_one_file_export_goes_to_stdout_without_out(tmp_path, dapple, llama):
    # Data on stdout, the summary on stderr (issue 68's quick start);
    # torchtitan writes two files and asks for --out.
    path = shaped(tmp_path, llama)
    written = tmp_path / "megatron.sh"
    assert dapple("export", "--plan", path, "--to", "megatron", "--out", written).returncode == 0
    shown = dapple("export", "--plan", path, "--to", "megatron")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == written.read_text()
    assert shown.stderr.startswith("stdout: megatron, 2 stages x tensor parallel 2 x data parallel 2 = 8 GPUs")
    assert len(shown.stderr.splitlines()) == 1
    # The launch line: the plan's 8 GPUs on one machine of eight.
    assert ('# torchrun --nnodes 1 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR '
            'pretrain_gpt.py "${DAPPLE_MEGATRON_ARGS[@]}"\n') in shown.stdout
    csv = dapple("export", "--plan", path, "--to", "torch-csv")
    assert csv.returncode == 0 and csv.stdout.splitlines()[0].startswith("0F0"), csv.stderr
    titan = dapple("export", "--plan", path, "--to", "torchtitan")
    assert titan.returncode == 2 and "give --out" in titan.stderr and not titan.stdout
