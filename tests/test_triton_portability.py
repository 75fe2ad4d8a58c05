"""The Triton kernels compile on the GPU image's Triton as well as on this repository's: rules checked on the
source, since CI has one Triton version and no GPU. Triton 3.6 (the H200 image's) fails to compile a nested
``@triton.jit`` call that leaves a string-valued ``tl.constexpr`` parameter to its default ("'str' object has no
attribute 'type'"), which Triton 3.7 accepts: run 29 lost every paged decode step to it. So no jit function
declares a string default; pass such values explicitly."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = sorted([ROOT / "core" / "gemmaserve" / "triton_sampling.py",
                         *(ROOT / "plugins" / "custom_torch" / "gemmaserve_custom_torch" / "kernels").glob("*.py")])


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name) \
        and target.value.id == "triton"


def string_defaults(source: str) -> list[str]:
    """``function(parameter)`` for each parameter of a ``@triton.jit`` function whose default is a string."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
            positional = node.args.posonlyargs + node.args.args
            pairs = list(zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults))
            pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
            found += [f"{node.name}({arg.arg})" for arg, default in pairs
                      if isinstance(default, ast.Constant) and isinstance(default.value, str)]
    return found


def test_the_rule_finds_a_string_default() -> None:
    source = ("import triton\nimport triton.language as tl\n@triton.jit\ndef helper(x, CACHE: tl.constexpr = '.cg'):\n"
              "    pass\n@triton.jit(do_not_specialize=['n'])\ndef kernel(x, *, MODE: tl.constexpr = 'a', n=1):\n"
              "    pass\ndef plain(mode='x'):\n    pass\n")
    assert string_defaults(source) == ["helper(CACHE)", "kernel(MODE)"]


def test_no_triton_jit_function_declares_a_string_default() -> None:
    assert len(KERNEL_SOURCES) > 5, KERNEL_SOURCES
    offenders = {path.name: found for path in KERNEL_SOURCES if (found := string_defaults(path.read_text()))}
    assert not offenders, f"pass these explicitly at every call instead (Triton 3.6 cannot compile them): {offenders}"
