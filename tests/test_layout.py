"""The package's shape: imports run one way between the sub-packages, modules and functions stay small."""

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_normswap


PACKAGE = Path(hf_normswap.__file__).parent
# Each part may import the parts on its own level or below, never above.
LEVELS = {
    "checkpoint": 0,
    "devices": 0,
    "memory": 0,
    "option_rules": 0,
    "records": 0,
    "tasks": 0,
    "model": 1,
    "probes": 2,
    "convert": 3,
    "sharding": 3,
    "heal": 4,
    "compare": 5,
    "hub": 6,
    "cli": 7,
    "__init__": 7,
}
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports explicitly (a package's `__init__` when a name comes from it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_normswap"):
            found.add(node.module)
    return {target for target in found if target in known and target != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def level(name: str) -> int:
    parts = name.split(".")
    return LEVELS["__init__"] if len(parts) == 1 else LEVELS[parts[1]]


def test_imports_run_one_way():
    edges = graph()
    upward = [(a, b) for a, targets in edges.items() for b in targets if level(b) > level(a)]
    assert not upward, upward


def test_no_import_cycle():
    edges, done, path = graph(), set(), []

    def visit(name):
        if name in path:
            raise AssertionError(" -> ".join(path[path.index(name) :] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(edges[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in edges:
        visit(name)


@pytest.mark.parametrize("name", sorted(modules()))
def test_modules_and_functions_are_small(name):
    path = modules()[name]
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{path}: {len(source.splitlines())} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and not (
            name.startswith("hf_normswap.model.") and node.name == "forward"
        ):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{path}:{node.lineno} {node.name}: {length} lines"


def test_the_command_line_imports_no_comparison_runner():
    """Every process of a healing imports the command line: evaluate and matplotlib (55 MiB) wait for a comparison."""
    code = "import sys, hf_normswap.cli; print(sorted({'evaluate', 'matplotlib'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_everything_the_package_imports_is_declared():
    """Each third-party module the package imports comes from a distribution that pyproject.toml declares, as a
    dependency or in an extra (an optional feature's: GGUF files, LoRA, the demos)."""
    declared = {
        re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        for requirement in importlib.metadata.requires("hf-normswap")
    }
    distributions = importlib.metadata.packages_distributions()
    undeclared = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {"hf_normswap"}:
                providers = {name.lower().replace("_", "-") for name in distributions.get(top, [top])}
                if not providers & declared:
                    undeclared.add(f"{top} ({path.name})")
    assert not undeclared, sorted(undeclared)


def test_the_package_exports_every_head_of_the_registry():
    """`hf_normswap` exports each NormSwap head class the registry (`model.heads.HEAD_CLASSES`) declares, and the
    Auto classes load each for a NormSwap configuration."""
    from transformers import AutoConfig

    from hf_normswap.model.heads import HEAD_CLASSES, NATIVE_AUTO_CLASSES

    for head, model_class in HEAD_CLASSES.items():
        name = model_class.__name__
        assert name in hf_normswap.__all__ and getattr(hf_normswap, name) is model_class
        assert NATIVE_AUTO_CLASSES[head]._model_mapping[hf_normswap.NormSwapConfig] is model_class
    assert AutoConfig.for_model("normswap").__class__ is hf_normswap.NormSwapConfig
