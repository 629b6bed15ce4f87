"""Scenario 6 on a GPU: a Qwen2.5-1.5B-shaped 4-bit model (random weights, the bundled
tokenizer), n-gram drafter, the `scripts.bench_concurrency` configurations on the plain
verify path (the slab, the only batch the fused tick uses; `classic_batchgen` on a
`BatchGenerator` runner), then the GPU default (compiled verify, `fast_verify`, which
keeps `BatchGenerator` and the alternating tick) for reference.

    OUT=results/gpu python3 scripts/gpu_concurrency.py      # SHAPE=tiny: a CPU dry run

Writes `$OUT/q15_concurrency.json`; prints one line per concurrency:
config -> [tok/s, ratio to classic, speculative rounds per request, fused ticks].
"""
import json, os, shutil, sys, tempfile, time, statistics
sys.path.insert(0, os.getcwd())
import models
import mlx.core as mx, mlx.nn as nn
from mlx.utils import tree_flatten
OUT = os.environ["OUT"]
def build(path, hidden, layers, heads, kv, inter):
    from mlx_lm.models import qwen2
    cfg = dict(model_type="qwen2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, intermediate_size=inter, vocab_size=151936, rms_norm_eps=1e-6,
               rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True)
    m = qwen2.Model(qwen2.ModelArgs.from_dict(cfg)); m.set_dtype(mx.bfloat16); nn.quantize(m, group_size=64, bits=4)
    mx.eval(m.parameters()); os.makedirs(path, exist_ok=True)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), dict(tree_flatten(m.parameters())))
    cfg["quantization"] = {"group_size": 64, "bits": 4}; json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    for f in os.listdir("models/bundled/target"):
        if "token" in f: shutil.copy(os.path.join("models/bundled/target", f), path)
Q15 = os.path.join(tempfile.mkdtemp(), "q15"); t = time.time(); build(Q15, *((1536, 28, 12, 2, 8960) if os.environ.get("SHAPE") != "tiny" else (128, 2, 4, 2, 256)))
print(f"built q15 in {time.time()-t:.1f}s", flush=True)
from models.runner import MlxRunner
from scripts import bench_concurrency as bc, bench_util
from scripts.prompts import token_prompts
def runner_for(fast, ragged=None):
    return MlxRunner.from_paths(Q15, drafter_kind="ngram", num_draft_tokens=4, max_batch_size=16, prefill_batch_size=8,
                                fast_verify=fast, warm_positions=512 if fast else None, ragged=ragged)
results = {}
t = time.time(); plain = runner_for(False); bench_util.warm_up(plain, plain.tokenizer)
batchgen = runner_for(False, ragged=False); bench_util.warm_up(batchgen, batchgen.tokenizer)
on = lambda name: batchgen if name in bc.ON_BATCHGEN else plain  # noqa: E731
print("plain runner", round(time.time() - t, 1), "s; can_fuse", plain.can_fuse(), plain.fuse_blocker, flush=True)
t = time.time(); costs = plain.tick_costs(); print("tick costs", round(time.time() - t, 1), "s", costs.to_dict(), flush=True)
results["tick_costs"] = costs.to_dict()
waves, max_tokens = 2, 128
for n in (1, 2, 4, 8):
    prompts = token_prompts(plain.tokenizer, n * waves, n, num_tokens=64)
    for name in bc.CONFIGS:  # warm the shapes of this concurrency once, unmeasured
        bc.one_run(on(name), name, prompts[:n], n, 16, 8)
    runs = {k: [] for k in bc.CONFIGS}
    for rep in range(2):
        for name in bc.CONFIGS:
            runs[name].append(bc.one_run(on(name), name, prompts, n, max_tokens, 8))
    row = {name: {"tok_s": statistics.median(r["aggregate_tok_s"] for r in rs),
                  "ratio": statistics.median(r["aggregate_tok_s"] / c["aggregate_tok_s"] for r, c in zip(rs, runs["classic"])),
                  "rounds_per_req": statistics.median(sum(r["rounds"]) / len(r["rounds"]) for r in rs),
                  "fused_ticks": rs[-1]["fused_ticks"], "accept_len": rs[-1]["acceptance_length"]} for name, rs in runs.items()}
    results[f"c{n}"] = row
    print(n, json.dumps({k: (round(v["tok_s"]), round(v["ratio"], 2), v["rounds_per_req"], v["fused_ticks"]) for k, v in row.items()}), flush=True)
    json.dump(results, open(os.path.join(OUT, "q15_concurrency.json"), "w"), indent=1)
plain.close(); batchgen.close()
t = time.time(); fast = runner_for(True); bench_util.warm_up(fast, fast.tokenizer)
print("compiled-verify runner", round(time.time() - t, 1), "s; can_fuse", fast.can_fuse(), flush=True)
for n in (1, 2, 4, 8):
    prompts = token_prompts(fast.tokenizer, n * waves, n, num_tokens=64)
    bc.one_run(fast, "alternate", prompts[:n], n, 16, 8)
    rs = [bc.one_run(fast, "alternate", prompts, n, max_tokens, 8) for _ in range(2)]
    results[f"c{n}"]["gpu_default_alternate_compiled"] = {"tok_s": statistics.median(r["aggregate_tok_s"] for r in rs)}
    print(n, "compiled alternate", round(results[f"c{n}"]["gpu_default_alternate_compiled"]["tok_s"]), flush=True)
    json.dump(results, open(os.path.join(OUT, "q15_concurrency.json"), "w"), indent=1)
