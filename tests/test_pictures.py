"""`dapple show`: pictures of a plan and its simulated iteration."""

import re
import struct

import pytest

pytest.importorskip("matplotlib")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from the IHDR chunk, which a PNG must start with."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    from conftest import run_dapple

    out = tmp_path_factory.mktemp("show") / "bert48-A.json"
    r = run_dapple(
        "plan", "--profile", "profiles/artifact/bert-48-pbs-2.json", "--topology", "A",
        "--global-batch-size", "64", "--schedule", "early-backward-1f1b", "--out", out,
    )
    assert r.returncode == 0, r.stderr
    return out


def test_gantt_png(dapple, plan_path, tmp_path):
    out = tmp_path / "gantt.png"
    r = dapple("show", "--plan", plan_path, "--gantt", out)
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stderr
    assert r.stdout == ""
    width, height = png_size(out)
    # Two stages and one link: wide for the timeline, not tall.
    assert 1000 <= width <= 5000
    assert 200 <= height <= 1000
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == (height, width)
    # No temporary file left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gantt.png"]


def test_gantt_svg_keeps_its_text(dapple, plan_path, tmp_path):
    out = tmp_path / "gantt.svg"
    r = dapple("show", "--plan", plan_path, "--gantt", out)
    assert r.returncode == 0, r.stderr
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    # The plan on A is 8:8 with 4 micro-batches (see test_cli / docs/formats.md).
    assert "stage 0 (8 GPUs: 0-7)" in svg
    assert "stage 1 (8 GPUs: 8-15)" in svg
    for mb in range(4):
        assert f">{mb}</text>" in svg
    assert "simulated iteration" in svg and "early-backward-1f1b" in svg


def test_gpipe_gantt_differs(dapple, plan_path, tmp_path):
    a, b = tmp_path / "a.svg", tmp_path / "b.svg"
    assert dapple("show", "--plan", plan_path, "--gantt", a).returncode == 0
    r = dapple("show", "--plan", plan_path, "--gantt", b, "--schedule", "gpipe")
    assert r.returncode == 0, r.stderr
    assert "gpipe" in b.read_text()
    assert a.read_text() != b.read_text()


def test_memory_and_diagram_png(dapple, plan_path, tmp_path):
    mem, diag = tmp_path / "memory.png", tmp_path / "plan.png"
    r = dapple("show", "--plan", plan_path, "--memory", mem, "--diagram", diag)
    assert r.returncode == 0, r.stderr
    assert str(mem) in r.stderr and str(diag) in r.stderr
    for path in (mem, diag):
        width, height = png_size(path)
        assert width >= 600 and height >= 250


def test_diagram_svg_lists_stages_and_devices(dapple, plan_path, tmp_path):
    out = tmp_path / "plan.svg"
    assert dapple("show", "--plan", plan_path, "--diagram", out).returncode == 0
    svg = out.read_text()
    assert "stage 0: layers 0-31" in svg and "stage 1: layers 32-52" in svg
    assert "28 model layers" in svg
    for device in (0, 7, 8, 15):
        assert f">{device}</text>" in svg


def test_same_input_same_svg(dapple, plan_path, tmp_path):
    a, b = tmp_path / "a.svg", tmp_path / "b.svg"
    assert dapple("show", "--plan", plan_path, "--memory", a).returncode == 0
    assert dapple("show", "--plan", plan_path, "--memory", b).returncode == 0
    assert a.read_bytes() == b.read_bytes()


def test_bad_extension_is_invalid_input(dapple, plan_path, tmp_path):
    good, bad = tmp_path / "gantt.png", tmp_path / "memory.jpg"
    r = dapple("show", "--plan", plan_path, "--gantt", good, "--memory", bad)
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0]
    # Names are checked first: nothing is written.
    assert list(tmp_path.iterdir()) == []


def test_no_output_is_a_usage_error(dapple, plan_path):
    r = dapple("show", "--plan", plan_path)
    assert r.returncode == 2
    assert "--gantt" in r.stderr


def test_importing_planner_does_not_import_matplotlib():
    import subprocess
    import sys

    code = "import sys, dapple.planner, dapple.planner.pictures; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def figure_texts(monkeypatch, draw):
    """Every shown text of the figure ``draw()`` makes (tick labels,
    legends, titles, GPU tags), caught before it is saved."""
    import matplotlib.text

    from dapple.planner import pictures

    figures = []
    monkeypatch.setattr(pictures, "_save", lambda fig, path, fmt: figures.append(fig))
    draw()
    (fig,) = figures
    # findobj can meet an artist twice (an axis shared by several stages): each once, in order.
    texts = {id(t): t for t in fig.findobj(matplotlib.text.Text)}
    return fig, [t.get_text() for t in texts.values() if t.get_text() and t.get_visible()]


def drawn(monkeypatch, plan_path, profile_path, tmp_path):
    """The texts of the timeline, memory picture and diagram of a plan."""
    from dapple import planner
    from dapple.planner import pictures

    plan, profile = planner.Plan.load(str(plan_path)), planner.Profile.load(str(profile_path))
    sim = planner.simulate(plan, profile)
    return {
        "gantt": figure_texts(monkeypatch, lambda: pictures.gantt(plan, sim, tmp_path / "g.svg"))[1],
        "memory": figure_texts(monkeypatch, lambda: pictures.memory(plan, sim, tmp_path / "m.svg"))[1],
        "diagram": figure_texts(monkeypatch, lambda: pictures.diagram(plan, tmp_path / "d.svg", profile)),
    }


