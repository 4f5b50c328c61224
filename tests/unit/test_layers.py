"""The package's layers (docs/architecture.md, "Layers"): imports point down only, and nothing imports in a circle.

Every import counts, also one inside a function (a lazy import is still a dependency) or under TYPE_CHECKING. The
graph is read from the source with `ast`; nothing is imported.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ddiloco"

LAYERS: tuple[tuple[tuple[str, tuple[str, ...]], ...], ...] = (
    (("cli", ("ddiloco.__main__", "ddiloco.cli")),),
    (("commands", ("ddiloco.*.commands", "ddiloco.runtime.process_commands", "ddiloco.runtime.run_commands")),),
    (("chaos", ("ddiloco.chaos", "ddiloco.chaos.*")),),
    (("runtime", ("ddiloco.runtime", "ddiloco.runtime.*")), ("sim", ("ddiloco.sim", "ddiloco.sim.*")),
     ("plan", ("ddiloco.plan", "ddiloco.plan.*"))),
    (("session", ("ddiloco.learner_session", "ddiloco.session_setup", "ddiloco.session_transport",
                  "ddiloco.session_messages",
                  "ddiloco.session_lifecycle", "ddiloco.learner_status", "ddiloco.learner_checkpoint",
                  "ddiloco.follower_session", "ddiloco.learner_group", "ddiloco.sharded_state", "ddiloco.evaluator",
                  "ddiloco.train_tinygpt", "ddiloco.work_ledger", "ddiloco.inprocess",
                  "ddiloco.model_buffers", "ddiloco.global_copy", "ddiloco.step_arguments", "ddiloco.optimizer_restore",
                  "ddiloco.model_checks")),),
    (("learner rules", ("ddiloco.learner_rules",)),),
    (("learner core", ("ddiloco.learner", "ddiloco.learner_model", "ddiloco.publisher", "ddiloco.fragment_access",
                       "ddiloco.sent_updates", "ddiloco.local_fragments",
                       "ddiloco.round_schedule", "ddiloco.learner_stats")),
     ("syncer core", ("ddiloco.syncer", "ddiloco.global_model", "ddiloco.round_journal", "ddiloco.liveness",
                      "ddiloco.admission", "ddiloco.open_round",
                      "ddiloco.round_timing",
                      "ddiloco.merge", "ddiloco.outer", "ddiloco.round_sum", "ddiloco.fused_close",
                      "ddiloco.state_plan")),
     ("transport", ("ddiloco.transport", "ddiloco.transport.*"))),
    (("building blocks", ("ddiloco.downlink", "ddiloco.update_values", "ddiloco.kernels", "ddiloco._kernels",
                          "ddiloco.kernel_threads", "ddiloco.checksums", "ddiloco.compression", "ddiloco.build_info",
                          "ddiloco.codec_interface", "ddiloco.zero_encodings", "ddiloco.fragments",
                          "ddiloco.model", "ddiloco.data", "ddiloco.training", "ddiloco.clock", "ddiloco.checkpoint",
                          "ddiloco.round_log", "ddiloco.state_tree",
                          "ddiloco.metrics", "ddiloco.throttle", "ddiloco.backoff", "ddiloco.run_config",
                          "ddiloco.flags", "ddiloco.fault_control", "ddiloco.corpus", "ddiloco.goodput",
                          "ddiloco.failures", "ddiloco.fault_plan", "ddiloco.data_parallel", "ddiloco.link_model",
                          "ddiloco.interrupts", "ddiloco.launcher_watch", "ddiloco.non_finite",
                          "ddiloco.rank_failures", "ddiloco.stdout_pipe", "ddiloco.replica_check")),),
    (("plain data", ("ddiloco", "ddiloco.config", "ddiloco.messages", "ddiloco.checks", "ddiloco.environment",
                     "ddiloco.exit_status")),),
)
"""Top to bottom. A module may import its own group and any lower layer; groups side by side in one layer (the
learner core, the syncer core and the transport; the runtime, the harness and the planner) never import each
other. An exact name wins over a pattern; patterns are tried in this order."""


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imports_of(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that module `name` (at `path`) imports, wherever in the file the import stands."""
    known = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            # `from ddiloco.a import b` depends on the module ddiloco.a.b where there is one, else on ddiloco.a.
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in known else module)
    return (found & known) - {name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def group_of(module: str) -> tuple[int, str]:
    """(layer index from the top, group name) of `module`; KeyError if the table does not place it."""
    for exact in (True, False):
        for index, layer in enumerate(LAYERS):
            for group, patterns in layer:
                for pattern in patterns:
                    is_pattern = "*" in pattern
                    if exact and not is_pattern and module == pattern:
                        return index, group
                    if not exact and is_pattern and fnmatch.fnmatchcase(module, pattern):
                        return index, group
    raise KeyError(module)


def layer_violations(graph: Mapping[str, set[str]]) -> list[str]:
    """Each import that points up, or sideways into a sibling group of the same layer."""
    wrong = []
    for module, targets in sorted(graph.items()):
        layer, group = group_of(module)
        for target in sorted(targets):
            target_layer, target_group = group_of(target)
            if target_layer < layer:
                wrong.append(f"{module} ({group}) imports {target} ({target_group}), a higher layer")
            elif target_layer == layer and target_group != group:
                wrong.append(f"{module} ({group}) imports {target} ({target_group}), a sibling group")
    return wrong


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_module_has_a_layer():
    unplaced = []
    for module in module_files():
        try:
            group_of(module)
        except KeyError:
            unplaced.append(module)
    assert unplaced == [], f"add these modules to LAYERS (and docs/architecture.md): {unplaced}"


def test_imports_point_down_only():
    assert layer_violations(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The checker itself: an upward import, a sideways one and a cycle are each reported."""
    package = tmp_path / "ddiloco"
    (package / "transport").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "transport" / "__init__.py").write_text("")
    (package / "config.py").write_text("from ddiloco import fragments\n")  # plain data -> building blocks: up
    (package / "fragments.py").write_text("import ddiloco.config\n")
    (package / "syncer.py").write_text("def f():\n    from ddiloco.transport import grpc_client\n")  # sideways, lazy
    (package / "transport" / "grpc_client.py").write_text("from .. import config\n")
    graph = import_graph(package)
    assert graph["ddiloco.syncer"] == {"ddiloco.transport.grpc_client"}
    assert graph["ddiloco.transport.grpc_client"] == {"ddiloco.config"}
    assert layer_violations(graph) == [
        "ddiloco.config (plain data) imports ddiloco.fragments (building blocks), a higher layer",
        "ddiloco.syncer (syncer core) imports ddiloco.transport.grpc_client (transport), a sibling group",
    ]
    assert cycles(graph) == [["ddiloco.config", "ddiloco.fragments"]]
