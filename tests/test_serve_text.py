"""serve.detok and serve.stops: streaming text without broken characters (S6) and stop strings (S7)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.detok import StreamDecoder, TokenTable, bytes_to_unicode, display_token
from serve.stops import StopMatcher
from tests.scripted import scripted_lm, scripted_tokenizer

S6_TEXT = "আমি বাংলায় গান গাই 😀 ক্ষমা"


def stream_pieces(table: TokenTable, ids) -> list[str]:
    dec = StreamDecoder(table)
    pieces = [dec.push(i) for i in ids]
    return [p for p in [*pieces, dec.flush()] if p]


def byte_table() -> tuple[TokenTable, dict[int, int]]:
    """A table whose ids 2..257 are the 256 single bytes (so every multi-byte character is split)."""
    tok = scripted_tokenizer()
    alphabet = bytes_to_unicode()
    return TokenTable.from_tokenizer(tok), {b: tok.token_to_id(alphabet[b]) for b in range(256)}


def test_bytes_to_unicode_is_gpt2s_alphabet():
    m = bytes_to_unicode()
    assert len(m) == 256 and len(set(m.values())) == 256
    assert m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ" and m[ord("A")] == "A"


def test_table_decodes_fixture_tok_like_the_tokenizer(fixture_tok):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fixture_tok / "tokenizer.json"))
    table = TokenTable.from_tokenizer(tok)
    for text in [S6_TEXT, "hello  world\n", "x != y", "ক্‌ষ"]:
        ids = tok.encode(text).ids
        assert table.decode(ids) == tok.decode(ids) == text
    assert table.decode([0]) == "<|endoftext|>"  # specials decode to their content


def test_s6_fixture_tok_stream_has_no_replacement_characters(fixture_tok):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fixture_tok / "tokenizer.json"))
    table = TokenTable.from_tokenizer(tok)
    ids = tok.encode(S6_TEXT).ids
    assert any(not _valid_utf8(table.token_bytes(i)) for i in ids)  # some tokens really split characters
    pieces = stream_pieces(table, ids)
    assert "".join(pieces) == table.decode(ids) == S6_TEXT
    assert all("\ufffd" not in p for p in pieces)
    for p in pieces:
        p.encode("utf-8").decode("utf-8")  # every piece is whole characters


def test_s6_byte_by_byte_stream():
    table, byte_id = byte_table()
    ids = [byte_id[b] for b in S6_TEXT.encode()]
    pieces = stream_pieces(table, ids)
    assert "".join(pieces) == S6_TEXT
    assert "😀" in pieces  # held until all four bytes arrived, then sent whole
    assert all("\ufffd" not in p for p in pieces)


def test_s6_incomplete_tail_is_flushed_at_end_as_replacement():
    table, byte_id = byte_table()
    ids = [byte_id[b] for b in "ক".encode()[:2]]  # two of three bytes, then the stream ends
    dec = StreamDecoder(table)
    assert [dec.push(i) for i in ids] == ["", ""]
    assert dec.flush() == "\ufffd"
    assert dec.text == table.decode(ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=4), max_size=30))
def test_s6_stream_equals_whole_decode_for_any_bytes(chunks):
    """Arbitrary token byte strings (valid or not): pieces join to the whole decode, and a piece holds a
    U+FFFD only where the whole decode has one."""
    vocab = {bytes_to_unicode()[b]: b for b in range(256)}
    specials = []
    for n, c in enumerate(chunks):
        spelled = "".join(bytes_to_unicode()[b] for b in c)
        vocab.setdefault(spelled, 256 + n)
    table = TokenTable(vocab, specials)
    ids = [vocab["".join(bytes_to_unicode()[b] for b in c)] for c in chunks]
    pieces = stream_pieces(table, ids)
    whole = table.decode(ids)
    assert "".join(pieces) == whole
    assert sum(p.count("\ufffd") for p in pieces) == whole.count("\ufffd")


def test_display_token():
    assert display_token(" বাংলা".encode()) == " বাংলা"
    assert display_token("ব".encode()[:2]) == "bytes:\\xe0\\xa6"


# ---- S7: stop strings


def run_matcher(pieces, stops):
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    if m.stop_at is None:
        out.append(m.finish())
    return out, m


def test_s7_stop_spanning_tokens_never_leaks():
    out, m = run_matcher(["ABC", "DEF", "G", "HI", "J", "KL"], ["DEFGHIJ"])
    assert "".join(out) == "ABC" and m.stop_at == 3
    assert all(not set(p) & set("DEFGHIJ") for p in out)


def test_s7_held_text_is_released_when_ambiguity_resolves():
    out, m = run_matcher(["AB", "DE", "X"], ["DEF"])
    assert out == ["AB", "", "DEX", ""] and m.stop_at is None


def test_s7_stop_inside_one_piece():
    out, m = run_matcher(["a gammaray"], ["gamma"])
    assert out == ["a "] and m.stop_at == 2


def test_held_tail_released_at_finish_and_earliest_stop_wins():
    out, _ = run_matcher(["hello wor"], ["world"])
    assert out == ["hello ", "wor"]
    out, m = run_matcher(["xxBBAA"], ["AA", "BB"])
    assert out == ["xx"] and m.stop_at == 2


def test_empty_stop_rejected():
    with pytest.raises(ValueError):
        StopMatcher([""])


@pytest.mark.parametrize("stream", [True, False])
def test_s7_scripted_model(stream):
    lm = scripted_lm(["ABC", "DEF", "G", "HI", "J", "KL"])
    if stream:
        gen = lm.start("x", 20, stop=["DEFGHIJ"])
        pieces = [c.text for c in gen]
        assert pieces == ["ABC"] and gen.finish_reason == "stop"
    else:
        c = lm.complete("x", 20, stop=["DEFGHIJ"])
        assert (c.text, c.finish_reason, c.tokens) == ("ABC", "stop", ["ABC"])
    c = scripted_lm(["a gammaray"]).complete("x", 5, stop="gamma")
    assert (c.text, c.finish_reason, c.completion_tokens) == ("a ", "stop", 1)


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
