"""`startup.transformers_without_torch`: transformers imported where PyTorch is installed
neither imports torch nor reports it available, and its tokenizers still load.

Each case runs in a fresh interpreter, with a stand-in `torch` package (its own
dist-info, a version transformers accepts) whose import writes a marker file; the
control case shows transformers finds it. The stand-in has no tensors, so transformers'
tokenizer import, which imports torch where it finds it, would fail if it did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "bundled" / "target"

PROBE = """
import json, os, sys
hide = sys.argv[1] in ("hide", "ask")
import models
from models.platform import startup
hidden = startup.transformers_without_torch() if hide else False
from transformers.utils import import_utils
out = {"hidden": hidden, "available": import_utils.is_torch_available()}
if sys.argv[1] == "hide":  # the stand-in has no tensors: transformers with torch visible would fail here
    from transformers import AutoTokenizer
    out["ids"] = AutoTokenizer.from_pretrained(sys.argv[2]).encode("def reverse(xs): return xs[::-1]")
out["torch_imported"] = os.path.exists(os.environ["TORCH_MARKER"])
out["torch_module"] = sys.modules.get("torch") is not None
print(json.dumps(out))
"""


def _fake_torch(root: Path) -> Path:
    site = root / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        "import os\nopen(os.environ['TORCH_MARKER'], 'w').close()\n__version__ = '2.9.0'\n"
    )
    info = site / "torch-2.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n")
    (info / "RECORD").write_text("")
    return site


def _probe(tmp_path: Path, mode: str, env_extra: dict | None = None) -> dict:
    site = tmp_path / "site" if (tmp_path / "site").exists() else _fake_torch(tmp_path)
    marker = tmp_path / f"torch-imported-{mode}"
    env = {name: value for name, value in os.environ.items() if name != "SPECSLOT_TRANSFORMERS_TORCH"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")]),
        TORCH_MARKER=str(marker),
        **(env_extra or {}),
    )
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(BUNDLED)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_transformers_loads_tokenizers_without_importing_torch(tmp_path):
    shown = _probe(tmp_path, "plain")
    hidden = _probe(tmp_path, "hide")
    # The stand-in is installed: transformers alone finds it.
    assert shown["available"] is True
    assert hidden["hidden"] is True
    assert hidden["available"] is False
    assert hidden["torch_imported"] is False and hidden["torch_module"] is False
    assert hidden["ids"][:3] and all(isinstance(i, int) for i in hidden["ids"])


def test_torch_stays_visible_when_asked(tmp_path):
    kept = _probe(tmp_path, "ask", {"SPECSLOT_TRANSFORMERS_TORCH": "1"})
    assert kept["hidden"] is False
    assert kept["available"] is True
