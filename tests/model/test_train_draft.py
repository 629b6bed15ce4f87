"""`scripts.tools.train_draft` end to end on the bundled 7M target at toy sizes: the draft it
writes loads, shares the target's vocabulary, drafts for the target with streams equal to
classic decode, records how it was made, and the same seed gives the same weights.
Its pure parts (batch plans, acceptance rounds, the learning-rate schedule, clipping,
loss masks) are checked with tables."""

from __future__ import annotations

import doctest
import json
import os

import mlx.core as mx
import numpy as np
import pytest

from scripts.tools import draft_data, draft_eval, draft_fit, train_draft

from .conftest import PROMPTS, isolated_streams, make_request

pytestmark = pytest.mark.model

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled", "target")
TOY = [
    "--num-prompts",
    "12",
    "--max-new-tokens",
    "16",
    "--gen-batch",
    "8",
    "--layers",
    "1",
    "--hidden",
    "64",
    "--intermediate",
    "128",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--steps",
    "12",
    "--batch-tokens",
    "512",
    "--warmup",
    "2",
    "--log-every",
    "4",
    "--eval-prompts",
    "2",
    "--eval-tokens",
    "16",
    "--bits",
    "8",
    "--group-size",
    "32",
]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """{name: output dir}: runs "a" and "b" with seed 0, "other" with seed 1, "cached" with
    seed 0 from data a --data-only run wrote (in "data"), "continued" from "a" on prompts
    that include requests the target writes itself."""
    root = tmp_path_factory.mktemp("drafts")
    out = {name: str(root / name) for name in ("a", "b", "other", "cached", "data", "continued")}
    for name, seed in (("a", 0), ("b", 0), ("other", 1)):
        assert train_draft.main(["--target", TARGET, "--out", out[name], "--seed", str(seed), *TOY]) == 0
    for extra in (["--data-only"], []):
        args = ["--target", TARGET, "--out", out["cached"], "--data", out["data"], *TOY, *extra]
        assert train_draft.main(args) == 0
    args = ["--target", TARGET, "--out", out["continued"], "--init", out["a"], *TOY, "--mix", "chat:1,self_chat:1"]
    assert train_draft.main(args) == 0
    return out


def weights(path):
    return mx.load(os.path.join(path, "model.safetensors"))


def test_the_draft_loads_with_the_targets_vocabulary(drafts):
    from models.loading.loader import check_same_vocabulary, load_model

    target, draft = load_model(TARGET), load_model(drafts["a"], "draft")
    check_same_vocabulary(target, draft)
    with open(os.path.join(drafts["a"], "config.json")) as f:
        config = json.load(f)
    assert (config["num_hidden_layers"], config["hidden_size"], config["quantization"]["bits"]) == (1, 64, 8)
    assert config["vocab_size"] == 2048 and config["tie_word_embeddings"] is True


def test_the_same_seed_gives_the_same_weights(drafts):
    a, b, other = weights(drafts["a"]), weights(drafts["b"]), weights(drafts["other"])
    assert a.keys() == b.keys() == other.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert not all(mx.array_equal(a[k], other[k]).item() for k in a)


def test_data_written_by_one_run_trains_the_same_draft_in_another(drafts):
    assert sorted(os.listdir(drafts["data"])) == [
        "data.json",
        "held_out_chat.npz",
        "held_out_code.npz",
        "held_out_code_chat.npz",
        "train.npz",
    ]
    a, cached = weights(drafts["a"]), weights(drafts["cached"])
    assert all(mx.array_equal(a[k], cached[k]).item() for k in a)
    with open(os.path.join(drafts["cached"], "provenance.json")) as f:
        record = json.load(f)
    assert record["data"]["read_from"] == drafts["data"] and record["data"]["examples"] == 12
    with open(os.path.join(drafts["data"], "data.json")) as f:
        writer = json.load(f)["command"]
    assert record["data"]["command"] == writer != record["command"]
    with open(os.path.join(drafts["cached"], "README.md")) as f:
        readme = f.read()
    lines = readme.splitlines()
    assert lines.index(writer) < lines.index(record["command"])  # both commands, data first


