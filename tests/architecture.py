"""The architecture contract, checked by `make lint` (python -m tests.architecture).

Layers import downwards only:

    pagedserve/ (LLM, CLI, serve)  →  scheduler_svc/, worker_svc/  →  services/, kernels/
    services/:  gateway/  →  rpc/  →  text/  →  common/;  kernels/  →  common/

Every project import goes through the one import root, `pagedserve.`. The cores and the services
import the floor, never the gateway: scheduler_svc/ imports services/common/ (and, from its edge
modules, services/rpc/); worker_svc/ the same and kernels/. Neither imports services/text/ (text
is the gateway's) nor the other; kernels/ imports only services/common/.

The transport-free modules -- all of kernels/, services/common/, services/text/, scheduler_svc/
and worker_svc/ but for their edge modules, and the gateway's Frontend -- load neither grpc,
protobuf, prometheus_client nor the rpc layer, directly or through any project module they load
(imports under `if TYPE_CHECKING:` are not loaded). The floor, services/common/, holds what more
than the gateway uses: a name there that only the gateway (and pagedserve/) imports moves to
services/gateway/. No function in the layer folders runs over MAX_FUNCTION_LINES lines.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = "pagedserve"
LAYER_FOLDERS = ("pagedserve", "services", "scheduler_svc", "worker_svc", "kernels")
CHECKED_FOLDERS = (*LAYER_FOLDERS, "tests", "bench")
GENERATED = (Path("services/rpc/v1"), Path("services/rpc/internal"))
MAX_FUNCTION_LINES = 60

# layer -> the layers it may import besides itself (and the packages above them, such as
# pagedserve.services)
ALLOWED: dict[str, set[str]] = {
    "pagedserve": {"scheduler_svc", "worker_svc", "services.gateway", "services.rpc",
                   "services.text", "services.common", "kernels"},
    "scheduler_svc": {"services.rpc", "services.common"},
    "worker_svc": {"services.rpc", "services.common", "kernels"},
    "services.gateway": {"services.rpc", "services.text", "services.common"},
    "services.rpc": {"services.text", "services.common"},
    "services.text": {"services.common"},
    "services.common": set(),
    "kernels": {"services.common"},
}
# the modules of scheduler_svc/ and worker_svc/ that speak gRPC; the rest is core
EDGE_MODULES = {"scheduler_svc.servicer", "scheduler_svc.submit_stream",
                "scheduler_svc.worker_client", "scheduler_svc.metrics",
                "worker_svc.servicer", "worker_svc.metrics", "worker_svc.kv_transfer"}
# transport-free although their layer is not
TRANSPORT_FREE_MODULES = {"services.gateway.frontend"}
WIRE_PACKAGES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "prometheus_client",
                 "pagedserve.services.rpc")
OTHER_TOP_LEVELS = tuple(f for f in LAYER_FOLDERS if f != ROOT)


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    subject: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.subject}: {self.rule}"


@dataclass(frozen=True)
class ImportSite:
    line: int
    name: str  # 'pagedserve.services.rpc.status.status_of', 'grpc'
    is_type_checking: bool  # under `if TYPE_CHECKING:`: never runs
    is_in_function: bool  # runs when the function does, not when the module loads


@dataclass(frozen=True)
class FunctionSite:
    line: int
    name: str
    num_lines: int


@dataclass
class Module:
    name: str  # 'services.rpc.status', 'pagedserve.cli'
    path: Path  # relative to the root
    imports: list[ImportSite]
    functions: list[FunctionSite]
    definitions: dict[str, tuple[int, set[str]]]  # top-level name -> line, the names it uses

    @property
    def layer(self) -> str | None:
        return layer_of(self.name)

    @property
    def is_transport_free(self) -> bool:
        if self.name in TRANSPORT_FREE_MODULES:
            return True
        return (self.layer not in (None, "pagedserve", "services.gateway", "services.rpc")
                and self.name not in EDGE_MODULES)

    def imported(self, scope: str = "all") -> Iterator[tuple[int, str]]:
        """(line, name) of its imports in `scope`: "all" (the source), "run" (leaves out those
        under `if TYPE_CHECKING:`), "load" (also those in functions: what importing it runs)."""
        for site in self.imports:
            if scope == "all" or not (site.is_type_checking
                                      or (scope == "load" and site.is_in_function)):
                yield site.line, site.name


def layer_of(module: str) -> str | None:
    """'services.rpc.status' -> 'services.rpc'; 'worker_svc.models.llama' -> 'worker_svc'."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0] if parts[0] in LAYER_FOLDERS else None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@functools.lru_cache(maxsize=1024)  # the tests check copies of the repository again and again
