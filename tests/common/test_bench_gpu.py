"""`python -m bench gpu --dry-run` on this CPU, as make test runs it so the command cannot rot
before a session is lent a GPU: every part runs (Triton in its interpreter, tiny dummy shapes; the
served parts through Ray Serve, in a test of their own that starts its cluster), the exactness
checks pass (against the stand-in the lent machine uses where the embedded SmolLM2 cannot travel:
a random checkpoint without a tokenizer), and the speed goals stay unjudged (a CPU's figures are
not an H100's)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.gpu import gpu, gpu_checks, gpu_kernels, gpu_overlap, gpu_served
from common.errors import InvalidRequestError
from replica_engine import LLM, SamplingParams

SERVED_PARTS = ("served", "served_options")


def dry_run(output: Path, parts: list[str]) -> dict:
    """`--dry-run --parts ...` into `output`: each part ran without an error; the result's parts."""
    gpu.main(["--dry-run", "--output", str(output), "--parts", ",".join(parts)])
    result = json.loads(output.read_text())
    assert result["dry_run"]
    assert set(result["parts"]) == set(parts)
    errors = {name: part["error"] for name, part in result["parts"].items() if "error" in part}
    assert not errors, errors
    return result["parts"]


def test_the_gpu_benchmark_rehearses_on_the_cpu(tmp_path: Path):
    """Every part but the served ones (the next test's: they start a Ray cluster)."""
    output = tmp_path / "gpu.json"
    parts = dry_run(output, [p for p in gpu.PARTS if p not in SERVED_PARTS])
    assert json.loads(output.read_text())["goals_met"] == {
        "every exactness check passes": True,
        "greedy tokens with async scheduling identical to synchronous steps (up to ties)": True,
        "every part ran": False,  # not the served ones
    }
    checks = parts["exactness"]["against_transformers"]
    assert [(c["dtype"], c["cuda_graphs"], c["attention_backend"]) for c in checks] == [
        ("float32", False, "triton"),
        ("bfloat16", False, "triton"),
        ("bfloat16", True, "triton"),
    ]
    async_checks = parts["exactness"]["async_against_sync"]
    assert [(c["dtype"], c["cuda_graphs"], c["async_scheduling"]) for c in async_checks] == [
        ("float32", False, True),
        ("bfloat16", True, True),
    ]
    assert parts["exactness"]["checkpoint"] == "tiny-llama shape, transformers' random init"
    assert [c["dtype"] for c in parts["exactness"]["triton_attention"]] == ["float32", "bfloat16"]
    steps = parts["steps"]["steps"]
    cases = ["decode-b1", "decode-b4", "decode-b1 graphs", "decode-b4 graphs", "mixed-4+28"]
    assert [s["case"] for s in steps] == cases
    assert all(s["step_ms"] > 0 and s["floor_ms"] > 0 for s in steps)
    assert parts["steps"]["device"]["source"] == "measured here"
    kernels = parts["kernels"]
    assert [s["rows"] for s in kernels["matmuls"]["step"]] == [4]
    matmuls = {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", "logits"}
    assert {m["matmul"] for m in kernels["matmuls"]["alone"]} == matmuls
    # the split-K candidate (interpreted here) computes what the library's matmul does
    assert all(m["split_k_relative_error"] < 1e-2 for m in kernels["matmuls"]["alone"])
    for mode in ("eager", "graphs"):
        profiles = kernels[f"profile_{mode}"]
        assert set(profiles) == {"decode-b1", "decode-b4"}
        assert all(p["kernels_ms_per_step"] > 0 and p["top"] for p in profiles.values()), profiles
    assert set(parts["offline"]) == {"eager", "graphs", "graphs_sync", "graphs_1024"}
    assert parts["offline"]["graphs_1024"]["max_num_seqs"] == 1024
    assert all(run["output_tokens"] > 0 and run["steps"] > 0 for run in parts["offline"].values())
    # The mixture: both layers' experts counted (2 picks of 8 a token), eager and graphs alike.
    moe = parts["moe"]
    assert [s["case"] for s in moe["steps"]] == cases[:4]
    eager_b1, eager_b4, graphs_b1, _ = (s["experts_read"] for s in moe["steps"])
    assert eager_b1 == 4 and 4 <= eager_b4 <= 16 and graphs_b1 == eager_b1  # a layer reads at most 8
    assert moe["offline_graphs"]["output_tokens"] > 0


@pytest.mark.own_ray_cluster
def test_the_gpu_benchmarks_served_parts_rehearse_through_serve(tmp_path: Path):
    parts = dry_run(tmp_path / "gpu.json", list(SERVED_PARTS))
    # The same requests through Serve and through the engine alone, none failed.
    for system in ("engine_alone", "served"):
        runs = parts["served"][system]
        assert set(runs) == {"c1", "c4", "poisson_4"}
        assert runs["c1"]["output_tok_per_s"] > 0 and runs["poisson_4"]["median"]["output_tok_per_s"] > 0
    # Where the cores went in each closed loop (tests/common/test_cpu_split.py: how it names them).
    for system in ("engine_alone", "served"):
        cores = parts["served"][system]["c4"]["cpu"]
        assert cores["wall_s"] > 0 and "the rest" in cores["by_process"], cores
    comparison = parts["served"]["served_vs_alone"]
    assert comparison["failed_requests"] == 0 and comparison["high_concurrency_tok_per_s_ratio"] > 0


def test_parts_run_alone_keep_the_files_other_parts(tmp_path: Path, monkeypatch):
    """A device call runs for 10 minutes at most: the parts go in two calls, into one file, and a
    part cut short keeps the figures it had."""
    output = tmp_path / "gpu.json"
    first = {"checkpoint": "stand-in: the first call's", **{kind: [] for kind in gpu.EXACTNESS_KINDS}}
    monkeypatch.setattr(gpu, "exactness", lambda plan, work_dir: first)
    gpu.main(["--dry-run", "--output", str(output), "--parts", "exactness"])
    monkeypatch.setattr(gpu, "steps", lambda plan, dry_run: {"error": "stand-in: the second call's"})
    first_measured_at = json.loads(output.read_text())["measured_at"]["exactness"]
    gpu.main(["--dry-run", "--output", str(output), "--parts", "steps"])
    result = json.loads(output.read_text())
    assert result["parts"] == {"exactness": first, "steps": {"error": "stand-in: the second call's"}}
    assert result["measured_at"]["exactness"] == first_measured_at  # a kept part keeps its date
    assert set(result["measured_at"]) == {"exactness", "steps"}

    def cut_short(plan, dry_run):  # the device call's time limit, mid-part
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu, "steps", cut_short)
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--dry-run", "--output", str(output), "--parts", "exactness,steps"])
    cut = json.loads(output.read_text())  # exactness ran again; steps keeps the second call's
    assert cut["parts"]["steps"] == result["parts"]["steps"]
    assert cut["measured_at"]["steps"] == result["measured_at"]["steps"]
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--output", str(output), "--parts", "steps,nonsense"])