def test_data_of_other_arguments_is_refused(drafts, tmp_path, capsys):
    args = ["--target", TARGET, "--out", str(tmp_path / "d"), "--data", drafts["data"], *TOY, "--num-prompts", "13"]
    assert train_draft.main(args) == 2
    assert "another num_prompts" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "d" / "config.json")


def test_the_provenance_records_the_run(drafts):
    from models.loading.checks import model_fingerprint

    with open(os.path.join(drafts["a"], "provenance.json")) as f:
        record = json.load(f)
    assert record["seed"] == 0 and "--num-prompts 12" in record["command"]
    assert record["target"]["fingerprint"] == model_fingerprint(TARGET)
    assert record["data"]["examples"] == 12 and record["data"]["completion_tokens"] > 12
    assert record["training"]["steps_run"] == 12 and [p["step"] for p in record["training"]["loss_curve"]] == [4, 8, 12]
    assert record["training"]["loss_last"] < record["training"]["loss_first"]
    for kind in ("chat", "code_chat", "code", "all"):
        measured = record["held_out_acceptance"][kind]
        assert measured["positions"] > 0 and 0.0 <= measured["agreement"] <= 1.0
    assert record["decode_step_ms"]["draft"] > 0 and record["draft"]["weight_file_bytes"] > 0
    with open(os.path.join(drafts["a"], "README.md")) as f:
        assert "kind: draft_model" in f.read()


def test_a_continued_draft_starts_from_the_earlier_one_and_records_it(drafts):
    """--init takes every weight of the earlier draft (its 8-bit weights dequantized), and
    the record and README carry the earlier draft's commands before the new one."""
    from pathlib import Path

    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_config

    from models.loading import dense_weights
    from models.loading.loader import load_model

    with open(os.path.join(drafts["a"], "provenance.json")) as f:
        earlier = json.load(f)
    with open(os.path.join(drafts["continued"], "provenance.json")) as f:
        record = json.load(f)
    assert record["continued_from"] == earlier and record["draft"]["init"].startswith("every weight from the draft")
    assert record["data"]["prompts_per_kind"] == {"chat": 6, "self_chat": 6}
    assert record["data"]["passes"]["self_chat"]["prompts"] == 6
    with open(os.path.join(drafts["continued"], "README.md")) as f:
        text = f.read()
    continuing = f"continuing that draft on new data (--init: where it was written, {earlier['args']['out']})"
    assert text.index(earlier["command"]) < text.index(continuing) < text.index(record["command"])

    config = {k: v for k, v in load_config(Path(drafts["a"])).items() if not k.startswith("quantization")}
    draft = draft_fit.build(config)
    draft_fit.init_from_draft(draft, load_model(drafts["a"], "draft").model, drafts["a"])
    again = load_model(drafts["a"], "draft")
    assert dense_weights.dequantize(again.model) > 0
    expected = dict(tree_flatten(again.model.parameters()))
    for name, value in tree_flatten(draft.parameters()):
        assert value.dtype == mx.float32 and mx.array_equal(value, expected[name].astype(mx.float32)), name
    with pytest.raises(ValueError, match="another shape"):
        draft_fit.init_from_draft(draft_fit.build({**config, "hidden_size": 32}), again.model, "x")


def test_the_draft_drafts_and_streams_equal_classic_decode(drafts):
    from models.runner import MlxRunner
    from scheduler.config import SchedulerConfig
    from scheduler.core import Scheduler

    runner = MlxRunner.from_paths(TARGET, drafter_kind="draft_model", drafter_path=drafts["a"], num_draft_tokens=3)
    try:
        prompts = [runner.tokenizer.encode(PROMPTS[i]) for i in (0, 8)]
        reference = isolated_streams(runner, prompts, max_tokens=16)
        streams, peak = {}, 0
        for i, p in enumerate(prompts):
            scheduler = Scheduler(runner, SchedulerConfig(b1_policy="on"))
            scheduler.submit(make_request(f"r{i}", p, max_tokens=16))
            streams[f"r{i}"] = []
            while scheduler.has_work():
                for event in scheduler.tick():
                    streams[event.request_id] += event.token_ids
                peak = max(peak, runner.num_live_sessions())
        assert streams == reference
        assert peak >= 1  # the requests ran speculative sessions with the trained draft
    finally:
        runner.close()


