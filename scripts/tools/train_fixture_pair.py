"""Train the bundled target + draft pair (Llama architecture) on the stdlib corpus.

Runs with PyTorch + transformers (on the lent GPU; it also runs, slowly, on CPU):

    python -m scripts.tools.build_corpus --out .devwork/train          # here: tokenizer + ids
    python -m scripts.tools.train_fixture_pair --data .devwork/train --out models/bundled

The target is trained with cross-entropy; the draft is distilled from the frozen target
(KL to the target's distribution plus cross-entropy), which is what makes its greedy
proposals agree with the target's. Weights are saved as HF-format float16 safetensors,
loadable by `mlx_lm.load`. `metrics.json` records the recipe, validation losses and the
greedy acceptance of the draft against the target (simulated rounds at K = 2, 4, 6 on
the target's own greedy continuations of held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

TARGET = dict(hidden_size=256, num_hidden_layers=8, intermediate_size=768, num_attention_heads=4, num_key_value_heads=4)
DRAFT = dict(hidden_size=192, num_hidden_layers=3, intermediate_size=512, num_attention_heads=3, num_key_value_heads=3)


def make_model(shape: dict, vocab_size: int, seq_len: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        **shape,
    )
    return LlamaForCausalLM(config)


def batches(ids: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator, device):
    while True:
        starts = rng.integers(0, len(ids) - seq_len - 1, size=batch)
        window = np.stack([ids[s : s + seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(window).to(device, non_blocking=True)
        yield t[:, :-1], t[:, 1:]


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


@torch.no_grad()
def valid_loss(model, ids, seq_len, device, max_windows=64) -> float:
    model.eval()
    n = min(max_windows, (len(ids) - 1) // seq_len)
    losses = []
    for i in range(0, n, 16):
        rows = [ids[j * seq_len : (j * seq_len) + seq_len + 1] for j in range(i, min(n, i + 16))]
        t = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(t[:, :-1]).logits.float()
        losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1)).item())
    model.train()
    return float(np.mean(losses))


def train(model, ids, steps, batch, seq_len, peak_lr, device, seed, teacher=None, log="", max_seconds=float("inf")):
    """Train for `steps` (stopping early past `max_seconds`); returns (seconds, steps run)."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = batches(ids, batch, seq_len, rng, device)
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        x, y = next(data)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            if teacher is not None:
                with torch.no_grad():
                    t_logp = F.log_softmax(teacher(x).logits.float(), dim=-1)
                kl = F.kl_div(F.log_softmax(logits, dim=-1), t_logp, log_target=True, reduction="batchmean") / x.size(1)
                loss = 0.3 * loss + 0.7 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"{log} step {step}/{steps} loss {loss.item():.3f} {time.time() - start:.0f}s", flush=True)
        if time.time() - start > max_seconds:
            print(f"{log}: time budget reached after {step + 1} steps", flush=True)
            return time.time() - start, step + 1
    return time.time() - start, steps


@torch.no_grad()
def greedy_acceptance(target, draft, ids, device, num_prompts=48, prompt_len=64, gen_len=128):
    """Per-token greedy agreement and simulated accepted-per-round at several K."""
    target.eval()
    draft.eval()
    rng = np.random.default_rng(1234)
    starts = rng.integers(0, len(ids) - prompt_len - 1, size=num_prompts)
    prompts = torch.from_numpy(np.stack([ids[s : s + prompt_len] for s in starts]).astype(np.int64)).to(device)
    seq = prompts
    for _ in range(gen_len):  # batch greedy without a cache: small models, short texts
        nxt = target(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    d_pred = draft(seq).logits[:, prompt_len - 1 : -1].argmax(-1)
    match = (d_pred == seq[:, prompt_len:]).cpu().numpy()
    result = {"per_token_agreement": float(match.mean())}
    for k in (2, 4, 6):
        accepted, rounds = 0, 0
        for row in match:
            pos = 0
            while pos < len(row):
                m = 0
                while m < k and pos + m < len(row) and row[pos + m]:
                    m += 1
                accepted += m
                rounds += 1
                pos += m + 1
        result[f"accepted_per_round_k{k}"] = accepted / rounds
    return result


def save(model, out_dir, tokenizer_dir):
    os.makedirs(out_dir, exist_ok=True)
    model.half().save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    model.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="folder with train.npy, valid.npy, tokenizer/")
    p.add_argument("--out", required=True)
    p.add_argument("--target-steps", type=int, default=3000)
    p.add_argument("--draft-steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-seconds",
        type=float,
        default=float("inf"),
        help="per-model wall-clock guard (the recipe records the steps run)",
    )
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train_ids = np.load(os.path.join(args.data, "train.npy"))
    valid_ids = np.load(os.path.join(args.data, "valid.npy"))
    tok_dir = os.path.join(args.data, "tokenizer")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")).get_vocab_size()
    vocab = int(math.ceil(vocab / 64) * 64)
    print(f"device {device}; train {len(train_ids)} tokens; vocab {vocab}", flush=True)

    target = make_model(TARGET, vocab, args.seq_len).to(device)
    t_secs = train(
        target,
        train_ids,
        args.target_steps,
        args.batch,
        args.seq_len,
        2e-3,
        device,
        args.seed,
        log="target",
        max_seconds=args.max_seconds,
    )
    target.eval()
    draft = make_model(DRAFT, vocab, args.seq_len).to(device)
    d_secs = train(
        draft,
        train_ids,
        args.draft_steps,
        args.batch,
        args.seq_len,
        3e-3,
        device,
        args.seed + 1,
        teacher=target,
        log="draft",
        max_seconds=args.max_seconds,
    )

    metrics = {
        "recipe": {
            **vars(args),
            "target_shape": TARGET,
            "draft_shape": DRAFT,
            "vocab_size": vocab,
            "optimizer": "AdamW(0.9,0.95) wd 0.1, cosine, 100 warmup, clip 1.0, bf16 autocast",
            "target_lr": 2e-3,
            "draft_lr": 3e-3,
            "draft_loss": "0.3*CE + 0.7*KL(target||draft)",
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
        },
        "params": {
            "target": sum(p.numel() for p in target.parameters()),
            "draft": sum(p.numel() for p in draft.parameters()),
        },
        "train_seconds": {"target": t_secs[0], "draft": d_secs[0]},
        "steps_run": {"target": t_secs[1], "draft": d_secs[1]},
        "valid_loss": {
            "target": valid_loss(target, valid_ids, args.seq_len, device),
            "draft": valid_loss(draft, valid_ids, args.seq_len, device),
        },
        "greedy_acceptance": greedy_acceptance(target, draft, valid_ids, device),
    }
    print(json.dumps(metrics, indent=2), flush=True)
    save(target, os.path.join(args.out, "target"), tok_dir)
    save(draft, os.path.join(args.out, "draft"), tok_dir)
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)


if __name__ == "__main__":
    main()
