"""The training corpus every machine has: the Python standard library's own source.

Used to train the bundled tokenizer and the bundled target + draft pair
(`scripts/tools/train_fixture_pair.py`). Files are taken in sorted relative-path order so a
given Python version yields the same corpus everywhere; every 20th file is held out
for validation. Each document ends with the end-of-text token.
"""

from __future__ import annotations

import glob
import os
import sysconfig

EOS_TOKEN = "<|endoftext|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# ChatML-style template; the bundled models are trained on code, so chat is a format
# convenience for the API rather than a skill they have.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SKIP_PARTS = ("site-packages", "pydoc_data", "encodings", "unicodedata")


def stdlib_files(stdlib_dir: str | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files, sorted, without bulky data modules."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    paths = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, root)
        if any(part in rel for part in _SKIP_PARTS):
            continue
        paths.append(rel)
    return sorted(paths)


def split_corpus(stdlib_dir: str | None = None) -> tuple[list[str], list[str]]:
    """(train texts, validation texts): every 20th file is validation."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    train, valid = [], []
    for i, rel in enumerate(stdlib_files(root)):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        (valid if i % 20 == 0 else train).append(text)
    return train, valid


def train_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 2048) -> None:
    """Train a byte-level BPE and write tokenizer.json + tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
