"""Layering: the scheduler stays free of mlx and ray, the model side free of serve_app and ray."""

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


def test_models_import_neither_serve_app_nor_ray():
    """Every module under models/ (the layer below serve_app) loads without serve_app or ray."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import models\n"
        "for m in pkgutil.walk_packages(models.__path__, 'models.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('serve_app', 'ray'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
