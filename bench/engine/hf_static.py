"""The static-batching baseline: Hugging Face `generate` on fixed batches, one after another.
A batch is left-padded to its longest prompt and runs until its longest output is done; every
request of a batch gets its first token when the batch's prefill ends, and finishes with it."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from bench.driver import Workload
from common.latency import RequestTiming


class _FirstTokenClock(StoppingCriteria):
    """Called after each new token; the first call marks when the batch's first tokens exist."""

    def __init__(self) -> None:
        self.first_token_time: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load(hf_dir: Path, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()


@torch.inference_mode()
def run(model, pad_token_id: int, workload: Workload, batch_size: int) -> tuple[float, list[RequestTiming]]:
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        output_lens = workload.output_lens[first : first + batch_size]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _FirstTokenClock()
        new_tokens = max(output_lens)
        model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
        end = time.perf_counter()
        timings += [
            RequestTiming(len(p), n, clock.first_token_time - start, end - start)
            for p, n in zip(prompts, output_lens, strict=True)
        ]
    return time.perf_counter() - start, timings
