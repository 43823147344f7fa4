"""The tables and figures of docs/schedules.md, written by its cog blocks
from the results files the benchmarks write
(`cog -I docs -r docs/schedules.md`; `--check` fails where the doc
differs): benchmarks/results/schedule_kinds.json
(`python benchmarks/schedule_kinds.py`) and
benchmarks/results/interleaving_gain.json
(`python benchmarks/interleaving_gain.py`). Paths are from the repository's
root, where cog runs."""

from __future__ import annotations

import json
import re
import statistics
import textwrap
from pathlib import Path

import cog

ROOT = Path(__file__).resolve().parent.parent
KINDS_FILE = ROOT / "benchmarks" / "results" / "schedule_kinds.json"
GAIN_FILE = ROOT / "benchmarks" / "results" / "interleaving_gain.json"

#: The kinds auto searches, in the benchmark's order.
KINDS = ("early-backward-1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "interleaved-zero-bubble", "zb-v",
         "dualpipev")
CHUNKED = ("interleaved-1f1b", "interleaved-zero-bubble", "zb-v", "dualpipev")
#: interleaving_gain.py's orders.
ORDERS = ("interleaved-1f1b", "interleaved-zero-bubble", "zb-v")
NAMES = {"early-backward-1f1b": "early backward", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2",
         "interleaved-1f1b": "interleaved 1F1B", "interleaved-zero-bubble": "interleaved zero bubble",
         "zb-v": "ZB-V", "dualpipev": "DualPipeV"}
#: Topologies whose links between stages are slow: Table V's B and C and the 16x1 cluster at 25 Gbps.
SLOW = ("B", "C", "16x1-25gbps")


class Para:
    """The pieces of one paragraph or list item, written wrapped as the doc's prose is."""

    WIDTH = 74

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def __call__(self, piece: str) -> None:
        self.pieces.append(piece.strip())

    def emit(self) -> None:
        text = " ".join(p for p in self.pieces if p)
        indent = "  " if text.startswith("- ") else ""
        cog.outl(textwrap.fill(text, self.WIDTH, subsequent_indent=indent, break_long_words=False,
                               break_on_hyphens=False))


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def kinds_results() -> dict:
    return _load(KINDS_FILE)


def gain_results() -> dict:
    return _load(GAIN_FILE)


def ms(x: float) -> str:
    return f"{x:.1f}"


def times(x: float) -> str:
    return f"{x:.3f}x"


def words(items: list[str]) -> str:
    """a, b and c."""
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def number(n: int) -> str:
    """A count as prose writes it: one to nine in words."""
    return ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")[n] if n < 10 else str(n)


def case_name(row: dict) -> str:
    """How prose names a case: BERT-48 C, bert-48-pbs-2 on 16x1, Llama-2-70B."""
    if row["case"].startswith("Table V "):
        return row["case"][len("Table V "):]
    if row["case"] == "llama-2-70b":
        return "Llama-2-70B"
    return f"{row['case']} on {row['topology'].split('-')[0]}"


def _ms(row: dict, kind: str) -> float | None:
    return row[kind].get("ms")


def _table_v_and_llama(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["case"].startswith("Table V ") or r["case"] == "llama-2-70b"]


def _llama(rows: list[dict]) -> dict:
    return next(r for r in rows if r["case"] == "llama-2-70b")


# schedule_kinds.json: "What it gains"


