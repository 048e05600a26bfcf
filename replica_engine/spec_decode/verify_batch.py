"""A step's sampling when some rows carry draft tokens: the logits hold, for such a row, its last
token's distribution and one per draft token (flat_batch's logits_indices). Rows without drafts
sample as always; each drafting row is verified (rejection_sampler), keeping the drafts that hold
and one token from the target. The verdicts are read on the host, so this step's tokens are there
when it returns (speculative steps are never scheduled ahead)."""

from __future__ import annotations

import dataclasses

import torch

from replica_engine.sampler import DeviceSample, sample, target_probs
from replica_engine.scheduler.plan import SamplingRow, ScheduledRow
from replica_engine.spec_decode.rejection_sampler import verify_draft


def sample_with_drafts(
    logits: torch.Tensor, rows: list[ScheduledRow], sampling: list[SamplingRow]
) -> DeviceSample:
    """`logits`: [sum of 1 + drafts per row, vocab]; one token per row, and the drafts kept."""
    starts, at = [], 0
    for row in rows:
        starts.append(at)
        at += 1 + len(row.draft_token_ids)
    plain = [i for i, row in enumerate(rows) if not row.draft_token_ids]
    tokens = [0] * len(rows)
    accepted = [0] * len(rows)
    base = None
    if plain:
        index = torch.tensor([starts[i] for i in plain], device=logits.device)
        base = sample(logits[index], [sampling[i] for i in plain])
        for i, token in zip(plain, base.token_ids.tolist(), strict=True):
            tokens[i] = token
    for i, row in enumerate(rows):
        drafts = row.draft_token_ids
        if not drafts:
            continue
        block = logits[starts[i] : starts[i] + 1 + len(drafts)]
        greedy = sampling[i].params.greedy
        # Greedy reads the logits' argmax, as plain decoding does; sampling, the distributions.
        scores = block if greedy else target_probs(block, [sampling[i]] * len(block))
        emitted = verify_draft(scores, list(drafts), greedy, sampling[i].generator)
        tokens[i], accepted[i] = emitted[-1], len(emitted) - 1
    token_ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
    if base is None or base.logprobs is None:
        return DeviceSample(token_ids, num_accepted=tuple(accepted))
    # Logprob rows are plain rows (a drafting row asks for none): renumbered among all rows.
    logprob_rows = tuple(plain[i] for i in base.logprob_rows)
    return dataclasses.replace(
        base, token_ids=token_ids, logprob_rows=logprob_rows, num_accepted=tuple(accepted)
    )
