"""Model resolution (docs/model.md § Files): Hub download, the tiny fallback, and secret redaction."""

from __future__ import annotations

import importlib
import logging
import sys
import types
from pathlib import Path

import pytest
from huggingface_hub.errors import LocalEntryNotFoundError

from personaplex_demo.errors import CheckpointError, ModelDownloadError
from personaplex_demo.logs import SecretFilter, install_secret_filter, redact_secrets
from personaplex_demo.model.config import ModelFiles
from personaplex_demo.runtime import hub
from personaplex_demo.runtime.hub import resolve_model

FAKE_TOKEN = "hf_FAKEfakeFAKEfakeFAKEfakeFAKEfake1234"
FILES = ModelFiles()


@pytest.fixture(autouse=True)
def _no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "CLOUDFLARE_TURN_KEY_API_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    # No stored login from this machine may leak into the tests.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


@pytest.fixture()
def tiny_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path | None]:
    """Use the real `ensure_tiny_repo` when the module exists; otherwise a stand-in."""
    calls: list[Path | None] = []
    try:
        real = importlib.import_module("personaplex_demo.runtime.tiny").ensure_tiny_repo
    except ImportError:
        real = None

    def ensure_tiny_repo(cache_dir: Path | None = None) -> Path:
        calls.append(cache_dir)
        if real is not None:
            return real(cache_dir)
        directory = tmp_path / "tiny-repo"
        directory.mkdir(exist_ok=True)
        return directory

    module = types.ModuleType("personaplex_demo.runtime.tiny")
    module.ensure_tiny_repo = ensure_tiny_repo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "personaplex_demo.runtime.tiny", module)
    return calls


def failing_download(exc: Exception, seen: list[str] | None = None):
    def download(repo_id: str, filename: str, **kwargs: object) -> str:
        if seen is not None:
            seen.append(filename)
        raise exc

    return download


def test_offline_auto_falls_back_to_tiny(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_calls: list[Path | None]
) -> None:
    # The real hf_hub_download: with HF_HUB_OFFLINE=1 and an empty cache it must fail at once.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("auto", cache_dir=tmp_path / "cache")
    assert source.is_tiny and source.name == "tiny"
    assert tiny_calls == [tmp_path / "cache"]
    assert source.fallback_reason is not None
    assert "nvidia/personaplex-7b-v1" in source.fallback_reason
    assert "HF_HUB_OFFLINE" in source.fallback_reason and "tiny offline model" in source.fallback_reason


def test_failed_download_falls_back_with_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_calls: list[Path | None]
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(hub, "hf_hub_download", failing_download(LocalEntryNotFoundError("no network"), seen))
    source = resolve_model("auto", cache_dir=tmp_path)
    assert source.is_tiny and tiny_calls == [tmp_path]
    assert seen == [FILES.tokenizer]  # a small file first: no 16 GB download before a 401
    assert "HF_TOKEN is not set" in (source.fallback_reason or "")


def test_explicit_real_model_raises(monkeypatch: pytest.MonkeyPatch, tiny_calls: list[Path | None]) -> None:
    monkeypatch.setattr(hub, "hf_hub_download", failing_download(LocalEntryNotFoundError("no network")))
    with pytest.raises(ModelDownloadError) as info:
        resolve_model("personaplex-7b-v1")
    message = str(info.value)
    assert "nvidia/personaplex-7b-v1" in message and "HF_TOKEN" in message and "--model tiny" in message
    assert isinstance(info.value, CheckpointError)
    assert tiny_calls == []  # never a silent fallback


def test_token_never_appears_in_reasons(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_calls: list[Path | None]
) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    boom = RuntimeError(f"401 Client Error for Authorization: Bearer {FAKE_TOKEN}")
    monkeypatch.setattr(hub, "hf_hub_download", failing_download(boom))
    source = resolve_model("auto", cache_dir=tmp_path)
    assert source.fallback_reason and FAKE_TOKEN not in source.fallback_reason
    with pytest.raises(ModelDownloadError) as info:
        resolve_model("personaplex-7b-v1")
    assert FAKE_TOKEN not in str(info.value)


