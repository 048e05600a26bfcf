"""Embeddings from the engine's own forward: the pooled final hidden states (after the model's last
RMSNorm) equal transformers' `last_hidden_state` pooled the same way, in float32, for last-token
and mean pooling, whole prompts and prompts pooled across chunks; embedding requests batched beside
generation change none of its tokens and give back every KV block; bad input is refused by name."""

from __future__ import annotations

import pytest
import torch

from common.errors import InvalidRequestError
from replica_engine import LLM, EngineConfig, SamplingParams

TOLERANCE = 1e-4  # float32; our kernels add in another order than transformers'
PROMPTS = [
    "Hi",
    "The capital of France is",
    "A lighthouse keeper climbs the stairs every evening to light the lamp, and every morning he "
    "climbs them again to put it out, whatever the weather and whoever is watching from the shore.",
]


@pytest.fixture(scope="module")
def mean_llm() -> LLM:
    """Mean pooling without normalizing, and a 16-token budget: longer prompts are pooled across
    chunks (and share steps with decodes)."""
    return LLM(
        dtype="float32",
        quantization="none",
        pooling="mean",
        normalize_embeddings=False,
        max_num_batched_tokens=16,
    )


@pytest.fixture(scope="module")
def hidden_states(hf_model):
    """transformers' final hidden states of a prompt's token ids, [tokens, hidden]."""

    @torch.no_grad()
    def run(token_ids: list[int]) -> torch.Tensor:
        return hf_model.model(torch.tensor([token_ids])).last_hidden_state[0]

    return run


def assert_close(ours: list[float], theirs: torch.Tensor) -> None:
    assert len(ours) == theirs.shape[0]
    assert (torch.tensor(ours) - theirs).abs().max().item() <= TOLERANCE


def test_last_token_embeddings_equal_transformers(exact_llm: LLM, hidden_states):
    """The default: the last token's state, unit length. A repeat reads the prompt's leading
    blocks from the prefix cache (only the last token must be computed) and is the same."""
    assert exact_llm.engine.config.pooling == "last" and exact_llm.engine.config.normalize_embeddings
    for outputs in (exact_llm.embed(PROMPTS), exact_llm.embed(PROMPTS)):
        for out in outputs:
            expected = torch.nn.functional.normalize(hidden_states(out.prompt_token_ids)[-1], dim=0)
            assert_close(out.embedding, expected)
    as_ids = exact_llm.embed([exact_llm.tokenizer.encode(PROMPTS[1])])  # a batch of one, as token ids
    assert as_ids[0].prompt_token_ids == outputs[1].prompt_token_ids
    assert_close(as_ids[0].embedding, torch.tensor(outputs[1].embedding))


def test_mean_embeddings_across_chunks_equal_transformers(mean_llm: LLM, hidden_states):
    """Summed chunk by chunk; a repeat must not take the prompt from the prefix cache (its
    tokens' states would be missing from the mean), so it is the same."""
    outputs = mean_llm.embed(PROMPTS)
    assert len(outputs[2].prompt_token_ids) > 2 * mean_llm.engine.config.max_num_batched_tokens
    for out in outputs:
        assert_close(out.embedding, hidden_states(out.prompt_token_ids).mean(0))
    assert [out.embedding for out in mean_llm.embed(PROMPTS)] == [out.embedding for out in outputs]


def test_embeddings_beside_generation_leave_its_tokens_and_free_every_block(mean_llm: LLM, hidden_states):
    """Embedding prompts take the budget beside decodes and prompt chunks: the generations are
    the tokens they are alone, the embeddings still transformers'."""
    params = SamplingParams(max_tokens=8, temperature=0)
    alone = [out.outputs[0].token_ids for out in mean_llm.generate([PROMPTS[0], PROMPTS[2]], params)]
    engine = mean_llm.engine
    manager = engine.core.kv_cache_manager
    free_before = manager.num_free_blocks
    generating = [engine.add_request(PROMPTS[0], params), engine.add_request(PROMPTS[2], params)]
    tokens: dict[str, list[int]] = {request_id: [] for request_id in generating}
    # The generations are decoding or part-way through a prompt when the embeddings come.
    outputs = engine.step()
    embedding = {engine.add_embedding_request(prompt): prompt for prompt in reversed(PROMPTS)}
    vectors: dict[str, list[float] | None] = {}
    while True:
        for output in outputs:
            if output.request_id in tokens:
                tokens[output.request_id] += output.new_token_ids
            else:
                assert output.finished and output.finish_reason == "stop" and not output.new_token_ids
                vectors[output.request_id] = output.embedding
        if not engine.has_unfinished_requests():
            break
        outputs = engine.step()
    assert [tokens[request_id] for request_id in generating] == alone
    for request_id, prompt in embedding.items():
        assert_close(vectors[request_id], hidden_states(engine.tokenize(prompt)).mean(0))
    assert manager.num_free_blocks == free_before == manager.num_blocks


def test_an_aborted_embedding_frees_its_blocks(mean_llm: LLM):
    engine = mean_llm.engine
    manager = engine.core.kv_cache_manager
    request_id = engine.add_embedding_request(PROMPTS[2])
    engine.step()  # its first chunk
    assert manager.num_free_blocks < manager.num_blocks
    final = engine.abort_request(request_id)
    assert final is not None and final.finish_reason == "abort" and final.embedding is None
    assert manager.num_free_blocks == manager.num_blocks and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "must not be empty"),
        ([[]], "non-empty"),
        ([49152], "token ids must be integers in [0, 49152)"),
        ([1] * 8193, "maximum context length of 8192"),
    ],
)
def test_bad_prompts_are_refused_by_name(exact_llm: LLM, prompt: object, message: str):
    with pytest.raises(InvalidRequestError, match=r"^prompt: ") as refused:
        exact_llm.embed(prompt)  # type: ignore[arg-type]
    assert message in str(refused.value)
    assert not exact_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("settings", "param"),
    [({"pooling": "max"}, "pooling"), ({"normalize_embeddings": 1}, "normalize_embeddings")],
)
def test_bad_settings_are_refused_by_name(settings: dict[str, object], param: str):
    with pytest.raises(InvalidRequestError, match=rf"^{param}: "):
        EngineConfig(**settings)  # type: ignore[arg-type]
