"""References from the code to the project's docs name sections that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# "docs/model.md § The ring rule", "engine.md § Recycle", "model.md § Depformer", ...
REFERENCE = re.compile(r"(?:docs/)?\b([\w-]+\.md) § ([A-Za-z][\w -]*[\w])")
# Any "<something> §" reference at all, to catch ones that point outside the repository.
ANY_REFERENCE = re.compile(r"([\w./-]+) §")


def sources() -> list[Path]:
    files = [*ROOT.glob("personaplex_demo/**/*.py"), *ROOT.glob("bench/*.py"), *ROOT.glob("tests/*.py"),
             *ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    return [f for f in files if f.is_file()]


def headings(doc: Path) -> set[str]:
    """Each heading, also without a trailing "(file.py)" note, as references may leave it out."""
    found = {line.lstrip("#").strip() for line in doc.read_text(encoding="utf-8").splitlines() if line.startswith("#")}
    return found | {re.sub(r" \([^)]*\)$", "", h) for h in found}


def test_every_docs_section_reference_names_an_existing_heading():
    found, broken = 0, []
    for path in sources():
        for name, section in REFERENCE.findall(path.read_text(encoding="utf-8")):
            doc = ROOT / "docs" / name
            found += 1
            if not doc.is_file() or not any(h == section or section.startswith(h + " ")
                                             for h in headings(doc)):
                broken.append(f"{path.relative_to(ROOT)}: {name} § {section}")
    assert found > 20, "the pattern no longer finds the references"
    assert not broken, "references to missing sections:\n" + "\n".join(broken)


def test_every_section_reference_points_into_the_repository():
    outside = []
    for path in sources():
        for target in ANY_REFERENCE.findall(path.read_text(encoding="utf-8")):
            name = Path(target).name
            if not ((ROOT / "docs" / name).is_file() or (ROOT / name).is_file()):
                outside.append(f"{path.relative_to(ROOT)}: {target} §")
    assert not outside, "references to documents that are not in the repository:\n" + "\n".join(outside)
