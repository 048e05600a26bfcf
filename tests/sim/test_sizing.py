"""Sizing a fleet from a user's trace and serve_config.yaml (fleet_sim/sizing.py)."""

import json
from pathlib import Path

import pytest
import yaml

from fleet_sim.sizing import fleet_settings, load_trace, main

SHIPPED = Path(__file__).parents[2] / "serve_config.yaml"


def write_lines(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_trace_lines_become_requests_in_arrival_order_sharing_exactly_their_named_prefix(tmp_path):
    shared = {"output_tokens": 5, "prefix_id": "doc", "prefix_tokens": 32}
    trace = write_lines(
        tmp_path,
        json.dumps({"arrival_s": 2.0, "prompt_tokens": 40, **shared}),
        '{"arrival_s": 1.0, "output_tokens": 3, "prompt_token_ids": [7, 8, 9], "tenant": "t"}',
        "",
        json.dumps({"arrival_s": 3.0, "prompt_tokens": 50, **shared}),
    )
    first, second, third = load_trace(trace)
    assert (first.prompt_token_ids, first.max_tokens, first.tenant) == ((7, 8, 9), 3, "t")
    assert second.prompt_token_ids[:32] == third.prompt_token_ids[:32]
    assert second.prompt_token_ids[32:] != third.prompt_token_ids[32:40]
    assert (len(second.prompt_token_ids), len(third.prompt_token_ids), second.tenant) == (40, 50, "doc")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not JSON"),
        ('{"arrival_s": 1, "prompt_tokens": 4}', "line 2: field 'output_tokens' must be an integer >= 1"),
        ('{"arrival_s": -1, "output_tokens": 1, "prompt_tokens": 4}', "line 2: field 'arrival_s'"),
        ('{"arrival_s": 1, "output_tokens": 1, "prompt_tokens": 4, "hue": 1}', "line 2: unknown field 'hue'"),
        ('{"arrival_s": 1, "output_tokens": 1, "prompt_token_ids": []}', "line 2: field 'prompt_token_ids'"),
        (
            '{"arrival_s": 1, "output_tokens": 1, "prompt_tokens": 4, "prefix_id": "a", "prefix_tokens": 9}',
            "line 2: field 'prefix_tokens' \\(9\\) exceeds 'prompt_tokens' \\(4\\)",
        ),
    ],
)
def test_a_malformed_trace_line_is_an_error_naming_the_line_and_field(tmp_path, line, message):
    trace = write_lines(tmp_path, '{"arrival_s": 0, "output_tokens": 1, "prompt_tokens": 4}', line)
    with pytest.raises(ValueError, match=message):
        load_trace(trace)


def test_the_shipped_serve_config_sizes_a_replica_as_the_engine_does():
    # serve_config.yaml: 1 GiB of bf16 K/V for SmolLM2 (30 layers x 3 KV heads x 64) = 2,911 blocks
    # and the null block, as the README's default CPU pool; budget 256, 64 sequences, kv_prefix.
    replica, max_ongoing, router = fleet_settings(SHIPPED)
    assert (replica.num_kv_blocks, replica.max_num_batched_tokens, replica.max_num_seqs) == (2911, 256, 64)
    assert (max_ongoing, router, replica.enable_prefix_caching) == (128, "kv_prefix", True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda args: args["engine"].update(speculative_model="x"), "args.engine.speculative_model"),
        (lambda args: args.update(num_replicas="auto"), "args.num_replicas 'auto'"),
        (lambda args: args.update(prefill_replicas=2), "args.prefill_replicas"),
        (lambda args: args.update(ingress_replicas=3), "args.ingress_replicas 3"),
        (lambda args: args.update(ingress="colocated"), "args.ingress colocated"),
        (lambda args: args.update(models=[{"served_model_name": "a"}]), "args.models: size one model"),
    ],
)
def test_a_serve_config_setting_the_simulator_cannot_model_is_an_error_naming_it(tmp_path, change, message):
    config = yaml.safe_load(SHIPPED.read_text())
    change(config["applications"][0]["args"])
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=message):
        fleet_settings(path)


def test_the_command_finds_the_fewest_replicas_meeting_the_ttft_target(tmp_path, capsys):
    request = {"output_tokens": 40, "prompt_tokens": 600}  # each prompt its own: ~0.4 s of prefill
    lines = [json.dumps({"arrival_s": i * 0.05, **request}) for i in range(120)]  # 20 requests/s
    trace = write_lines(tmp_path, *lines)
    step_time = tmp_path / "step_time.json"
    step_time.write_text(json.dumps({"coefficients": [0.016, 0.00064, 0.0, 3.1e-7, 3.1e-7, 0.0017]}))
    argv = ["--trace", str(trace), "--serve-config", str(SHIPPED), "--step-time", str(step_time)]
    main([*argv, "--replicas", "1,4,16", "--routers", "power_of_two", "--ttft-p90-target", "1.0"])
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "TTFT p90 <= 1.0 s with power_of_two: 16 replicas"  # 1 and 4 fall behind
    assert "   1 replicas power_of_two" in out and "   4 replicas power_of_two" in out


def test_every_serve_config_setting_is_either_modeled_or_known_not_to_matter():
    from deployments.app_args import AppArgs
    from fleet_sim.sizing import APP_IGNORED, APP_MODELED

    assert set(AppArgs.model_fields) == APP_MODELED | APP_IGNORED  # a new setting needs a decision here
