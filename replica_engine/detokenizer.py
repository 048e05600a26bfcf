"""Incremental detokenization and stop strings for one request.

Text is decoded over a short sliding window (vLLM's prefix/read offsets), seeded with the last
prompt tokens so tokenizers that drop a leading space on a lone token still get it right. While
the request runs, the last len(longest stop) - 1 characters are held back from the stream, so a
client never sees the start of a stop string that is then cut off."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], stop: list[str]
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""  # output text so far, cut before a stop string once one appears
        self._num_emitted_chars = 0

    def add_token(self, token_id: int) -> bool:
        """Append one output token; True when a stop string has appeared (the text is cut there)."""
        self._token_ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self._token_ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # no new characters yet, or half a multi-byte character
        previous_length = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return self._cut_at_stop_string(previous_length)

    def _cut_at_stop_string(self, previous_length: int) -> bool:
        cut = -1
        for stop in self._stop:
            index = self.text.find(stop, max(0, previous_length - len(stop) + 1))
            if index != -1 and (cut == -1 or index < cut):
                cut = index
        if cut == -1:
            return False
        self.text = self.text[:cut]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned that is safe to show (all of it once the request has finished)."""
        end = len(self.text) if finished else max(self._num_emitted_chars, len(self.text) - self._holdback)
        delta = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta
