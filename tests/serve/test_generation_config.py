"""The model's generation_config.json sampling fills what a request leaves out, as vLLM's
`--generation-config auto` does, under the app's `sampling_defaults`; `generation_config: vllm`
turns it off; offline, LLM.get_default_sampling_params returns it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.model_source import DEFAULT_MODEL, resolve_model
from deployments.app import model_settings
from deployments.app_args import AppArgs
from deployments.served_model import sampling_defaults
from replica_engine import LLM, SamplingParams

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "do_sample": True, "eos_token_id": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's files, with a generation config that recommends sampling."""
    directory = tmp_path_factory.mktemp("model")
    source = resolve_model(DEFAULT_MODEL).hf_dir
    assert source is not None
    for file in source.iterdir():
        if file.name != "generation_config.json":
            (directory / file.name).symlink_to(file.resolve())
    (directory / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return directory


def ingress_defaults(model_dir: Path, **args: object) -> dict:
    app = AppArgs(model=str(model_dir), **args)
    return sampling_defaults(resolve_model(app.model), model_settings(app, app.engine_config()))


def test_the_models_generation_config_fills_what_a_request_leaves_out(model_dir: Path):
    assert ingress_defaults(model_dir) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    over = ingress_defaults(model_dir, sampling_defaults={"temperature": 0.2})
    assert over == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 64}
    assert ingress_defaults(model_dir, generation_config="vllm") == {}


def test_offline_default_sampling_params_are_the_models(model_dir: Path):
    llm = LLM(model=str(model_dir), dtype="float32")
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.9, max_tokens=64)
