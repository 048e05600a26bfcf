"""The offline API, vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))` returns a
RequestOutput per prompt (`output.outputs[0].text`), and `LLM.embed(prompts)` embeddings."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from common.lora import LoRARequest
from common.model_source import DEFAULT_MODEL, generation_defaults, resolve_model
from common.prompts import Prompt
from common.sampling_params import SamplingParams
from common.tokenizer import Message
from replica_engine.config import EngineConfig
from replica_engine.engine import LLMEngine
from replica_engine.outputs import CompletionOutput, EmbeddingOutput, RequestDelta, RequestOutput


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
    ) -> list[RequestOutput]:
        """Run every prompt (text, or a list of token ids) to completion, each `n` times (its
        SamplingParams'); outputs in prompt order. `lora_request` (as vLLM's): every prompt runs
        with that adapter (needs `enable_lora`); per prompt, set `SamplingParams.lora` instead."""
        prompts = self._listed(prompts)
        if lora_request is not None:
            if not isinstance(sampling_params, list):
                sampling_params = [sampling_params or SamplingParams()] * len(prompts)
            sampling_params = [dataclasses.replace(p, lora=lora_request) for p in sampling_params]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run([self.engine.tokenize(p) for p in prompts], texts, sampling_params)

    def get_default_sampling_params(self) -> SamplingParams:
        """What the model's generation_config.json recommends, over SamplingParams' defaults (as
        vLLM's): pass it, changed or not, to generate with them."""
        return SamplingParams(**generation_defaults(resolve_model(self.engine.config.model)))

    def embed(self, prompts: Prompt | list[Prompt]) -> list[EmbeddingOutput]:
        """Every prompt's embedding (text, or a list of token ids), in prompt order: its prompt
        computed in the engine's batches like any other and pooled as `pooling` says."""
        token_ids = [self.engine.tokenize(p) for p in self._listed(prompts)]
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
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation, or a list of them; each is answered as the assistant's next turn.
        `tools` (OpenAI's function tools) and `chat_template_kwargs` (e.g. Qwen3's
        `enable_thinking`) go to the chat template, as vLLM's LLM.chat; the text is not parsed
        for calls (common.tool_parsers.parse_message reads them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.chat_prompt_ids(c, tools, chat_template_kwargs) for c in conversations]
        tokenizer = self.engine.tokenizer
        texts = [tokenizer.decode(ids) if tokenizer is not None else None for ids in prompts]
        return self._run(prompts, texts, sampling_params)

    @staticmethod
    def _listed(prompts: Prompt | list[Prompt]) -> list[Prompt]:
        """One prompt (text, or token ids) or a list of them, as a list."""
        one_of_ids = isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        if isinstance(prompts, str) or one_of_ids:
            return [prompts]  # type: ignore[list-item]
        return list(prompts)  # type: ignore[arg-type]

    def _run(
        self,
        prompts: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | list[SamplingParams] | None,
    ) -> list[RequestOutput]:
        """Each prompt's n choices, each an engine request of its own (params.for_choice)."""
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        results: list[RequestOutput] = []
        choices: dict[str, tuple[RequestOutput, int]] = {}  # engine request -> its prompt and choice
        with self._aborting_on_error(choices):
            for prompt, text, params in zip(prompts, texts, sampling_params, strict=True):
                result = RequestOutput("", text, prompt, [CompletionOutput(j) for j in range(params.n)])
                for j in range(params.n):
                    request_id = self.engine.add_request(prompt, params.for_choice(j))
                    choices[request_id] = (result, j)
                    result.request_id = result.request_id or request_id  # its first choice's
                results.append(result)
            for delta in self._outputs():
                result, j = choices[delta.request_id]
                result.add(j, delta)
        return results

    def _outputs(self) -> Iterator[RequestDelta]:
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
