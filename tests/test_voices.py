"""Voice catalogue: official archive layout, safe extraction, strict `.pt` loading (docs/model.md § Files)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
import torch

from personaplex_demo.call_settings import DEFAULT_VOICE, VOICE_NAMES
from personaplex_demo.errors import CallerError, UnknownVoiceError, VoiceArchiveError, VoiceFileError
from personaplex_demo.runtime import voices
from personaplex_demo.runtime.tiny import tiny_voice_prompts
from personaplex_demo.runtime.voices import VoiceCatalog, write_voices_archive

DIM = 64


@pytest.fixture(scope="module")
def prompts() -> dict[str, dict[str, torch.Tensor]]:
    return tiny_voice_prompts(DIM)


@pytest.fixture()
def catalog(tmp_path: Path, prompts: dict[str, dict[str, torch.Tensor]]) -> VoiceCatalog:
    archive = write_voices_archive(tmp_path / "voices.tgz", prompts)
    return VoiceCatalog.from_archive(archive, tmp_path / "unpacked")


def test_voice_names() -> None:
    assert len(VOICE_NAMES) == 18 and len(set(VOICE_NAMES)) == 18
    assert VOICE_NAMES[:4] == ("NATF0", "NATF1", "NATF2", "NATF3")
    assert VOICE_NAMES[-1] == "VARM4"
    assert DEFAULT_VOICE == "NATF2" and DEFAULT_VOICE in VOICE_NAMES


def test_tiny_voice_prompts(prompts: dict[str, dict[str, torch.Tensor]]) -> None:
    assert list(prompts) == list(VOICE_NAMES)
    for index, (name, p) in enumerate(prompts.items()):
        assert p["embeddings"].shape == (4 + index % 5, 1, 1, DIM), name
        assert p["embeddings"].dtype == torch.float32
        assert p["cache"].shape == (1, 17, 4) and p["cache"].dtype == torch.long
        assert 0 <= int(p["cache"][:, 0].min()) and int(p["cache"][:, 0].max()) < 32000
        assert 0 <= int(p["cache"][:, 1:].min()) and int(p["cache"][:, 1:].max()) < 2048
    # Deterministic: the same seed gives the same tensors, another seed different ones.
    again = tiny_voice_prompts(DIM)
    assert all(torch.equal(again[n]["embeddings"], prompts[n]["embeddings"]) for n in VOICE_NAMES)
    other = tiny_voice_prompts(DIM, seed=1)
    assert not torch.equal(other["NATF0"]["embeddings"], prompts["NATF0"]["embeddings"])


def test_round_trip(
    catalog: VoiceCatalog, prompts: dict[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    assert catalog.names == sorted(VOICE_NAMES)
    assert "NATF2" in catalog.names
    for name in VOICE_NAMES:
        prompt = catalog.load(name)
        assert prompt.name == name
        assert torch.equal(prompt.embeddings, prompts[name]["embeddings"])
        assert torch.equal(prompt.cache, prompts[name]["cache"])
        assert prompt.length == prompts[name]["embeddings"].shape[0] and prompt.dim == DIM
    assert sorted(p.name for p in (tmp_path / "unpacked" / "voices").iterdir()) == sorted(
        f"{n}.pt" for n in VOICE_NAMES
    )


def test_archive_bytes_are_deterministic(tmp_path: Path, prompts: dict[str, dict[str, torch.Tensor]]) -> None:
    a = write_voices_archive(tmp_path / "a.tgz", prompts).read_bytes()
    b = write_voices_archive(tmp_path / "b.tgz", prompts).read_bytes()
    assert a == b


def test_load_casts_and_caches(catalog: VoiceCatalog) -> None:
    bf16 = catalog.load("NATM1", dtype=torch.bfloat16)
    assert bf16.embeddings.dtype == torch.bfloat16 and bf16.cache.dtype == torch.long
    assert catalog.load("NATM1", dtype=torch.bfloat16) is bf16
    assert catalog.load("NATM1", dtype=torch.float32) is not bf16
    with pytest.raises(VoiceFileError, match="dimension 64"):
        catalog.load("NATM1", dim=4096)


def test_unknown_voice_lists_valid_names(catalog: VoiceCatalog) -> None:
    with pytest.raises(UnknownVoiceError) as info:
        catalog.load("NOPE")
    message = str(info.value)
    assert "NOPE" in message
    assert all(name in message for name in VOICE_NAMES)
    assert isinstance(info.value, CallerError)


@pytest.mark.parametrize(
    "name",
    ["../../x", "voices/NATF0", "NATF0.pt", "..", "a\\b", "NATF0\x00", "", "x" * 65, "/etc/passwd", None, 3],
)
def test_path_like_names_are_refused(catalog: VoiceCatalog, name: object) -> None:
    with pytest.raises(UnknownVoiceError, match="Valid voices: NATF0"):
        catalog.load(name)  # type: ignore[arg-type]


# -- hostile archives -------------------------------------------------------------------------


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _good_voice() -> bytes:
    buf = io.BytesIO()
    torch.save(tiny_voice_prompts(8)["NATF0"], buf)
    return buf.getvalue()


def _device(name: str) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    return info, None


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (_link("voices/NATF1.pt", "/etc/passwd", tarfile.SYMTYPE), "link to an absolute path"),
        (_link("voices/NATF1.pt", "../../../evil.pt", tarfile.SYMTYPE), "would link to"),
        (_link("voices/NATF1.pt", "../../evil.pt", tarfile.LNKTYPE), "would link to"),
        (_file("../evil.pt"), "outside the destination"),
        (_file("voices/../../evil.pt"), "outside the destination"),
        (_device("voices/null.pt"), "special file"),
    ],
)
def test_unsafe_members_are_refused(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes | None], reason: str
) -> None:
    archive = _tar(tmp_path / "voices.tgz", [_file("voices/NATF0.pt", _good_voice()), member])
    target = tmp_path / "out" / "deep"
    with pytest.raises(VoiceArchiveError, match=reason) as info:
        VoiceCatalog.from_archive(archive, target)
    assert repr(member[0].name) in str(info.value)  # the message names the member
    # Checked before writing: not even the good member was extracted, and nothing escaped.
    assert not target.exists()
    assert not (tmp_path / "evil.pt").exists() and not (tmp_path / "out" / "evil.pt").exists()


def test_oversized_member_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(voices, "MAX_MEMBER_BYTES", 1000)
    archive = _tar(tmp_path / "voices.tgz", [_file("voices/NATF0.pt", b"\0" * 5000)])
    with pytest.raises(VoiceArchiveError, match="'voices/NATF0.pt'.*over the 1000-byte limit"):
        VoiceCatalog.from_archive(archive, tmp_path / "out")


def test_not_an_archive(tmp_path: Path) -> None:
    bad = tmp_path / "voices.tgz"
    bad.write_bytes(b"this is not a tar file")
    with pytest.raises(VoiceArchiveError, match="voices.tgz"):
        VoiceCatalog.from_archive(bad, tmp_path / "out")


def test_only_voices_pt_files_are_catalogued(tmp_path: Path) -> None:
    good = _good_voice()
    archive = _tar(
        tmp_path / "voices.tgz",
        [
            _file("./voices/NATF0.pt", good),
            _file("voices/VARM4.pt", good),
            _file("voices/README.txt", b"hello"),
            _file("voices/._NATF0.pt", b"resource fork"),
            _file("voices/sub/NATM0.pt", good),
            _file("other/NATM1.pt", good),
            _file("NATM2.pt", good),
            _file("/voices/NATM3.pt", good),  # the "data" filter makes it relative; not a voice member either
        ],
    )
    catalog = VoiceCatalog.from_archive(archive, tmp_path / "out")
    assert catalog.names == ["NATF0", "VARM4"]
    assert catalog.load("VARM4").embeddings.shape[-1] == 8
    with pytest.raises(VoiceArchiveError, match="no voices/NAME.pt"):
        VoiceCatalog.from_archive(_tar(tmp_path / "empty.tgz", [_file("x.txt")]), tmp_path / "out2")


# -- broken voice files -----------------------------------------------------------------------


class Exploit:
    """Unpickling this runs a shell command; weights_only loading must refuse it."""

    marker: Path

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def _catalog_with(tmp_path: Path, payload: object, raw: bytes | None = None) -> VoiceCatalog:
    folder = tmp_path / "voices"
    folder.mkdir(exist_ok=True)
    path = folder / "NATF0.pt"
    if raw is not None:
        path.write_bytes(raw)
    else:
        torch.save(payload, path)
    return VoiceCatalog({"NATF0": path})


def test_pickled_object_is_refused(tmp_path: Path) -> None:
    exploit = Exploit()
    exploit.marker = tmp_path / "pwned"
    catalog = _catalog_with(tmp_path, exploit)
    with pytest.raises(VoiceFileError, match="NATF0.pt.*weights_only"):
        catalog.load("NATF0")
    assert not exploit.marker.exists()


def test_pickled_object_inside_archive_is_refused(tmp_path: Path) -> None:
    exploit = Exploit()
    exploit.marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"embeddings": exploit, "cache": torch.zeros(1, 17, 4, dtype=torch.long)}, buf)
    archive = _tar(tmp_path / "voices.tgz", [_file("voices/NATF0.pt", buf.getvalue())])
    catalog = VoiceCatalog.from_archive(archive, tmp_path / "out")
    with pytest.raises(VoiceFileError, match="weights_only"):
        catalog.load("NATF0")
    assert not exploit.marker.exists()


def test_not_a_tensor_file(tmp_path: Path) -> None:
    catalog = _catalog_with(tmp_path, None, raw=b"\x00garbage" * 10)
    with pytest.raises(VoiceFileError, match="NATF0.pt"):
        catalog.load("NATF0")


GOOD_EMB = torch.zeros(5, 1, 1, 8)
GOOD_CACHE = torch.zeros(1, 17, 4, dtype=torch.long)


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ([GOOD_EMB, GOOD_CACHE], "expected a dict"),
        ({"embeddings": GOOD_EMB}, "missing key"),
        ({"cache": GOOD_CACHE}, "missing key"),
        ({"embeddings": torch.zeros(5, 8), "cache": GOOD_CACHE}, r"\[T, 1, 1, D\]"),
        ({"embeddings": torch.zeros(0, 1, 1, 8), "cache": GOOD_CACHE}, r"T >= 1"),
        ({"embeddings": torch.zeros(5, 2, 1, 8), "cache": GOOD_CACHE}, r"\[T, 1, 1, D\]"),
        ({"embeddings": torch.zeros(5, 1, 1, 8, dtype=torch.long), "cache": GOOD_CACHE}, "floating-point"),
        ({"embeddings": torch.full((5, 1, 1, 8), float("nan")), "cache": GOOD_CACHE}, "NaN"),
        ({"embeddings": GOOD_EMB, "cache": torch.zeros(1, 16, 4, dtype=torch.long)}, r"\[1, 17, 4\]"),
        ({"embeddings": GOOD_EMB, "cache": torch.zeros(1, 17, 4)}, "integer tensor"),
        ({"embeddings": GOOD_EMB, "cache": torch.full((1, 17, 4), 5000, dtype=torch.long)}, "out of range"),
        ({"embeddings": "not a tensor", "cache": GOOD_CACHE}, "floating-point tensor, got str"),
    ],
)
def test_wrong_contents_are_refused(tmp_path: Path, payload: object, problem: str) -> None:
    catalog = _catalog_with(tmp_path, payload)
    with pytest.raises(VoiceFileError, match=problem) as info:
        catalog.load("NATF0")
    assert "NATF0.pt" in str(info.value)


def test_int32_cache_is_widened(tmp_path: Path) -> None:
    catalog = _catalog_with(tmp_path, {"embeddings": GOOD_EMB.to(torch.bfloat16), "cache": GOOD_CACHE.int()})
    prompt = catalog.load("NATF0", dtype=torch.float32)
    assert prompt.cache.dtype == torch.long and prompt.embeddings.dtype == torch.float32
