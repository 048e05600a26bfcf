"""Pipeline parallelism for the Llama family, applied to a loaded model: each stage keeps a
contiguous run of the layers (the first also the embeddings, the last the final norm and the LM
head), receives the hidden states and residual stream from the stage before and sends its own on
(models/llama.py). Each stage's KV cache holds only its layers, over the same block ids. Stages
run one batch at a time for now: the pipeline fills with one step, so PP buys memory, not yet
throughput."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from common.errors import InvalidRequestError
from replica_engine.models.llama import LlamaForCausalLM, PipelineStage


def check_layers(config: PretrainedConfig, stages: int) -> None:
    if stages < 1:
        raise InvalidRequestError("pipeline_parallel_size", f"must be at least 1, got {stages}")
    if stages > config.num_hidden_layers:
        raise InvalidRequestError(
            "pipeline_parallel_size", f"{stages} stages for the model's {config.num_hidden_layers} layers"
        )


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Contiguous runs as even as can be; the earlier stages take the remainder."""
    share, extra = divmod(num_layers, stages)
    runs, start = [], 0
    for index in range(stages):
        end = start + share + (index < extra)
        runs.append(range(start, end))
        start = end
    return runs


def keep_stage(model: LlamaForCausalLM, index: int, stages: int) -> None:
    """Keep stage `index`'s layers (of `stages`), in place; the rest is freed."""
    if stages == 1:
        return
    run = stage_layers(len(model.model.layers), stages)[index]
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in run)
    model.stage = PipelineStage(index, stages)
