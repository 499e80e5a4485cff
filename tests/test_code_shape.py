"""The package stays easy to hold in one's head: small modules, classes and functions, no import
circle, the layers that must stay free of torch free of it, and ruff clean (docs/design-notes.md
§ Layout)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "personaplex_demo"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 60
MAX_TOP_LEVEL_MODULES = 6
# Folders whose every module must import without torch: they run in processes that never load
# the model (the page's process with engine processes, media workers) or sit between the doors
# and the room. orchestration/ starts both sides of the process boundary: its engine side loads the model.
TORCH_FREE_FOLDERS = ("serving", "web", "rtc", "procs", "api")
TORCH_FREE_MODULES = ("orchestration.media_worker", "orchestration.media_workers", "orchestration.page_relay",
                      "cli.app", "cli.preflight", "cli.lifecycle", "frame", "errors",
                      "call_settings", "logs", "addresses", "runtime.facts")


def parse(source: str) -> ast.Module:
    # CPython 3.11 counts the AST constructor's recursion per interpreter, not per thread, so a
    # parse on a thread that an earlier test left running can fail this one with a spurious
    # "AST constructor recursion depth mismatch" (python/cpython#106905); the next try succeeds.
    for attempt in range(3):
        try:
            return ast.parse(source)
        except SystemError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def test_no_module_over_400_lines_no_class_over_250_no_function_over_60():
    too_long = []
    for path in package_modules().values():
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT)
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(parse(source)):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_long.append(f"{name}: class {node.name}, {lines} lines")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                too_long.append(f"{name}:{node.lineno}: function {node.name}, {lines} lines")
    assert not too_long, "\n".join(too_long)


def test_a_handful_of_top_level_modules_the_rest_in_folders():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def imported_modules(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Package modules that `path` imports, at any depth: lazy imports and those for type checking too
    (a circle only a type checker walks is still two modules that cannot be read apart)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
                target = ".".join(p for p in (base, node.module or "") if p)
                found.update(c for c in (target, *(f"{target}.{a.name}" for a in node.names)) if c in known)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in known)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(parse(path.read_text(encoding="utf-8")).body)
    found.discard(name)
    return found


def test_no_import_circle_in_the_package():
    modules = package_modules()
    graph = {name: imported_modules(path, name, modules) for name, path in modules.items()}
    circles = []
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def walk(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append(" -> ".join(trail[trail.index(target):] + [name, target]))
            elif target not in state:
                walk(target, trail + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    assert not circles, "\n".join(circles)


# The layers, bottom to top: the folders each folder may import from ("" is the package's top-level
# modules, shared by all). The doors (web/ the page's, api/ the sockets') stand side by side on the
# room and never import each other; procs/, the process plumbing, sits below them, and
# orchestration/, which hosts them in processes, above them.
MAY_IMPORT = {
    "": set(),
    "model": {""},
    "engine": {"", "model"},
    "runtime": {"", "model", "engine", "serving"},
    "serving": {"", "engine"},  # the engine's type, for a type checker only
    "procs": {"", "serving"},
    "rtc": {""},
    "web": {"", "serving", "runtime", "rtc"},
    "api": {"", "serving", "runtime"},
    "orchestration": {"", "serving", "runtime", "procs", "rtc", "web", "api"},
    "cli": {"", "model", "engine", "runtime", "serving", "procs", "rtc", "web", "api", "orchestration"},
}


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def test_each_layer_imports_only_the_layers_below_it_and_no_door_another_door():
    modules = package_modules()
    assert {folder_of(name) for name in modules} == set(MAY_IMPORT), "a folder without its place in MAY_IMPORT"
    wrong = []
    for name, path in modules.items():
        for target in imported_modules(path, name, modules):
            if folder_of(target) != folder_of(name) and folder_of(target) not in MAY_IMPORT[folder_of(name)]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_torch_free_layers_do_not_import_torch():
    # The room, the doors and the media side move numpy arrays only; torch stays in the engine and
    # in the processes that load the model. One fresh interpreter imports them in turn and names
    # the first after which torch is loaded: that module, or one it imports, pulls torch in.
    modules = package_modules()
    inner = {name: name.removeprefix("personaplex_demo.") for name in modules}
    names = [name for name, rest in inner.items() if rest.split(".")[0] in TORCH_FREE_FOLDERS or rest in TORCH_FREE_MODULES]
    assert len(names) > 20, names
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n"
            "        sys.exit(f'importing {name} imported torch')\n")
    out = subprocess.run([sys.executable, "-c", code, *names], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_media_worker_checks_a_persona_without_loading_torch(tiny_repo):
    # A socket door checks the caller's persona on the worker's event loop: importing torch there, on
    # the first call, would stall every call of that worker for seconds.
    code = ("import sys\n"
            "from personaplex_demo.runtime.facts import EngineFacts\n"
            "facts = EngineFacts({'voice_names': ['NATF2'], 'max_persona_tokens': 512, 'tokenizer_path': sys.argv[1]})\n"
            "assert facts.persona_tokens('You enjoy a good conversation.')\n"
            "facts.validate_request('NATF2', 'You are a patient librarian.', __import__('personaplex_demo.call_settings',"
            " fromlist=['SamplingParams']).SamplingParams())\n"
            "sys.exit('checking a persona imported torch' if 'torch' in sys.modules else 0)\n")
    tokenizer = next(tiny_repo.glob("tokenizer*.model"))
    out = subprocess.run([sys.executable, "-c", code, str(tokenizer)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_ruff_is_clean():
    # requirements-dev.txt pins ruff, so the README's test command lints as CI does.
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
