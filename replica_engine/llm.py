"""The offline API, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`, and
`LLM.embed(prompts)` for embeddings."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from common.lora import LoRARequest
from common.model_source import DEFAULT_MODEL
from common.prompts import Prompt
from common.sampling_params import SamplingParams
from common.tokenizer import Message
from replica_engine.config import EngineConfig
from replica_engine.engine import LLMEngine
from replica_engine.outputs import CompletionOutput, EmbeddingOutput, RequestOutput


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_settings: object) -> None:
        """`engine_settings` are EngineConfig fields (max_num_batched_tokens, block_size, ...)."""
        self.engine = LLMEngine(EngineConfig(model=model, offline=True, **engine_settings))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt (text, or a list of token ids) to completion; outputs in prompt order.
        `lora_request` (as vLLM's): every prompt runs with that adapter (needs `enable_lora`);
        per prompt, set `SamplingParams.lora` instead."""
        prompts = self._tokenized(prompts)
        if lora_request is not None:
            if not isinstance(sampling_params, list):
                sampling_params = [sampling_params or SamplingParams()] * len(prompts)
            sampling_params = [dataclasses.replace(p, lora=lora_request) for p in sampling_params]
        return self._run(prompts, sampling_params)

    def embed(self, prompts: Prompt | list[Prompt]) -> list[EmbeddingOutput]:
        """Every prompt's embedding (text, or a list of token ids), in prompt order: its prompt
        computed in the engine's batches like any other and pooled as `pooling` says."""
        token_ids = self._tokenized(prompts)
        embeddings: dict[str, list[float] | None] = {}
        with self._aborting_on_error(embeddings):
            for prompt in token_ids:
                embeddings[self.engine.add_embedding_request(prompt)] = None
            for output in self._outputs():
                embeddings[output.request_id] = output.embedding
        results = []
        pairs = zip(embeddings.items(), token_ids, strict=True)
        for index, ((request_id, embedding), prompt) in enumerate(pairs):
            if embedding is None:  # finished with reason error
                raise RuntimeError(f"the engine failed while computing prompt {index}'s embedding")
            results.append(EmbeddingOutput(request_id, prompt, embedding))
        return results

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[CompletionOutput]:
        """One conversation, or a list of them; each is answered as the assistant's next turn.
        `tools` (OpenAI's function tools) go to the chat template, as vLLM's LLM.chat; the text
        is not parsed for calls (common.tool_parsers.parse_message reads them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([self.engine.chat_prompt_ids(c, tools) for c in conversations], sampling_params)

    def _tokenized(self, prompts: Prompt | list[Prompt]) -> list[list[int]]:
        """One prompt or a list of them, as token ids."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return [self.engine.tokenize(p) for p in prompts]

    def _run(
        self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None
    ) -> list[CompletionOutput]:
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        completions: dict[str, CompletionOutput] = {}
        with self._aborting_on_error(completions):
            for prompt, params in zip(prompts, sampling_params, strict=True):
                request_id = self.engine.add_request(prompt, params)
                completions[request_id] = CompletionOutput(request_id, prompt)
            for output in self._outputs():
                completions[output.request_id].add(output)
        return list(completions.values())

    def _outputs(self) -> Iterator[RequestOutput]:
        """Step until every request has finished."""
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()

    @contextlib.contextmanager
    def _aborting_on_error(self, request_ids: Iterable[str]) -> Iterator[None]:
        """If the block raises (or is interrupted), every request in `request_ids` (read then: a
        dict the block fills, keyed by id) is aborted, its KV blocks freed."""
        try:
            yield
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
