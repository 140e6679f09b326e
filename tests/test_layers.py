"""Imports flow one way: application -> stages -> core (issue 17), checked on the import graph.

- core (``gemline.lake``, ``locks``, ``errors``, ``hygiene``, ``beam_runner``, ``configtree``, ``gate``, ``increments``, ``metrics``, ``process``, ``supervisor``, ``tables``): imports no stage and no application
  module;
- stages (``ingest``, ``sequences``, ``features``, ``validation``, ``trainer``, ``kernels``): import the core, their
  own package, and of another stage only its typed records (``ingest.schema``, ``ingest.config``,
  ``sequences.schema``, ``sequences.config``, ``sequences.materialize``, ``features.definitions``) or a library stage: ``kernels`` (jagged
  ops) and ``features`` (point-in-time feature computation, which the build composes and whose tables it writes);
  never the application. The libraries themselves obey the same rule, so ``features`` never reaches into the
  build;
- application (``gemline.cli``, ``demo``, ``cluster``, ``config``): anything.

Every import counts, also one inside a function (late imports that dodge a cycle are the thing to find).
``KNOWN`` lists the imports against the direction that the tree still has, to be removed one by one (the
stages still take the root ``GemlineConfig``); a new one fails the test, and so does an entry of ``KNOWN`` that no
longer occurs, so the list only shrinks. In the spirit of TorchRec's code-quality tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("ingest", "sequences", "features", "validation", "trainer", "kernels")
CORE = {"gemline", "gemline.plots", "gemline.lake", "gemline.locks", "gemline.errors", "gemline.hygiene", "gemline.beam_runner", "gemline.configtree",
        "gemline.gate", "gemline.increments", "gemline.metrics", "gemline.polling", "gemline.process", "gemline.supervisor", "gemline.tables"}
LIBRARIES = ("kernels", "features")
# sequences.materialize: the pointer layout of ``examples`` (issue 15) is read by rebuilding its lists
# from ``history``; that reading rule is part of the examples contract, like the schema; sequences.history_tail
# is the same rule for a long-running reader (the history read by increments, compacted).
RECORDS = {"ingest.schema", "ingest.config", "sequences.schema", "sequences.config", "sequences.materialize",
           "sequences.history_tail", "sequences.pointer_summaries", "sequences.sorted_history", "features.definitions"}

KNOWN: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("gemline", *STAGES):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _owner(module: str, modules: dict[str, Path]) -> str | None:
    """The first-party module an import names (``a.b.c`` -> the longest known prefix), or None."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _layer(module: str) -> str:
    if module in CORE:
        return "core"
    return "app" if module.startswith("gemline.") else "stage"


def _against_direction(importer: str, imported: str) -> bool:
    source, target = _layer(importer), _layer(imported)
    if source == "core":
        return target != "core"
    if source == "stage":
        if target == "app":
            return True
        same_package = importer.split(".")[0] == imported.split(".")[0]
        return target == "stage" and not same_package and imported not in RECORDS and imported.split(".")[0] not in LIBRARIES
    return False


def _violations() -> set[tuple[str, str]]:
    modules = _modules()
    found = set()
    for importer, path in modules.items():
        for name in _imports(path):
            imported = _owner(name, modules)
            if imported is not None and imported != importer and _against_direction(importer, imported):
                found.add((importer, imported))
    return found


def test_imports_flow_from_application_to_stages_to_core():
    new = _violations() - KNOWN
    assert not new, f"imports against the layer direction (application -> stages -> core): {sorted(new)}"


def test_known_exceptions_only_shrink():
    gone = KNOWN - _violations()
    assert not gone, f"these imports are gone: remove them from KNOWN in {__file__}: {sorted(gone)}"


def test_the_check_sees_a_violation():
    # The rule itself, on hand-made edges: a core module importing a stage, a stage importing the CLI.
    assert _against_direction("gemline.lake", "ingest.pipeline")
    assert _against_direction("trainer.train", "gemline.cli")
    assert _against_direction("sequences.pipeline", "trainer.train")
    assert _against_direction("features.vectorized", "sequences.history")  # a library never reaches into a stage
    assert not _against_direction("sequences.vectorized", "features.vectorized")
    assert not _against_direction("sequences.pipeline", "ingest.schema")
    assert not _against_direction("gemline.cli", "trainer.train")
    assert not _against_direction("trainer.models.gem", "kernels.types")
