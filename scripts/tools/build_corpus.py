"""Build the stdlib training corpus: a byte-level BPE tokenizer and token-id arrays.

    python -m scripts.tools.build_corpus --out .devwork/train [--vocab-size 2048]

Writes `tokenizer/` (tokenizer.json, tokenizer_config.json), `train.npy` and
`valid.npy` (uint16 ids, documents separated by the end-of-text token). Input for
`scripts/tools/train_fixture_pair.py`.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from models.corpus import EOS_TOKEN, split_corpus, train_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args()

    from tokenizers import Tokenizer

    start = time.time()
    train, valid = split_corpus()
    print(f"{len(train)} train / {len(valid)} valid files, {sum(map(len, train)) / 1e6:.1f} MB")
    tok_dir = os.path.join(args.out, "tokenizer")
    train_tokenizer(train, tok_dir, vocab_size=args.vocab_size)
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eos = tok.token_to_id(EOS_TOKEN)
    for name, texts in (("train", train), ("valid", valid)):
        ids: list[int] = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eos)
        np.save(os.path.join(args.out, f"{name}.npy"), np.array(ids, dtype=np.uint16))
        print(f"{name}: {len(ids)} tokens ({sum(map(len, texts)) / len(ids):.2f} bytes/token)")
    print(f"done in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