def test_bad_input_is_one_line(tmp_path, capsys):
    out = str(tmp_path / "d")
    assert train_draft.main(["--target", str(tmp_path / "missing"), "--out", out, *TOY]) == 2
    assert train_draft.main(["--target", TARGET, "--out", out, *TOY, "--heads", "3", "--kv-heads", "2"]) == 2
    with pytest.raises(SystemExit):
        train_draft.main(["--target", TARGET, "--out", out, "--mix", "chat:1,poetry:1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("train_draft: error: ") for line in lines), lines
    assert "missing" in lines[0] and "--kv-heads" in lines[1] and "poetry" in lines[2]


def test_a_draft_init_cannot_continue_is_one_line_before_any_data(drafts, tmp_path, capsys):
    out, data = str(tmp_path / "d"), str(tmp_path / "data")
    common = ["--target", TARGET, "--out", out, "--data", data, *TOY]
    assert train_draft.main([*common, "--init", str(tmp_path / "missing")]) == 2
    assert train_draft.main([*common, "--init", drafts["a"], "--hidden", "32"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("train_draft: error: ") for line in lines), lines
    assert "missing" in lines[0] and "another shape" in lines[1]
    assert not os.path.exists(data)


@pytest.mark.parametrize("module", [draft_data, draft_eval, draft_fit, train_draft])
def test_docstring_examples_hold(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    "lengths, batch_tokens, rows",
    [
        ([10, 11, 12], 64, [2, 1]),  # one padded length (32): two rows a batch
        ([10, 40, 90, 11], 64, [2, 1, 1]),  # lengths 32, 64, 96: one row for the two long ones
        ([200], 64, [1]),  # longer than the budget: a batch of its own
    ],
)
def test_a_batch_plan_takes_every_example_once(lengths, batch_tokens, rows):
    batches = draft_data.plan_batches(lengths, batch_tokens, np.random.default_rng(0))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert sorted(len(b) for b in batches) == sorted(rows)
    assert all(len({draft_data.padded_length(lengths[i]) for i in b}) == 1 for b in batches)


@pytest.mark.parametrize(
    "matches, k, expected",
    [
        ([[True, True, True, True]], 4, 4.0),
        ([[False, False]], 4, 0.0),
        ([[True, False, True]], 1, 1.0),
        ([[True, True, True, False, True]], 2, 1.0),  # rounds take 2 (+1), 0 (+1), 1
        ([[True], [False]], 4, 0.5),
    ],
)
def test_accepted_drafts_per_round(matches, k, expected):
    assert draft_eval.accepted_per_round(matches, k) == pytest.approx(expected)


def make_example(num_prompt, num_completion, k=2):
    ids = np.tile(np.arange(k, dtype=np.int32), (num_completion, 1))
    return draft_data.Example(
        list(range(100, 100 + num_prompt)),
        list(range(num_completion)),
        ids,
        np.log(np.full((num_completion, k), 0.25, np.float32)),
    )


@pytest.mark.parametrize(
    "num_prompt, num_completion, max_seq, kept",
    [
        (10, 5, 64, (10, 5)),  # fits
        (70, 5, 64, (59, 5)),  # the prompt loses its start
        (10, 80, 64, (1, 63)),  # the completion its tail, one prompt token stays
    ],
)
def test_clip_keeps_the_completions_context(num_prompt, num_completion, max_seq, kept):
    e = draft_data.clip(make_example(num_prompt, num_completion), max_seq)
    assert (len(e.prompt_ids), len(e.completion_ids)) == kept and len(e.topk_ids) == kept[1]
    assert e.prompt_ids[-1] == 100 + num_prompt - 1


def test_the_loss_mask_covers_completion_targets_only():
    inputs, targets, mask, top_ids, top_probs = draft_data.collate([make_example(3, 2)], topk=2, num_rows=2)
    assert inputs.shape == (2, 32) and mask.sum().item() == 2
    assert mask[0, :6].tolist() == [0, 0, 1, 1, 0, 0]  # positions 2 and 3 predict the completion
    assert targets[0, 2:4].tolist() == [0, 1] and top_probs[0, 2].tolist() == pytest.approx([0.5, 0.5])
    assert mask[1].sum().item() == 0  # a padding row


def test_the_draft_config_keeps_the_family_and_refuses_others():
    target = {
        "model_type": "llama",
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
        "num_hidden_layers": 30,
        "layer_types": ["full_attention"] * 30,
        "quantization": {"bits": 4},
        "tie_word_embeddings": False,
    }
    config = draft_fit.draft_config(target, hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=None)
    assert (config["num_hidden_layers"], config["head_dim"], config["tie_word_embeddings"]) == (2, 16, True)
    assert "quantization" not in config and config["layer_types"] == ["full_attention"] * 2
    with pytest.raises(ValueError, match="qwen3"):
        draft_fit.draft_config(
            {**target, "model_type": "qwen3"}, hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, head_dim=None
        )


def test_training_prompts_are_not_evaluation_prompts():
    from scripts.bench import prompts

    def texts(chats):
        return {c[0]["content"] for c in chats}

    assert not texts(prompts.training_chat_questions(3000, 0)) & texts(prompts.chat_questions(3000, 0))
    assert not set(prompts._TRAIN_TOPICS) & set(prompts._TOPICS) and not set(prompts._TRAIN_ASKS) & set(prompts._ASKS)
    held_out, train = prompts._corpus_files("valid"), prompts._corpus_files("train")
    for snippet in prompts.training_snippets(3, 0, 300):
        assert any(snippet in f for f in train) and not any(snippet in f for f in held_out)


def test_a_pass_cut_short_holds_prompts_of_every_length():
    """Chunks run shuffled: the first quarter of them (what a deadline might leave) spans
    short and long prompts alike, and every prompt is in exactly one chunk."""
    lengths = list(range(1, 513))
    chunks = draft_data.plan_chunks(lengths, 16, seed=0)
    assert sorted(i for c in chunks for i in c) == list(range(512))
    first = [lengths[i] for c in chunks[: len(chunks) // 4] for i in c]
    assert min(first) < 128 and max(first) > 384
    wide = [c for c in chunks if max(lengths[i] for i in c) > draft_data.PREFILL_WIDTH]
    assert all(len(c) * max(lengths[i] for i in c) <= 16 * draft_data.PREFILL_WIDTH + 16 * 32 for c in wide)


def test_fixed_shape_generation_is_mlx_lms_greedy_decode():
    """Left-padded rows in fixed buffers (two batches of unequal prompts) continue each
    prompt with exactly the tokens mlx-lm's `generate_step` gives it alone, stop after an
    EOS id (kept), and keep the top-k log-probabilities of every generated position."""
    from mlx_lm.generate import generate_step

    from models.loading.loader import load_model

    target = load_model(TARGET)
    texts = [
        "def add(a, b):\n",
        "import os\nimport sys\n\nclass Foo:\n    def __init__(self",
        "x = [",
        "for i in range(10):\n    print(i",
    ]
    prompts = [target.tokenizer.encode(t) for t in texts]
    refs = []
    for p in prompts:
        refs.append([int(y) for y, _ in generate_step(mx.array(p), target.model, max_tokens=20)])
    stop = refs[1][5]  # an "EOS" that one stream meets part-way
    examples, stats = draft_data.generate(
        target.model, prompts, max_new_tokens=20, temperature=0.0, eos_ids=[stop], topk=3, batch_size=3
    )
    for ref, example in zip(refs, examples):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert example.completion_ids == ref[:cut]
        assert example.topk_ids.shape == example.topk_logprobs.shape == (cut, 3)
        assert all(t in row for t, row in zip(ref[:cut], example.topk_ids))  # greedy: the token is in its top k
        assert (example.topk_logprobs <= 0).all()
    assert stats["tokens"] == sum(len(e.completion_ids) for e in examples) and stats["kept"] == 4


def test_a_finished_chunks_buffers_are_freed_without_the_cycle_collector(monkeypatch):
    """Each chunk's key/value buffers go when the chunk ends, not when Python's cyclic
    collector next runs (rarely, in a process holding millions of kept tokens)."""
    import gc
    import weakref

    from models.loading.loader import load_model

    target = load_model(TARGET)
    made = []

    class Recorded(draft_data._FixedBatch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(draft_data, "_FixedBatch", Recorded)
    prompts = [target.tokenizer.encode(t) for t in ("def f(x):\n", "x = [1, 2", "import os\n")]
    gc.disable()
    try:
        draft_data.generate(target.model, prompts, max_new_tokens=4, temperature=0.0, eos_ids=[], topk=2, batch_size=1)
        assert len(made) == 3 and all(ref() is None for ref in made)
    finally:
        gc.enable()


def test_rejection_acceptance_is_one_for_the_target_itself_and_a_probability_else(drafts):
    from models.loading.loader import load_model

    target, draft = load_model(TARGET, "target"), load_model(drafts["a"], "draft")
    prompt = list(target.tokenizer.encode("def add(a, b):\n    return"))
    example = draft_data.Example(prompt, [11, 12, 13, 14], np.zeros((4, 0), np.int32), np.zeros((4, 0), np.float32))
    (same,) = draft_eval.rejection_acceptance(target.model, target.model, [example], 0.7)
    assert len(same) == 4 and all(abs(a - 1.0) < 1e-4 for a in same)
    (other,) = draft_eval.rejection_acceptance(target.model, draft.model, [example], 0.7)
    assert len(other) == 4 and all(0.0 <= a <= 1.0 + 1e-5 for a in other) and min(other) < 0.999
    # The target drafting for itself is the ceiling.
    assert draft_eval.expected_per_round([other], 4) <= draft_eval.expected_per_round([same], 4)


def test_draft_accept_reports_greedy_and_sampled_acceptance(drafts, tmp_path, capsys):
    from scripts.tools import draft_accept

    out = tmp_path / "accept.json"
    args = ["--target", TARGET, "--draft", drafts["a"], "--prompts", "2", "--tokens", "8", "--kinds", "code,chat"]
    assert draft_accept.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())["result"]
    assert set(result) == {"code", "chat"}
    for row in result.values():
        assert set(row) == {"greedy", "t0.7"}
        for r in row.values():
            assert r["positions"] > 0 and 0.0 <= r["per_token"] <= 1.0
            assert 0.0 <= r["k2"] <= r["k3"] <= r["k4"] <= r["k6"] <= 6
    assert "| code | greedy |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        draft_accept.main([*args[:4], "--kinds", "poetry"])


def test_expected_rounds_are_the_simulated_rounds_for_certain_outcomes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        matches = [list(rng.random(int(rng.integers(1, 30))) < 0.6) for _ in range(3)]
        for k in (1, 2, 4, 6):
            expected = draft_eval.expected_per_round([[float(m) for m in row] for row in matches], k)
            assert expected == pytest.approx(draft_eval.accepted_per_round(matches, k))


def test_the_draft_vocab_covers_the_training_tokens_and_is_measured(drafts):
    """train_draft writes draft_vocab.json by default: the target's most frequent output
    tokens, the share they cover, and the agreement with the whole and the cut head."""
    with open(os.path.join(drafts["a"], "draft_vocab.json")) as f:
        vocab = json.load(f)
    with open(os.path.join(drafts["a"], "provenance.json")) as f:
        record = json.load(f)
    assert vocab["coverage"] >= 0.995 and vocab["tokens_counted"] == record["data"]["completion_tokens"]
    assert vocab["ids"] == sorted(set(vocab["ids"])) and len(vocab["ids"]) == record["draft_vocab"]["ids"]
    assert 0 < len(vocab["ids"]) < 2048  # the toy's vocabulary: the head is cut
    for kind in ("chat", "code_chat", "code"):
        both = vocab["agreement"][kind]
        assert 0.0 <= both["cut head"] <= 1.0 and 0.0 <= both["whole head"] <= 1.0
    with open(os.path.join(drafts["a"], "README.md")) as f:
        assert "output head" in f.read()


def test_a_cut_head_keeps_the_whole_heads_logits_on_its_tokens(drafts):
    from models.loading import dense_weights, draft_vocab
    from models.loading.loader import load_model

    whole, cut = load_model(drafts["a"], "draft"), load_model(drafts["a"], "draft")
    for loaded in (whole, cut):
        dense_weights.apply(loaded.model, loaded.name, None)
    ids = draft_vocab.read(drafts["a"], 2048)
    assert draft_vocab.apply(cut.model, cut.path, cut.name, True) == len(ids)
    tokens = mx.array([whole.tokenizer.encode("def add(a, b):\n    return a + b\n")])
    a, b = whole.model(tokens), cut.model(tokens)
    inside = mx.array(ids)
    assert mx.allclose(mx.take(a, inside, axis=-1), mx.take(b, inside, axis=-1), rtol=1e-5, atol=1e-5)
    off = mx.array(np.setdiff1d(np.arange(2048), ids))
    assert bool(mx.all(mx.take(b, off, axis=-1) == -mx.inf))
    in_set = set(ids)
    for whole_best, cut_best in zip(mx.argmax(a, axis=-1)[0].tolist(), mx.argmax(b, axis=-1)[0].tolist()):
        assert cut_best in in_set and (whole_best not in in_set or whole_best == cut_best)
    assert draft_vocab.apply(whole.model, whole.path, whole.name, False) == 0  # draft_vocab: false


def test_a_runner_drafts_only_the_cut_heads_tokens_and_samples_from_them(drafts):
    """The runner cuts the head at load (draft_vocab on by default); sampled drafts come
    from distributions that are zero off the cut vocabulary."""
    from models.loading.draft_vocab import SubsetHead, read
    from models.runner import MlxRunner
    from models.sampling.samplers import RequestSampler
    from scheduler.request import SamplingParams

    runner = MlxRunner.from_paths(TARGET, drafter_kind="draft_model", drafter_path=drafts["a"], num_draft_tokens=3)
    try:
        drafter = runner._slot.drafter
        assert isinstance(drafter.model.lm_head, SubsetHead)
        ids = set(read(drafts["a"], 2048))
        prompt = runner.tokenizer.encode(PROMPTS[3])
        state = drafter.new_state(prompt[:-1])
        assert set(drafter.propose(state, prompt, 4)) <= ids
        state = drafter.new_state(prompt[:-1])
        sampler = RequestSampler(SamplingParams(max_tokens=8, temperature=1.0, seed=3), prompt)
        tokens, q = drafter.propose_sampled(state, prompt, 3, sampler, 2048)
        assert set(tokens.tolist()) <= ids
        off = mx.array(np.setdiff1d(np.arange(2048), sorted(ids)))
        assert float(mx.max(mx.take(q, off, axis=-1))) == 0.0
        assert mx.allclose(q.sum(axis=-1), mx.ones((3,)), atol=1e-5)
    finally:
        runner.close()


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{not json", "unreadable"),
        ('{"ids": [1, 2, 2]}', "distinct token ids below 2048"),
        ('{"ids": [1, 4096]}', "distinct token ids below 2048"),
        ('{"ids": []}', "distinct token ids below 2048"),
        ('{"other": 1}', "unreadable"),
    ],
)
def test_a_bad_draft_vocab_file_is_one_error(tmp_path, content, fragment):
    from models.loading.checks import ModelLoadError
    from models.loading.draft_vocab import read

    (tmp_path / "draft_vocab.json").write_text(content)
    with pytest.raises(ModelLoadError, match=fragment):
        read(str(tmp_path), 2048)


def test_draft_vocab_tool_writes_the_file_from_a_data_directory(drafts, tmp_path, capsys):
    """`scripts.tools.draft_vocab` gives an existing draft the file from a --data directory."""
    import shutil

    from scripts.tools import draft_vocab as tool

    copy = tmp_path / "draft"
    shutil.copytree(drafts["cached"], copy)
    os.unlink(copy / "draft_vocab.json")
    assert tool.main(["--data", drafts["data"], "--draft", str(copy), "--coverage", "0.9"]) == 0
    vocab = json.loads((copy / "draft_vocab.json").read_text())
    assert 0.9 <= vocab["coverage"] <= 1.0 and set(vocab["agreement"]) == {"chat", "code_chat", "code"}
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(["--data", str(tmp_path / "none"), "--draft", str(copy)])
