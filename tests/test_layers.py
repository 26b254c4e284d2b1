"""The architecture as a test: imports point down the layers and never go in circles (pyproject.toml's
[tool.importlinter] contracts, checked by import-linter over every import, function-level ones too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(lint), "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_a_broken_layer_is_caught(tmp_path):
    """The contracts can fail: an upward import from the decoding layer into rpc is reported."""
    config = tmp_path / "contracts.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["common"]\n\n[[tool.importlinter.contracts]]\n'
        'name = "inverted"\ntype = "layers"\nlayers = ["common.decoding", "common.rpc"]\n'
    )
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run(
        [str(lint), "--no-cache", "--config", str(config)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 1 and "BROKEN" in out.stdout, out.stdout + out.stderr
