"""The documentation site builds with `mkdocs build --strict` (every nav page exists, no broken
links)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_mkdocs_build_strict(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install mkdocs)")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "index.html").exists()
    assert (site / "operations" / "index.html").exists()
    assert (site / "examples" / "index.html").exists()
    shutil.rmtree(site, ignore_errors=True)
