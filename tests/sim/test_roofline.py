"""The GPU roofline the simulator uses where no GPU can run: hand-computed times for Llama-3-8B."""

import json
from pathlib import Path

import pytest
import yaml

from common.model_shapes import dummy_config_dict
from fleet_sim.roofline import ModelCost, RooflineStepTime
from fleet_sim.sizing import main
from replica_engine.scheduler.step_time_model import StepShape
from tests.sim.test_sizing import SHIPPED, write_lines

LLAMA3_8B = dummy_config_dict("llama3-8b")


def test_the_model_cost_is_llama_3_8bs_published_size():
    cost = ModelCost.of(LLAMA3_8B)
    assert cost.weight_bytes / 2 == pytest.approx(8.03e9, rel=0.001)  # 8.03 B parameters in bf16
    assert cost.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128


def test_a_mixtures_cost_is_its_published_size_and_a_token_computes_its_top_k_experts():
    cost = ModelCost.of(dummy_config_dict("qwen3-30b-a3b"))
    assert cost.weight_bytes / 2 == pytest.approx(30.5e9, rel=0.01)  # "30.5B in total, 3.3B activated"
    embedding = 151936 * 2048  # looked up, not multiplied; the count includes it
    active = cost.linear_flops_per_token / 2 + cost.lm_head_flops / 2 + embedding
    assert active == pytest.approx(3.3e9, rel=0.03)
    assert cost.expert_bytes_per_expert == 48 * 3 * 2048 * 768 * 2
    mixtral = ModelCost.of(dummy_config_dict("mixtral-8x7b"))
    assert mixtral.weight_bytes / 2 == pytest.approx(46.7e9, rel=0.01)


def test_a_decode_step_reads_only_the_experts_its_tokens_touch():
    """One token reads its 8 experts of 128 in every layer; as the batch grows the expected count
    of distinct experts (uniform routing) nears all 128, and the step reads every weight."""
    cost = ModelCost.of(dummy_config_dict("qwen3-30b-a3b"))
    dense = cost.weight_bytes - 128 * cost.expert_bytes_per_expert
    assert cost.bytes_read(1) == pytest.approx(dense + 8 * cost.expert_bytes_per_expert)
    assert cost.bytes_read(32) == pytest.approx(
        dense + 128 * (1 - (120 / 128) ** 32) * cost.expert_bytes_per_expert
    )
    assert cost.bytes_read(1) < cost.bytes_read(8) < cost.bytes_read(32) < cost.bytes_read(256)
    assert cost.bytes_read(256) == pytest.approx(cost.weight_bytes, rel=1e-6)
    h100 = RooflineStepTime.named("h100-sxm", dummy_config_dict("qwen3-30b-a3b"))
    one = StepShape.of([(99, 1, True)])
    weights_s = cost.bytes_read(1) / (3.35e12 * 0.8)
    kv_s = 100 * cost.kv_bytes_per_token / (3.35e12 * 0.8)
    lm_head_s = cost.lm_head_flops / (989e12 * 0.6)
    assert h100.predict_raw(one) == pytest.approx(1e-3 + weights_s + kv_s + lm_head_s)
    assert ModelCost.of(LLAMA3_8B).bytes_read(64) == ModelCost.of(LLAMA3_8B).weight_bytes


