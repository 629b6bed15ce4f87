"""GGUF files as mlx-lm directories (`models.loading.gguf`), two ways:

- tiny random llamas written here as GGUF files the way llama.cpp's converter writes
  them (its tensor names, q / k rows permuted for its interleaved rope, a byte-level
  BPE vocabulary in the metadata; `mx.save_gguf`, float32): converting one must give
  the original model's logits, and broken or unsupported files one ModelLoadError;
- the real SmolLM2-135M-Instruct file (Q4_1 layers, a Q8_0 embedding) from the
  specslot cache (`make model`): its config and tokenizer against its own metadata.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import replace

import pytest

from models.loading import gguf
from models.loading.checks import ModelLoadError

from .conftest import PROMPTS

pytestmark = pytest.mark.model

# mlx-lm's names -> llama.cpp's (written out here, not taken from models.loading.gguf).
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
ROPE_THETA = 50000.0  # not mlx-lm's default, so the converted config must carry it
CONTEXT = 512


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, on q / k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, args) -> dict:
    """The model's weights under llama.cpp's names, q / k rows permuted as it stores them."""

    out = {}
    for gguf_name, part, suffix, value in llama_cpp_names(model, LAYER_NAMES):
        if part == "self_attn.q_proj":
            value = llama_cpp_permute(value, args.num_attention_heads)
        elif part == "self_attn.k_proj":
            value = llama_cpp_permute(value, args.num_key_value_heads)
        out[f"{gguf_name}.{suffix}"] = value
    return out


def llama_cpp_names(model, layer_names: dict):
    """(llama.cpp's name, mlx-lm's layer part or top-level name, suffix, value) of each weight."""
    from mlx.utils import tree_flatten

    for name, value in tree_flatten(model.parameters()):
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            _, _, layer, part = base.split(".", 3)
            yield f"blk.{layer}.{layer_names[part]}", part, suffix, value
        else:
            yield TOP_NAMES[base], base, suffix, value


def gguf_metadata(args, tokenizer_dir: str, arch: str = "llama") -> dict:
    """llama.cpp's metadata keys for a llama of `args` and the tokenizer in `tokenizer_dir`."""
    import mlx.core as mx

    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tokenizer_config = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]

    def u32(value):
        return mx.array(value, dtype=mx.uint32)

    return {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.block_count": u32(args.num_hidden_layers),
        f"{arch}.context_length": u32(CONTEXT),
        f"{arch}.embedding_length": u32(args.hidden_size),
        f"{arch}.feed_forward_length": u32(args.intermediate_size),
        f"{arch}.attention.head_count": u32(args.num_attention_heads),
        f"{arch}.attention.head_count_kv": u32(args.num_key_value_heads),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(args.rms_norm_eps, dtype=mx.float32),
        f"{arch}.rope.freq_base": mx.array(args.rope_theta, dtype=mx.float32),
        f"{arch}.rope.dimension_count": u32(args.hidden_size // args.num_attention_heads),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": mx.array([3 if i in special else 1 for i in range(len(tokens))], dtype=mx.int32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": u32(vocab[tokenizer_config["eos_token"]]),
        "tokenizer.ggml.padding_token_id": u32(vocab[tokenizer_config["pad_token"]]),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": tokenizer_config["chat_template"],
    }


class TinyGGUF:
    """A tiny random llama (in memory) and the tokenizer its GGUF files carry."""

    def __init__(self, tokenizer_dir: str, tied: bool):
        from models.tiny import random_model, tiny_args

        with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
            vocab_size = len(json.load(f)["model"]["vocab"])
        self.tokenizer_dir = tokenizer_dir
        self.args = replace(
            tiny_args(vocab_size), rope_theta=ROPE_THETA, tie_word_embeddings=tied, max_position_embeddings=CONTEXT
        )
        self.model = random_model(self.args, seed=3, embed_scale=4.0, out_scale=0.5)

    def write(self, path: str, meta_changes: dict | None = None, extra_tensors: dict | None = None) -> str:
        """Write the GGUF file to `path`; `meta_changes` replace metadata keys (None: drop)."""
        import mlx.core as mx

        meta = gguf_metadata(self.args, self.tokenizer_dir)
        for key, value in (meta_changes or {}).items():
            if value is None:
                meta.pop(key)
            else:
                meta[key] = value
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mx.save_gguf(path, {**gguf_tensors(self.model, self.args), **(extra_tensors or {})}, meta)
        return path

    def logits(self, model, ids):
        import mlx.core as mx

        out = model(mx.array([ids]))[0]
        mx.eval(out)
        return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh specslot cache for the test (SPECSLOT_CACHE_DIR)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSLOT_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request, tiny_pair):
    return TinyGGUF(tiny_pair[0], tied=request.param)


