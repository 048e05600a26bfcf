"""The offline API, vLLM-style: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from common.model_source import DEFAULT_MODEL
from common.prompts import Prompt
from common.sampling_params import SamplingParams
from common.tokenizer import Message
from replica_engine.config import EngineConfig
from replica_engine.engine import LLMEngine
from replica_engine.outputs import CompletionOutput


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
    ) -> list[CompletionOutput]:
        """Run every prompt (text, or a list of token ids) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        token_ids = [self.engine.tokenize(p) for p in prompts]
        return self._run(token_ids, sampling_params)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """One conversation, or a list of them; each is answered as the assistant's next turn."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([self.engine.chat_prompt_ids(c) for c in conversations], sampling_params)

    def _run(
        self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None
    ) -> list[CompletionOutput]:
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        completions: dict[str, CompletionOutput] = {}
        try:
            for prompt, params in zip(prompts, sampling_params, strict=True):
                request_id = self.engine.add_request(prompt, params)
                completions[request_id] = CompletionOutput(request_id, prompt)
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    completions[output.request_id].add(output)
        except BaseException:
            for request_id in completions:
                self.engine.abort_request(request_id)
            raise
        return list(completions.values())
