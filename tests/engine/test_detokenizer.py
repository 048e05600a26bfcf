import pytest

from replica_engine.detokenizer import IncrementalDetokenizer

TEXT = "Café au lait — naïve façade 😀 costs 3€. Then the end."


class _SlowTokenizer:
    """A tokenizer without a stream decoder (as a slow, Python one is): the real tokenizer
    behind is_fast False, so the sliding-window path runs."""

    is_fast = False

    def __init__(self, fast) -> None:
        self._fast = fast

    def __getattr__(self, name: str):
        return getattr(self._fast, name)


@pytest.fixture(params=["stream", "window"])
def either_tokenizer(request, tokenizer):
    """Each test on both ways to detokenize: a fast tokenizer's stream, a slow one's window."""
    return tokenizer if request.param == "stream" else _SlowTokenizer(tokenizer)


def _stream(
    tokenizer, text: str, stop: list[str], include_stop: bool = False
) -> tuple[IncrementalDetokenizer, list[str], bool]:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), stop, include_stop)
    deltas, stopped = [], False
    for token_id in ids:
        stopped = detok.add_token(token_id)
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(detok.take_delta(finished=True))
    return detok, deltas, stopped


def test_incremental_text_equals_decoding_everything_at_once(either_tokenizer):
    detok, deltas, stopped = _stream(either_tokenizer, TEXT, [])
    assert not stopped
    assert "".join(deltas) == detok.text == either_tokenizer.decode(either_tokenizer.encode(TEXT))
    assert sum(1 for d in deltas if d) > 5  # really incremental


def test_stop_string_cuts_the_text_and_no_part_of_it_is_ever_streamed(either_tokenizer):
    detok, deltas, stopped = _stream(either_tokenizer, TEXT, ["3€", "zzz"])
    assert stopped
    assert detok.text == "Café au lait — naïve façade 😀 costs "
    assert "".join(deltas) == detok.text
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert "3" not in streamed  # the stop string's start was held back, never shown


def test_include_stop_str_in_output_ends_the_text_with_the_first_stop_string(either_tokenizer):
    """vLLM's include_stop_str_in_output: the text ends after the earliest stop string, and
    nothing is held back while it runs (no stop string's start is ever cut off)."""
    detok, deltas, stopped = _stream(either_tokenizer, TEXT, ["zzz", "costs 3", "3€"], include_stop=True)
    assert stopped
    assert detok.text == "Café au lait — naïve façade 😀 costs 3"
    assert "".join(deltas) == detok.text
    assert deltas[0]  # streamed from the first token on: no holdback


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_have_text_only_when_not_skipped(either_tokenizer, skip: bool):
    detok = IncrementalDetokenizer(either_tokenizer, [1], [], skip_special_tokens=skip)
    for token_id in [*either_tokenizer.encode("Paris."), either_tokenizer.eos_token_id]:
        detok.add_token(token_id)
    eos = either_tokenizer.decode([either_tokenizer.eos_token_id])
    assert eos == "<|im_end|>"
    assert detok.take_delta(finished=True) == ("Paris." if skip else "Paris." + eos)


def test_a_token_the_stream_refuses_leaves_the_text_whole(tokenizer, monkeypatch):
    """tokenizers' stream decoder raises on some tokenizers' text (issue #1705): a stand-in for
    it that refuses one token, each in turn (one of them right after half a character, which
    has no text yet); the request goes on from a window and loses no text."""
    from tokenizers.decoders import DecodeStream

    whole, refusals = tokenizer.decode(tokenizer.encode(TEXT)), []
    for refused in range(len(tokenizer.encode(TEXT))):

        class RefusingStream:
            def __init__(self, **kwargs) -> None:
                self._stream, self._steps = DecodeStream(**kwargs), 0

            def step(self, backend, token_id: int, refused: int = refused) -> str | None:
                self._steps += 1
                if self._steps == refused + 1:
                    refusals.append(refused)
                    raise Exception("Invalid prefix encountered")
                return self._stream.step(backend, token_id)

        monkeypatch.setattr("replica_engine.detokenizer.DecodeStream", RefusingStream)
        detok, deltas, stopped = _stream(tokenizer, TEXT, [])
        assert not stopped
        assert "".join(deltas) == detok.text == whole, refused
    assert refusals == list(range(len(tokenizer.encode(TEXT))))  # the stream ran, and refused each
