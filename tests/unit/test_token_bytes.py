"""`TextCodec.token_bytes`: a token's own UTF-8 bytes for logprobs' `bytes`, from its
vocabulary entry when it holds part of a character (its text alone is U+FFFD). The
bundled byte-level tokenizer is checked end to end in tests/serve/test_logprobs_http.py."""

from __future__ import annotations

import pytest

from serve_app.openai.codec import TextCodec


class TableTokenizer:
    """id -> (vocabulary piece, text decoded alone)."""

    chat_template = None
    added_tokens_decoder: dict = {}

    def __init__(self, table):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.table[i][1] for i in ids)

    def convert_ids_to_tokens(self, token_id):
        return self.table[token_id][0]

    def encode(self, text, add_special_tokens=True):
        return []


@pytest.mark.parametrize(
    "piece, text, expected",
    [
        ("<0xE2>", "\ufffd", b"\xe2"),  # SentencePiece byte fallback
        ("Ã", "\ufffd", b"\xc3"),  # byte-level BPE: Ã stands for byte 0xC3
        ("âĤ", "\ufffd", b"\xe2\x82"),  # two bytes of a three-byte character
        ("▁hi", " hi", b" hi"),  # whole characters: the text's bytes
        ("é", "é", "é".encode()),
        ("▁", "\ufffd", "\ufffd".encode()),  # neither form: the text's bytes
    ],
)
def test_a_tokens_bytes(piece, text, expected):
    assert TextCodec(TableTokenizer({7: (piece, text)})).token_bytes(7) == expected
