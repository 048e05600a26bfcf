"""Incremental detokenization and stop strings for one request.

A fast tokenizer's text comes from its own stream decoder (tokenizers' DecodeStream: one call per
token in Rust, about a microsecond, where decoding a window twice costs ~8 us). Other tokenizers
decode a short sliding window (vLLM's prefix/read offsets), as does a request whose tokens the
stream refuses. Both are seeded with the last prompt tokens, so tokenizers that drop a leading
space on a lone token still get it right, and both hold back half a multi-byte character until
it is whole. While the request runs, the last
len(longest stop) - 1 characters are held back from the stream, so a client never sees the start
of a stop string that is then cut off (none when the stop string stays in the text,
`include_stop_str_in_output`). Special tokens have no text unless `skip_special_tokens` is off."""

from __future__ import annotations

from collections import deque
from functools import partial

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT_TOKENS = 6


class _WindowDecoder:
    """New text per token from decoding a sliding window twice (a tokenizer without a stream)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._skip_special = skip_special

    def step(self, token_id: int) -> str | None:
        self._token_ids.append(token_id)
        decode = partial(self._tokenizer.decode, skip_special_tokens=self._skip_special)
        prefix = decode(self._token_ids[self._prefix_offset : self._read_offset])
        full = decode(self._token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # no new characters yet, or half a multi-byte character
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return full[len(prefix) :]


class _StreamDecoder:
    """New text per token from a fast tokenizer's own stream decoder. Where the stream refuses a
    token (it raises when a tokenizer's text for more tokens does not extend its text for fewer:
    tokenizers issue #1705), the request goes on decoding a window, from its latest tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context: list[int], skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special)
        self._decoded = deque(context, maxlen=_PROMPT_CONTEXT_TOKENS)  # latest whose text is out
        self._pending: list[int] = []  # since then: no text yet (half a character, special tokens)
        self._window: _WindowDecoder | None = None

    def step(self, token_id: int) -> str | None:
        if self._window is not None:
            return self._window.step(token_id)
        try:
            text = self._stream.step(self._tokenizer.backend_tokenizer, token_id)
        except Exception:
            self._window = _WindowDecoder(self._tokenizer, list(self._decoded), self._skip_special)
            texts = [self._window.step(pending) for pending in (*self._pending, token_id)]
            return "".join(text for text in texts if text) or None
        self._pending.append(token_id)
        if text:
            self._decoded.extend(self._pending)
            self._pending.clear()
        return text


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._stop = stop
        self._include_stop = include_stop
        self._holdback = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        decoder = _StreamDecoder if tokenizer.is_fast else _WindowDecoder
        self._decoder = decoder(tokenizer, context, skip_special_tokens)
        self.text = ""  # output text so far, cut before a stop string once one appears
        self._num_emitted_chars = 0

    def add_token(self, token_id: int) -> bool:
        """Append one output token; True when a stop string has appeared (the text is cut there)."""
        new_text = self._decoder.step(token_id)
        if not new_text:
            return False
        previous_length = len(self.text)
        self.text += new_text
        return self._cut_at_stop_string(previous_length)

    def _cut_at_stop_string(self, previous_length: int) -> bool:
        found: tuple[int, str] | None = None  # the earliest stop string in the new text
        for stop in self._stop:
            index = self.text.find(stop, max(0, previous_length - len(stop) + 1))
            if index != -1 and (found is None or index < found[0]):
                found = (index, stop)
        if found is None:
            return False
        index, stop = found
        self.text = self.text[: index + len(stop) if self._include_stop else index]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned that is safe to show (all of it once the request has finished)."""
        end = len(self.text) if finished else max(self._num_emitted_chars, len(self.text) - self._holdback)
        delta = self.text[self._num_emitted_chars : end]
        self._num_emitted_chars = end
        return delta
