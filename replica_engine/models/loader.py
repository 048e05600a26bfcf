"""Build our model from a ModelSource: construct it in the target dtype on the target device,
then fill it from safetensors (merging q/k/v and gate/up) or with dummy random weights."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from common.model_source import ModelSource, model_config_dict
from replica_engine.attention.base import AttentionBackend
from replica_engine.kernels.quantized_weight import quantize_int8
from replica_engine.models.gguf_weights import hold_gguf_weights
from replica_engine.models.layers import Linear, MergedLinear
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.models.moe import Experts, SparseMoeBlock
from replica_engine.parallel.pipeline_parallel import keep_stage
from replica_engine.parallel.place import WHOLE_MODEL, WorkerPlace
from replica_engine.parallel.tensor_parallel import shard_model

logger = logging.getLogger(__name__)

# Hugging Face projection name -> (our merged parameter, shard index)
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: PreTrainedTokenizerBase | None  # None: token ids in and out
    stop_token_ids: frozenset[int]  # eos and chat-end tokens


def load_tokenizer(source: ModelSource) -> LoadedTokenizer:
    if source.dummy_shape is not None:
        return LoadedTokenizer(None, frozenset())
    assert source.hf_dir is not None
    if not source.has_tokenizer:
        return LoadedTokenizer(None, _stop_token_ids(source.hf_dir, None))
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
    return LoadedTokenizer(tokenizer, _stop_token_ids(source.hf_dir, tokenizer))


def load_config(source: ModelSource) -> PretrainedConfig:
    if source.dummy_shape is not None:
        return AutoConfig.for_model(**model_config_dict(source))
    return AutoConfig.from_pretrained(source.hf_dir)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    source: ModelSource,
    config: PretrainedConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    seed: int = 0,
    place: WorkerPlace = WHOLE_MODEL,
    quantization: str = "none",
    amx_weights: bool = False,
) -> LlamaForCausalLM:
    """The model whole, or one parallel worker's share of it (loaded whole, then cut: every
    worker draws the same dummy weights from the same seed). `quantization` as EngineConfig's,
    resolved: `gguf` swaps in the file's quantized blocks, `int8` quantizes what is kept;
    `amx_weights` as EngineConfig's, resolved."""
    with torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(config, backend, max_position)
    if source.dummy_shape is not None:
        _fill_dummy(model, seed)
    else:
        _load_safetensors(model, source.hf_dir)
    if quantization == "gguf":
        assert source.gguf_path is not None, "config.resolve allows gguf for GGUF models only"
        hold_gguf_weights(model, source.gguf_path)
    shard_model(model, place.rank, place.tensor_parallel_size, place.expert_parallel)
    keep_stage(model, place.rank, place.pipeline_parallel_size)
    if quantization == "int8":
        _quantize_int8(model)
    _pack(model, amx_weights)
    return model.eval()


def _pack(model: LlamaForCausalLM, amx_weights: bool) -> None:
    """On the CPU, the linear weights in the packed kernel's layout (redone at each start: 0.2 s
    for SmolLM2 in bfloat16, 0.8 s in float32 on this machine; not worth a disk cache), and
    their bfloat16 copies for AMX if asked."""
    if next(model.parameters()).device.type != "cpu":
        return
    started = time.perf_counter()
    model.pack_for_cpu(amx_weights)
    copies = " (with bfloat16 copies for AMX)" if amx_weights else ""
    logger.info("linear weights packed for the CPU kernel%s in %.2f s", copies, time.perf_counter() - started)


@torch.no_grad()
def _quantize_int8(model: LlamaForCausalLM) -> None:
    """Every linear layer but a mixture's routers (and the embeddings, unless split over workers)
    as int8 with one scale per output channel, where its input features come in groups of 32."""
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    for module in model.modules():
        if isinstance(module, Linear) and module.in_features % 32 == 0 and id(module) not in routers:
            module.hold(quantize_int8(module.weight))
        if isinstance(module, Experts) and module.gate_up_proj is not None and module.down_proj is not None:
            stacked = (module.gate_up_proj, module.down_proj)
            if all(w.shape[2] % 32 == 0 for w in stacked):
                module.hold([tuple(quantize_int8(w[e]) for w in stacked) for e in range(module.num_experts)])
    if model.vocab_shard is None and model.config.hidden_size % 32 == 0:
        model.hold_embeddings(quantize_int8(model.model.embed_tokens.weight))


