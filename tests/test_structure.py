"""The shape of the source tree, as docs/architecture.md promises it: no
function over 100 lines (Rust unit tests aside), no import circle between Rust
modules or between Python modules, and every path the page names exists.

These read the source, not the installed wheel. Run them alone with
`python3 tests/test_structure.py` (prints every finding) or through pytest."""

import ast
import re
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 100
RUST_CRATES = {"dapple_core": ROOT / "rust_core" / "core" / "src", "dapple_py": ROOT / "rust_core" / "py" / "src"}
PYTHON_PACKAGES = ("dapple",)  # planner/ and cli/ are links to its subpackages
#: dapple-core's groups of modules by concept, each building only on those
#: before it (docs/architecture.md's table follows this order).
CORE_LAYERS = ("error", "formats", "cluster", "model", "cost", "schedule", "plan", "simulation", "baselines", "search")


# ---- Rust -------------------------------------------------------------------


def rust_code(text: str) -> str:
    """The text with comments, strings and char literals blanked out (newlines
    kept), so that braces and `crate::` inside them count for nothing."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", text[i : j + 1]))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x[0-9a-fA-F]{2}'", text[i:]):
            m = re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'|'\\x[0-9a-fA-F]{2}'", text[i:])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def block_end(code: str, open_brace: int) -> int:
    """Index of the brace that closes the one at `open_brace`."""
    depth = 0
    for j in range(open_brace, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced braces")


def cfg_test_spans(code: str) -> list[tuple[int, int]]:
    """Spans of `#[cfg(test)]` items (unit-test modules and test helpers)."""
    spans = []
    for m in re.finditer(r"#\[cfg\(test\)\]", code):
        brace, semi = code.find("{", m.end()), code.find(";", m.end())
        if brace >= 0 and (semi < 0 or brace < semi):
            spans.append((m.start(), block_end(code, brace)))
    return spans


def rust_functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, line count) of each function outside test code."""
    code = rust_code(path.read_text())
    tests = cfg_test_spans(code)
    found = []
    for m in re.finditer(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)", code):
        if any(a <= m.start() <= b for a, b in tests):
            continue
        # The body opens at the first `{` after the signature; a `;` first
        # means a declaration without a body (a trait method).
        depth, j = 0, m.end()
        while j < len(code):
            if code[j] in "([<":
                depth += 1
            elif code[j] in ")]>" and not (code[j] == ">" and code[j - 1] == "-"):
                depth -= 1
            elif code[j] == ";" and depth <= 0:
                j = -1
                break
            elif code[j] == "{" and depth <= 0:
                break
            j += 1
        if j < 0 or j >= len(code):
            continue
        end = block_end(code, j)
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, end) + 1
        found.append((m.group(1), first, last - first + 1))
    return found


