"""CPU checks of the integration example in docs/python.md (the GPU suite
runs it: test_gpu_docs_example.py): it compiles, and every module attribute
it names exists and is called with arguments its signature takes."""

import ast
import importlib
import inspect

import pytest

import csfmoe
from docs_example import example


@pytest.fixture(scope="module")
def tree():
    src = example("integration")
    compile(src, "docs/python.md:integration", "exec")  # a SyntaxError names the doc line
    return ast.parse(src)


def _aliases(tree):
    """Names bound by the block's imports -> the objects they name."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                # `import a.b` binds `a`; `import a.b as c` binds `c` to a.b.
                name = a.name if a.asname else a.name.split(".")[0]
                out[a.asname or name] = importlib.import_module(name)
        elif isinstance(node, ast.ImportFrom):
            mod = importlib.import_module(node.module)
            for a in node.names:
                assert hasattr(mod, a.name), f"from {node.module} import {a.name}: no such name"
                out[a.asname or a.name] = getattr(mod, a.name)
    return out


def _resolve(node, aliases):
    """The object a dotted name (csfmoe.checkpoint.save_file) names, or None
    when it does not start at an imported module."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, aliases)
        if base is None:
            return None
        assert hasattr(base, node.attr), f"{ast.unparse(node)}: {base!r} has no attribute '{node.attr}'"
        return getattr(base, node.attr)
    return None


def test_docs_example_compiles_and_names_exist(tree):
    aliases = _aliases(tree)
    assert aliases.get("csfmoe") is csfmoe
    named = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _resolve(node, aliases) is not None:
            named += 1
    assert named >= 10  # the block really uses the package's API


def test_docs_example_calls_fit_signatures(tree):
    aliases = _aliases(tree)
    checked = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = _resolve(node.func, aliases)
        if fn is None or any(isinstance(a, ast.Starred) for a in node.args) or any(
                k.arg is None for k in node.keywords):
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature
            continue
        kwargs = {k.arg: None for k in node.keywords}
        try:
            sig.bind(*[None] * len(node.args), **kwargs)
        except TypeError as err:
            raise AssertionError(f"{ast.unparse(node)}: {err}") from None
        if fn is csfmoe.prepare_experts:
            # Extra keywords go on to PreparedExperts.
            extra = set(kwargs) - set(sig.parameters)
            known = set(inspect.signature(csfmoe.PreparedExperts).parameters)
            assert extra <= known, f"{ast.unparse(node)}: PreparedExperts takes no {sorted(extra - known)}"
        checked.add(getattr(fn, "__qualname__", repr(fn)))
    for want in ("save_file", "compress_checkpoint", "load_checkpoint", "gather_moe_layer", "prepare_experts"):
        assert any(q.endswith(want) for q in checked), f"the example no longer calls {want}"
