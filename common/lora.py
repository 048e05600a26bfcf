"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`): what a
request names, and the check an adapter passes before any replica loads it.

Torch-free: the Ingress checks an adapter (config and tensor shapes, from the safetensors header
alone) when it is loaded by the API, and the engine's frontend checks it before a request reaches
the step, so a bad file is a 400 at load, never a failed step mid-stream."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.errors import InvalidRequestError

# The linear layers an adapter may target, as PEFT names them in a Llama-family model.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # no "/", "..", ":": a name is one directory


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with: its name (as clients call it) and its local directory.
    Both key the prefix cache, so a name loaded again from another directory shares nothing."""

    name: str
    path: str

    @property
    def key(self) -> str:
        return f"{self.name}\x00{self.path}"


@dataclass(frozen=True)
class LoRATensor:
    """One targeted linear layer of one decoder layer: the keys of its A ([rank, in]) and B
    ([out, rank]) in the safetensors file."""

    layer: int
    module: str  # one of TARGET_MODULES
    a_key: str
    b_key: str


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: what its weights are and how they scale (alpha / r, or / sqrt(r) with
    rsLoRA)."""

    lora: LoRARequest
    rank: int
    scaling: float
    tensors: tuple[LoRATensor, ...] = field(default=())

    @property
    def weights_path(self) -> str:
        return os.path.join(self.lora.path, WEIGHTS_FILE)


def check_adapter_name(name: object, param: str = "model") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidRequestError(
            param, f"an adapter name is letters, digits, '.', '_' and '-' (no '/', '..' or ':'), got {name!r}"
        )
    return name


def module_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each target module in a model of this (HF) config."""
    hidden, inter = model_config.hidden_size, model_config.intermediate_size
    head_dim = getattr(model_config, "head_dim", None) or hidden // model_config.num_attention_heads
    q_size = model_config.num_attention_heads * head_dim
    kv_size = model_config.num_key_value_heads * head_dim
    return {
        "q_proj": (q_size, hidden),
        "k_proj": (kv_size, hidden),
        "v_proj": (kv_size, hidden),
        "o_proj": (hidden, q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_adapter(
    lora: LoRARequest, model_config: Any, max_lora_rank: int, param: str = "model"
) -> AdapterInfo:
    """The adapter at `lora.path`, checked against the model it will run on; InvalidRequestError
    naming `param` if it cannot run: missing files, a rank above `max_lora_rank`, a module we
    cannot target, a tensor of the wrong shape, or PEFT features we do not apply."""

    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(
            param, f"adapter {lora.name!r} at {lora.path}: {why}", code="invalid_lora_adapter"
        )

    config = _read_json(os.path.join(lora.path, CONFIG_FILE), refuse)
    rank, scaling, targets = _parse_config(config, max_lora_rank, refuse)
    header = _safetensors_header(os.path.join(lora.path, WEIGHTS_FILE), refuse)
    shapes = module_shapes(model_config)
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key, entry in header.items():
        match = _TENSOR_KEY.search(key)
        if match is None:
            raise refuse(f"tensor {key!r} is not a LoRA A/B weight of a decoder layer's linear layer")
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in targets:
            raise refuse(f"tensor {key!r} is for {module!r}, not among target_modules {sorted(targets)}")
        if module in MLP_MODULES and _has_experts(model_config):
            raise refuse(
                f"tensor {key!r} targets {module!r} of a mixture of experts: no LoRA on its MLPs yet"
            )
        if layer >= model_config.num_hidden_layers:
            raise refuse(
                f"tensor {key!r} is for layer {layer}; the model has {model_config.num_hidden_layers}"
            )
        out_features, in_features = shapes[module]
        expected = [rank, in_features] if which == "A" else [out_features, rank]
        if list(entry.get("shape", ())) != expected:
            raise refuse(f"tensor {key!r} has shape {entry.get('shape')}, expected {expected} (r={rank})")
        found.setdefault((layer, module), {})[which] = key
    tensors = []
    for (layer, module), keys in sorted(found.items()):
        if set(keys) != {"A", "B"}:
            raise refuse(f"layer {layer} {module} has lora_{next(iter(keys))} without its pair")
        tensors.append(LoRATensor(layer, module, keys["A"], keys["B"]))
    if not tensors:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    return AdapterInfo(lora, rank, scaling, tuple(tensors))


def _has_experts(model_config: Any) -> bool:
    """A mixture of experts (Mixtral's or Qwen-MoE's config fields)."""
    return bool(getattr(model_config, "num_local_experts", 0) or getattr(model_config, "num_experts", 0))


def _read_json(path: str, refuse: Any) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            config = json.load(file)
    except FileNotFoundError:
        raise refuse(f"no {CONFIG_FILE}") from None
    except (OSError, ValueError) as error:
        raise refuse(f"{CONFIG_FILE} cannot be read: {error}") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    return config


def _parse_config(config: Mapping[str, Any], max_lora_rank: int, refuse: Any) -> tuple[int, float, set[str]]:
    """(rank, scaling, target modules) of a PEFT LoRA config, refusing what we would apply wrongly."""
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise refuse(f"rank {rank} is above this replica's max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    for name, off in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(name, off) not in (off, None):
            raise refuse(f"{name}={config[name]!r} is not supported")
    for name in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise refuse(f"{name} is not supported")
    targets = config.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGET_MODULES)
    elif isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets:
        raise refuse(f"target_modules must be a list of module names, got {targets!r}")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise refuse(f"target_modules {unknown} are not among {list(TARGET_MODULES)}")
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), set(targets)


def _safetensors_header(path: str, refuse: Any) -> dict[str, dict[str, Any]]:
    """The tensors' names, dtypes and shapes: the file's JSON header, read without the data."""
    try:
        with open(path, "rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > 100 * 1024 * 1024:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(file.read(length))
    except FileNotFoundError:
        raise refuse(f"no {WEIGHTS_FILE} (only safetensors weights are read)") from None
    except (OSError, ValueError, struct.error) as error:
        raise refuse(f"{WEIGHTS_FILE} is not a safetensors file: {error}") from None
    if not isinstance(header, dict):
        raise refuse(f"{WEIGHTS_FILE} has no tensor table")
    header.pop("__metadata__", None)
    return header