def _scan(name: str, is_package: bool,
          source: str) -> tuple[list[ImportSite], list[FunctionSite],
                                dict[str, tuple[int, set[str]]]]:
    """One walk over a module: its imports (names made absolute), its functions and its public
    top-level names."""
    imports, functions = [], []
    tree = ast.parse(source, name)
    todo: list[tuple[ast.AST, bool, bool]] = [(tree, False, False)]
    while todo:
        node, is_type_checking, is_in_function = todo.pop()
        if isinstance(node, ast.Import):
            imports.extend(ImportSite(node.lineno, alias.name, is_type_checking, is_in_function)
                           for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                base = parts[: len(parts) - node.level + is_package]
                source = ".".join([ROOT, *base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            imports.extend(ImportSite(node.lineno, f"{source}.{alias.name}", is_type_checking,
                                      is_in_function) for alias in node.names)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.append(FunctionSite(node.lineno, node.name,
                                          node.end_lineno - node.lineno + 1))
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo.extend((child, True, is_in_function) for child in node.body)
            todo.extend((child, is_type_checking, is_in_function) for child in node.orelse)
        else:
            is_function = is_in_function or isinstance(node, _FUNCTIONS)
            todo.extend((child, is_type_checking, is_function)
                        for child in ast.iter_child_nodes(node))
    local = {alias.asname or alias.name: f"{node.module}.{alias.name}".removeprefix(ROOT + ".")
             for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
             for alias in node.names}
    definitions = {}
    for node in tree.body:
        targets = ([node.name] if isinstance(node, ast.ClassDef | ast.FunctionDef) else
                   [t.id for t in node.targets if isinstance(t, ast.Name)]
                   if isinstance(node, ast.Assign) else [])
        used = {local.get(n.id, f"{name}.{n.id}") for n in ast.walk(node)
                if isinstance(n, ast.Name)}
        definitions.update({t: (node.lineno, used) for t in targets})
    return imports, functions, definitions


def _is_wire(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in WIRE_PACKAGES)


def _may_import(source_layer: str, target_layer: str) -> bool:
    allowed = {source_layer, *ALLOWED.get(source_layer, set())}
    return any(target_layer == layer or layer.startswith(target_layer + ".") for layer in allowed)


def _layer_violations(module: Module) -> Iterator[Violation]:
    for line, name in module.imported():
        if name.split(".")[0] in OTHER_TOP_LEVELS:
            yield Violation(module.path, line, f"imports {name}", f"import it as {ROOT}.{name}")
        elif module.is_transport_free and _is_wire(name):
            yield Violation(module.path, line, f"imports {name}",
                            "a transport-free module imports no gRPC or protobuf")
        elif module.layer is not None and (name == ROOT or name.startswith(ROOT + ".")):
            target_layer = layer_of(name.removeprefix(ROOT).removeprefix(".")) or ROOT
            if not _may_import(module.layer, target_layer):
                yield Violation(module.path, line, f"imports {name}",
                                f"{module.layer} may not import {target_layer}")


def _function_violations(module: Module) -> Iterator[Violation]:
    for function in module.functions:
        if function.num_lines > MAX_FUNCTION_LINES:
            yield Violation(module.path, function.line, f"function {function.name}",
                            f"{function.num_lines} lines, over the {MAX_FUNCTION_LINES} a "
                            "function may have: split it")


class ImportGraph:
    """What a module loads, followed transitively: all of a module a caller names (its functions
    may run), only what importing them runs of the packages above it."""

    def __init__(self, modules: dict[str, Module]) -> None:
        self._modules = modules
        self._loads: dict[tuple[str, str], list[tuple[int, str, str]]] = {}
        self._wire_paths: dict[tuple[str, str], list[str] | None] = {}

    def loads(self, module: Module, scope: str = "run") -> list[tuple[int, str, str]]:
        """(line, project module or wire package, its scope) for each import that runs."""
        key = (module.name, scope)
        if key not in self._loads:
            self._loads[key] = [(line, *target) for line, name in module.imported(scope)
                                for target in self._targets(name)]
        return self._loads[key]

    def _targets(self, name: str) -> list[tuple[str, str]]:
        if _is_wire(name):
            return [(name, "run")]
        if not (name == ROOT or name.startswith(ROOT + ".")):
            return []
        parts = name.split(".")
        found = []
        for end in range(1, len(parts) + 1):
            dotted = ".".join(parts[:end])
            key = dotted if dotted in self._modules else dotted.removeprefix(ROOT + ".")
            if key in self._modules:
                found.append((key, "load"))
        if found:  # the module named, or the package whose attribute it is
            found[-1] = (found[-1][0], "run")
        return found

    def wire_path(self, module: Module, scope: str) -> list[str] | None:
        """The first chain of project modules from `module` to a wire package, if one loads."""
        key = (module.name, scope)
        if key not in self._wire_paths:
            self._wire_paths[key] = self._find_wire_path(module, scope)
        return self._wire_paths[key]

    def _find_wire_path(self, module: Module, scope: str) -> list[str] | None:
        seen = {(module.name, scope)}
        todo = [(module, scope, [module.name])]
        while todo:
            current, current_scope, chain = todo.pop(0)
            for _, target, target_scope in self.loads(current, current_scope):
                if _is_wire(target):
                    return [*chain, target]
                if (target, target_scope) not in seen:
                    seen.add((target, target_scope))
                    todo.append((self._modules[target], target_scope, [*chain, target]))
        return None


def _transport_violations(module: Module, graph: ImportGraph, modules: dict[str, Module],
                          reported: set[int]) -> Iterator[Violation]:
    """A transport-free module's imports of project modules that load the wire (an import on a
    line in `reported` broke the layer rules already; a transport-free module it imports answers
    for itself)."""
    seen = set(reported)
    for line, target, scope in graph.loads(module):
        if _is_wire(target) or modules[target].is_transport_free or line in seen:
            continue
        chain = graph.wire_path(modules[target], scope)
        if chain is not None:
            seen.add(line)
            yield Violation(module.path, line, f"loads {' -> '.join(chain)}",
                            "a transport-free module loads no gRPC or protobuf, not even "
                            "through another module")


def _floor_violations(modules: dict[str, Module]) -> Iterator[Violation]:
    """A name on the floor (services/common/) that the gateway imports, and no other layer but the
    top one (pagedserve/, which wires every layer) uses, directly or through another name of the
    floor, is the gateway's own: it belongs there."""
    floor = {f"{m.name}.{name}": used for m in modules.values() if m.layer == "services.common"
             for name, (_, used) in m.definitions.items()}
    users: dict[str, set[str]] = {}
    for module in modules.values():
        for _, name in module.imported():
            users.setdefault(name.removeprefix(ROOT + "."), set()).add(module.layer or "")
    shared = {name for name in floor if users.get(name, set()) - {ROOT, "", "services.gateway"}}
    todo = list(shared)
    while todo:
        for name in floor.get(todo.pop(), set()):
            if name in floor and name not in shared:
                shared.add(name)
                todo.append(name)
    for module in modules.values():
        if module.layer != "services.common":
            continue
        for name, (line, _) in module.definitions.items():
            qualified = f"{module.name}.{name}"
            if qualified not in shared and "services.gateway" in users.get(qualified, set()):
                yield Violation(module.path, line, f"defines {name}",
                                "only the gateway uses it: move it to services/gateway/")


def _module(root: Path, path: Path) -> Module:
    rel = path.relative_to(root)
    name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    return Module(name, rel, *_scan(name, rel.name == "__init__.py", path.read_text()))


def check(root: Path) -> list[Violation]:
    modules: dict[str, Module] = {}
    for folder in CHECKED_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if not any(root / generated in path.parents for generated in GENERATED):
                module = _module(root, path)
                modules[module.name] = module
    graph = ImportGraph(modules)
    violations = []
    for module in modules.values():
        layer_violations = list(_layer_violations(module))
        violations.extend(layer_violations)
        if module.is_transport_free:
            violations.extend(_transport_violations(module, graph, modules,
                                                    {v.line for v in layer_violations}))
        if module.layer is not None:
            violations.extend(_function_violations(module))
    violations.extend(_floor_violations(modules))
    return violations


def main() -> int:
    violations = check(Path(__file__).resolve().parent.parent)
    for violation in violations:
        print(violation)
    print(f"architecture contract: {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
