"""Compile Triton kernels for a GPU target without a GPU (Triton lowers them to a cubin with its
own ptxas), for tests/engine/test_triton_compiles.py. It runs as a process of its own: with
TRITON_INTERPRET=1 (the tests' setting on a CPU) Triton's standard library is the interpreter's,
and a kernel calling it does not compile.

`python -m harness.triton_compile` reads a JSON list of launches on stdin, each {"case",
"module", "kernel", "args", "kwargs"} (a tensor argument given as {"tensor": its dtype}), and
writes a JSON object of each failed case's error (empty: every kernel compiled)."""

from __future__ import annotations

import importlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

POINTER_TYPES = {
    "bfloat16": "*bf16",
    "float32": "*fp32",
    "float16": "*fp16",
    "int32": "*i32",
    "int64": "*i64",
}
SM90 = ("cuda", 90, 32)  # H100 and H200


def launch_record(case: str, kernel: object, args: tuple, kwargs: dict) -> dict:
    """A launch as this module's input: its tensors by dtype, its other values as they are."""

    def plain(value: object) -> object:
        return (
            {"tensor": str(value.dtype).removeprefix("torch.")} if isinstance(value, torch.Tensor) else value
        )

    fn = kernel.fn  # the interpreter's and Triton's own JITFunction both keep it
    return {
        "case": case,
        "module": fn.__module__,
        "kernel": fn.__name__,
        "args": [plain(a) for a in args],
        "kwargs": {name: plain(v) for name, v in kwargs.items()},
    }


def _signature(jit, launch: dict) -> tuple[dict[str, str], dict[str, object]]:
    values = dict(zip(jit.arg_names, launch["args"], strict=False)) | launch["kwargs"]
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = {}
    for param in jit.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, dict):
            signature[param.name] = POINTER_TYPES[value["tensor"]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs


def _compile(launch: dict) -> str | None:
    """The launch's kernel compiled for SM90 with its arguments' types: None, or why not."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    signature, constexprs = _signature(jit, launch)
    try:
        compiled = triton.compile(ASTSource(jit, signature, constexprs), target=GPUTarget(*SM90))
    except Exception as error:  # reported by case: the test lists every kernel that failed
        return f"{type(error).__name__}: {error}"
    return None if compiled.asm.get("cubin") else "no cubin"


def compile_launches(launches: list[dict]) -> dict[str, str]:
    """Each launch compiled (two at a time: ptxas and Triton's passes take a core each); the
    failures' errors by case."""
    with ProcessPoolExecutor(max_workers=2) as pool:
        errors = list(pool.map(_compile, launches))
    return {launch["case"]: error for launch, error in zip(launches, errors, strict=True) if error}


if __name__ == "__main__":
    json.dump(compile_launches(json.load(sys.stdin)), sys.stdout)