def test_tiny_is_resolved_without_the_hub(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_calls: list[Path | None]
) -> None:
    monkeypatch.setattr(hub, "hf_hub_download", failing_download(AssertionError("must not be called")))
    source = resolve_model("tiny", cache_dir=tmp_path)
    assert source.is_tiny and source.fallback_reason is None and tiny_calls == [tmp_path]


def test_unknown_model_name() -> None:
    with pytest.raises(ValueError, match="auto, personaplex-7b-v1, tiny"):
        resolve_model("gpt-5")


def test_real_download_pins_one_snapshot_and_reports_progress(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    snapshot = tmp_path / "models--nvidia--personaplex-7b-v1" / "snapshots" / "abc123"
    calls: list[tuple[str, str | None, bool]] = []

    def download(
        repo_id: str,
        filename: str,
        *,
        revision: str | None = None,
        local_files_only: bool = False,
        tqdm_class: type | None = None,
        **kwargs: object,
    ) -> str:
        calls.append((filename, revision, local_files_only))
        if tqdm_class is not None:  # what huggingface_hub does while it streams a file
            with tqdm_class(total=1000, disable=True) as bar:
                for _ in range(4):
                    bar.update(250)
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / filename).write_bytes(b"x")
        return str(snapshot / filename)

    reports: list[tuple[str, float]] = []
    monkeypatch.setattr(hub, "hf_hub_download", download)
    source = resolve_model(
        "personaplex-7b-v1", cache_dir=tmp_path, progress=lambda m, f: reports.append((m, f))
    )
    assert not source.is_tiny and source.name == "personaplex-7b-v1" and source.fallback_reason is None
    assert source.directory == snapshot
    assert source.lm_path == snapshot / FILES.lm and source.voices_path.exists()
    assert [c[0] for c in calls] == [FILES.tokenizer, FILES.voices, FILES.mimi, FILES.lm]
    assert [c[1] for c in calls] == [None, "abc123", "abc123", "abc123"]
    assert not any(c[2] for c in calls)
    fractions = [f for _, f in reports]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and all(0.0 <= f <= 1.0 for f in fractions)
    assert any("model.safetensors" in m for m, _ in reports)


def test_offline_uses_only_the_local_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    flags: list[object] = []

    def download(repo_id: str, filename: str, *, local_files_only: bool = False, **kwargs: object) -> str:
        flags.append(local_files_only)
        (tmp_path / filename).write_bytes(b"x")
        return str(tmp_path / filename)

    monkeypatch.setattr(hub, "hf_hub_download", download)
    assert resolve_model("auto").directory == tmp_path
    assert flags == [True] * 4


# -- secrets ----------------------------------------------------------------------------------


def test_redact_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("CLOUDFLARE_TURN_KEY_API_TOKEN", "cf-secret-value-42")
    text = (
        f"token={FAKE_TOKEN} turn=cf-secret-value-42 other=hf_{'A' * 30} Authorization: Bearer abc.def.ghi123"
    )
    out = redact_secrets(text)
    assert FAKE_TOKEN not in out and "cf-secret-value-42" not in out and "hf_AAAA" not in out
    assert "abc.def.ghi123" not in out and out.count("***") == 4
    assert redact_secrets("hf_hub_download is fine") == "hf_hub_download is fine"


def test_secret_filter_scrubs_log_records(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "using token %s for %s", (FAKE_TOKEN, "repo"), None
    )
    assert SecretFilter().filter(record) is True
    assert record.getMessage() == "using token *** for repo"


def test_installed_filter_covers_messages_and_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    import io

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("personaplex_demo.test_secret")
    log.addHandler(handler)
    log.propagate = False
    try:
        install_secret_filter(log)
        install_secret_filter(log)  # idempotent
        assert sum(isinstance(f, SecretFilter) for f in handler.filters) == 1
        log.warning("header Authorization=%s", FAKE_TOKEN)
        try:
            raise RuntimeError(f"bad token {FAKE_TOKEN}")
        except RuntimeError:
            log.exception("download failed")
    finally:
        log.removeHandler(handler)
    output = stream.getvalue()
    assert FAKE_TOKEN not in output
    assert "header Authorization=***" in output and "bad token ***" in output
