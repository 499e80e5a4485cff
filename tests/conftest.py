"""Shared fixtures: the golden files and hash-v1 tiny checkpoints built once per session."""

from __future__ import annotations

import json
import os
import pkgutil
import tempfile
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden"


def project_deprecations_as_errors() -> str:
    """A PYTHONWARNINGS value under which a DeprecationWarning from the project's own code (a module of
    personaplex_demo, or the script run as __main__) is an error; those from libraries stay warnings."""
    import personaplex_demo

    modules = ["__main__", *(m.name for m in pkgutil.walk_packages(personaplex_demo.__path__, "personaplex_demo."))]
    return ",".join(f"error::DeprecationWarning:{m}" for m in modules)


def golden(name: str) -> dict:
    return json.loads((GOLDEN / name).read_text())


@pytest.fixture(scope="session", autouse=True)
def _deterministic_torch():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory):
    """The tiny offline model repository, built once per test session."""
    from personaplex_demo.runtime.tiny import ensure_tiny_repo

    return ensure_tiny_repo(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def tiny_cache_dir(tiny_repo):
    return tiny_repo.parent


@pytest.fixture
def recordings(tmp_path):
    """A recordings store of its own for a test, deleted afterwards."""
    from personaplex_demo.web.recording import RecordingStore

    store = RecordingStore(tmp_path / "calls")
    yield store
    store.close()


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_in_the_temp_folder():
    """Every recordings folder this test process made (its name carries the pid) is gone at the end;
    the launched apps are checked the same way by tests/browser_support.py."""
    yield
    left = sorted(Path(tempfile.gettempdir()).glob(f"personaplex-calls-{os.getpid()}-*"))
    assert not left, f"the tests left recordings folders behind: {left}"


@pytest.fixture
def loopback_ice(monkeypatch):
    """aioice skips 127.0.0.1; peers in this process (and the app's, told by PERSONAPLEX_LOOPBACK_ICE)
    meet on loopback only."""
    import aioice.ice

    from personaplex_demo.rtc.patches import loopback_host_addresses

    monkeypatch.setattr(aioice.ice, "get_host_addresses", loopback_host_addresses)
