"""Compiling Triton kernels for the H200 (sm_90) without a GPU: Triton -> PTX -> cubin with Triton's bundled
ptxas, the real compiler path the interpreter never takes. For the kernel tests' compile checks."""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest


def require_hopper_compiler() -> None:
    """Skip the calling test where the compile cannot run: under the interpreter, or without bundled ptxas."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs under the Triton interpreter")
    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not (Path(nvidia.__file__).parent / "bin" / "ptxas").exists():
        pytest.skip("triton has no bundled ptxas here")


def compile_for_hopper(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], *,
                       unaligned: Collection[str] = (), num_warps: int = 4) -> dict[str, Any]:
    """The sm_90 build of ``kernel`` at ``num_warps`` (its ``asm``: "ptx", "cubin", ...). Every pointer and integer
    argument not in ``unaligned`` carries the 16-divisibility the launcher sees at model shapes (fp32 scalars never
    do)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
               if kind not in ("constexpr", "fp32") and name not in unaligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], (kernel, constexprs)
    return compiled.asm
