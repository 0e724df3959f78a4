"""The loop's one-way data flow, enforced on the import graph.

Serving never imports trainers (it only emits events); trainers never import the web stack.
Orchestration (``rtrl/``: the CLI, the demo, benchmarks) and the simulated users, which are a client
of the gateway, may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WEB_STACK = ("fastapi", "uvicorn", "starlette", "serving")
SERVING_MAY_IMPORT = ("realtime_rl.events", "realtime_rl.bus", "realtime_rl.config")
# Clients/orchestrators of the gateway, not trainers: they start it or call it over HTTP.
TRAINER_SIDE_EXEMPT = {"realtime_rl/simusers.py"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_serving_never_imports_trainers():
    offenders = []
    for path in package_files("serving"):
        for name in imports_of(path):
            if name.startswith(("offline_rl", "realtime_rl")) and not name.startswith(SERVING_MAY_IMPORT):
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders


@pytest.mark.parametrize("package", ["offline_rl", "realtime_rl", "policy"])
def test_trainers_never_import_the_web_stack(package):
    offenders = []
    for path in package_files(package):
        rel = str(path.relative_to(ROOT))
        if rel in TRAINER_SIDE_EXEMPT or rel.endswith("cli.py"):
            continue
        for name in imports_of(path):
            if name.split(".")[0] in WEB_STACK:
                offenders.append(f"{rel} imports {name}")
    assert not offenders, offenders


def test_policy_depends_on_no_stage():
    offenders = []
    for path in package_files("policy"):
        rel = str(path.relative_to(ROOT))
        for name in imports_of(path):
            # The tiny model's tokenizer is trained on the task corpus: the one allowed edge.
            if name.startswith(("realtime_rl", "serving")) or (name.startswith("offline_rl")
                                                                and name != "offline_rl.tasks"):
                offenders.append(f"{rel} imports {name}")
    assert not offenders, offenders
