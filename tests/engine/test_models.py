"""Each supported architecture, loaded from a Hugging Face directory, against transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from common.model_source import ModelSource
from replica_engine import LLM, SamplingParams
from replica_engine.attention import get_backend
from replica_engine.models.llama import LlamaForCausalLM
from replica_engine.models.loader import load_config

TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
ARCHITECTURES = {
    "llama": lambda: LlamaConfig(**TINY, rope_theta=10000.0),
    "llama3_rope_scaling": lambda: LlamaConfig(
        **TINY,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": lambda: MistralConfig(**TINY, head_dim=16, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(
        **{**TINY, "tie_word_embeddings": True}, head_dim=32
    ),  # q/k norms, head_dim != hidden/heads
}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_architecture_matches_transformers(architecture, tmp_path: Path, model_dir: Path, tokenizer):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(ARCHITECTURES[architecture](), dtype=torch.float32).eval()
    with torch.no_grad():  # random biases / norms so those code paths matter
        for name, param in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.5)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)

    prompts = ["The capital of France is", "Once upon a time there was a " * 5]
    llm = LLM(str(tmp_path), max_num_batched_tokens=16, dtype="float32")  # chunked prefill
    ours = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, ours, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)[
                0, ids.shape[1] :
            ]
        assert out.outputs[0].token_ids == expected.tolist(), architecture


def test_a_directory_missing_weights_is_a_clear_error(tmp_path: Path, model_dir: Path):
    hf = AutoModelForCausalLM.from_config(ARCHITECTURES["llama"]())
    hf.save_pretrained(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    "shape,billions", [("smollm2-135m", 0.135), ("qwen3-0.6b", 0.596), ("llama3-8b", 8.03)]
)
def test_dummy_shapes_have_the_real_parameter_counts(shape, billions):
    config = load_config(ModelSource(shape, None, dummy_shape=shape))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, get_backend("torch"), max_position=16)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e9 - billions) / billions < 0.01, count
