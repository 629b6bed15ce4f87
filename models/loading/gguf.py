"""GGUF files (llama.cpp's format) as mlx-lm model directories, without torch.

`materialize(path)` turns a `.gguf` file into a directory `mlx_lm.load` reads (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json), once per file content, under the
specslot cache. MLX reads the GGUF itself (`mx.load`); Q4_0, Q4_1 and Q8_0 tensors arrive
MLX affine-quantized (groups of 32) and are written as they are, and whether a layer stays
quantized where it runs is `models.loading.dense_weights`' choice. Supported: `llama`
(Mistral-style too; `_unpermute` undoes llama.cpp's q and k row permutation), `qwen2` and
`gemma3` (text), with a byte-level BPE (`tokenizer.ggml.model` gpt2) or a SentencePiece
(llama) vocabulary. Anything else (another architecture, another vocabulary, a
pre-tokenizer not in `PRE_TOKENIZERS`, a tensor type MLX cannot read) is one
ModelLoadError naming it. See docs/models.md, "GGUF files".
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections import Counter

from models.loading.checks import ModelLoadError, cache_root, file_sha256

logger = logging.getLogger("specslot")

GGUF_MAGIC = b"GGUF"
GROUP_SIZE = 32  # llama.cpp's block size for Q4_0, Q4_1 and Q8_0
FORMAT_VERSION = 2  # bump when the directory written here changes (its config, its files)
# llama.cpp's architecture -> mlx-lm's model type and the Hugging Face class it names
_MODELS = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
ARCHITECTURES = tuple(_MODELS)

# llama.cpp's per-layer tensor names -> mlx-lm's (llama and qwen2 share them).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma 3 (text): norms around attention and the MLP both, and on q and k.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GEMMA3_SLIDING_PATTERN = 6  # a full-attention layer after five sliding ones, where the file does not say

# The regular expressions llama.cpp's pre-tokenizer names stand for (its llama-vocab.cpp),
# as Hugging Face `tokenizers` pre-tokenizers.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    # name: (split digits one by one first, regex)
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp's token types
_SPACE = "\u2581"  # SentencePiece's space mark


def is_gguf_file(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def find_gguf(path: str) -> str | None:
    """The GGUF file `path` names: itself, or the one `.gguf` file of a directory that
    has no config.json (None otherwise). Raises ModelLoadError for a directory holding
    several, which would be a guess."""
    if is_gguf_file(path):
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(name for name in os.listdir(path) if name.lower().endswith(".gguf"))
    if len(found) > 1:
        raise ModelLoadError(f"{path!r} holds {len(found)} GGUF files ({', '.join(found[:4])}); name the one to serve")
    return os.path.join(path, found[0]) if found else None


def check_gguf(path: str, role: str) -> None:
    """One line naming the fault unless `path` starts like a GGUF file."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{role} model {path!r} cannot be read: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{role} model {path!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")


def materialize(path: str, role: str = "target", sha: str | None = None) -> str:
    """The mlx-lm directory converted from the GGUF file at `path` (whose sha256 is `sha`
    when the caller has checked it already): built on first use (under a lock, so
    processes starting together build it once), reused after."""
    check_gguf(path, role)
    sha = sha or file_sha256(path)
    stem = os.path.basename(path)[: -len(".gguf")]
    root = os.path.join(cache_root(), "gguf")
    out = os.path.join(root, f"{stem}-{sha[:16]}-v{FORMAT_VERSION}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(out, "config.json")):
            tmp = tempfile.mkdtemp(prefix=".converting-", dir=root)
            try:
                convert(path, tmp, sha, role)
                os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide it from other users of the cache
                os.replace(tmp, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            logger.info("%s model %s converted from GGUF into %s", role, os.path.basename(path), out)
    return out


def convert(path: str, out_dir: str, sha: str = "", role: str = "target") -> None:
    """Write the mlx-lm directory for the GGUF file at `path` into `out_dir`."""
    import mlx.core as mx

    try:
        with mx.stream(mx.cpu):
            tensors, meta = mx.load(path, return_metadata=True)
    except Exception as exc:  # MLX names the unreadable part (a tensor type, a truncated file)
        raise ModelLoadError(f"{role} model {path!r}: MLX cannot read this GGUF file: {exc}") from None
    arch = _text(meta, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{role} model {path!r}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    config = model_config(meta, arch, tensors, path, role)
    weights = mlx_weights(tensors, config, path, role)
    config["quantization"] = quantization_config(weights)
    if not config["quantization"]:
        del config["quantization"]
    config["gguf_sha256"] = sha  # part of the model's fingerprint (models.loading.checks)
    tokenizer_json, tokenizer_config = tokenizer_files(meta, path, role)
    with mx.stream(mx.cpu):
        mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "tokenizer.json"), tokenizer_json)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)


