"""The shipped configs build, and bad args fail the deploy naming the field (no cluster needed)."""

from __future__ import annotations

import pydantic
import pytest
import yaml

from deployments.app import AppArgs, build_app
from harness.serve_cluster import REPO


@pytest.mark.parametrize("config", ["serve_config.yaml", "serve_config.gpu.yaml"])
def test_shipped_configs_build(config: str):
    app_config = yaml.safe_load((REPO / config).read_text())["applications"][0]
    assert app_config["import_path"] == "deployments.app:build_app"
    build_app(AppArgs.model_validate(app_config["args"]))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"engine": {"max_num_batched_tokns": 512}}, "max_num_batched_tokns"),
        ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
        ({"sampling_defaults": {"temperature": -1}}, "temperature"),
        ({"num_gpu": 1}, "num_gpu"),
        ({"target_kv_cache_usage": 2}, "target_kv_cache_usage"),
        ({"request_router": "random"}, "request_router"),
    ],
)
def test_bad_args_name_the_field(args: dict, field: str):
    with pytest.raises((pydantic.ValidationError, ValueError), match=field):
        build_app(AppArgs.model_validate(args))
