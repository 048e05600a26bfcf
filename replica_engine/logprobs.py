"""Logprobs, read from the logits a request is sampled from (after its processing, before
temperature): of each sampled token, and of prompt tokens for requests that ask (prompt_logprobs),
each with its rank and the likeliest alternatives. Computed on the logits' device; read on the host
(for sampled tokens, a step later under async scheduling: device_transfer.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.logprobs import TokenLogprob

# On the CPU, rows whose logprobs are computed together: 16 rows of a 49k vocabulary stay in the
# cache through the softmax, the rank count and top-k (620 rows at once took 4.6x as long).
CPU_ROWS_PER_PASS = 16


@dataclass(frozen=True)
class LogprobTensors:
    """Row i's target's logprob and rank, and its likeliest tokens' logprobs and ids."""

    chosen: torch.Tensor  # [n] float32
    ranks: torch.Tensor  # [n] int64
    top_values: torch.Tensor  # [n, most] float32
    top_ids: torch.Tensor  # [n, most] int64

    @classmethod
    def of(cls, logits: torch.Tensor, targets: torch.Tensor, most: int) -> LogprobTensors:
        """Of row i of `logits`: targets[i]'s logprob and rank, and the `most` likeliest tokens."""
        rows = CPU_ROWS_PER_PASS
        if logits.device.type == "cpu" and len(logits) > rows:
            parts = [
                cls.of(logits[i : i + rows], targets[i : i + rows], most) for i in range(0, len(logits), rows)
            ]
            return cls(
                *(torch.cat(tensors) for tensors in zip(*(part.tensors() for part in parts), strict=True))
            )
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(-1, targets[:, None])[:, 0]
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        top_values, top_ids = (
            logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], logprobs[:, :0].long())
        )
        return cls(chosen, ranks, top_values, top_ids)

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.ranks, self.top_values, self.top_ids]


def read_logprobs(
    host: Sequence[torch.Tensor], targets: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """`LogprobTensors.tensors()` copied to the host, as each row's TokenLogprob with its own
    number of alternatives."""
    chosen, ranks, values, ids = (t.tolist() for t in host)
    return [
        TokenLogprob(
            targets[i],
            chosen[i],
            ranks[i],
            tuple(zip(ids[i][: num_top[i]], values[i][: num_top[i]], strict=True)),
        )
        for i in range(len(targets))
    ]


def logprobs_of(logits: torch.Tensor, targets: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """For row i of `logits`: targets[i]'s logprob and rank, and the num_top[i] likeliest tokens."""
    target_ids = torch.tensor(targets, device=logits.device)
    tensors = LogprobTensors.of(logits, target_ids, max(num_top, default=0))
    return read_logprobs(tensors.tensors(), targets, num_top)