def kinds_summary() -> None:
    """The paragraph over the kind table: the cases, the run, auto's choices."""
    out = Para()
    data = kinds_results()
    rows = data["rows"]
    slower = [r for r in rows if "ms" in r["auto"]
              and any(_ms(r, k) is not None and r["auto"]["ms"] > _ms(r, k) * (1 + 1e-9) for k in KINDS)]
    chosen: dict[str, int] = {}
    for r in rows:
        chosen[r["auto"]["kind"]] = chosen.get(r["auto"]["kind"], 0) + 1
    order = sorted(chosen, key=lambda k: (-chosen[k], KINDS.index(k)))
    left = [r for r in rows if r["auto"]["kind"] != "early-backward-1f1b"]
    gains = [_ms(r, "early-backward-1f1b") / r["auto"]["ms"] for r in left if _ms(r, "early-backward-1f1b")]
    load = data["load_average_before"][0]
    out(f"(`benchmarks/results/schedule_kinds.json`; {len(rows)} cases, {data['wall_s']:.0f} s on this "
        f"{data['cpus']}-core machine at load {load:.1f}, Llama-2-70B planned "
        f"{number(len(_llama(rows).get('runs', {}).get('auto', [0])))} times). Auto is slower than a kind "
        f"alone in {number(len(slower)) if slower else 'none'} of the {len(rows)}.")
    by_kind = [f"{NAMES[k]} in {chosen[k]}" for k in order]
    out(f"It chooses {words(by_kind)}; where it leaves early backward ({len(left)} cases) it gains "
        f"{times(min(gains))} to {times(max(gains))} over it (median {times(statistics.median(gains))}).")
    out('Table V and Llama-2-70B ("-": no plan of that kind fits):')
    out.emit()


def kinds_table() -> None:
    """Table V's cases and Llama-2-70B, each kind's time and auto's."""
    rows = _table_v_and_llama(kinds_results()["rows"])
    cog.outl("| case | topology | auto ms (kind) | " + " | ".join(f"{k} ms" for k in KINDS)
             + " | auto over early backward |")
    cog.outl("|---|---|--:|" + "--:|" * len(KINDS) + "--:|")
    for r in rows:
        cells = " | ".join("-" if _ms(r, k) is None else ms(_ms(r, k)) for k in KINDS)
        eb = _ms(r, "early-backward-1f1b")
        gain = times(eb / r["auto"]["ms"]) if eb else "-"
        cog.outl(f"| {r['case']} | {r['topology']} | {ms(r['auto']['ms'])} ({r['auto']['kind']}) | {cells} | {gain} |")


def early_backward_wins() -> None:
    """The bullet on where early backward wins: the case of a pipeline it
    wins by most over ZB-H1, with both plans' warm-up depths."""
    out = Para()
    rows = [r for r in kinds_results()["rows"] if r["auto"]["kind"] == "early-backward-1f1b"
            and len(r["early-backward-1f1b"]["warmups"]) > 1 and _ms(r, "zb-h1")]
    r = max(rows, key=lambda r: _ms(r, "zb-h1") / _ms(r, "early-backward-1f1b"))
    eb, zb = r["early-backward-1f1b"], r["zb-h1"]
    same = "on the same layout" if zb["shape"] == eb["shape"] else f"on its own layout ({zb['shape']})"
    out(f"- **Where auto keeps early backward** on a pipeline ({number(len(rows))} cases), its searched depths do "
        "what ZB-H1's fixed ones cannot: a stage may run further ahead than ZB-H1's S - i, as on")
    out(f"  {case_name(r)} ({eb['shape']}, {ms(eb['ms'])} ms): K = {', '.join(map(str, eb['warmups']))}, "
        f"where ZB-H1 {same} runs K = {', '.join(map(str, zb['warmups']))} and takes {ms(zb['ms'])} ms;")
    out("  and ZB-H1's later stages hold more micro-batches.")
    out.emit()


