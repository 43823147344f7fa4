"""The .pyi stubs describe the compiled module exactly (names, parameters, defaults)."""

import ast
import inspect
from pathlib import Path

import planner._core as core

STUB = Path(core.__file__).parent / "_core.pyi"


def stub_functions():
    tree = ast.parse(STUB.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_every_compiled_function_has_a_stub_and_back():
    compiled = {n for n in dir(core) if not n.startswith("_") and callable(getattr(core, n))}
    assert compiled == set(stub_functions())


def test_stub_parameters_match_the_compiled_signatures():
    for name, node in stub_functions().items():
        sig = inspect.signature(getattr(core, name))
        args = node.args
        stub_positional = [a.arg for a in args.args]
        stub_kwonly = [a.arg for a in args.kwonlyargs]
        real_positional = [p.name for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        real_kwonly = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert (stub_positional, stub_kwonly) == (real_positional, real_kwonly), name
        stub_defaults = [ast.literal_eval(d) for d in args.defaults] + [
            ast.literal_eval(d) if d is not None else inspect.Parameter.empty for d in args.kw_defaults
        ]
        real_defaults = [p.default for p in sig.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD][
            len(stub_positional) - len(args.defaults):
        ] + [p.default for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert stub_defaults == real_defaults, name
