"""The scheduler package stays free of mlx and ray (it drives a ModelRunner protocol)."""

import subprocess
import sys


def test_scheduler_imports_neither_mlx_nor_ray():
    code = (
        "import sys\n"
        "import scheduler.core, scheduler.engine, scheduler.slot, scheduler.adaptive, scheduler.rules\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'ray'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
