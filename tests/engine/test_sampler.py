import pytest
import torch

from common.sampling_params import SamplingParams
from replica_engine.kernels import cpu as cpu_kernels
from replica_engine.logits_processors import process_logits
from replica_engine.sampler import sample as sample_tokens
from replica_engine.sampler import target_probs
from replica_engine.scheduler.plan import SamplingRow


def _requests(*params: SamplingParams) -> list[SamplingRow]:
    return [
        SamplingRow(p, torch.Generator().manual_seed(p.seed) if p.seed is not None else None) for p in params
    ]


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return sample_tokens(logits.clone(), rows).token_ids.tolist()


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_even_beside_random_rows():
    logits = _logits(3)
    out = sample(
        logits, _requests(SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0))
    )
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(4, seed=1)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)] * 2
    for _ in range(5):
        assert sample(logits, _requests(*params)) == logits.argmax(-1).tolist()


def test_top_k_keeps_samples_within_the_k_best():
    logits = _logits(1, vocab=200, seed=2)
    best5 = set(logits[0].topk(5).indices.tolist())
    draws = {sample(logits, _requests(SamplingParams(temperature=5.0, top_k=5)))[0] for _ in range(200)}
    assert draws <= best5 and len(draws) > 1


def test_top_p_keeps_samples_within_the_nucleus():
    logits = torch.tensor([[4.0, 3.5, 3.0, -5.0, -5.0, -5.0]])
    probs = logits.softmax(-1)[0]
    assert probs[:2].sum() < 0.9 < probs[:3].sum()
    draws = {sample(logits, _requests(SamplingParams(top_p=0.9)))[0] for _ in range(300)}
    assert draws == {0, 1, 2}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sample(logits, _requests(SamplingParams()))[0]] += 1
    assert torch.allclose(counts / 2000, torch.tensor([0.5, 0.3, 0.2]), atol=0.05)


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    logits = _logits(3, seed=3)
    alone = [sample(logits[1:2], _requests(SamplingParams(seed=42)))[0] for _ in range(1)]
    seeded = _requests(SamplingParams(), SamplingParams(seed=42), SamplingParams(temperature=0.7))
    assert sample(logits, seeded)[1] == alone[0]
    other_seed = [sample(logits[1:2], _requests(SamplingParams(seed=s)))[0] for s in range(20)]
    assert len(set(other_seed)) > 1  # the seed matters


def test_penalties_follow_vllms_definitions():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    row = SamplingRow(  # prompt [2], output [0, 0, 3], as the runner keeps them
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        output_counts=torch.tensor([2.0, 0.0, 0.0, 1.0]),
        prompt_seen=torch.tensor([False, False, True, False]),
    )
    processed = logits.clone()
    process_logits(processed, [row])
    # token 0: seen twice -> 2/2 - 0.5*2 - 0.25; token 2: in the prompt only -> -1*2; token 3: once
    expected = torch.tensor([[2.0 / 2 - 1.0 - 0.25, 1.0, -2.0, 0.5 / 2 - 0.5 - 0.25]])
    assert torch.allclose(processed, expected)


def test_logit_bias_min_p_and_banned_tokens():
    logits = torch.zeros(1, 6)
    assert sample(logits, [SamplingRow(SamplingParams(temperature=0, logit_bias={4: 5.0}))]) == [4]
    banned = SamplingRow(SamplingParams(temperature=0), banned_token_ids=frozenset({0, 1}))
    assert sample(torch.tensor([[9.0, 8.0, 1.0, 0.0, 0.0, 0.0]]), [banned]) == [2]
    skewed = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02]]))
    draws = {sample(skewed, [SamplingRow(SamplingParams(min_p=0.5))])[0] for _ in range(300)}
    assert draws == {0, 1}  # 0.3 >= 0.5 * 0.5 > 0.1


def test_a_grammar_bitmask_allows_only_its_tokens_and_leaves_other_rows_alone():
    logits = _logits(2, vocab=64, seed=4)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # only token 35
    rows = [SamplingRow(SamplingParams(), allowed_tokens=bitmask), SamplingRow(SamplingParams(temperature=0))]
    for _ in range(20):
        assert sample(logits, rows) == [35, logits[1].argmax().item()]


def test_logprobs_are_the_processed_log_softmax_with_rank_and_top():
    logits = _logits(2, seed=5)
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=3)),
        SamplingRow(SamplingParams(temperature=0)),
    ]
    on_device = sample_tokens(logits.clone(), rows)
    sampled = on_device.read(on_device.tensors())  # what the host reads (a CPU's are the same)
    expected = logits[0].log_softmax(-1)
    first = sampled.logprobs[0]
    assert first is not None and sampled.logprobs[1] is None
    assert first.token_id == sampled.token_ids[0] and first.rank == 1
    assert abs(first.logprob - expected.max().item()) < 1e-6
    assert [t for t, _ in first.top] == expected.topk(3).indices.tolist()


def _full_sort_reference(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row's top-k then top-p distribution from a sort of the whole vocabulary."""
    values, order = logits.sort(descending=True)
    k = top_k if top_k > 0 else len(values)
    probs = values[:k].softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p if top_p < 1 else torch.ones(k, dtype=torch.bool)
    kept = torch.full_like(logits, float("-inf"))
    kept[order[:k][keep]] = values[:k][keep]
    return kept.softmax(-1)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu_kernel", "torch"])
def test_top_k_and_top_p_cut_where_a_sort_of_the_whole_vocabulary_does(kernel: bool, monkeypatch):
    """The CPU kernel finds the cut among each row's likeliest candidates only (those above a floor
    that holds the row's nucleus), torch's way (a GPU's) sorts the row: rows whose nucleus is a few
    tokens, hundreds or most of the vocabulary, and rows under neither limit, each get the
    distribution a full sort gives, whatever shares the batch."""
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "kept_floor", lambda *args: None)
    vocab = 4100  # not a multiple of 16: the kernel's last values are read one by one
    generator = torch.Generator().manual_seed(7)
    peaked = torch.randn(vocab, generator=generator) * 4
    flat = torch.randn(vocab, generator=generator) * 0.3  # a nucleus of thousands of tokens
    cases = [
        (peaked, 0, 0.9),
        (flat, 0, 0.9),
        (flat, 0, 0.999),
        (flat, 300, 0.95),
        (peaked, 5, 1.0),
        (flat, 0, 1.0),
    ]
    # all together, and each beside a top-k 5 row alone (the fewest candidates)
    for batch in [cases, *([case, (peaked, 5, 1.0)] for case in cases)]:
        logits = torch.stack([row for row, _, _ in batch])
        rows = _requests(*(SamplingParams(top_k=k, top_p=p) for _, k, p in batch))
        probs = target_probs(logits.clone(), rows)
        for row, (row_logits, k, p) in enumerate(batch):
            expected = _full_sort_reference(row_logits, k, p)
            assert torch.equal(probs[row] > 0, expected > 0), (row, k, p)
            assert torch.allclose(probs[row], expected, atol=1e-6), (row, k, p)
    wide = target_probs(flat[None].clone(), _requests(SamplingParams(top_p=0.9)))
    assert 1000 < int((wide > 0).sum()) < vocab  # a nucleus of thousands of tokens