def test_a_small_decode_reads_the_weights_and_a_full_prompt_chunk_is_bound_by_compute():
    h100 = RooflineStepTime.named("h100-sxm", LLAMA3_8B)
    cost = h100.cost
    weights_s = cost.weight_bytes / (3.35e12 * 0.8)
    one_decode = StepShape.of([(99, 1, True)])  # 100 keys and values read
    lm_head_s = cost.lm_head_flops / (989e12 * 0.6)
    kv_s = 100 * cost.kv_bytes_per_token / (3.35e12 * 0.8)
    assert h100.predict_raw(one_decode) == pytest.approx(1e-3 + weights_s + kv_s + lm_head_s)
    chunk = StepShape().plus(0, 8192)
    linear_s = 8192 * cost.linear_flops_per_token / (989e12 * 0.6)
    attention_s = (8192 * 8193 // 2) * cost.attention_flops_per_pair / (989e12 * 0.5)
    assert linear_s > weights_s  # past the knee
    assert h100.predict_raw(chunk) == pytest.approx(1e-3 + linear_s + attention_s + lm_head_s)
    assert h100.predict(chunk) == h100.predict_raw(chunk)


def llama3_8b_config(tmp_path: Path, model: str = "dummy:llama3-8b", **engine: object) -> Path:
    """serve_config.yaml with Llama-3-8B's shape (or `model`'s), an 8,192-token budget and `engine`
    over it."""
    config = yaml.safe_load(SHIPPED.read_text())
    args = config["applications"][0]["args"]
    args["model"] = model
    args["engine"].update(max_num_batched_tokens=8192, **engine)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_an_unknown_accelerator_is_refused_by_name():
    with pytest.raises(ValueError, match="accelerator: 'tpu-v9'"):
        RooflineStepTime.named("tpu-v9", LLAMA3_8B)


def test_the_sizing_command_sizes_a_gpu_fleet_from_the_configs_model(tmp_path, capsys):
    serve_config = llama3_8b_config(tmp_path, kv_cache_bytes=50 * 10**9, max_num_seqs=256)
    request = {"output_tokens": 100, "prompt_tokens": 2000}
    # 30 requests/s: 60,000 prompt tokens/s, where one replica's steps compute ~36,000 (8,192 in 0.23 s)
    trace = write_lines(tmp_path, *(json.dumps({"arrival_s": i / 30, **request}) for i in range(300)))
    argv = ["--trace", str(trace), "--serve-config", str(serve_config), "--accelerator", "h100-sxm"]
    main([*argv, "--replicas", "1,2", "--routers", "power_of_two", "--ttft-p90-target", "0.5"])
    out = capsys.readouterr().out
    assert "a replica: 23840 KV blocks" in out  # 50 GB of 2 MiB blocks, less the null block
    assert out.splitlines()[-1] == "TTFT p90 <= 0.5 s with power_of_two: 2 replicas"


def test_two_gpus_halve_the_work_and_add_two_all_reduces_a_layer():
    one, two = (RooflineStepTime.named("h100-sxm", LLAMA3_8B, gpus) for gpus in (1, 2))
    cost, h100 = one.cost, one.accelerator
    decodes = StepShape.of([(1023, 1, True)] * 64)
    work = one.predict_raw(decodes) - h100.step_overhead_s
    # 64 tokens of 4,096 bf16 values; a ring of N GPUs moves 2(N-1)/N of them: all of them for two
    all_reduce_s = 10e-6 + 64 * 4096 * 2 / (0.7 * 450e9)
    assert two.predict_raw(decodes) == pytest.approx(h100.step_overhead_s + work / 2 + 64 * all_reduce_s)
    assert cost.num_layers == 32


def test_the_sizing_command_sizes_tensor_parallel_replicas(tmp_path, capsys):
    serve_config = llama3_8b_config(tmp_path, kv_cache_bytes=100 * 10**9, tensor_parallel_size=2)
    trace = write_lines(
        tmp_path,
        *(json.dumps({"arrival_s": i / 10, "output_tokens": 50, "prompt_tokens": 500}) for i in range(50)),
    )
    argv = [
        "--trace",
        str(trace),
        "--serve-config",
        str(serve_config),
        "--replicas",
        "1",
        "--routers",
        "power_of_two",
    ]
    main([*argv, "--accelerator", "h100-sxm"])
    assert "2 GPUs (tensor parallel)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--step-time", str(tmp_path / "unused.json")])
    assert "engine.tensor_parallel_size: needs --accelerator" in capsys.readouterr().err


def test_the_sizing_command_sizes_a_mixture_of_experts_fleet(tmp_path, capsys):
    """Qwen3-30B-A3B on two H100s, its experts split between them."""
    serve_config = llama3_8b_config(
        tmp_path,
        "dummy:qwen3-30b-a3b",
        kv_cache_bytes=60 * 10**9,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )
    trace = write_lines(
        tmp_path,
        *(json.dumps({"arrival_s": i / 20, "output_tokens": 100, "prompt_tokens": 1000}) for i in range(200)),
    )
    argv = ["--trace", str(trace), "--serve-config", str(serve_config), "--accelerator", "h100-sxm"]
    main([*argv, "--replicas", "1,2", "--routers", "power_of_two", "--ttft-p90-target", "0.5"])
    out = capsys.readouterr().out
    assert "a replica: 38145 KV blocks" in out  # 60 GB in 1.5 MiB blocks (48 layers, 4 KV heads of 128)
    assert "2 GPUs (tensor parallel)" in out
    assert out.splitlines()[-1].startswith("TTFT p90 <= 0.5 s with power_of_two: ")
