"""Every Triton kernel of the engine (and bench.gpu's split-K candidate) compiles for the GPUs
bench.gpu runs on (sm_90: H100 and H200), here, without one: Triton lowers a kernel to a cubin
with its own ptxas, and no device is needed for that. The other Triton tests run the kernels in
Triton's interpreter, which executes their Python and never compiles them, so a kernel can pass
there and fail to compile (a branch whose types differ, a constexpr used as a tensor): this
catches it before a lent GPU's minutes are spent on it. Each kernel is compiled with the
arguments its wrapper launches it with (recorded at the launch, not run), as a GPU would get them
(the interpreter's float32 dots off), in a process without the interpreter
(harness/triton_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

from bench.gpu import split_k_matmul
from harness.paged_batches import paged_batch
from harness.triton_compile import launch_record
from replica_engine.attention import triton_paged
from replica_engine.kernels import triton_moe, triton_pointwise

LLAMA3_8B = (32, 8, 128)  # heads, KV heads, head dim
SMOLLM2 = (9, 3, 64)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Launches:
    """Each kernel launch a wrapper makes, recorded (not run) under a case name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.records: list[dict] = []
        self._monkeypatch = monkeypatch

    def record(self, case: str, kernel: object, launch: Callable[[], object]) -> None:
        calls: list[tuple[tuple, dict]] = []
        self._monkeypatch.setattr(kernel, "run", lambda *a, grid, warmup, **kw: calls.append((a, kw)))
        launch()
        assert calls, f"{case}: the wrapper launched nothing"
        self.records += [launch_record(f"{case} #{i}", kernel, *call) for i, call in enumerate(calls)]


def test_every_triton_kernel_compiles_for_sm90(monkeypatch):
    monkeypatch.setattr(triton_paged, "_INTERPRETED", False)  # bf16 dots as a GPU runs them
    monkeypatch.setattr(triton_moe, "_INTERPRETED", False)
    monkeypatch.setattr(split_k_matmul, "_INTERPRETED", False)
    launches = Launches(monkeypatch)
    record_pointwise(launches)  # in bfloat16: float32 takes no other branch in them
    for name, dtype in DTYPES.items():  # float32: the dots at full precision, another branch
        record_attention(launches, name, dtype)
        record_moe(launches, name, dtype)
        record_split_k(launches, name, dtype)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "harness.triton_compile"],
        input=json.dumps(launches.records),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    failures = json.loads(done.stdout)
    assert failures == {}, "\n".join(f"{case}: {error[-1500:]}" for case, error in failures.items())
    kernels = {record["kernel"] for record in launches.records}
    assert kernels == {
        "_rms_norm_kernel", "_silu_mul_kernel", "_rotary_store_kernel", "_paged_attention_kernel",
        "_grouped_gemm_kernel", "_split_k_kernel",
    }  # fmt: skip


def record_pointwise(launches: Launches) -> None:
    name, dtype = "bf16", torch.bfloat16
    for dim, with_residual in ((576, True), (4096, True), (4096, False)):  # 576: no power of two
        x, weight = torch.zeros(2, dim, dtype=dtype), torch.ones(dim, dtype=dtype)
        residual = torch.zeros_like(x) if with_residual else None
        case = f"rms_norm {name} {dim} residual={with_residual}"
        launch = partial(triton_pointwise.rms_norm, x, weight, 1e-5, residual)
        launches.record(case, triton_pointwise._rms_norm_kernel, launch)
    launch = partial(triton_pointwise.silu_mul, torch.zeros(2, 2 * 14336, dtype=dtype))
    launches.record(f"silu_mul {name}", triton_pointwise._silu_mul_kernel, launch)
    for heads, kv_heads, head_dim in (LLAMA3_8B, SMOLLM2):
        tokens = 3
        qkv = torch.zeros(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        cos = sin = torch.ones(tokens, 1, head_dim, dtype=dtype)
        caches = [torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype) for _ in "kv"]
        views = (t.view(tokens, -1, head_dim) for t in (q, k, v))
        launch = partial(
            triton_pointwise.rotary_store_, *views, cos, sin, *caches, torch.arange(16, 16 + tokens)
        )
        launches.record(
            f"rotary_store {name} {heads}/{kv_heads}/{head_dim}",
            triton_pointwise._rotary_store_kernel,
            launch,
        )


def record_attention(launches: Launches, name: str, dtype: torch.dtype) -> None:
    for heads, kv_heads, head_dim in (LLAMA3_8B, SMOLLM2):
        for kind, rows in (("decode", [(40, 1), (7, 1)]), ("mixed", [(0, 21), (30, 1), (12, 9)])):
            batch = paged_batch(rows, heads, kv_heads, head_dim, 16, seed=0, dtype=dtype)
            args = (batch.query, batch.k_cache, batch.v_cache, batch.metadata, head_dim**-0.5)
            launch = partial(triton_paged.TritonAttention().attend, *args)
            case = f"paged_attention {name} {kind} {heads}/{kv_heads}/{head_dim}"
            launches.record(case, triton_paged._paged_attention_kernel, launch)


def record_moe(launches: Launches, name: str, dtype: torch.dtype) -> None:
    experts, hidden, width, top_k = 8, 256, 128, 2
    for num_tokens in (1, 64):
        x = torch.zeros(num_tokens, hidden, dtype=dtype)
        gate_up = torch.zeros(experts, 2 * width, hidden, dtype=dtype)
        down = torch.zeros(experts, hidden, width, dtype=dtype)
        ids = torch.randint(0, experts, (num_tokens, top_k), generator=torch.Generator().manual_seed(0))
        weights = torch.full((num_tokens, top_k), 0.5)
        launch = partial(triton_moe.fused_moe, x, gate_up, down, ids, weights)
        # two launches: gate|up, then down with the routing weights
        launches.record(f"grouped_gemm {name} {num_tokens} tokens", triton_moe._grouped_gemm_kernel, launch)


def record_split_k(launches: Launches, name: str, dtype: torch.dtype) -> None:
    """bench.gpu's split-K candidate (bench/gpu/split_k_matmul.py) at the row counts it takes."""
    weight = torch.zeros(256, 512, dtype=dtype)
    for rows in (1, 32, 64):
        launch = partial(
            split_k_matmul.split_k_linear,
            torch.zeros(rows, 512, dtype=dtype),
            weight,
            split_k_matmul.CONFIGS[-1],
        )
        launches.record(f"split_k {name} {rows} rows", split_k_matmul._split_k_kernel, launch)
