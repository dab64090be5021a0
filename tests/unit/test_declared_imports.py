"""Every import in the project resolves to the standard library, the project, or a declared package.

A fresh venv holds only what `pyproject.toml` names (the README installs `.[test]`), so an import that
works here only because an earlier session installed the package by hand fails a new user at collection.
This reads every `import` statement with `ast` (function-level and guarded ones too), maps each top-level
module to the distribution that installed it (`importlib.metadata.packages_distributions`), and asks that
the distribution be declared: `dependencies` or an extra for `moeserve/` and `launch/`, `dependencies` or
the `test` extra for `tests/`. Optional accelerators are listed below with why; their imports must be
guarded where they are used.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = {"moeserve", "launch", "conf"}

# Imported behind a check (try/except ImportError, importorskip, or a config switch); never required.
OPTIONAL = {
    "deep_ep": "DeepEP dispatcher, built from source on GPU machines (ep/deepep.py)",
    "deep_gemm": "DeepGEMM FP8 grouped GEMM, when installed",
    "flashinfer": "flashinfer attention backend (the `gpu` extra)",
    "mooncake": "Mooncake transfer engine / fault-tolerant process group, when installed",
    "nixl": "NIXL transfer backend, when installed",
    "sglang_router": "SGLang's router, for router tests when installed",
    "llguidance": "a second grammar engine that bench.grammar_mask compares against, when installed",
}


def _req_name(spec: str) -> str:
    return re.split(r"[\s<>=!~\[;@]", spec.strip(), maxsplit=1)[0]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], set[str]]:
    """(every declared distribution, those a `.[test]` install brings)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {_normalize(_req_name(s)) for s in project["dependencies"]}
    extras = project.get("optional-dependencies", {})
    every = base | {_normalize(_req_name(s)) for specs in extras.values() for s in specs}
    return every, base | {_normalize(_req_name(s)) for s in extras.get("test", [])}


def _local_test_modules() -> set[str]:
    tests = ROOT / "tests"
    names = {p.stem for p in tests.rglob("*.py")}
    return names | {p.name for p in tests.rglob("*") if p.is_dir()}


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]


def undeclared_imports(root: Path = ROOT) -> list[str]:
    """'file:line: module (why)' for each import that a fresh `.[test]` install may not satisfy."""
    every, with_test = _declared()
    dists = md.packages_distributions()
    local_tests = _local_test_modules()
    problems = []
    for top in ("moeserve", "launch", "tests"):
        allowed = with_test if top == "tests" else every
        for path in sorted((root / top).rglob("*.py")):
            for lineno, mod in _imports(path):
                if mod in sys.stdlib_module_names or mod in PROJECT or mod in OPTIONAL:
                    continue
                if top == "tests" and mod in local_tests:
                    continue
                owners = {_normalize(d) for d in dists.get(mod, [])}
                if not owners:
                    why = "not installed and not in OPTIONAL"
                elif owners & allowed:
                    continue
                else:
                    why = f"installed by {sorted(owners)}, which pyproject.toml does not declare"
                problems.append(f"{path.relative_to(root)}:{lineno}: {mod} ({why})")
    return problems


def test_every_import_is_declared():
    problems = undeclared_imports()
    assert not problems, "imports a fresh venv may lack:\n" + "\n".join(problems)


def test_the_check_names_a_planted_undeclared_import(tmp_path):
    # markupsafe comes with jinja2 but is not declared: a planted import of it must be reported.
    for top in ("moeserve", "launch", "tests"):
        (tmp_path / top).mkdir()
    (tmp_path / "tests" / "test_planted.py").write_text("import json\nimport markupsafe\n")
    (tmp_path / "moeserve" / "ok.py").write_text("import torch\nfrom moeserve import x\n")
    assert undeclared_imports(tmp_path) == [
        "tests/test_planted.py:2: markupsafe (installed by ['markupsafe'], which pyproject.toml does "
        "not declare)"
    ]
