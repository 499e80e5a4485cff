"""Project files stay consistent: README and CI run the same tests; the docs list every setting;
dependencies are pinned."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CI_RUN = ROOT / ".ci" / "run"


def readme_code_lines() -> list[str]:
    """Lines inside the README's fenced code blocks."""
    lines, inside = [], False
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line.strip())
    return lines


def readme_test_command() -> str:
    found = [line for line in readme_code_lines() if "requirements-dev.txt" in line and "pytest" in line]
    assert len(found) == 1, f"expected one test command in README.md, found {found}"
    return found[0]


def ci_test_command() -> str:
    found = re.findall(r"^TEST_COMMAND=(.+)$", CI_RUN.read_text(encoding="utf-8"), flags=re.M)
    assert len(found) == 1, "expected one TEST_COMMAND=... line in .ci/run"
    words = shlex.split(found[0])
    assert len(words) == 1, "TEST_COMMAND must be one quoted string"
    return words[0]


def pins(path: Path) -> dict[str, str]:
    result: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-r "):
            continue
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line), (
            f"{path.name}: not pinned with ==: {raw!r}"
        )
        name, version = line.split("==")
        result[name.lower().replace("_", "-")] = version
    return result


def test_readme_and_ci_run_the_same_test_command() -> None:
    assert readme_test_command() == ci_test_command()
    assert (
        ci_test_command()
        == "pip install torch==2.13.0 && pip install -r requirements-dev.txt && python -m pytest"
    )


def test_readme_start_command() -> None:
    assert (
        "pip install torch==2.13.0 && pip install -r requirements.txt && python app.py" in readme_code_lines()
    )
    assert "http://127.0.0.1:7860" in README.read_text(encoding="utf-8")


def test_readme_space_front_matter() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.startswith("---\ntitle: PersonaPlex Live\n")
    front = text.split("---\n", 2)[1]
    for line in ("sdk: gradio", "sdk_version: 5.50.0", "app_file: app.py", "suggested_hardware: a100-large"):
        assert line in front.splitlines()
    # The front page's sections, in this order; the manual is in docs/.
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == [
        "## Quick start",
        "## The page",
        "## Call it from code",
        "## Running on your own GPU box",
        "## Hosting as a Hugging Face Space",
        "## Offline CLI",
        "## Architecture",
        "## Documentation",
    ]
    for door in ("### The Realtime API", "### GPT-Live", "### Coming from NVIDIA's server", "### Agent frameworks"):
        assert door in text.splitlines(), door


def test_the_readme_links_every_docs_page() -> None:
    text = README.read_text(encoding="utf-8")
    for page in sorted(DOCS.glob("*.md")):
        assert f"](docs/{page.name})" in text, page.name
    assert "](BENCHMARKS.md)" in text


def test_ci_run_script() -> None:
    text = CI_RUN.read_text(encoding="utf-8")
    assert os.access(CI_RUN, os.X_OK), ".ci/run must be executable"
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert 'bash -c "$TEST_COMMAND"' in text
    assert '"$rc" -eq 5' in text  # pytest's "no tests collected" must fail CI
    assert "chromium espeak-ng sox" in text


def test_requirements_are_pinned() -> None:
    runtime = pins(ROOT / "requirements.txt")
    assert runtime["torch"] == "2.13.0"
    assert runtime["gradio"] == "5.50.0"
    assert runtime["fastrtc"] == "0.0.34"
    for name in (
        "numpy",
        "safetensors",
        "sentencepiece",
        "huggingface-hub",
        "pyloudnorm",
        "soundfile",
        "tqdm",
        "av",
        "protobuf",
    ):
        assert name in runtime, name
    dev_text = (ROOT / "requirements-dev.txt").read_text(encoding="utf-8")
    assert "-r requirements.txt" in dev_text.splitlines()
    dev = pins(ROOT / "requirements-dev.txt")
    for name in ("pytest", "pytest-asyncio", "playwright", "aiohttp", "httpx", "ruff"):
        assert name in dev, name
    assert not set(dev) & set(runtime), "requirements-dev.txt repeats a runtime pin"


def test_space_sdk_version_matches_the_gradio_pin() -> None:
    front = README.read_text(encoding="utf-8").split("---\n", 2)[1]
    sdk = re.search(r"^sdk_version: (\S+)$", front, flags=re.M)
    assert sdk and sdk.group(1) == pins(ROOT / "requirements.txt")["gradio"]


def doc_section(path: Path, title: str) -> str:
    """The `## title` section of a Markdown file, up to the next `## ` heading."""
    text = path.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_readme_flags_table_lists_every_app_setting() -> None:
    from personaplex_demo.cli.config import OTHER_ENV, AppConfig, specs

    section = doc_section(DOCS / "configuration.md", "Flags and environment")
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `--"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    fields = specs(AppConfig)
    assert set(rows) == {f"`{s.flag}`" for s in fields}, "docs/configuration.md's table and AppConfig list different flags"
    for spec in fields:
        _, env, default, meaning = rows[f"`{spec.flag}`"]
        assert env.split()[0] == f"`{spec.option.env}`", spec.flag
        assert default == f"`{spec.shown(spec.default)}`", spec.flag
        assert meaning, spec.flag
    for name in OTHER_ENV:
        assert f"`{name}" in section, name


def _documented(section: str, keys) -> list[str]:
    return [k for k in keys if f"`{k}`" not in section]


def test_readme_documents_every_transcript_field(tmp_path) -> None:
    import json

    import numpy as np

    from personaplex_demo.cli.offline import Conversation, transcript_json
    from personaplex_demo.engine.pcm import SamplingParams
    from personaplex_demo.serving.room import END_MESSAGES
    from personaplex_demo.web.handler import CallRequest
    from personaplex_demo.web.recording import CallRecording

    section = doc_section(DOCS / "transcripts.md", "Transcripts")
    offline = transcript_json(Conversation(np.zeros(1920, np.float32), ["hi"]), "tiny", "NATF2", "p", 1,
                              SamplingParams(seed=1), 0.08)
    assert not _documented(section, [*offline, *offline["sampling"], *offline["frames"][0]])
    rec = CallRecording(tmp_path / "call", CallRequest("NATF2", "p", SamplingParams(seed=1)).recording_meta("c", "tiny"))
    rec.add_caller(np.zeros(1920, np.int16))
    rec.add_agent(np.zeros(1920, np.float32), "hi")
    page = json.loads(rec.finish("hangup").transcript.read_text(encoding="utf-8"))
    assert not _documented(section, [*page, *page["sampling"], *page["segments"][0]])
    assert json.dumps(page["channels"]) in section
    # How a call can end: a queued call that times out never goes live, so it has no recording.
    assert not _documented(section, ["hangup", *END_MESSAGES.keys() - {"queue_timeout", "not_reading"}])


def test_the_readme_recipes_for_agent_frameworks_are_what_their_tests_run():
    """README's pipecat and LiveKit recipes use the calls tests/clients makes against the app."""
    text = README.read_text(encoding="utf-8")
    clients = "".join((ROOT / "tests" / "clients" / name).read_text() for name in ("pipecat_agent.py",
                                                                                   "livekit_agent.py"))
    for call in ("OpenAIRealtimeLLMService(api_key=", "OpenAILiveLLMService(api_key=", "events.AudioOutput(voice=",
                 "openai.realtime.RealtimeModel(base_url=", "openai.realtime.GPTLiveModel(base_url=",
                 "AgentSession(llm=model)", "system_instruction=", "text_prompt=", "livekit-plugins-nvidia"):
        assert call in text and call in clients, call
