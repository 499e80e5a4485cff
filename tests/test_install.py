"""The project as a user installs it: `pip install .` gives the console scripts, which run from any folder."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from .conftest import project_deprecations_as_errors

ROOT = Path(__file__).resolve().parent.parent
# What a wheel is built from; copied, so the build leaves nothing behind in the checkout.
SOURCES = ("pyproject.toml", "README.md", "requirements.txt", "personaplex_demo")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment with the project installed (not editable) and its bin folder returned.

    The environment sees the running one's packages (torch, gradio, setuptools, pip) through a .pth
    file, so only the project itself is built and installed: offline and in seconds."""
    base = tmp_path_factory.mktemp("install")
    src = base / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    python = bin_dir / "python"
    venv_site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    check=True, capture_output=True, text=True).stdout.strip())
    (venv_site / "outer-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    result = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                             "--ignore-installed", "--quiet", str(src)],
                            env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return bin_dir


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PERSONAPLEX_", "PIP_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def test_installed_package_is_a_copy_with_its_data(installed) -> None:
    out = subprocess.run([installed / "python", "-c", "import personaplex_demo, pathlib; "
                          "print(pathlib.Path(personaplex_demo.__file__).parent)"],
                         cwd=installed, env=_clean_env(), capture_output=True, text=True, check=True).stdout
    package = Path(out.strip())
    assert package.is_relative_to(installed.parent) and not package.is_relative_to(ROOT)
    assert json.loads((package / "assets" / "personas.json").read_text(encoding="utf-8"))
    # The page's scripts and styles are files too: a copy without them serves a page that cannot call.
    shipped = {p.name for p in (package / "assets").iterdir()}
    assert {p.name for p in (ROOT / "personaplex_demo" / "assets").iterdir()} <= shipped


def test_personaplex_live_help_from_another_folder(installed, tmp_path) -> None:
    result = subprocess.run([installed / "personaplex-live", "--help"], cwd=tmp_path, env=_clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: personaplex-live") and "--slots" in result.stdout


@pytest.mark.slow
def test_personaplex_offline_runs_from_another_folder(installed, tiny_cache_dir, tmp_path) -> None:
    rate = 16000
    t = np.arange(rate) / rate
    sf.write(tmp_path / "caller.wav", (0.2 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), rate)
    result = subprocess.run([installed / "personaplex-offline", "--input", "caller.wav", "--output", "agent.wav",
                             "--transcript", "agent.json", "--model", "tiny", "--cache-dir", str(tiny_cache_dir),
                             "--seed", "7", "--quiet"],
                            cwd=tmp_path, env=dict(_clean_env(), PYTHONWARNINGS=project_deprecations_as_errors()),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    info = sf.info(tmp_path / "agent.wav")
    assert (info.samplerate, info.channels, info.frames) == (24000, 1, 24000)
    data = json.loads((tmp_path / "agent.json").read_text(encoding="utf-8"))
    assert data["model"] == "tiny" and data["seed"] == 7 and data["duration_s"] == 1.0