def _stop_token_ids(hf_dir: Path, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The tokenizer's eos plus generation_config's eos list (where chat models put e.g. <|eot_id|>)."""
    eos_id = tokenizer.eos_token_id if tokenizer is not None else None
    ids = {eos_id} if eos_id is not None else set()
    if (hf_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(hf_dir).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return frozenset(ids)


@torch.no_grad()
def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Small uniform weights as vLLM's dummy format uses; norms stay at 1 so activations stay sane."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" not in name:
            param.uniform_(-1e-3, 1e-3, generator=generator)


def _checkpoint_name_to_ours(hf_name: str) -> tuple[str, tuple[int, ...]]:
    """A checkpoint's weight -> (our parameter, where in it): `()` the whole,
    `(shard,)` a merged projection's shard (`...self_attn.k_proj.weight` -> `...qkv_proj.weight`,
    (1,)), `(expert, shard)` or `(expert,)` a slice of the stacked experts
    (`...mlp.experts.3.up_proj.weight` -> `...mlp.experts.gate_up_proj`, (3, 1)); transformers'
    own stacked `...mlp.experts.gate_up_proj` (as it holds them in memory) is a whole. Mixtral's
    `block_sparse_moe` and w1/w3/w2 are read as `mlp` and gate/up/down."""
    parts = hf_name.split(".")
    parts = ["mlp" if p == "block_sparse_moe" else p for p in parts]
    if "experts" in parts and parts[-1] == "weight":
        at = parts.index("experts")
        expert, projection = int(parts[at + 1]), _MIXTRAL_EXPERT.get(parts[at + 2], parts[at + 2])
        prefix = ".".join(parts[: at + 1])
        if projection == "down_proj":
            return f"{prefix}.down_proj", (expert,)
        return f"{prefix}.gate_up_proj", (expert, _MERGED[projection][1])
    for index, part in enumerate(parts):
        if part in _MERGED:
            merged, shard_id = _MERGED[part]
            return ".".join([*parts[:index], merged, *parts[index + 1 :]]), (shard_id,)
    return ".".join(parts), ()


def _regions(model: LlamaForCausalLM) -> dict[str, list[tuple[int, ...]]]:
    """Every parameter's parts a checkpoint must fill, as _checkpoint_name_to_ours names them."""
    modules = dict(model.named_modules())
    regions: dict[str, list[tuple[int, ...]]] = {}
    for name, _ in model.named_parameters():
        owner_name, leaf = name.rsplit(".", 1)
        owner = modules[owner_name]
        if isinstance(owner, MergedLinear):
            regions[name] = [(i,) for i in range(len(owner.shard_sizes))]
        elif isinstance(owner, Experts):
            shards = (0, 1) if leaf == "gate_up_proj" else (None,)  # gate | up; down whole
            regions[name] = [(e,) if s is None else (e, s) for e in range(owner.num_experts) for s in shards]
        else:
            regions[name] = [()]
    return regions


def _region(model: LlamaForCausalLM, name: str, param: torch.Tensor, where: tuple[int, ...]) -> torch.Tensor:
    if not where:
        return param
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    if isinstance(owner, MergedLinear):
        start, end = owner.shard_range(where[0])
        return param[start:end]
    if len(where) == 1:
        return param[where[0]]
    expert, shard = where
    width = param.shape[1] // 2
    return param[expert, shard * width : (shard + 1) * width]


@torch.no_grad()
def _load_safetensors(model: LlamaForCausalLM, hf_dir: Path) -> None:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {hf_dir}")
    params = dict(model.named_parameters())
    regions = _regions(model)
    expected = {(name, where) for name, parts in regions.items() for where in parts}
    loaded: set[tuple[str, tuple[int, ...]]] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for hf_name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and model.tie_word_embeddings):
                    continue
                name, where = _checkpoint_name_to_ours(hf_name)
                if not where and name in regions:  # whole: transformers' own stacked experts too
                    params[name].copy_(reader.get_tensor(hf_name))
                    loaded.update((name, part) for part in regions[name])
                    continue
                if (name, where) not in expected:
                    raise ValueError(f"model: unexpected weight {hf_name!r} in {file.name}")
                _region(model, name, params[name], where).copy_(reader.get_tensor(hf_name))
                loaded.add((name, where))
    missing = expected - loaded
    if missing:
        named = sorted(f"{name}{list(where) if where else ''}" for name, where in missing)
        raise ValueError(f"model: {hf_dir} lacks {len(missing)} weights, e.g. {named[:3]}")
