"""Batched sampling. Each row's logits are first processed (logits_processors: bias, min_tokens,
penalties, grammar mask); logprobs, for rows that ask, are read from those processed logits,
before temperature, min-p, top-k and top-p (so a greedy row's logprob is the model's own
log-softmax when nothing else applies). Then greedy at temperature 0, else temperature, min-p,
top-k and top-p, with a per-request generator where a seed is given (so a seeded request
samples the same tokens whatever else shares its batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.logprobs import TokenLogprob
from replica_engine.device_transfer import to_device
from replica_engine.executor import SampledTokens
from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.logits_processors import process_logits
from replica_engine.logprobs import LogprobTensors, read_logprobs
from replica_engine.scheduler.plan import SamplingRow


@dataclass(frozen=True)
class DeviceSample:
    """A step's sampled tokens, still on the logits' device (the next step's placeholders read
    them there), with the logprobs of the rows that asked."""

    token_ids: torch.Tensor  # [rows] int64
    logprob_rows: tuple[int, ...] = ()  # the rows that asked for logprobs
    num_top: tuple[int, ...] = ()  # alternatives each of them asked for
    logprobs: LogprobTensors | None = None
    num_accepted: tuple[int, ...] = ()  # per row, draft tokens kept (speculative decoding)

    def tensors(self) -> list[torch.Tensor]:
        """What the host reads: copied behind the step (device_transfer.HostCopy)."""
        return [self.token_ids, *(self.logprobs.tensors() if self.logprobs is not None else ())]

    def read(self, host: list[torch.Tensor]) -> SampledTokens:
        """From `tensors()`' host copies: the tokens, and each asking row's logprobs."""
        token_ids = host[0].tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            targets = [token_ids[i] for i in self.logprob_rows]
            for row, logprob in zip(
                self.logprob_rows, read_logprobs(host[1:], targets, self.num_top), strict=True
            ):
                logprobs[row] = logprob
        return SampledTokens(token_ids, logprobs, self.num_accepted)


def _kept_floor(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the least likely token each row keeps under its top-k and top-p (top-p over the
    top-k's renormalized mass); 0 for a row under neither. `probs`: [rows, vocab], relative to each
    row's likeliest token (1 there). On a CPU the kernel finds it among the row's likeliest tokens
    (cpu_sampling.cpp); elsewhere the row is sorted whole (a GPU's sort is fast, and looking for
    fewer candidates would wait for the device)."""
    floor = cpu_kernels.kept_floor(probs, top_k, top_p)
    if floor is not None:
        return floor
    vocab = probs.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    limited, nucleus = top_k > 0, top_p < 1
    values = probs.sort(dim=-1, descending=True).values
    in_k = torch.arange(vocab, device=probs.device)[None, :] < k[:, None]
    values = values.masked_fill(~in_k, 0.0)
    norm = values.sum(dim=-1)  # the top-k's mass: the whole row's without a top-k
    # Drop a token once the tokens before it already cover top_p; the first always stays.
    covered = ((values.cumsum(dim=-1) - values) >= (top_p * norm)[:, None]) & nucleus[:, None]
    kept = (in_k & ~covered).sum(dim=-1, keepdim=True)
    # A row under neither limit keeps every token.
    return torch.where((limited | nucleus)[:, None], values.gather(-1, kept - 1), 0.0)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> DeviceSample:
    """One token per row of `logits` ([num_requests, vocab], float32; changed in place). Nothing
    here waits for the device: the per-row settings go over from the host without a sync."""
    if all(row.is_plain for row in rows):
        return DeviceSample(_sample(logits, rows))
    process_logits(logits, rows)
    token_ids = _sample(logits, rows)
    asked = tuple(i for i, row in enumerate(rows) if row.params.logprobs is not None)
    if not asked:
        return DeviceSample(token_ids)
    num_top = tuple(rows[i].params.logprobs or 0 for i in asked)
    index = to_device(asked, torch.int64, logits.device)
    tensors = LogprobTensors.of(logits[index], token_ids[index], max(num_top))
    return DeviceSample(token_ids, asked, num_top, tensors)


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    greedy_ids = logits.argmax(dim=-1)
    if all(r.params.greedy for r in rows):
        return greedy_ids
    sampled = _draw(target_probs(logits, rows), rows)
    is_greedy = to_device([r.params.greedy for r in rows], torch.bool, logits.device)
    return torch.where(is_greedy, greedy_ids, sampled)


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row from its probabilities: one uniform number a row (a seeded row's from its
    own generator) through inverse_cdf."""
    uniform = torch.rand(len(rows), device=probs.device)
    for index, row in enumerate(rows):
        if row.generator is not None:
            uniform[index] = torch.rand((), generator=row.generator, device=probs.device)
    return inverse_cdf(probs, uniform)


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """For each row of `probs` ([rows, vocab]; unnormalized, zeros allowed), the token where its
    `uniform` ([rows], in [0, 1)) falls in the row's cumulative sum: a draw from the row. One
    number a row, where an exponential race over the vocabulary drew 49k (a millisecond a row on
    a CPU)."""
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    # Strictly below the total, so the token found has a probability above zero.
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def target_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution each row draws from: temperature (1 for greedy rows), top-k, top-p, then
    min-p; [rows, vocab]."""
    params = [r.params for r in rows]
    device = logits.device
    temperature = to_device([p.temperature if not p.greedy else 1.0 for p in params], torch.float32, device)
    scaled = logits / temperature[:, None]
    # Each token's probability relative to its row's likeliest (1 there): the cuts compare these.
    probs = scaled.sub_(scaled.amax(dim=-1, keepdim=True)).exp_()
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = to_device([p.top_k for p in params], torch.int64, device)
        top_p = to_device([p.top_p for p in params], torch.float32, device)
        probs.masked_fill_(probs < _kept_floor(probs, top_k, top_p), 0.0)
    if any(p.min_p > 0 for p in params):  # below min_p times the likeliest token's probability: out
        min_p = to_device([p.min_p for p in params], torch.float32, device)
        probs.masked_fill_(probs < min_p[:, None], 0.0)
    return probs.div_(probs.sum(dim=-1, keepdim=True))
