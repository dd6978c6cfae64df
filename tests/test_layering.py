"""Dependencies point down the flow (DESIGN.md, "Layout: packages by stage"): every import of every
module of ``extract`` (at the top, inside functions and under ``TYPE_CHECKING`` alike) is read with
``ast`` and checked against the stages each package may import. No module is imported: the test is
fast and sees lazy imports too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "extract"

# what each part of ``extract`` may import of the others (itself always). ``errors`` is every stage's:
# the one module of error types, ``processes`` every stage's that runs under a launcher: the one object of
# the job's processes (data/, models/ and the store type against it). The order: names < processes <
# store < read < analysis; names < capture; data and models build on names and the store; job and cli
# put it all together.
ANYTHING = None
ALLOWED: dict[str, set[str] | None] = {
    "errors": {"names"},  # only inside PoolShapeError, for the shape in its message (names imports errors)
    "names": {"errors"},
    "processes": {"names", "errors"},
    "store": {"names", "errors", "processes"},
    "read": {"names", "errors", "store"},
    "analysis": {"names", "errors", "store", "read"},
    "capture": {"names", "errors"},
    "data": {"names", "errors", "store", "processes"},
    "models": {"names", "errors", "store", "processes"},
    "job": ANYTHING,
    "cli": ANYTHING,
    # the public API (lazy), ``python -m extract`` and the ``python -m extract.X`` shims over cli/
    "extract": ANYTHING,
    "__main__": ANYTHING,
    "compare": {"cli"},
    "export": {"cli"},
    "probe": {"cli"},
    "report": {"cli"},
    "top": {"cli"},
    "verify": {"cli"},
}

# Imports that break the order above, each with why it stays (module, the part of extract it imports).
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    # The report's sample images and texts reopen the job's data source (imported inside the functions
    # that need it, only when a report shows samples): a use of data's machinery, not of a name.
    ("extract.analysis.images", "data"): "report: sample images from the job's data source",
    ("extract.analysis.texts", "data"): "report: sample texts from the job's data source",
    # ``hidden_states.N`` aliases are found by running the model once under ``Capture`` and matching
    # the outputs, and TransformerLens's names by one forward that tells tuples from tensors (the
    # table itself is capture's): the hook machinery, which the model source needs, not a name.
    ("extract.models.hf_hub", "capture"): "hidden_states.N and TransformerLens aliases found with Capture",
}

NAMES_MAY_IMPORT = {"numpy", "torch"}  # besides the standard library: names/ imports no other package


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """The part of ``extract`` a module belongs to: its package (``store``), or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "extract"


def _type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations, never run."""
    blocks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    return {id(inner) for block in blocks for statement in block.body for inner in ast.walk(statement)}


def _imports(path: Path, annotations: bool = True) -> list[str]:
    """Every module ``path`` imports (absolute names), at any depth of its code; ``annotations``: with
    those under ``if TYPE_CHECKING:``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skipped = set() if annotations else _type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if node.module is None or name == "extract":  # ``from . import x``: x may be a module
                found.extend(f"{name}.{alias.name}" for alias in node.names)
            else:
                found.append(name)
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_part_of_the_package_has_its_rule():
    parts = {_part(_module_name(path)) for path in MODULES}
    assert parts - set(ALLOWED) == set(), "a new package or module: say what it may import in ALLOWED"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_imports_point_down_the_flow(path: Path):
    module = _module_name(path)
    part = _part(module)
    allowed = ALLOWED[part]
    if allowed is ANYTHING:
        return
    wrong = sorted(
        {
            target
            for target in (name for name in _imports(path) if name.split(".")[0] == "extract")
            if (other := _part(target)) != part and other not in allowed and (module, other) not in KNOWN_EXCEPTIONS
        }
    )
    assert not wrong, f"{module} ({part}) imports {', '.join(wrong)}; {part} may import {sorted(allowed)}"


def test_the_known_exceptions_still_exist():
    """An exception that was fixed leaves the list, so that the list says what is left."""
    found = {
        (_module_name(path), _part(name)) for path in MODULES for name in _imports(path) if name.startswith("extract")
    }
    assert set(KNOWN_EXCEPTIONS) <= found, sorted(set(KNOWN_EXCEPTIONS) - found)


@pytest.mark.parametrize("path", sorted((PACKAGE / "names").rglob("*.py")), ids=lambda p: p.name)
def test_names_import_only_the_standard_library_numpy_and_torch(path: Path):
    outside = {
        top
        for name in _imports(path)
        if (top := name.split(".")[0]) != "extract"
        and top not in sys.stdlib_module_names
        and top not in NAMES_MAY_IMPORT
        and top != "__future__"
    }
    assert not outside, f"extract/names/{path.name} imports {sorted(outside)}"


@pytest.mark.parametrize("stage", ["store", "read", "analysis"])
def test_the_store_the_reader_and_the_analysis_never_import_capture(stage: str):
    """Their layer names, layouts and pools come from ``extract.names``."""
    importers = sorted(
        _module_name(path)
        for path in (PACKAGE / stage).rglob("*.py")
        if any(_part(name) == "capture" for name in _imports(path) if name.startswith("extract"))
    )
    assert not importers, importers


def test_no_two_modules_import_each_other_even_lazily():
    """An import inside a function still makes a cycle (``models.hf`` and ``models.hf_text`` had one):
    what two modules share goes into a third. Imports for annotations alone do not run, and do not count."""
    modules = {_module_name(path): path for path in MODULES}
    graph = {
        name: {target for target in _imports(path, annotations=False) if target in modules and target != name}
        for name, path in modules.items()
    }
    cycles = []
    for start in graph:  # a path back to ``start`` through modules that sort after it: each cycle once
        stack = [(start, [start])]
        seen = {start}
        while stack:
            node, trail = stack.pop()
            for target in sorted(graph[node]):
                if target == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif target > start and target not in seen:
                    seen.add(target)
                    stack.append((target, [*trail, target]))
    assert not cycles, cycles


def test_below_the_runner_the_processes_are_one_object():
    """accelerate's ``PartialState`` is built in ``job/dist.py`` and wrapped in ``extract.processes.Processes``;
    every other module takes that object (its rank, world, mesh, barrier and broadcast), never the raw state."""
    holders = sorted(
        _module_name(path)
        for path in MODULES
        if _module_name(path) not in {"extract.job.dist", "extract.processes"}
        and "PartialState" in path.read_text(encoding="utf-8")
    )
    assert not holders, holders


def test_the_process_object_imports_no_stage_and_nothing_heavy_at_the_top():
    """Low in the flow, and light: data/, models/ and the store import it for annotations."""
    tree = ast.parse((PACKAGE / "processes.py").read_text(encoding="utf-8"))
    top = {
        alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert top <= {"__future__", "dataclasses", "typing"}, top
