from replica_engine.detokenizer import IncrementalDetokenizer

TEXT = "Café au lait — naïve façade 😀 costs 3€. Then the end."


def _stream(tokenizer, text: str, stop: list[str]) -> tuple[IncrementalDetokenizer, list[str], bool]:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), stop)
    deltas, stopped = [], False
    for token_id in ids:
        stopped = detok.add_token(token_id)
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            break
    if not stopped:
        deltas.append(detok.take_delta(finished=True))
    return detok, deltas, stopped


def test_incremental_text_equals_decoding_everything_at_once(tokenizer):
    detok, deltas, stopped = _stream(tokenizer, TEXT, [])
    assert not stopped
    assert "".join(deltas) == detok.text == tokenizer.decode(tokenizer.encode(TEXT))
    assert sum(1 for d in deltas if d) > 5  # really incremental


def test_stop_string_cuts_the_text_and_no_part_of_it_is_ever_streamed(tokenizer):
    detok, deltas, stopped = _stream(tokenizer, TEXT, ["3€", "zzz"])
    assert stopped
    assert detok.text == "Café au lait — naïve façade 😀 costs "
    assert "".join(deltas) == detok.text
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert "3" not in streamed  # the stop string's start was held back, never shown


def test_special_tokens_are_not_in_the_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [1], [])
    for token_id in [*tokenizer.encode("Paris."), tokenizer.eos_token_id]:
        detok.add_token(token_id)
    assert detok.take_delta(finished=True) == "Paris."
