"""Logprobs, read from the logits a request is sampled from (after its processing, before
temperature): of each sampled token, and of prompt tokens for requests that ask (prompt_logprobs),
each with its rank and the likeliest alternatives."""

from __future__ import annotations

import torch

from common.logprobs import TokenLogprob
from replica_engine.scheduler.plan import SamplingRow


def logprobs_of(logits: torch.Tensor, targets: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """For row i of `logits`: targets[i]'s logprob and rank, and the num_top[i] likeliest tokens."""
    logprobs = logits.log_softmax(dim=-1)
    index = torch.arange(len(targets), device=logits.device)
    target_ids = torch.tensor(targets, device=logits.device)
    chosen = logprobs[index, target_ids]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    most = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0])
    chosen_l, ranks_l, values_l, ids_l = (
        chosen.tolist(),
        ranks.tolist(),
        top_values.tolist(),
        top_ids.tolist(),
    )
    return [
        TokenLogprob(
            targets[i],
            chosen_l[i],
            ranks_l[i],
            tuple(zip(ids_l[i][: num_top[i]], values_l[i][: num_top[i]], strict=True)),
        )
        for i in range(len(targets))
    ]


def token_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]
) -> list[TokenLogprob | None]:
    """The sampled tokens' logprobs, for the rows that asked."""
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    results: list[TokenLogprob | None] = [None] * len(rows)
    if not asked:
        return results
    computed = logprobs_of(
        logits[asked], [token_ids[i] for i in asked], [rows[i].params.logprobs or 0 for i in asked]
    )
    for i, result in zip(asked, computed, strict=True):
        results[i] = result
    return results
