"""bench.gpu's plans: what each part runs on a GPU (FULL), on this CPU as make test's dry run
(DRY_RUN: Triton interpreted, tiny shapes) and as the CPU rehearsal of the GPU plan's load
(REHEARSAL)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.gpu import gpu_checks, gpu_kernels, gpu_moe, gpu_served, gpu_steps
from harness import serve_cluster
from replica_engine.config import GPU_DEFAULTS


@dataclass(frozen=True)
class Plan:
    device: str
    exactness_lengths: tuple[int, ...]  # prompt tokens, one request each
    exactness_tokens: int
    oracle_stand_in: str | None  # a random checkpoint of this shape instead of SmolLM2
    attention_heads: dict[str, tuple[int, int, int]]  # name -> (heads, kv heads, head dim)
    steps: gpu_steps.StepPlan
    kernels: gpu_kernels.KernelPlan  # on the steps' model
    model: str  # offline and served
    offline_requests: int
    max_len: int  # cap on each drawn prompt and output length
    served: gpu_served.ServedPlan
    served_base: Path  # the shipped config the served app is built from
    moe: gpu_moe.MoePlan  # its offline run: offline_requests of the same workload
    # the served app's args over bench/gpu/gpu_served's (the engine alone is built from them too)
    served_app_args: dict = field(default_factory=dict)
    offline_engine: dict = field(default_factory=dict)  # the offline part's settings over its own


FULL = Plan(
    device="cuda",
    exactness_lengths=(5, 40, 200, 700),
    exactness_tokens=32,
    oracle_stand_in=None,
    attention_heads=gpu_checks.HEAD_SHAPES,
    steps=gpu_steps.StepPlan(
        model="dummy:llama3-8b",
        decode_batches=(1, 8, 32, 64, 128, 256),
        context=512,
        mixed=((32, 224), (64, 448), (128, 896), (256, 1792)),
        num_steps=20,
        kv_cache_bytes=None,
    ),
    kernels=gpu_kernels.KernelPlan(
        matmul_rows=(1, 8, 32, 64, 128, 256), profiled_batches=(1, 32, 256), num_steps=5, matmul_calls=50
    ),
    model="dummy:llama3-8b",
    offline_requests=1000,
    max_len=1024,
    served=gpu_served.ServedPlan(
        closed=((1, 16), (64, 128)),
        poisson_rates=(4.0, 8.0, 16.0),
        poisson_requests=48,
        seeds=(0, 1, 2),
        options=(
            ("core_thread", {"engine": {"core_process": False}}),
            ("separate", {"ingress": "separate"}),
        ),
    ),
    served_base=serve_cluster.REPO / "serve_config.gpu.yaml",
    moe=gpu_moe.MoePlan(
        model="dummy:qwen3-30b-a3b",
        decode_batches=(1, 8, 32, 64, 128),
        context=512,
        num_steps=10,
        kv_cache_bytes=None,
    ),
)
DRY_RUN = Plan(
    device="cpu",
    exactness_lengths=(5, 20),
    exactness_tokens=8,
    oracle_stand_in="tiny-llama",  # SmolLM2 through the interpreter: test_triton_attention's job
    # the interpreter runs each (request, head, tile) program in Python: SmolLM2's 9 heads only
    attention_heads={k: v for k, v in gpu_checks.HEAD_SHAPES.items() if k.startswith("smollm2")},
    steps=gpu_steps.StepPlan(
        model="dummy:tiny-llama",
        decode_batches=(1, 4),
        context=32,
        mixed=((4, 28),),
        num_steps=3,
        kv_cache_bytes=16 << 20,
    ),
    kernels=gpu_kernels.KernelPlan(matmul_rows=(4,), profiled_batches=(1, 4), num_steps=2, matmul_calls=1),
    model="dummy:tiny-llama",
    offline_requests=4,  # each token of both runs goes through the interpreted Triton attention
    max_len=24,
    served=gpu_served.ServedPlan(
        closed=((1, 2), (4, 4)), poisson_rates=(4.0,), poisson_requests=3, seeds=(0,)
    ),
    served_base=serve_cluster.SHIPPED_CONFIG,
    moe=gpu_moe.MoePlan(
        model="dummy:tiny-moe", decode_batches=(1, 4), context=32, num_steps=3, kv_cache_bytes=16 << 20
    ),
    served_app_args={"engine": {"core_process": True}},  # as a GPU replica runs its core
)
# `--rehearse`: the served parts on this CPU at the GPU plan's concurrency, the tiny dummy model's
# short steps standing in for a GPU's, so that the serving path's host cost shows against the
# engine alone's as it does beside a GPU (closed loops only: Poisson rates are the GPU's). Its
# engines compute on one thread: a device's work takes no host core, and a second OpenMP thread
# would spin (up to milliseconds after each of a tiny model's short ops) on the core the client,
# HAProxy and the replica's event loop share. Its core in a process of its own, as the dry run's.
#
# Its offline part: the GPU plan's 1,000 requests, with a GPU's batch (budget and width), on the
# CPU's own attention (no graphs), where the tiny model's short steps leave the host's side of
# each step to show, as beside a GPU.
REHEARSAL = replace(
    DRY_RUN,
    max_len=256,
    offline_requests=FULL.offline_requests,
    offline_engine={
        "attention_backend": "auto",
        "max_num_batched_tokens": GPU_DEFAULTS["offline_max_num_batched_tokens"],
        "max_num_seqs": GPU_DEFAULTS["max_num_seqs"],
    },
    served_app_args={**DRY_RUN.served_app_args, "cpu_threads": 1},
    served=replace(
        FULL.served, closed=((1, 16), (64, 256)), poisson_rates=(), poisson_requests=0, seeds=(), rounds=3
    ),
)
