"""The shape of the code, as docs/architecture.md states it: no module of the package over 600
lines, and the layering contract of pyproject.toml ([tool.importlinter]) kept."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "dcp_datastates"
MAX_LINES = 600


def test_no_module_of_the_package_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (each over {MAX_LINES} lines): {long}"


def test_the_layers_contract_is_kept():
    lint = shutil.which("lint-imports")
    assert lint, "lint-imports is missing: pip install -e \".[test]\" installs import-linter"
    r = subprocess.run([lint, "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout, r.stdout[-2000:]