@pytest.fixture(scope="module")
def untied(tiny_pair):
    return TinyGGUF(tiny_pair[0], tied=False)


def load_dir(path: str):
    from mlx_lm.utils import load

    return load(path)


# -- tiny GGUF files ------------------------------------------------------------------


def test_a_converted_tiny_llama_gives_the_original_logits(tiny, tmp_path, cache):
    import mlx.core as mx

    path = tiny.write(str(tmp_path / "tiny.gguf"))
    out = gguf.materialize(path)
    assert out.startswith(str(cache / "gguf") + os.sep)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["rope_theta"] == ROPE_THETA and config["max_position_embeddings"] == CONTEXT
    assert config["tie_word_embeddings"] is tiny.args.tie_word_embeddings
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert "quantization" not in config
    model, tokenizer = load_dir(out)
    ids = tokenizer.encode(PROMPTS[0] + " " + PROMPTS[8])
    assert len(ids) > 8
    want, got = tiny.logits(tiny.model, ids), tiny.logits(model, ids)
    assert mx.abs(want - got).max().item() < 1e-4
    assert (mx.argmax(want, -1) == mx.argmax(got, -1)).all().item()


def test_without_the_q_k_unpermutation_the_logits_differ(untied, tmp_path, monkeypatch, cache):
    """The logits test above can fail: skip `_unpermute` and the rope rotates the wrong
    pairs of dimensions (everything else converted alike)."""
    import mlx.core as mx

    path = untied.write(str(tmp_path / "tiny.gguf"))
    monkeypatch.setattr(gguf, "_unpermute", lambda rows, heads: rows)
    out = str(tmp_path / "unpermuted")
    os.makedirs(out)
    gguf.convert(path, out)
    model, tokenizer = load_dir(out)
    ids = tokenizer.encode(PROMPTS[0] + " " + PROMPTS[8])
    assert mx.abs(untied.logits(untied.model, ids) - untied.logits(model, ids)).max().item() > 1e-2


