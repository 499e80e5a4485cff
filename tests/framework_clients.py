"""The agent frameworks' own virtual environments (their pins clash with the app's): pipecat and
LiveKit Agents, each at the versions in tests/clients/requirements-<name>.txt.

CI builds them before the test command and names their interpreters in PERSONAPLEX_PIPECAT_PYTHON
and PERSONAPLEX_LIVEKIT_PYTHON (.ci/run); elsewhere the first test that needs one builds it under
.venvs/ in the repository and reuses it while its requirements stay the same.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = Path(__file__).resolve().parent / "clients"
_lock = threading.Lock()


def requirements(name: str) -> Path:
    return CLIENTS / f"requirements-{name}.txt"


def build(name: str, venv: Path) -> Path:
    """A virtual environment at `venv` with `name`'s requirements; its interpreter."""
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r",
                    str(requirements(name))], check=True)
    return python


def client_python(name: str) -> Path:
    """The interpreter of `name`'s environment, built here if CI did not build it."""
    given = os.environ.get(f"PERSONAPLEX_{name.upper()}_PYTHON")
    if given:
        return Path(given)
    venv = ROOT / ".venvs" / name
    marker = venv / "built-from.txt"
    wanted = requirements(name).read_text()
    with _lock:
        if not marker.exists() or marker.read_text() != wanted:
            log.warning("building %s's virtual environment in %s (once; a minute or two)", name, venv)
            build(name, venv)
            marker.write_text(wanted)
    return venv / "bin" / "python"


def run_client(name: str, args: list[str], timeout: float, log_path: Path) -> dict:
    """Run tests/clients/<name>_agent.py in its environment; the fields of its RESULT line. Its
    own log goes to `log_path`."""
    with log_path.open("w") as err:
        done = subprocess.run([str(client_python(name)), str(CLIENTS / f"{name}_agent.py"), *args], cwd=CLIENTS,
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (f"{name} client failed (exit {done.returncode}); its log:\n"
                                            + log_path.read_text()[-4000:])
    return json.loads(lines[-1].removeprefix("RESULT "))

