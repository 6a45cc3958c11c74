"""llama_fit.py: the test world's resident fits itself to the simulated card as llama.cpp's --fit does."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.stack.llama import Fit

GiB = 1 << 30
FIT = Fit()  # 12 GiB + 1 MiB per token + 1 GiB, 1 GiB left free, no less than 4096 tokens


def run_fit(kit: Any, gpusim: Path, tmp_path: Path, fit: Fit | None, *server: str) -> subprocess.CompletedProcess[str]:
    """Run llama_fit.py in front of a command that prints the arguments it was given."""
    fit_file = tmp_path / "strata.fit.json"
    fit_file.unlink(missing_ok=True)
    if fit is not None:
        fit_file.write_text(json.dumps(asdict(fit)))
    out = subprocess.run([kit.PY, str(kit.SIM / "llama_fit.py"), "--dir", str(gpusim), "--name", "strata",
                          "--bytes", "21GiB", "--fit-file", str(fit_file), "--", "echo", *server],
                         capture_output=True, text=True, timeout=10)
    ooms = kit.ledger.ooms(gpusim)
    kit.ledger.reset(gpusim)  # the echo has exited: its claim is forgotten, not left lagging
    out.ooms = ooms  # type: ignore[attr-defined]
    return out


def test_the_formula_is_the_worlds_resident_at_its_full_context(kit: Any, gpusim: Path, tmp_path: Path) -> None:
    assert FIT.claim(8192) == 21 * GiB and FIT.claim(4096) == 17 * GiB
    out = run_fit(kit, gpusim, tmp_path, FIT, "-c", "8192", "-np", "2")  # 24 free: the claim and its margin
    assert out.returncode == 0 and out.stdout.split() == ["-c", "8192", "-np", "2"] and not out.stderr
    fd = kit.ledger.claim(gpusim, "stray", 3 * GiB)  # 21 free: 1024 tokens less (two slots of 256, twice)
    assert run_fit(kit, gpusim, tmp_path, FIT, "-c", "8192", "-np", "2").stdout.split()[1] == "7168"
    os.close(fd)


def test_without_the_fit_file_it_claims_its_fixed_size(kit: Any, gpusim: Path, tmp_path: Path) -> None:
    fd = kit.ledger.claim(gpusim, "stray", 3 * GiB)
    out = run_fit(kit, gpusim, tmp_path, None, "-c", "8192", "-np", "2")
    assert out.returncode == 0 and out.stdout.split() == ["-c", "8192", "-np", "2"]  # 21 GiB fit beside 3
    os.close(fd)
    fd = kit.ledger.claim(gpusim, "bigger", 4 * GiB)
    out = run_fit(kit, gpusim, tmp_path, None, "-c", "8192", "-np", "2")
    assert out.returncode == 1 and "cudaMalloc failed: out of memory" in out.stderr  # no fitting: OOM
    os.close(fd)


def test_short_of_memory_it_lowers_its_context_until_the_claim_fits(kit: Any, gpusim: Path, tmp_path: Path) -> None:
    fd = kit.ledger.claim(gpusim, "stray", int(2.5 * GiB))
    out = run_fit(kit, gpusim, tmp_path, FIT, "-m", "x.gguf", "-c", "8192", "-np", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["-m", "x.gguf", "-c", "7680", "-np", "2"]
    assert "reducing n_ctx from 8192 to 7680" in out.stderr
    assert out.ooms == []  # type: ignore[attr-defined]
    os.close(fd)


def test_it_fails_only_when_even_the_minimum_does_not_fit(kit: Any, gpusim: Path, tmp_path: Path) -> None:
    fd = kit.ledger.claim(gpusim, "stray", 7 * GiB)  # 17 free: the minimum (12 + 4 + 1) just fits
    out = run_fit(kit, gpusim, tmp_path, FIT, "-c", "8192", "-np", "2")
    assert out.returncode == 0 and out.stdout.split() == ["-c", "4096", "-np", "2"]
    assert out.ooms == []  # type: ignore[attr-defined]
    fd2 = kit.ledger.claim(gpusim, "more", 1 * GiB)
    out = run_fit(kit, gpusim, tmp_path, FIT, "-c", "8192", "-np", "2")
    assert out.returncode == 1 and "cudaMalloc failed: out of memory" in out.stderr
    assert [o["name"] for o in out.ooms] == ["strata"]  # type: ignore[attr-defined]
    os.close(fd)
    os.close(fd2)