def test_the_converted_tokenizer_is_the_original(untied, tiny_pair, tmp_path, cache):
    """Vocabulary, merges, special tokens, chat template and EOS from the metadata give
    back the tokenizer the tiny model was trained with, token for token."""
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    out = gguf.materialize(untied.write(str(tmp_path / "tiny.gguf")))
    original, converted = load_tokenizer(Path(tiny_pair[0])), load_tokenizer(Path(out))
    assert converted.vocab == original.vocab
    texts = PROMPTS + ["naïve café — 東京 😀\n\n\t  x", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert converted.encode(text) == original.encode(text), text
        assert converted.decode(converted.encode(text)) == text
    assert converted.eos_token_ids == original.eos_token_ids
    messages = [{"role": "user", "content": "hello"}]
    assert converted.apply_chat_template(messages, add_generation_prompt=True) == original.apply_chat_template(
        messages, add_generation_prompt=True
    )


SPACE = "\u2581"


def spm_vocabulary(size: int, seed: int = 5) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of `size` pieces as llama.cpp's converter writes one
    (tokens, scores, types): <unk>, <s>, </s>, the 256 byte tokens, the space mark and ten
    letters, then pieces joined from earlier ones, each with its own score."""
    rng = random.Random(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = [SPACE, *"abcdefghij"]
    while len(tokens) + len(pieces) < size:
        joined = rng.choice(pieces) + rng.choice(pieces)
        if len(joined) <= 6 and joined not in pieces:
            pieces.append(joined)
    scores = [0.0] * len(tokens) + rng.sample(range(-10 * size, 0), len(pieces))
    return tokens + pieces, [float(x) for x in scores], types + [1] * len(pieces)


def llama_cpp_sentencepiece(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenization of `text` (no special tokens): a space mark
    first and for every space, then the adjacent pair whose joined piece scores highest
    merges (the leftmost of equals), until none joins into a piece; characters no piece
    holds become their UTF-8 bytes' tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    symbols = list(SPACE + text.replace(" ", SPACE))
    while True:
        best = None
        for j in range(len(symbols) - 1):
            i = vocab.get(symbols[j] + symbols[j + 1])
            if i is not None and (best is None or scores[i] > best[0]):
                best = (scores[i], j)
        if best is None:
            break
        j = best[1]
        symbols[j : j + 2] = [symbols[j] + symbols[j + 1]]
    ids = []
    for symbol in symbols:
        ids += [vocab[symbol]] if symbol in vocab else [vocab[f"<0x{b:02X}>"] for b in symbol.encode()]
    return ids


def test_a_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(untied, tmp_path, cache):
    """`tokenizer.ggml.model` llama (Llama 1-2, Mistral, TinyLlama GGUFs): the converted
    tokenizer merges by the pieces' scores as llama.cpp does, falls back to bytes, puts
    the space mark before the text and after a special token, and decodes back to the text."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    size = untied.args.vocab_size
    tokens, scores, types = spm_vocabulary(size)
    changes = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": None,
        "tokenizer.ggml.merges": None,
        "tokenizer.ggml.padding_token_id": None,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array(scores, dtype=mx.float32),
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=mx.uint32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.add_bos_token": mx.array(True),
    }
    out = gguf.materialize(untied.write(str(tmp_path / "spm.gguf"), changes))
    tokenizer = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    rng = random.Random(11)
    texts = ["abc", "a b  c", "hij\n\tgab", "café 東京 x", "  leading", "é"]
    texts += [
        "".join(rng.choice("abcdefghij  é") for _ in range(rng.randint(1, 40))).strip() or "a" for _ in range(200)
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == llama_cpp_sentencepiece(text, tokens, scores), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("ab").ids[0] == 1  # the BOS the metadata asks for
    with_special = tokenizer.encode("ab</s>cd", add_special_tokens=False).ids
    assert with_special == llama_cpp_sentencepiece("ab", tokens, scores) + [2] + llama_cpp_sentencepiece(
        "cd", tokens, scores
    )
    config = json.loads(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8").read())
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    no_scores = {k: v for k, v in changes.items() if k != "tokenizer.ggml.scores"}
    with pytest.raises(ModelLoadError, match="no tokenizer.ggml.scores"):
        gguf.materialize(untied.write(str(tmp_path / "noscores.gguf"), no_scores))


# mlx-lm's Gemma 3 layer names -> llama.cpp's (written out here, not taken from the converter).
GEMMA3_NAMES = {
    **{k: v for k, v in LAYER_NAMES.items() if k != "post_attention_layernorm"},
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def test_a_converted_tiny_gemma3_gives_the_original_logits(untied, tmp_path, cache):
    """A Gemma 3 text model as llama.cpp writes one: its tensor names, every norm stored
    as 1 + w (the factor it multiplies by), no output head, sliding layers given per layer,
    a SentencePiece vocabulary without a space prefix. The converted model computes the
    original's logits; stored as they are, the norms would not."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    from models.tiny import random_model, sliding_args

    size = untied.args.vocab_size
    args = replace(sliding_args("gemma3_text", size, 8, 4), rope_theta=50000.0, max_position_embeddings=CONTEXT)
    model = random_model(args, seed=4, embed_scale=1.0, out_scale=0.5, module=gemma3_text)
    model.sanitize({})  # tied, as every Gemma 3: no lm_head
    tensors = {}
    for gguf_name, _, suffix, value in llama_cpp_names(model, GEMMA3_NAMES):
        if gguf_name.endswith("norm"):
            value = mx.random.uniform(-0.5, 0.5, value.shape) + 1  # w stored as 1 + w
        tensors[f"{gguf_name}.{suffix}"] = value
    norms = {n: v - 1 for n, v in tensors.items() if n.rsplit(".", 1)[0].endswith("norm")}
    model.load_weights(  # the original: its norms as w
        [(n, norms.get(g, v)) for (n, _), (g, v) in zip(tree_flatten(model.parameters()), tensors.items())]
    )
    tokens, scores, types = spm_vocabulary(size)

    def u32(value):
        return mx.array(value, dtype=mx.uint32)

    meta = {
        "general.architecture": "gemma3",
        "gemma3.block_count": u32(4),
        "gemma3.context_length": u32(CONTEXT),
        "gemma3.embedding_length": u32(64),
        "gemma3.feed_forward_length": u32(128),
        "gemma3.attention.head_count": u32(4),
        "gemma3.attention.head_count_kv": u32(2),
        "gemma3.attention.key_length": u32(16),
        "gemma3.attention.value_length": u32(16),
        "gemma3.attention.layer_norm_rms_epsilon": mx.array(1e-6, dtype=mx.float32),
        "gemma3.rope.freq_base": mx.array(50000.0, dtype=mx.float32),
        "gemma3.attention.sliding_window": u32(8),
        "gemma3.attention.sliding_window_pattern": mx.array([True, False, True, False]),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array(scores, dtype=mx.float32),
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(True),
        "tokenizer.ggml.add_space_prefix": mx.array(False),
    }
    path = str(tmp_path / "gemma3.gguf")
    mx.save_gguf(path, tensors, meta)
    out = gguf.materialize(path)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "gemma3_text" and config["tie_word_embeddings"] is True
    assert (config["sliding_window"], config["sliding_window_pattern"], config["query_pre_attn_scalar"]) == (8, 2, 16)
    converted, tokenizer = load_dir(out)
    ids = tokenizer.encode("abc hij gab")
    assert ids[0] == 1 and ids[1:] == llama_cpp_sentencepiece("abc hij gab", tokens, scores)[1:]  # no space mark first
    ids = ids + [7, 300, 401, size - 1] * 3  # past the sliding window of 8
    want, got = untied.logits(model, ids), untied.logits(converted, ids)
    assert mx.abs(want - got).max().item() < 1e-4 * max(1.0, mx.abs(want).max().item())
    stored = gemma3_text.Model(args)  # the file's norms taken as they are
    stored.sanitize({})
    stored.load_weights([(n, v) for (n, _), v in zip(tree_flatten(stored.parameters()), tensors.values())])
    assert mx.abs(want - untied.logits(stored, ids)).max().item() > 1e-2


@pytest.mark.parametrize(
    "changes, extra, words",
    [
        ({"general.architecture": "phi3"}, None, ["architecture 'phi3'", "llama, qwen2"]),
        ({"tokenizer.ggml.model": "bert"}, None, ["vocabulary type 'bert'", "gpt2", "llama"]),
        ({"tokenizer.ggml.pre": "mystery-bpe"}, None, ["pre-tokenizer 'mystery-bpe'", "smollm"]),
        ({"llama.block_count": None}, None, ["lacks llama.block_count"]),
        ({"llama.rope.scaling.type": "yarn"}, None, ["rope scaling 'yarn'"]),
        (None, {"blk.0.attn_sinks.weight": "ones"}, ["tensor 'blk.0.attn_sinks.weight'"]),
    ],
    ids=["architecture", "vocabulary", "pre-tokenizer", "metadata", "rope-scaling", "tensor"],
)
def test_unsupported_files_are_one_error_naming_the_fault(untied, tmp_path, cache, changes, extra, words):
    import mlx.core as mx

    from models.loading.hub import resolve_model_dir

    extra = {name: mx.ones((4,)) for name in extra or {}}
    path = untied.write(str(tmp_path / "odd.gguf"), changes, extra)
    with pytest.raises(ModelLoadError) as err:
        resolve_model_dir(path, "target")
    message = str(err.value)
    assert "\n" not in message and path in message and message.startswith("target model")
    for word in words:
        assert word in message
    # nothing half-written is left behind, nor anything that a later load would reuse
    assert [p for p in os.listdir(cache / "gguf") if not p.startswith(".lock")] == []


def test_files_that_are_not_gguf_or_are_cut_short(untied, tmp_path, cache):
    from models.loading.hub import resolve_model_dir

    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        resolve_model_dir(str(not_gguf), "draft")
    data = open(untied.write(str(tmp_path / "whole.gguf")), "rb").read()
    for cut in (len(data) // 2, 60):
        cut_short = tmp_path / f"cut{cut}.gguf"
        cut_short.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="MLX cannot read this GGUF file") as err:
            resolve_model_dir(str(cut_short), "target")
        assert "\n" not in str(err.value)


def test_a_directory_holding_one_gguf_resolves_and_two_are_refused(untied, tmp_path, cache):
    from models.loading.hub import resolve_model_dir

    one = tmp_path / "one"
    path = untied.write(str(one / "tiny.gguf"))
    assert resolve_model_dir(str(one), "target") == gguf.materialize(path)
    shutil.copy(path, one / "other.gguf")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files") as err:
        resolve_model_dir(str(one), "target")
    assert "other.gguf" in str(err.value) and "tiny.gguf" in str(err.value)


def test_the_conversion_is_cached_by_content(untied, tmp_path, cache):
    path = untied.write(str(tmp_path / "tiny.gguf"))
    first = gguf.materialize(path)
    stamps = {name: os.stat(os.path.join(first, name)).st_mtime_ns for name in os.listdir(first)}
    assert set(stamps) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert gguf.materialize(path) == first
    assert {name: os.stat(os.path.join(first, name)).st_mtime_ns for name in os.listdir(first)} == stamps
    # other bytes under the same name: another directory
    untied.write(path, {"general.name": "tiny, renamed"})
    second = gguf.materialize(path)
    assert second != first and os.path.isdir(first)
    assert sorted(os.listdir(cache / "gguf")) == sorted([".lock", os.path.basename(first), os.path.basename(second)])


def test_the_cache_follows_specslot_cache_dir(untied, tmp_path, monkeypatch):
    path = untied.write(str(tmp_path / "tiny.gguf"))
    for name in ("a", "b"):
        monkeypatch.setenv("SPECSLOT_CACHE_DIR", str(tmp_path / name))
        out = gguf.materialize(path)
        assert os.path.dirname(out) == str(tmp_path / name / "gguf")
        assert os.path.isfile(os.path.join(out, "config.json"))


# -- the real SmolLM2-135M-Instruct file ------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_meta(smollm2_gguf):
    import mlx.core as mx

    with mx.stream(mx.cpu):
        _, meta = mx.load(smollm2_gguf, return_metadata=True)
    return meta


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(Path(smollm2_dir))


def test_smollm2_config_matches_its_metadata(smollm2_dir, smollm2_meta):
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)

    def meta(key):
        return smollm2_meta[key].item()

    assert config["model_type"] == smollm2_meta["general.architecture"] == "llama"
    assert config["num_hidden_layers"] == meta("llama.block_count") == 30
    assert config["hidden_size"] == meta("llama.embedding_length") == 576
    assert config["intermediate_size"] == meta("llama.feed_forward_length") == 1536
    assert config["num_attention_heads"] == meta("llama.attention.head_count") == 9
    assert config["num_key_value_heads"] == meta("llama.attention.head_count_kv") == 3
    assert config["head_dim"] == 64
    assert config["rope_theta"] == meta("llama.rope.freq_base") == 100000
    assert config["max_position_embeddings"] == meta("llama.context_length") == 8192
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["vocab_size"] == len(smollm2_meta["tokenizer.ggml.tokens"]) == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    # Q4_1 layers, the embedding Q8_0: MLX affine groups of 32
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert config["gguf_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_smollm2_vocabulary_is_the_gguf_tokens_id_for_id(smollm2_tokenizer, smollm2_meta):
    tokens = smollm2_meta["tokenizer.ggml.tokens"]
    vocab = smollm2_tokenizer.vocab
    assert len(vocab) == len(tokens) == 49152
    assert all(vocab[token] == i for i, token in enumerate(tokens))


def test_smollm2_tokenizer_round_trips_and_splits_as_llama_cpp_does(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = (
        "def f(x):\n    return x ** 2  # 12345\n\n\n\tnaïve café, Grüße, 東京, Привет 😀🚀\r\n"
        "    spaces   and\ttabs   \n{\"a\": [1, 2.5e-3]} <b>&amp;</b> it's DON'T\n"
    )
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    # smollm's pre-tokenizer: digits split off one by one before GPT-2's regex runs, so
    # the spaces before a number stay one run ("ĠĠ"), not a run plus " 1" as GPT-2 alone
    # would split them (the vocabulary holds no token with a digit beside anything else)
    assert tok.encode("2024") == [tok.vocab[d] for d in "2024"]
    assert tok.encode("x  31") == [tok.vocab[t] for t in ("x", "ĠĠ", "3", "1")]
    # merges applied: whole words, GPT-2's byte-level space marker
    assert tok.encode("Hello world") == [tok.vocab["Hello"], tok.vocab["Ġworld"]]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2}
    assert tok.encode("Hello")[0] != 1  # add_bos_token is false in the metadata


def test_smollm2_control_tokens_are_single_ids_inside_text(smollm2_tokenizer, smollm2_meta):
    """Each control token of the metadata (<|im_start|>, <repo_name>, ...: 17) is one id,
    also with text around it, and is left out of a decode that skips special tokens."""
    tok = smollm2_tokenizer
    tokens, types = smollm2_meta["tokenizer.ggml.tokens"], smollm2_meta["tokenizer.ggml.token_type"].tolist()
    control = [i for i, t in enumerate(types) if t == 3]
    assert len(control) == 17 and control[:3] == [0, 1, 2]
    for i in control:
        ids = tok.encode(f"a{tokens[i]}b")
        assert ids == [tok.vocab["a"], i, tok.vocab["b"]], tokens[i]
        assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_smollm2_chat_template_renders_chatml(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    text = tok.decode(ids)
    assert ids[0] == 1 and text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_on_a_gpu_a_gguf_models_float32_norms_take_its_half_dtype(smollm2_dir, monkeypatch):
    """GGUF keeps norms in float32 beside half scales: off the CPU the loaded model has one
    float dtype (a float32 norm would make every activation float32); on the CPU, float32."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from models.loading import loader

    def dtypes(model):
        return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}

    assert dtypes(loader.load_model(smollm2_dir).model) == {mx.float32}
    with monkeypatch.context() as m:
        m.setattr(loader, "_to_float32_on_cpu", lambda model: None)
        m.setattr(loader.mx, "default_device", lambda: mx.gpu)
        m.setattr(loader.cpu_math, "install", lambda: None)
        loaded = loader.load_model(smollm2_dir)
    assert dtypes(loaded.model) == {mx.float16}
