"""What a user's `pip install` gets: the wheel holds every module of the three packages and the
files the engine reads beside its code (the native kernels' C sources, the shipped router)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sekv_core", "sekv_cli", "sekv_bench")
DATA = ("*.c", "routers/*.safetensors")  # under sekv_core: read beside the code


def test_the_wheel_holds_every_module_and_the_engines_data(tmp_path):
    pytest.importorskip("setuptools")
    tree = tmp_path / "tree"  # a copy: the build writes its scratch beside the sources
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tree / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation",
         "--quiet", "--wheel-dir", str(tmp_path)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("sekv-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    source = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    source += [p for pattern in DATA for p in (ROOT / "sekv_core").rglob(pattern)]
    wanted = {p.relative_to(ROOT).as_posix() for p in source if "__pycache__" not in p.parts}
    assert any(name.startswith("sekv_core/store/") for name in wanted)
    assert wanted - held == set()
