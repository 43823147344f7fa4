"""Build the paper's Table V plans as dapple plans, to cost them with our model.

A paper plan "P:Q" with split "a:b" becomes two stages whose boundary sits
right after the a-th block (model layer) of the profile; "DP" is one stage on
every GPU; "straight" is one GPU per stage with blocks spread evenly. Micro-
batching is the one our planner would pick for that shape: every divisor of
the global batch is tried and the fastest estimate that fits is kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from dapple import planner

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT.parent / "shared" / "reference" / "dapple-paper-results.json"
ARTIFACT_PROFILES = ROOT / "profiles" / "artifact"


def reference() -> dict:
    """The paper's tables as data (../shared beside the checkout)."""
    return json.loads(REFERENCE.read_text())


def shipped_profiles(ref: dict) -> dict[str, Path]:
    """Model name -> our conversion of the artifact profile the paper used
    (``profiles/artifact/<artifact file stem>.json``), for the models that
    have one."""
    return {
        model: ARTIFACT_PROFILES / f"{Path(m['artifact_profile']).stem}.json"
        for model, m in ref["models"].items()
        if m.get("artifact_profile")
    }


def table_v_cases(ref: dict) -> list[tuple[str, Path, int]]:
    """(model, profile path, global batch size) of every Table V model that
    has a shipped profile, in the table's order."""
    profiles = shipped_profiles(ref)
    seen: dict[str, tuple[str, Path, int]] = {}
    for row in ref["table_V_planning_results"]:
        if row["model"] in profiles and row["model"] not in seen:
            seen[row["model"]] = (row["model"], profiles[row["model"]], row["gbs"])
    return list(seen.values())


def block_positions(profile: planner.Profile) -> list[int]:
    return [i for i, layer in enumerate(profile.layers) if layer.get("kind") == "block"]


def boundaries_after_blocks(profile: planner.Profile, blocks_per_stage: list[int]) -> list[tuple[int, int]]:
    pos = block_positions(profile)
    n = len(profile.layers)
    cuts, seen = [], 0
    for b in blocks_per_stage[:-1]:
        seen += b
        cuts.append(pos[seen - 1] + 1)
    starts = [0] + cuts
    ends = cuts + [n]
    return list(zip(starts, ends))


def even_blocks(total: int, stages: int) -> list[int]:
    base, extra = divmod(total, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def paper_plan(profile: planner.Profile, topology: planner.Topology, gbs: int, row: dict):
    """dapple Plan with the paper's shape and split at the micro-batch size
    and warm-up depths that simulate fastest and fit, or None."""
    g = topology.num_devices
    kind = row["plan"]
    blocks = len(block_positions(profile))
    if kind == "DP":
        replicas, split = [g], [blocks]
    elif kind == "straight":
        replicas, split = [1] * g, even_blocks(blocks, g)
    else:
        replicas = [int(x) for x in kind.split(":")]
        split = [int(x) for x in row["split"].split(":")]
    ranges = boundaries_after_blocks(profile, split)
    devices, nxt = [], 0
    for r in replicas:
        devices.append(list(range(nxt, nxt + r)))
        nxt += r
    return layout_plan(profile, topology, gbs, [(s, e, d) for (s, e), d in zip(ranges, devices)])


def layout_plan(profile: planner.Profile, topology: planner.Topology, gbs: int,
                stages: list[tuple[int, int, list[int]]]):
    """The layout ``stages`` ((layer_start, layer_end, devices) each) as an
    early-backward dapple plan, at the micro-batch size and warm-up depths
    that simulate fastest and fit (as ``dapple compare`` costs a baseline),
    or None when none fits."""
    try:
        return planner.layout_plan(profile, topology, gbs, stages)
    except planner.InfeasibleError:
        return None