def llama_kinds() -> None:
    """The Llama-2-70B bullet: each kind's plan, and how the searches varied from run to run."""
    out = Para()
    r = _llama(kinds_results()["rows"])
    eb, auto = r["early-backward-1f1b"], r["auto"]
    eb_ms = eb["ms"]
    out(f"- **Llama-2-70B on 64x8 A100s at a global batch of {r['global_batch_size']}** (timed operator by "
        f"operator): early backward {ms(eb_ms)} ms (MFU {eb['mfu']:.3f}) on")
    out(f"  {len(eb['warmups'])} stages of {eb['shape'].split(':')[0]} GPUs (`{eb['layout']}`), "
        f"{eb['micro_batches']} micro-batches of {eb['micro_batch_size']}, K = "
        f"{', '.join(map(str, eb['warmups']))}. Auto plans {NAMES[auto['kind']]} on")
    ranks = len(auto["shape"].split(" ")[0].split(":"))
    chunks = re.search(r"v=(\d+)", auto["shape"])
    cut = f", {chunks.group(1)} chunks a rank" if chunks else ""
    out(f"  {number(ranks)} ranks of {auto['shape'].split(':')[0]} GPUs{cut} (`{auto['layout']}`), "
        f"{auto['micro_batches']} micro-batches of {auto['micro_batch_size']}: {ms(auto['ms'])} ms "
        f"({times(eb_ms / auto['ms'])}, MFU {auto['mfu']:.3f}).")
    others = sorted((k for k in KINDS if k != auto["kind"] and _ms(r, k)), key=lambda k: _ms(r, k))
    alone = [f"{NAMES[k]} {ms(_ms(r, k))} ({r[k]['shape']})" for k in others]
    none = [NAMES[k] for k in KINDS if _ms(r, k) is None]
    out(f"  The kinds alone: {words(alone)}" + (f"; {words(none)} find no plan that fits." if none else "."))
    runs = r.get("runs", {})
    if runs:
        count = len(runs["auto"])
        varied, steady = [], []
        for k in ("auto", *KINDS):
            seen = []
            for o in runs[k]:
                text = f"{ms(o['ms'])} ({o['shape']})" if "ms" in o else "none that fits"
                if text not in seen:
                    seen.append(text)
            name = "auto" if k == "auto" else NAMES[k]
            if len(seen) > 1:
                varied.append(f"{name} gave {' or '.join(seen)}")
            else:
                steady.append(name)
        if varied:
            out(f"  Planned {number(count)} times in one process, the searches on this space of 512 GPUs did "
                f"not always return the same plan: {'; '.join(varied)} (the table holds the first run; "
                f"{words(steady)} returned the same plan each time).")
        else:
            out(f"  Planned {number(count)} times, every search returned the same plan.")
    out.emit()


