"""`kernel_cache_dir`: MLX's and the CUDA driver's kernel caches go into one
subdirectory per MLX version and GPU model, set before anything touches the GPU."""

import os

import pytest

from models.platform import kernel_cache


@pytest.fixture
def env(monkeypatch):
    for name in ("MLX_PTX_CACHE_DIR", "CUDA_CACHE_PATH", "CUDA_CACHE_MAXSIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_gpu_host_gets_its_caches_under_the_directory(env, tmp_path):
    env.setattr(kernel_cache, "gpu_models", lambda: ["NVIDIA H200", "NVIDIA H200"])
    home = kernel_cache.use(str(tmp_path / "kernels"))
    assert home.startswith(str(tmp_path / "kernels" / "mlx-")) and home.endswith(os.sep + "NVIDIA-H200")
    assert os.environ["MLX_PTX_CACHE_DIR"] == os.path.join(home, "ptx") and os.path.isdir(os.path.join(home, "ptx"))
    assert os.environ["CUDA_CACHE_PATH"] == os.path.join(home, "driver")
    assert int(os.environ["CUDA_CACHE_MAXSIZE"]) == kernel_cache.DRIVER_CACHE_BYTES


def test_an_operator_set_driver_cache_size_is_kept(env, tmp_path):
    env.setattr(kernel_cache, "gpu_models", lambda: ["NVIDIA A100-SXM4-80GB"])
    env.setenv("CUDA_CACHE_MAXSIZE", "123")
    assert kernel_cache.use(str(tmp_path)).endswith("NVIDIA-A100-SXM4-80GB")
    assert os.environ["CUDA_CACHE_MAXSIZE"] == "123"


@pytest.mark.parametrize("cache_dir, models", [(None, ["NVIDIA H200"]), ("x", [])])
def test_nothing_is_set_when_unset_or_without_an_nvidia_gpu(env, tmp_path, cache_dir, models):
    env.setattr(kernel_cache, "gpu_models", lambda: models)
    assert kernel_cache.use(cache_dir and str(tmp_path / cache_dir)) is None
    assert "MLX_PTX_CACHE_DIR" not in os.environ and not (tmp_path / "x").exists()


def test_gpu_models_reads_the_driver_entries(monkeypatch, tmp_path):
    entry = tmp_path / "0000:01:00.0" / "information"
    entry.parent.mkdir()
    entry.write_text("Model: \t NVIDIA H200\nIRQ: 42\n")
    monkeypatch.setattr(kernel_cache.glob, "glob", lambda pattern: [str(entry)])
    assert kernel_cache.gpu_models() == ["NVIDIA H200"]
