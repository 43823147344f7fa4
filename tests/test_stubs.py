"""The .pyi stubs describe the compiled module exactly (names, parameters,
defaults, classes and their members, constants)."""

import ast
import inspect
from pathlib import Path

import dapple.planner._core as core

STUB = Path(core.__file__).parent / "_core.pyi"
TREE = ast.parse(STUB.read_text())


def functions(body):
    return {node.name: node for node in body if isinstance(node, ast.FunctionDef)}


def annotated(body):
    return {node.target.id for node in body if isinstance(node, ast.AnnAssign)}


def classes():
    return {node.name: node for node in TREE.body if isinstance(node, ast.ClassDef)}


def public(obj):
    return {n for n in dir(obj) if not n.startswith("_")}


def test_every_compiled_name_has_a_stub_and_back():
    compiled = public(core)
    stubbed = set(functions(TREE.body)) | annotated(TREE.body) - {"__version__"} | set(classes())
    assert compiled == stubbed


def test_every_class_member_has_a_stub_and_back():
    for name, node in classes().items():
        members = public(getattr(core, name))
        assert members == set(functions(node.body)) | annotated(node.body), name


def check_signature(function, node, skip_self=False):
    sig = inspect.signature(function)
    args = node.args
    stub_positional = [a.arg for a in args.args][1 if skip_self else 0:]
    stub_kwonly = [a.arg for a in args.kwonlyargs]
    params = [p for p in sig.parameters.values() if p.name != "self"]
    real_positional = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
    real_kwonly = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    assert (stub_positional, stub_kwonly) == (real_positional, real_kwonly), node.name
    stub_defaults = [ast.literal_eval(d) for d in args.defaults] + [
        ast.literal_eval(d) if d is not None else inspect.Parameter.empty for d in args.kw_defaults
    ]
    real_defaults = [p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)][
        len(real_positional) - len(args.defaults):
    ] + [p.default for p in params if p.kind is p.KEYWORD_ONLY]
    assert stub_defaults == real_defaults, node.name


def test_stub_parameters_match_the_compiled_signatures():
    for name, node in functions(TREE.body).items():
        check_signature(getattr(core, name), node)
    for cls_name, cls_node in classes().items():
        cls = getattr(core, cls_name)
        for name, node in functions(cls_node.body).items():
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
            check_signature(getattr(cls, name), node, skip_self=not static)
