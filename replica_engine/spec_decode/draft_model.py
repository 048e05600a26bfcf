"""A draft model (vLLM's `method: draft_model`, `model: ...`): a smaller model with the target's
vocabulary, run by this engine's own model runner with a K/V pool of its own, proposes each
decode's next tokens greedily, k forward passes a step for all the decodes at once.

Per request the proposer keeps how many leading tokens of the sequence its pool holds. A step
first computes what is missing of them up to the last token (the prompt, the first time; then
the tokens verification kept), which also gives the first draft token; then one decode pass per
further draft token. Draft tokens' own K/V are not trusted: the next catch-up writes over them
from the last token the sequence certainly holds. A request's state goes when it finishes or is
preempted; when the pool is short, states of requests not drafting now go first, else the
request does not draft this step."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from common.errors import InvalidRequestError
from common.model_source import resolve_model
from common.sampling_params import SamplingParams
from replica_engine.config import EngineConfig
from replica_engine.kv_cache_manager import NULL_BLOCK_ID, blocks_for_tokens
from replica_engine.model_runner import ModelRunner, load_runner
from replica_engine.models.loader import load_config
from replica_engine.request import Request
from replica_engine.scheduler.plan import SamplingRow, ScheduledBatch, ScheduledRow
from replica_engine.spec_decode.config import FIELD, SpeculativeConfig

logger = logging.getLogger(__name__)
_GREEDY = SamplingRow(SamplingParams(max_tokens=1, temperature=0.0))


@dataclass
class DraftState:
    block_ids: list[int] = field(default_factory=list)
    num_blocks_in_runner: int = 0
    num_computed: int = 0  # leading tokens of the sequence whose K/V the draft pool holds


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self._free = list(range(NULL_BLOCK_ID + 1, num_blocks + 1))
        self.states: dict[str, DraftState] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, limits: dict[Request, int]) -> dict[Request, list[int]]:
        sequences = {r: r.prompt_token_ids + r.output_token_ids for r in limits}
        drafting = {r.request_id for r in limits}
        ready = [r for r in limits if self._hold(r, len(sequences[r]) + limits[r] - 1, drafting)]
        drafts: dict[Request, list[int]] = {r: [] for r in ready}
        rows = {}
        for r in ready:  # the catch-up, whose last token's logits give the first draft
            state, sequence = self.states[r.request_id], sequences[r]
            start = min(state.num_computed, len(sequence) - 1)
            rows[r] = self._row(r.request_id, state, sequence[start:], start)
            state.num_computed = len(sequence)
        for position in range(max((limits[r] for r in ready), default=0)):
            if position:  # one decode pass per further draft token
                rows = {
                    r: self._row(
                        r.request_id,
                        self.states[r.request_id],
                        drafts[r][-1:],
                        len(sequences[r]) + position - 1,
                    )
                    for r in ready
                    if limits[r] > position
                }
            sampled = self.runner.execute(ScheduledBatch(tuple(rows.values()))).sampled.token_ids
            for r, token in zip(rows, sampled, strict=True):
                drafts[r].append(token)
        return drafts

    def _row(self, request_id: str, state: DraftState, tokens: list[int], start: int) -> ScheduledRow:
        row = ScheduledRow(
            request_id,
            tuple(tokens),
            start,
            tuple(state.block_ids[state.num_blocks_in_runner :]),
            is_decode=len(tokens) == 1,
            sampling=_GREEDY,
            block_offset=state.num_blocks_in_runner,
        )
        state.num_blocks_in_runner = len(state.block_ids)
        return row

    def _hold(self, request: Request, num_tokens: int, drafting: set[str]) -> bool:
        """Blocks for the request's first `num_tokens` tokens; states of requests not `drafting`
        now (by id) are given up for them if the pool is short."""
        state = self.states.setdefault(request.request_id, DraftState())
        missing = blocks_for_tokens(num_tokens, self.block_size) - len(state.block_ids)
        if missing > len(self._free):
            for request_id in [i for i in self.states if i not in drafting]:
                self._forget(request_id)
        if missing > len(self._free):
            return False
        state.block_ids += [self._free.pop() for _ in range(max(0, missing))]
        return True

    def _forget(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is None:
            return
        self._free += state.block_ids
        if state.num_blocks_in_runner:
            self.runner.release([request_id])

    def request_finished(self, request: Request) -> None:
        self._forget(request.request_id)

    def request_preempted(self, request: Request) -> None:
        self._forget(request.request_id)


def build_draft_proposer(
    config: EngineConfig, target: EngineConfig, spec: SpeculativeConfig, vocab_size: int, num_blocks: int
) -> DraftModelProposer:
    """The draft model loaded as the user's `config` would load it, sized by the resolved `target`
    (its context, its batch width, as many blocks as the target's pool); refused by name where
    its vocabulary is not the target's or its context is shorter."""
    assert spec.model is not None and target.max_model_len is not None
    try:
        source = resolve_model(spec.model)
    except InvalidRequestError as error:  # named as the user set it: the draft's, not the target's
        raise InvalidRequestError(f"{FIELD}.model", error.message) from None
    model_config = load_config(source)
    if model_config.vocab_size != vocab_size:
        raise InvalidRequestError(
            f"{FIELD}.model",
            f"{spec.model!r} has {model_config.vocab_size} tokens; the target model {vocab_size}",
        )
    draft = dataclasses.replace(
        config,
        model=spec.model,
        quantization="auto",
        speculative_config=None,
        enable_lora=False,
        num_kv_blocks=num_blocks,
        kv_cache_bytes=None,
        max_model_len=None,
        max_num_seqs=target.max_num_seqs,
        max_num_batched_tokens=target.max_model_len,  # a catch-up may be a whole prompt
        cuda_graphs=False,
        async_scheduling=False,
        amx_weights=False,
    ).resolve(model_config)
    if draft.max_model_len is not None and draft.max_model_len < target.max_model_len:
        raise InvalidRequestError(
            f"{FIELD}.model",
            f"{spec.model!r} holds {draft.max_model_len} tokens; the target's context is"
            f" {target.max_model_len}",
        )
    draft = dataclasses.replace(draft, max_model_len=target.max_model_len)
    runner = load_runner(source, model_config, draft)
    runner.allocate_kv_cache(num_blocks + 1)  # + the null block
    logger.info("draft model %s loaded: %d blocks of K/V", spec.model, num_blocks)
    return DraftModelProposer(runner, num_blocks, draft.block_size)