def model_config(meta: dict, arch: str, tensors: dict, path: str, role: str) -> dict:
    """mlx-lm's config.json for the GGUF's metadata (Hugging Face's key names)."""

    def num(key, default=None):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ModelLoadError(f"{role} model {path!r}: GGUF metadata lacks {arch}.{key}")
            return default
        return value.item()

    hidden = int(num("embedding_length"))
    heads = int(num("attention.head_count"))
    head_dim = int(num("attention.key_length", hidden // heads))
    rope_dims = int(num("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{role} model {path!r}: partial rotary embeddings ({rope_dims} of {head_dim} dimensions) are not supported"
        )
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(
            f"{role} model {path!r}: per-frequency rope factors (rope_freqs, "
            "Llama 3.1-style rope scaling) are not supported"
        )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{role} model {path!r}: the GGUF file has no token_embd tensor")
    vocab = int(num("vocab_size", tensors["token_embd.weight"].shape[0]))
    config = {
        "model_type": _MODELS[arch][0],
        "architectures": [_MODELS[arch][1]],
        "hidden_size": hidden,
        "num_hidden_layers": int(num("block_count")),
        "intermediate_size": int(num("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(num("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(f"{num('attention.layer_norm_rms_epsilon'):.7g}"),  # float32's digits
        "vocab_size": vocab,
        "rope_theta": float(num("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(num("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    scaling = _text(meta, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ModelLoadError(f"{role} model {path!r}: rope scaling {scaling!r} is not supported (linear is)")
        config["rope_scaling"] = {"type": "linear", "factor": float(num("rope.scaling.factor"))}
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value.item())
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch == "gemma3":
        config.update(_gemma3_config(meta, config, num, path, role))
    return config


def _gemma3_config(meta: dict, config: dict, num, path: str, role: str) -> dict:
    """What a Gemma 3 config adds, as llama.cpp reads the file: sliding layers (local rope
    base 10,000) and every sixth layer full unless the file gives the pattern; queries
    scaled by the head size (the 27B's, 62 layers: by hidden size / heads)."""
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        period = GEMMA3_SLIDING_PATTERN
    elif pattern.size == 1:
        period = int(pattern.item())
    else:  # one flag per layer, true where it slides: the same period all through, or refused
        sliding = [bool(x) for x in pattern.tolist()]
        period = sliding.index(False) + 1 if False in sliding else len(sliding) + 1
        if sliding != [(i + 1) % period != 0 for i in range(len(sliding))]:
            raise ModelLoadError(f"{role} model {path!r}: a Gemma 3 sliding-window layout that repeats no period")
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    return {
        "rope_theta": float(num("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,
        "sliding_window": int(num("attention.sliding_window", 512)),
        "sliding_window_pattern": period,
        "query_pre_attn_scalar": config["hidden_size"] // heads if layers == 62 else config["head_dim"],
    }


def mlx_weights(tensors: dict, config: dict, path: str, role: str) -> dict:
    """The GGUF's tensors under mlx-lm's names, llama's q / k rows back in Hugging Face order,
    Gemma 3's norms back to its own form (llama.cpp stores 1 + w, the factor they multiply by)."""
    gemma = config["model_type"] == "gemma3_text"
    layer_names = _GEMMA3_LAYER_NAMES if gemma else _LAYER_NAMES
    out = {}
    for name, value in tensors.items():
        base, _, suffix = name.rpartition(".")
        if base.startswith("blk."):
            _, layer, part = base.split(".", 2)
            mapped = layer_names.get(part)
            target = mapped and f"model.layers.{layer}.{mapped}"
        else:
            part, target = base, _TOP_NAMES.get(base)
        if gemma and part.endswith("norm") and suffix == "weight":
            value = value - 1
        if target is None:
            raise ModelLoadError(
                f"{role} model {path!r}: GGUF tensor {name!r} has no place in a {config['model_type']} model"
            )
        if config["model_type"] == "llama" and part in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if part == "attn_q" else "num_key_value_heads"]
            value = _unpermute(value, heads)
        out[f"{target}.{suffix}"] = value
    return out


def _unpermute(rows, heads: int):
    """Undo llama.cpp's q / k permutation (rows of each head interleaved in pairs for its
    rope), on weight, scales, biases or bias alike: quantization groups run along a row."""
    shape = rows.shape
    half = shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def quantization_config(weights: dict) -> dict:
    """mlx-lm's `quantization` entry: the commonest bit width as the default, each layer
    of another width (a Q8_0 embedding beside Q4_1 layers) named with its own."""
    import mlx.core as mx

    bits = {}
    for name, value in weights.items():
        if name.endswith(".scales"):
            layer = name[: -len(".scales")]
            packed = weights[f"{layer}.weight"]
            if packed.dtype != mx.uint32:
                continue
            bits[layer] = packed.shape[-1] * 32 // (value.shape[-1] * GROUP_SIZE)
    if not bits:
        return {}
    common = Counter(bits.values()).most_common(1)[0][0]
    config = {"group_size": GROUP_SIZE, "bits": common}
    config.update({layer: {"group_size": GROUP_SIZE, "bits": b} for layer, b in sorted(bits.items()) if b != common})
    return config


def tokenizer_files(meta: dict, path: str, role: str) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) for the GGUF's vocabulary: a byte-level BPE
    (`gpt2`: its merges and pre-tokenizer) or a SentencePiece one (`llama`: its scores)."""
    from tokenizers import AddedToken, processors

    kind = _text(meta, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            f"{role} model {path!r}: GGUF vocabulary type {kind!r} is not supported "
            "(byte-level BPE, 'gpt2', and SentencePiece, 'llama', are)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {token: i for i, token in enumerate(tokens)}
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [_NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, vocab, path, role)
    else:
        tokenizer = _sentencepiece_bpe(meta, tokens, vocab, types, path, role)
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )

    def token(key):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(value.item())] if value is not None else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta["tokenizer.ggml.add_bos_token"].item()) if "tokenizer.ggml.add_bos_token" in meta else False
    if add_bos and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "clean_up_tokenization_spaces": False,
    }
    template = _text(meta, "tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    return json.loads(tokenizer.to_str()), {k: v for k, v in tokenizer_config.items() if v is not None}


def _byte_level_bpe(meta: dict, vocab: dict, path: str, role: str):
    """A byte-level BPE from the GGUF's merges, split as its pre-tokenizer name says."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _text(meta, "tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{role} model {path!r}: GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    digits, split = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict, tokens: list, vocab: dict, types: list, path: str, role: str):
    """A SentencePiece vocabulary as llama.cpp runs it: spaces become the space mark (one is
    put before the text and after each special token too, unless `add_space_prefix` is
    false), then adjacent pieces merge while their join is a piece, the highest score first;
    a character no piece holds becomes its UTF-8 bytes' <0xXX> tokens. As a Hugging Face
    BPE: each normal piece that splits into two normal pieces is a merge, ranked by its score."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise ModelLoadError(f"{role} model {path!r}: the SentencePiece vocabulary has no tokenizer.ggml.scores")
    scores = scores.tolist()
    normal = {token: i for i, token in enumerate(tokens) if types[i] == _NORMAL}
    merges = []
    for piece, i in normal.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        merges += [(-scores[i], normal[a], normal[b], a, b) for a, b in splits if a in normal and b in normal]
    merges.sort()
    unknown = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in merges],
            unk_token=tokens[int(unknown.item())] if unknown is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix")
    steps = [normalizers.Prepend(_SPACE)] if prefix is None or bool(prefix.item()) else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if steps else [])
    )
    return tokenizer


def _text(meta: dict, key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