def test_shaped_stages_show_their_shape_in_every_picture(monkeypatch, shaped_plan, tmp_path):
    texts = drawn(monkeypatch, *shaped_plan, tmp_path)
    # Stage 0: t = 2 on 4 GPUs is 2 replicas, ZeRO-1; stage 1: 4 plain replicas re-computing.
    first, second = "stage 0 (4 GPUs: 0-3)\nt2\u00d7r2 zero", "stage 1 (4 GPUs: 4-7)\nt1\u00d7r4 rc"
    for kind in ("gantt", "memory"):
        assert first in texts[kind] and second in texts[kind], (kind, texts[kind])
    fig, diagram = texts["diagram"]
    assert any(t.startswith("stage 0: layers 0-2") and t.endswith(", t2\u00d7r2 zero") for t in diagram), diagram
    assert any(t.startswith("stage 1: layers 3-5") and t.endswith(", t1\u00d7r4 rc") for t in diagram), diagram
    # Each GPU says its split group (replica); stage 1 does not split, so has no groups to tell.
    tags = [t for t in diagram if t.startswith("s") and t[1:2].isdigit()]
    assert tags == ["s0 r0", "s0 r0", "s0 r1", "s0 r1", "s1", "s1", "s1", "s1"]
    assert any("outlined: a split group" in t for t in diagram)
    from matplotlib.patches import FancyBboxPatch

    outlines = [p for p in fig.axes[0].patches if isinstance(p, FancyBboxPatch) and p.get_facecolor()[3] == 0]
    assert len(outlines) == 2


def test_a_plain_plans_labels_are_as_before_shapes(monkeypatch, plan_path, tmp_path):
    from conftest import PROFILES

    texts = drawn(monkeypatch, plan_path, PROFILES / "bert-48-pbs-2.json", tmp_path)
    names = ["stage 0 (8 GPUs: 0-7)", "stage 1 (8 GPUs: 8-15)"]
    assert [t for t in texts["gantt"] if t.startswith("stage ")] == names
    assert sorted(t for t in texts["memory"] if t.startswith("stage ") and "peak" not in t) == names
    fig, diagram = texts["diagram"]
    assert [t for t in diagram if t.startswith("s") and t[1:2].isdigit()] == ["s0"] * 8 + ["s1"] * 8
    # No stage shape ("t2×r4") and no outlined split group; the title's
    # layout ("pp2 × (r8)") names the replicas alone.
    assert not any(re.search(r"\bt\d+\u00d7", t) or "outlined" in t for t in diagram)
    assert [t for t in diagram if t.startswith("stage ")] == [
        "stage 0: layers 0-31 (input_ids .. layer_27; 28 model layers)",
        "stage 1: layers 32-52 (layer_28 .. pooler; 20 model layers)",
    ]


def test_show_draws_a_shaped_plans_groups_into_its_svg(dapple, shaped_plan, tmp_path):
    plan, profile = shaped_plan
    out = tmp_path / "plan.svg"
    r = dapple("show", "--plan", plan, "--profile", profile, "--diagram", out, "--gantt", tmp_path / "g.svg")
    assert r.returncode == 0, r.stderr
    svg = out.read_text()
    assert "s0 r1" in svg and "t2\u00d7r2 zero" in svg
    assert "t1\u00d7r4 rc" in (tmp_path / "g.svg").read_text()


def test_a_gantt_of_32_stages_of_512_gpus_keeps_every_label_whole(monkeypatch):
    """Issue 67: Llama-2-70B over 32 stages of 512 H100s (2048x8): each
    stage's label is short ("s23 (512: 11776-12287)") and lies whole inside
    the figure, and the title says the layout once ("pp32 × (r512)"), not
    "512:" 32 times."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from conftest import ROOT
    from dapple import planner
    from dapple.planner import pictures

    profile = planner.transformer_profile(ROOT / "profiles" / "models" / "llama-2-70b.json", gpu="H100-80GB", seq_len=4096,
                                          micro_batch_sizes=[1])
    n, stages = len(profile.layers), 32
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    plan = planner.layout_plan(profile, "2048x8-h100", 2048,
                               [(cuts[i], cuts[i + 1], list(range(512 * i, 512 * (i + 1)))) for i in range(stages)])
    figures = []
    monkeypatch.setattr(pictures, "_save", lambda fig, path, fmt: figures.append(fig))
    pictures.gantt(plan, planner.simulate(plan, profile), "gantt.svg")
    (fig,) = figures
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    labels = fig.axes[0].get_yticklabels()
    assert labels[23].get_text() == "s23 (512: 11776-12287)"
    for text in [*labels, *fig.texts]:
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width, (text.get_text(), box.x0, box.x1, fig.bbox.width)
    title = fig.texts[0].get_text()
    assert "pp32 × (r512)" in title and "512:" not in title, title
