"""Incremental detokenization: UTF-8 safety, stop strings across token boundaries."""

from __future__ import annotations

from pagedinfer.engine.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Every token is one UTF-8 byte (ids 0..255); 256 is a special token."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        special = "" if skip_special_tokens else "<s>" * sum(1 for i in ids if i == 256)
        return special + data.decode("utf-8", errors="replace")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    pieces = []
    for i in range(0, len(ids), chunk):
        text, stop = detok.push(ids[i : i + chunk])
        pieces.append(text)
        if stop:
            return pieces
    pieces.append(detok.flush())
    return pieces


def test_multibyte_characters_never_stream_replacement_chars():
    tok = ByteTokenizer()
    text = "héllo → 世界 🎉!"
    pieces = stream(IncrementalDetokenizer(tok, tok.encode("prompt: ")), tok.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_token_boundaries_is_never_shown():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    pieces = stream(detok, tok.encode("abc STOP def"))
    assert "".join(pieces) == "abc " and detok.stopped_on == "STOP"
    assert all("S" not in p for p in pieces)


def test_partial_stop_prefix_is_released_when_not_a_stop():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("</end>",))
    shown = []
    for b in tok.encode("x </en"):
        shown.append(detok.push([b])[0])
    assert "".join(shown) == "x "  # "</en" is held back
    text, stop = detok.push(tok.encode("d? no"))
    assert stop is None and "".join(shown) + text + detok.flush() == "x </end? no"


def test_earliest_of_several_stop_strings_wins_and_specials_skipped():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("bb", "ab"))
    text = "".join(stream(detok, [256, *tok.encode("xxabb")], chunk=3))
    assert text == "xx" and detok.stopped_on == "ab"


def test_a_push_of_several_ids_says_how_many_came_up_to_the_stop():
    """Speculative steps push several ids at once: the ones after the id that completed a stop
    string are not output (`num_pushed_kept`); later pushes keep none."""
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=("STOP",))
    assert detok.push(tok.encode("ab ST"))[1] is None and detok.num_pushed_kept == 5
    text, stop = detok.push(tok.encode("OP and more"))
    assert stop == "STOP" and detok.num_pushed_kept == 2 and detok.text == "ab "
    assert detok.push(tok.encode("x"))[1] == "STOP" and detok.num_pushed_kept == 0
