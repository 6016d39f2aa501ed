"""Incremental detokenization (engine/decoding/detok.py): the pieces handed out add up to the answer decoded whole,
stop strings are found across token boundaries, an incomplete character is held back, and the work per
token does not grow with the answer."""

from __future__ import annotations

import pytest

from kvcli.engine.decoding.detok import TextStream


def _stream(tok, ids, stop=()):
    pieces: list[str] = []
    s = TextStream(tok, stop, pieces.append)
    for i in ids:
        if s.put(i):
            break
    s.end()
    return s, pieces


TEXTS = [
    "The Licensor grants you a licence.\n\nSection 2: Patents — «quoted», naïve café, 日本語のテキスト, emoji 🙂🙃!",
    "  leading spaces, trailing spaces   \n\ttabs\tand\u00a0non-breaking spaces ",
    "def f(x):\n    return x ** 2  # code\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_decode(tokenizer, plain_tokenizer, text):
    for tok in (tokenizer, plain_tokenizer):  # byte-level BPE and SentencePiece-style
        ids = tok(text, add_special_tokens=False)["input_ids"]
        s, pieces = _stream(tok, ids)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == s.text == whole
        assert "\ufffd" not in "".join(pieces)  # multi-byte characters are never split into replacement chars


def test_a_stop_string_across_token_boundaries_cuts_the_text(tokenizer):
    text = "alpha beta gamma delta epsilon"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for stop, want in (("gam", "alpha beta "), ("a d", "alpha beta gamm"), ("on", "alpha beta gamma delta epsil"),
                       ("zzz", text)):
        s, pieces = _stream(tokenizer, ids, stop=(stop,))
        assert "".join(pieces) == s.text == want, stop
        assert s.stopped == (stop != "zzz")


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    s, pieces = _stream(tokenizer, ids, stop=("four", "two"))
    assert "".join(pieces) == "one "


def test_work_per_token_does_not_grow_with_the_answer(tokenizer):
    """Each token decodes a bounded window: the ids decoded per token stay constant, never the answer so far."""
    ids = tokenizer("word " * 400, add_special_tokens=False)["input_ids"]
    decoded: list[int] = []

    class Counting:
        def decode(self, some, **kw):
            decoded.append(len(some))
            return tokenizer.decode(some, **kw)

    s = TextStream(Counting(), ("never",), None)
    for i in ids:
        s.put(i)
    per_token = decoded[: len(ids) * 2]  # two window decodes per token
    assert max(per_token) <= 8 and len(ids) > 300