def zb_h2_gives() -> None:
    """The paragraph of "What ZB-H2 gives"."""
    out = Para()
    rows = kinds_results()["rows"]
    chosen = sum(r["auto"]["kind"] == "zb-h2" for r in rows)
    both = [r for r in rows if _ms(r, "zb-h1") and _ms(r, "zb-h2")]

    def tally(group: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
        faster = [r for r in group if _ms(r, "zb-h2") < _ms(r, "zb-h1") * (1 - 1e-9)]
        slower = [r for r in group if _ms(r, "zb-h2") > _ms(r, "zb-h1") * (1 + 1e-9)]
        equal = [r for r in group if r not in faster and r not in slower]
        return faster, equal, slower

    slow = [r for r in both if r["topology"] in SLOW]
    fast = [r for r in both if r["topology"] not in SLOW]
    faster, equal, slower = tally(both)
    sf, se, ss = tally(slow)
    ff, fe, fs = tally(fast)
    out(f"On the {len(rows)} cases of `benchmarks/schedule_kinds.py` (table above) auto chooses ZB-H2 in "
        f"{chosen}. Of the {len(both)} where both fit, ZB-H2 is faster than ZB-H1 in {len(faster)}, as fast "
        f"in {len(equal)} and slower in {len(slower)}.")
    out(f"Where links are slow (configurations B and C, the 16x1 topologies at 25 Gbps) it is faster in "
        f"{len(sf)} of {len(slow)}; on faster links (A, 2x8 NVLink and the A100s' 64x8) in {len(ff)} of "
        f"{len(fast)}, as fast in {len(fe)} (there its longer warm-up has less of a round trip to cover).")
    best = sorted(faster, key=lambda r: _ms(r, "zb-h2") / _ms(r, "zb-h1"))[:4]
    out("Its largest gains: " + words(
        [f"{case_name(r)} {ms(_ms(r, 'zb-h1'))} -> {ms(_ms(r, 'zb-h2'))} ms "
         f"({times(_ms(r, 'zb-h2') / _ms(r, 'zb-h1'))})" for r in best]) + ".")
    if slower:
        def layouts(r: dict) -> str:
            two, one = r["zb-h2"]["shape"], r["zb-h1"]["shape"]
            return f"both on {two}" if two == one else f"{two} against {one}"

        out("Slower: " + words([f"{case_name(r)} ({ms(_ms(r, 'zb-h2'))} against {ms(_ms(r, 'zb-h1'))} ms, "
                                     f"{layouts(r)})" for r in slower]) + ".")
    misfit = [case_name(r) for r in rows if _ms(r, "zb-h1") and not _ms(r, "zb-h2")]
    if misfit:
        out(f"It does not fit {words(misfit)}, where ZB-H1 does.")
    out.emit()


# interleaving_gain.json: "What the chunked kinds give"


def _best_cut(row: dict, order: str) -> tuple[int, float] | None:
    runs = row["interleaved"].get(order, {})
    fitting = [(int(v), r["ms"]) for v, r in runs.items() if r.get("fits_memory")]
    return min(fitting, key=lambda vr: vr[1]) if fitting else None


def gain_run() -> None:
    """How the benchmark ran."""
    out = Para()
    data = gain_results()
    out(f"`python benchmarks/interleaving_gain.py` (`benchmarks/results/interleaving_gain.json`,")
    out(f"{data['wall_s']:.0f} s alone on this 2-core machine at load {data['load_average_before'][0]:.1f}) "
        "plans each case for the kinds of one")
    out.emit()


def gain_cut_table() -> None:
    rows = gain_results()["rows"]
    cog.outl("| case | plan | plan ms | " + " | ".join(f"{o}: best v, ms, over the plan" for o in ORDERS) + " |")
    cog.outl("|---|---|--:|" + "--:|" * len(ORDERS))
    for r in rows:
        cells = []
        for order in ORDERS:
            b = _best_cut(r, order)
            cells.append("-" if b is None else f"{b[0]}, {ms(b[1])}, {times(r['plan_ms'] / b[1])}")
        cog.outl(f"| {r['case']} | {r['plan_kind']}, {r['shape']} | {ms(r['plan_ms'])} | " + " | ".join(cells) + " |")


def gain_search_table() -> None:
    rows = gain_results()["rows"]
    cog.outl("| case | plan ms | " + " | ".join(f"--schedule {o}" for o in ORDERS) + " | fastest kind |")
    cog.outl("|---|--:|" + "--:|" * (len(ORDERS) + 1))
    for r in rows:
        cells = []
        for order in ORDERS:
            f = r["searched"][order]
            cells.append("-" if "ms" not in f else f"{f['shape']}, {ms(f['ms'])}, {times(r['plan_ms'] / f['ms'])}")
        a = r["fastest"]
        cells.append(f"{a['kind']}, {a['shape']}, {ms(a['ms'])}, {times(r['plan_ms'] / a['ms'])}")
        cog.outl(f"| {r['case']} | {ms(r['plan_ms'])} | " + " | ".join(cells) + " |")


def _gain_name(row: dict) -> str:
    return row["case"][len("Table V "):] if row["case"].startswith("Table V ") else row["case"]


def gain_llama() -> None:
    """The Llama-2-70B bullet of "What the chunked kinds give"."""
    out = Para()
    r = next(r for r in gain_results()["rows"] if r["case"] == "Llama-2-70B")
    plan, p, m = r["plan_ms"], r["ranks"], r["micro_batches"]
    cuts = {o: _best_cut(r, o) for o in ORDERS}
    top = min((o for o in ORDERS if cuts[o]), key=lambda o: cuts[o][1])
    v, best = cuts[top]
    rest = [f"{times(plan / cuts[o][1])} from {NAMES[o]} ({cuts[o][0]} chunks, {ms(cuts[o][1])} ms)"
            for o in ORDERS if o != top and cuts[o]]
    out(f"- **Llama-2-70B on 512 A100s** (its layers timed as their FLOPs over half the bf16 peak, "
        f"`efficiency=0.5`: not the profile of the kind table above) **gains {times(plan / best)}** from "
        f"{NAMES[top]} with {v} chunks a rank over its plan ({r['plan_kind']}, {ms(plan)} -> {ms(best)} ms), "
        f"{words(rest)}.")
    i1 = {int(k): x for k, x in r["interleaved"]["interleaved-1f1b"].items()}
    v1 = cuts["interleaved-1f1b"][0]
    bound = (p - 1) / (m + p - 1)
    out(f"  With {p} ranks and {m} micro-batches 1F1B waits (p - 1)/(m + p - 1) = {p - 1}/{m + p - 1} of its "
        f"iteration, and {v1} chunks take {v1 - 1}/{v1} of that away: {100 * bound * (v1 - 1) / v1:.1f}% at "
        f"most; against 1F1B on the same cut (v = 1, {ms(i1[1]['ms'])} ms) interleaved 1F1B takes "
        f"{100 * (1 - i1[v1]['ms'] / i1[1]['ms']):.1f}% off.")
    seq = [ms(i1[k]["ms"]) for k in sorted(i1) if "ms" in i1[k]]
    worse = [k for k in sorted(i1) if k > 1 and "ms" in i1[k] and "ms" in i1.get(k - 1, {})
             and i1[k]["ms"] > i1[k - 1]["ms"]]
    layers = max(end for _, end in r["interleaved"][top][str(v)]["chunk_layers"])
    sizes = [f"{layers // (p * k)} or {-(-layers // (p * k))}" if layers % (p * k) else f"{layers // (p * k)}"
             for k in worse]
    out(f"  By v = 1 to {max(i1)} interleaved 1F1B gives {', '.join(seq)} ms" + (
        f": more chunks are not always faster, as {layers} layers cut into "
        f"{words([str(p * k) for k in worse])} chunks are {words(sizes)} layers each, and the longest chunk "
        "sets the pace." if worse else "."))
    out.emit()


def gain_one_chunk() -> None:
    """Interleaved zero bubble at one chunk (ZB-H1 on the cut by the ranks' speeds) against the plan."""
    out = Para()
    rows = [r for r in gain_results()["rows"] if r["interleaved"]]
    beat = []
    for r in rows:
        one = r["interleaved"]["interleaved-zero-bubble"].get("1", {})
        if one.get("fits_memory") and one["ms"] < r["plan_ms"] * (1 - 1e-9):
            beat.append(f"{ms(one['ms'])} against {ms(r['plan_ms'])} ms on {_gain_name(r)}")
    out("- **Interleaved zero bubble with one chunk is ZB-H1** on the layers cut again by the ranks' speeds, "
        "which the ZB-H1 search also runs (`interleave::cut_by_rank_speeds`): ")
    if beat:
        out(f"  it beats the planner's plan here ({'; '.join(beat)}), where the search left a faster cut "
            "unranked (\"How far from exact\" above).")
    else:
        out(f"  on none of the {len(rows)} pipelines does it beat the planner's plan.")
    out.emit()


def gain_table_v() -> None:
    """What cutting the Table V plans into chunks gives."""
    out = Para()
    rows = [r for r in gain_results()["rows"] if r["case"].startswith("Table V ") and r["interleaved"]]
    gains, losses = [], 0
    for r in rows:
        for o in ORDERS:
            b = _best_cut(r, o)
            if b and b[1] < r["plan_ms"] * (1 - 1e-9):
                gains.append(f"{NAMES[o]} {times(r['plan_ms'] / b[1])} on {_gain_name(r)} (v = {b[0]})")
            losses += bool(b and b[1] > r["plan_ms"] * (1 + 1e-9))
    ones = [(r["plan_ms"] / r["interleaved"]["interleaved-1f1b"]["1"]["ms"], _gain_name(r)) for r in rows
            if r["interleaved"]["interleaved-1f1b"].get("1", {}).get("fits_memory")]
    (lo, lo_name), (hi, hi_name) = max(ones), min(ones)
    out(f"- **The Table V plans mostly lose.** Of their {len(rows)} pipelines' best cuts into each order "
        f"({len(rows) * len(ORDERS)} cells) {losses} are slower than the plan. The plans are ZB-H1 or early "
        "backward with searched depths; v = 1 of interleaved 1F1B, with torch's fixed depths on the layers "
        f"cut again, is already {100 * (1 / lo - 1):.0f}% to {100 * (1 / hi - 1):.0f}% slower ({lo_name} to "
        f"{hi_name}). Each added chunk adds p transfers a micro-batch over their 25 Gbps links, and a rank "
        "reduces all its chunks' gradients after its last pass (here no AllReduce overlaps another chunk's "
        "backward, where Megatron's do), which on hybrid plans (1:2:...:2) holds up every replicated rank.")
    if gains:
        out(f"  Faster than the plan: {words(gains)}.")
    misfit = []
    for r in rows:
        runs = r["interleaved"]["interleaved-1f1b"]
        unfit = [int(v) for v, x in runs.items() if not x.get("fits_memory")]
        if unfit and r["case"].startswith("Table V AmoebaNet"):
            misfit.append(f"{_gain_name(r)} at v = {', '.join(map(str, sorted(unfit)))}")
    if misfit:
        out(f"  AmoebaNet's deep warm-ups do not fit in interleaved 1F1B: {words(misfit)}.")
    out.emit()


def gain_search() -> None:
    """What each chunked kind's own search finds that cutting the plan does not, and the reverse."""
    out = Para()
    rows = [r for r in gain_results()["rows"] if r["interleaved"]]
    found, missed = [], []
    for r in rows:
        for o in ORDERS:
            s, b = r["searched"][o], _best_cut(r, o)
            if "ms" not in s or b is None:
                continue
            if s["ms"] < b[1] * (1 - 1e-9) and s["ms"] < r["plan_ms"] * (1 - 1e-9):
                found.append(f"{_gain_name(r)} as {NAMES[o]}: {s['shape']}, {ms(s['ms'])} ms "
                             f"({times(r['plan_ms'] / s['ms'])}), where the plan ({r['shape']}) cut into chunks "
                             f"gives at best {ms(b[1])}")
            elif s["ms"] > b[1] * (1 + 1e-9) and b[1] < r["plan_ms"]:
                missed.append(f"on {_gain_name(r)}, the {NAMES[o]} search's {ms(s['ms'])} ms ({s['shape']}) "
                              f"against {ms(b[1])} from the plan's {r['shape']} cut into {b[0]} chunks")
    out("- The search finds what cutting the planner's plan does not " + (
        f"on {number(len(found))} of these: {'; '.join(found)}." if found else "nowhere here."))
    if missed:
        out(f"  It misses what cutting the plan finds {'; '.join(missed)} (a search of one kind visits "
            "layouts in order of a bound that is not a proof).")
    out.emit()


def auto_over_searches() -> None:
    """Where auto's chunked plan beats that kind's own search (schedule_kinds.json)."""
    out = Para()
    rows = kinds_results()["rows"]
    beaten = []
    for r in rows:
        k = r["auto"]["kind"]
        if k not in CHUNKED:
            continue
        alone = _ms(r, k)
        if alone is None:
            beaten.append(f"{case_name(r)}, {ms(r['auto']['ms'])} ms as {NAMES[k]} ({r['auto']['shape']}), where "
                       f"`--schedule {k}` finds no plan that fits")
        elif r["auto"]["ms"] < alone * (1 - 1e-9):
            beaten.append(f"{case_name(r)}, {ms(r['auto']['ms'])} ms as {NAMES[k]} ({r['auto']['shape']}), where "
                       f"`--schedule {k}` plans {ms(alone)}")
    chosen = [f"{case_name(r)} ({NAMES[r['auto']['kind']]})" for r in rows if r["auto"]["kind"] in CHUNKED]
    out("- `--schedule auto` chooses among them with the other kinds (the table of \"What it gains\" above): "
        f"a chunked kind on {words(chosen) if chosen else 'no case'}.")
    if beaten:
        out(f"  It plans {'; '.join(beaten)}: each search ranks layouts by a bound that is not a proof and stops "
            "at different layouts than the joint search, so on spaces larger than 512 layouts neither is "
            "exact.")
    out.emit()


# pipeline orders


def order_rows(order, label: str = "rank", tail: str = "") -> None:
    """A pipeline order of one stage a rank, each rank's cells less their stage (`0F1` -> `F1`)."""
    cog.outl("```")
    for rank, cells in enumerate(order.rank_cells()):
        cog.outl(f"{label} {rank}: " + " ".join(re.sub(r"^\d+", "", c) for c in cells) + tail)
    cog.outl("```")


def shell_indented(*commands: str, indent: str = "  ") -> None:
    """`shell_example.shell`'s console block, indented to sit in a list item."""
    import shell_example

    cog.outl(indent + "```console")
    for command in commands:
        printed = shell_example.run(command)
        cog.outl(f"{indent}$ {command}")
        for line in printed.splitlines():
            cog.outl(indent + line if line else "")
    cog.outl(indent + "```")