def test_a_checkpoint_without_a_tokenizer_serves_token_ids(tmp_path: Path):
    """The stand-in the lent machine compares against (the dry run above checks its outputs)."""
    checkpoint = gpu_checks.random_checkpoint(tmp_path, "tiny-llama")
    assert not list(checkpoint.glob("tokenizer*"))
    llm = LLM(model=str(checkpoint), dtype="float32", kv_cache_bytes=4 << 20)
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")


def test_served_options_serve_each_options_app_args(tmp_path: Path, monkeypatch):
    """The served_options part (in a GPU's plan only: each option is a cluster of its own): each
    option's app args over the served part's, its engine settings merged into theirs, and each
    compared with the engine alone's closed loops. Stand-ins for the clusters and the engine."""
    figures = {"output_tok_per_s": 100.0, "ttft_p50_s": 0.02, "tbt_p50_s": 0.005, "failed": 0}
    alone_plans, served_args = [], []

    def engine_alone(args, base, arrivals, plan):
        alone_plans.append(plan)
        return {"c1": figures, "c4": figures}

    def through_serve(args, base, work_dir, arrivals, plan):
        served_args.append(args)
        return {"c1": {**figures, "ttft_p50_s": 0.03}, "c4": {**figures, "output_tok_per_s": 50.0}}

    monkeypatch.setattr(gpu_served, "engine_alone", engine_alone)
    monkeypatch.setattr(gpu_served, "through_serve", through_serve)
    option = {"ingress": "colocated", "engine": {"core_process": True}}
    plan = replace(gpu.DRY_RUN, served=replace(gpu.DRY_RUN.served, options=(("both", option),)))
    result = gpu.served_options(plan, tmp_path)
    assert [p.poisson_rates for p in alone_plans] == [()]  # closed loops only
    assert served_args == [
        {"model": plan.model, "num_replicas": 1, "num_gpus": 0, "ingress": "colocated",
         "engine": {"dtype": "bfloat16", "core_process": True}}
    ]  # fmt: skip
    versus = result["both"]["vs_alone"]
    assert versus["high_concurrency_tok_per_s_ratio"] == 0.5
    assert versus["c1_ttft_p50_extra_s"] == pytest.approx(0.01)
    assert gpu.served_options(gpu.DRY_RUN, tmp_path) == {"skipped": "no served options in this plan"}


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [  # names of the forms a CUDA profile gives (nvjet: cuBLAS's Hopper GEMMs), and ours
        ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", "matmul"),
        ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_traits<128, cutlass::bfloat16_t>>", "attention"),
        ("_paged_attention_kernel", "attention"),
        ("_rms_norm_kernel", "fused pointwise"),
        ("_silu_mul_kernel", "fused pointwise"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>", "torch elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, FillFunctor<int>>", "torch elementwise"),
        ("aten::addmm", "matmul"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
        ("triton_poi_fused_add_0", "other"),
    ],
)
def test_a_profiles_kernels_are_grouped_by_what_they_do(kernel: str, kind: str):
    assert gpu_kernels.category(kernel) == kind


@pytest.mark.parametrize("ahead", [True, False])
def test_the_stand_in_device_runs_the_engines_own_loop(ahead: bool):
    """bench.gpu --rehearse's overlap part: the real engine over a stand-in device (a thread
    sleeping an H100 roofline's step times). With async scheduling the core submits a step
    before collecting the one in flight; in synchronous steps never."""
    engine = {"attention_backend": "auto", "max_num_batched_tokens": 256, "max_num_seqs": 8}
    run = gpu_overlap.overlap_run("dummy:tiny-llama", 12, 40, engine, ahead)
    assert run["requests"] == 12 and run["steps"] > 0  # every token came back (checked inside)
    assert run["most_steps_in_flight"] == (2 if ahead else 1)
    assert 0 < run["device_busy_s"] <= run["wall_s"]
