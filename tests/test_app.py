"""The app's command line: flags, env vars and defaults from AppConfig, --help, and a quiet start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import free_port
from personaplex_demo.cli.config import AppConfig, parse_config, specs

from .conftest import project_deprecations_as_errors

ROOT = Path(__file__).resolve().parent.parent
FIELDS = specs(AppConfig)


def test_every_field_is_a_flag_with_help_and_an_env_var() -> None:
    assert [s.name for s in FIELDS] == [f for f in AppConfig.__dataclass_fields__]
    envs = [s.option.env for s in FIELDS]
    assert all(s.option.help for s in FIELDS) and all(envs) and len(set(envs)) == len(envs)


def test_flags_win_over_env_vars_and_env_vars_over_defaults() -> None:
    assert parse_config([], environ={}) == AppConfig()
    env = {"PERSONAPLEX_SLOTS": "8", "PERSONAPLEX_TIME_LIMIT": "60", "PERSONAPLEX_SHARE": "yes",
           "PERSONAPLEX_CACHE": "/tmp/c", "PERSONAPLEX_MODEL": "tiny", "PERSONAPLEX_PORT": " "}
    cfg = parse_config([], environ=env)
    assert (cfg.slots, cfg.time_limit, cfg.share, cfg.cache_dir, cfg.model, cfg.port) == (8, 60.0, True, "/tmp/c",
                                                                                          "tiny", 7860)
    cfg = parse_config(["--slots", "2", "--time-limit", "30.5", "--model", "auto"], environ=env)
    assert (cfg.slots, cfg.time_limit, cfg.model) == (2, 30.5, "auto")


def test_a_space_listens_on_every_interface_unless_told_otherwise() -> None:
    assert parse_config([], environ={"SPACE_ID": "user/space"}).host == "0.0.0.0"
    assert parse_config([], environ={"SPACE_ID": "x", "PERSONAPLEX_HOST": "10.0.0.1"}).host == "10.0.0.1"
    assert parse_config(["--host", "::1"], environ={"SPACE_ID": "x"}).host == "::1"


@pytest.mark.parametrize(("argv", "complaint"), [
    (["--engines", "ray", "--devices", "cpu,cpu"], "--devices is for --engines local"),
    (["--ray-address", "auto"], "--ray-address is for --engines ray"),
])
def test_flags_of_the_other_back_end_are_a_usage_error(argv, complaint, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config(argv, environ={})
    assert exit_info.value.code == 2 and complaint in capsys.readouterr().err


def test_the_ray_back_end_without_ray_installed_says_how_to_install_it(monkeypatch, capsys) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--engines", "ray"], environ={})
    assert exit_info.value.code == 2 and "pip install -r requirements-ray.txt" in capsys.readouterr().err


@pytest.mark.parametrize(("env", "complaint"), [
    ({"PERSONAPLEX_SLOTS": "many"}, "PERSONAPLEX_SLOTS: 'many' is neither auto nor a whole number"),
    ({"PERSONAPLEX_SLOTS": "0"}, "PERSONAPLEX_SLOTS: must be at least 1, not 0"),
    ({"PERSONAPLEX_IDLE_RELEASE": "-2"}, "PERSONAPLEX_IDLE_RELEASE: must be greater than 0, not -2"),
    ({"PERSONAPLEX_SHARE": "maybe"}, "PERSONAPLEX_SHARE: 'maybe' is not one of 1, true, yes, on, 0, false"),
    ({"PERSONAPLEX_MODEL": "big"}, "PERSONAPLEX_MODEL: 'big' is not one of auto, personaplex-7b-v1, tiny"),
    ({"PERSONAPLEX_WEIGHTS": "int4"}, "PERSONAPLEX_WEIGHTS: 'int4' is not one of dense, int8"),
])
def test_a_bad_env_var_is_a_one_line_error(env, complaint, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config([], environ=env)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and complaint in err


@pytest.mark.parametrize(("argv", "complaint"), [
    (["--max-queue", "-1"], "argument --max-queue: must be at least 0, not -1"),
    (["--port", "70000"], "argument --port: must be between 1 and 65535, not 70000"),
    (["--time-limit", "soon"], "argument --time-limit: 'soon' is not a number"),
    (["--weights", "int8", "--dtype", "fp16"], "--weights int8 needs --dtype bfloat16 or float32"),
])
def test_a_bad_flag_names_the_flag(argv, complaint, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})
    assert complaint in capsys.readouterr().err


def test_help_shows_each_default_and_each_env_var() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSONAPLEX_") and k != "SPACE_ID"}
    env["COLUMNS"] = "500"  # one line per flag: argparse wraps help to the terminal width
    out = subprocess.run([sys.executable, "app.py", "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    lines = out.splitlines()
    helps: dict[str, str] = {}  # flag -> its help, which argparse may start on the next line
    for line in lines:
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")  # "--new-name, --old-name": a renamed flag's former name
            helps[flag] = line
        elif line.startswith("    ") and helps:
            helps[flag] += line
    for spec in FIELDS:
        assert spec.flag in helps, f"{spec.flag} is not in --help"
        assert f"(default: {spec.shown(spec.default)})" in helps[spec.flag], helps[spec.flag]
        assert any(line.split() == [spec.option.env, spec.flag] for line in lines), spec.option.env
    for name in ("HF_TOKEN", "SPACE_ID", "PERSONAPLEX_LOOPBACK_ICE"):
        assert any(line.strip().startswith(name + " ") for line in lines), name


@pytest.mark.slow
def test_app_start_logs_are_quiet_and_say_where_it_serves(tiny_cache_dir, tmp_path) -> None:
    """The README's start command with the tiny model: no request-by-request httpx lines, no Gradio hint
    about launch(share=True), and no DeprecationWarning from the project's own code (it would be an error)."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False", PERSONAPLEX_CACHE=str(tiny_cache_dir),
               PYTHONWARNINGS=project_deprecations_as_errors())
    for var in ("HF_TOKEN", "SPACE_ID", "PERSONAPLEX_VERBOSE", "PERSONAPLEX_SHARE"):
        env.pop(var, None)
    log = tmp_path / "app.log"
    serving = f"serving on http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--model", "tiny", "--port", str(port)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while serving not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
        time.sleep(1.0)  # anything Gradio prints just after the server is up
        text = log.read_text()
        assert proc.poll() is None, f"the app stopped:\n{text[-3000:]}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    first = text.splitlines()[:30]
    assert any(serving in line for line in first), text
    assert not [line for line in first if "httpx" in line or "HTTP Request" in line], text
    assert not [line for line in first if "share=True" in line or "launch()" in line], text
    assert not [line for line in first if "Warning" in line], text
    banner = [line for line in first if "WARNING" in line and "tiny offline model" in line]
    assert banner and "hash" not in banner[0] and "babbles" in banner[0], text