def rust_modules(src: Path) -> dict[str, Path]:
    """Module path (`search::dp`) -> file, for every file of a crate."""
    modules = {}
    for path in sorted(src.rglob("*.rs")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts = parts[:-1]
        modules["::".join(parts)] = path
    return modules


def rust_import_graph(src: Path) -> nx.DiGraph:
    """Module -> modules of the same crate that it names (`crate::a::b`,
    `super::x`, and `use` lists), test code left out. A module is an edge's
    end only where it is a file; `crate::a::b::Thing` counts as `a::b`."""
    modules = rust_modules(src)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        code = rust_code(path.read_text())
        for a, b in reversed(cfg_test_spans(code)):
            code = code[:a] + code[b + 1 :]
        here = name.split("::") if name else []
        # A file's own module is its parent for `super::` when it is a mod.rs.
        parent = here[:-1] if path.stem not in ("mod", "lib") else here[:-1]
        paths = []
        for m in re.finditer(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)", code):
            base = [] if m.group(1) == "crate" else parent
            paths.append(base + m.group(2).strip(":").split("::"))
        for m in re.finditer(r"\buse\s+(crate|super)::\{([^;]*)\};", code):
            base = [] if m.group(1) == "crate" else parent
            for item in re.findall(r"([A-Za-z_][A-Za-z0-9_:]*)\s*(?:[,}]|::\{|$)", m.group(2)):
                paths.append(base + item.strip(":").split("::"))
        for parts in paths:
            for k in range(len(parts), 0, -1):
                target = "::".join(parts[:k])
                if target in modules:
                    if target != name and not name.startswith(target + "::") and not target.startswith(name + "::" if name else "\0"):
                        graph.add_edge(name, target)
                    break
    return graph


# ---- Python -----------------------------------------------------------------


def python_files() -> list[Path]:
    return [p for pkg in PYTHON_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def python_module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_import_graph() -> nx.DiGraph:
    """Module -> project modules it imports, anywhere in the file (an import
    inside a function still ties the two modules together)."""
    files = {python_module(p): p for p in python_files()}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                # A package's __init__ re-exporting its modules is not a circle
                # with them; a module importing its own package's names is.
                if target and target != name and not target.startswith(name + "."):
                    graph.add_edge(name, target)
                    break
    return graph


def python_functions(path: Path) -> list[tuple[str, int, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


# ---- findings ---------------------------------------------------------------


def long_functions() -> list[str]:
    found = []
    for src in RUST_CRATES.values():
        for path in sorted(src.rglob("*.rs")):
            found += [f"{path.relative_to(ROOT)}:{line} {name} {count}" for name, line, count in rust_functions(path) if count > MAX_FUNCTION_LINES]
    for path in python_files():
        found += [f"{path.relative_to(ROOT)}:{line} {name} {count}" for name, line, count in python_functions(path) if count > MAX_FUNCTION_LINES]
    return found


def with_submodules_in_parents(graph: nx.DiGraph) -> nx.DiGraph:
    """The graph between top-level modules, each with its submodules: an
    edge `search::candidate -> baselines` is `search -> baselines`, so that
    `baselines -> search::space` closes a circle with it."""
    collapsed = nx.DiGraph()
    for a, b in graph.edges:
        top_a, top_b = a.split("::")[0], b.split("::")[0]
        if top_a != top_b:
            collapsed.add_edge(top_a, top_b)
    return collapsed


def imports_against_the_layers(graph: nx.DiGraph | None = None, layers=CORE_LAYERS) -> list[str]:
    """Imports of dapple-core from a group into a later one of ``layers``,
    and files in no group."""
    graph = graph if graph is not None else rust_import_graph(RUST_CRATES["dapple_core"])
    group = {name: name.split("::")[0] for name in graph.nodes if name}
    found = [f"{name}: in no group" for name, g in group.items() if g not in layers]
    found += [f"{a} -> {b}" for a, b in graph.edges if a and b and group[a] in layers and group[b] in layers
              and layers.index(group[b]) > layers.index(group[a])]
    return sorted(found)


def import_circles() -> list[str]:
    graphs = {crate: rust_import_graph(src) for crate, src in RUST_CRATES.items()}
    for crate in RUST_CRATES:
        graphs[f"{crate} (submodules in their parent)"] = with_submodules_in_parents(graphs[crate])
    graphs["python"] = python_import_graph()
    circles = []
    for where, graph in graphs.items():
        for component in nx.strongly_connected_components(graph):
            if len(component) > 1:
                cycle = nx.find_cycle(graph.subgraph(component))
                circles.append(f"{where}: " + " -> ".join([a for a, _ in cycle] + [cycle[0][0]]))
    return circles


def missing_architecture_paths(text: str | None = None) -> list[str]:
    """Paths in docs/architecture.md's backticks (anything with a `/` or a
    file suffix) that do not exist. A bare name is looked up from the root and
    under the folders named so far in its section (a heading starts one)."""
    text = text if text is not None else (ROOT / "docs" / "architecture.md").read_text()
    missing, folders = [], [ROOT]
    for line in text.splitlines():
        if line.startswith("#"):
            folders = [ROOT]
        for token in re.findall(r"`([^`\s]+)`", line):
            for item in token.split(","):
                item = item.strip()
                if not re.fullmatch(r"[\w./-]+", item) or not ("/" in item or re.search(r"\.(rs|py|md|json|toml|sh)$", item)):
                    continue
                found = [base / item for base in reversed(folders) if (base / item).exists()]
                if not found:
                    missing.append(item)
                elif item.endswith("/"):
                    folders.append(found[0])
    return missing


def test_no_function_over_100_lines():
    assert long_functions() == []


def test_no_import_circles():
    assert import_circles() == []


def test_each_core_group_builds_only_on_those_before_it():
    assert imports_against_the_layers() == []


def test_every_path_in_the_architecture_page_exists():
    assert missing_architecture_paths() == []


def test_the_checks_see_the_tree():
    # Guards against a checker that finds nothing because it reads nothing.
    assert len(rust_modules(RUST_CRATES["dapple_core"])) > 15
    assert python_import_graph().number_of_edges() > 30
    assert rust_import_graph(RUST_CRATES["dapple_core"]).number_of_edges() > 30
    assert sum(1 for src in RUST_CRATES.values() for p in src.rglob("*.rs") for _ in rust_functions(p)) > 300


def test_the_checks_catch_what_they_claim(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "lib.rs").write_text("mod a;\nmod b;\n")
    (src / "a.rs").write_text("use crate::b::Thing;\npub fn f() {\n    let s = \"}\";\n" + "    let x = 1;\n" * 120 + "}\n")
    (src / "b.rs").write_text("pub struct Thing;\nfn g() { crate::a::f() }\n#[cfg(test)]\nmod tests {\n    fn t() {\n" + "    1;\n" * 200 + "    }\n}\n")
    assert [(n, c) for n, _, c in rust_functions(src / "a.rs")] == [("f", 123)]
    assert [n for n, _, _ in rust_functions(src / "b.rs")] == ["g"]
    graph = rust_import_graph(src)
    assert set(graph.edges) == {("a", "b"), ("b", "a")}
    # A circle through a submodule: c::d imports e, e imports c::f.
    (src / "lib.rs").write_text("mod a;\nmod b;\nmod c;\nmod e;\n")
    (src / "c").mkdir()
    (src / "c" / "mod.rs").write_text("mod d;\nmod f;\n")
    (src / "c" / "d.rs").write_text("use crate::e::g;\n")
    (src / "c" / "f.rs").write_text("pub fn h() {}\n")
    (src / "e.rs").write_text("pub fn g() { crate::c::f::h() }\n")
    graph = rust_import_graph(src)
    assert ("c::d", "e") in graph.edges and ("e", "c::f") in graph.edges
    assert not list(nx.simple_cycles(graph.subgraph(["c::d", "c::f", "e"])))
    assert set(with_submodules_in_parents(graph).edges) >= {("c", "e"), ("e", "c")}
    assert imports_against_the_layers(graph, ("e", "c")) == ["a: in no group", "b: in no group", "e -> c::f"]
    page = "## Core (`rust_core/core/src/`)\n| a | `cost.rs`, `gone.rs` |\n## Python\n| b | `cost.rs` `planner/plan.py` |\n"
    assert missing_architecture_paths(page) == ["gone.rs", "cost.rs"]


if __name__ == "__main__":
    for title, findings in (
        ("functions over 100 lines", long_functions()),
        ("import circles", import_circles()),
        ("core imports against CORE_LAYERS", imports_against_the_layers()),
        ("paths in docs/architecture.md that do not exist", missing_architecture_paths()),
    ):
        print(f"{title}: {len(findings)}")
        for finding in findings:
            print(f"  {finding}")
    sys.exit(1 if any((long_functions(), import_circles(), imports_against_the_layers(), missing_architecture_paths()))
             else 0)
