"""The architecture contract, checked by `make lint` (python -m tests.architecture).

Layers import downwards only:

    pagedserve/ (LLM, CLI, serve)  →  scheduler_svc/, worker_svc/  →  services/, kernels/
    services/:  gateway/  →  rpc/  →  text/  →  common/

Every project import goes through the one import root, `pagedserve.`. The cores -- all of
kernels/, services/common/, services/text/, and scheduler_svc/ and worker_svc/ but for their
edge modules -- import neither grpc, protobuf, prometheus_client nor the rpc layer.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = "pagedserve"
LAYER_FOLDERS = ("pagedserve", "services", "scheduler_svc", "worker_svc", "kernels")
CHECKED_FOLDERS = (*LAYER_FOLDERS, "tests", "bench")
GENERATED = (Path("services/rpc/v1"), Path("services/rpc/internal"))

# layer -> the layers it may import (itself always)
ALLOWED: dict[str, set[str]] = {
    "pagedserve": set(LAYER_FOLDERS),
    "scheduler_svc": {"services", "kernels"},
    "worker_svc": {"services", "kernels"},
    "services.gateway": {"services.rpc", "services.text", "services.common"},
    "services.rpc": {"services.text", "services.common"},
    "services.text": {"services.common"},
    "services.common": set(),
    "kernels": set(),
}
# the modules of scheduler_svc/ and worker_svc/ that speak gRPC; the rest is core
EDGE_MODULES = {"scheduler_svc.servicer", "scheduler_svc.submit_stream",
                "scheduler_svc.worker_client", "scheduler_svc.metrics",
                "worker_svc.servicer", "worker_svc.metrics"}
WIRE_PACKAGES = ("grpc", "grpc_health", "grpc_reflection", "google.protobuf", "prometheus_client",
                 "pagedserve.services.rpc")
OTHER_TOP_LEVELS = tuple(f for f in LAYER_FOLDERS if f != ROOT)


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: imports {self.imported}: {self.rule}"


def layer_of(module: str) -> str | None:
    """'services.rpc.status' -> 'services.rpc'; 'worker_svc.models.llama' -> 'worker_svc'."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0] if parts[0] in LAYER_FOLDERS else None


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                name = ".".join(["pagedserve", *base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}"


def _is_covered(layer: str, target: str) -> bool:
    return target == layer or target.startswith(layer + ".") or layer.startswith(target + ".")


def check_file(root: Path, path: Path) -> list[Violation]:
    rel = path.relative_to(root)
    module = ".".join(rel.with_suffix("").parts)
    is_package = rel.name == "__init__.py"
    if is_package:
        module = module.removesuffix(".__init__")
    source_layer = layer_of(module)
    is_core = (source_layer not in (None, "pagedserve", "services.gateway", "services.rpc")
               and module not in EDGE_MODULES)
    violations = []
    for line, name in _imports(ast.parse(path.read_text(), str(path)), module, is_package):
        if name.split(".")[0] in OTHER_TOP_LEVELS:
            violations.append(Violation(rel, line, name, f"import it as {ROOT}.{name}"))
            continue
        if is_core and any(name == p or name.startswith(p + ".") for p in WIRE_PACKAGES):
            violations.append(Violation(rel, line, name, "a core imports no gRPC or protobuf"))
            continue
        if source_layer is None or not (name == ROOT or name.startswith(ROOT + ".")):
            continue
        target_layer = layer_of(name.removeprefix(ROOT).removeprefix(".")) or "pagedserve"
        if _is_covered(source_layer, target_layer):
            continue
        if not any(_is_covered(allowed, target_layer)
                   for allowed in ALLOWED.get(source_layer, set())):
            violations.append(Violation(rel, line, name,
                                        f"{source_layer} may not import {target_layer}"))
    return violations


def check(root: Path) -> list[Violation]:
    violations = []
    for folder in CHECKED_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            if not any(root / generated in path.parents for generated in GENERATED):
                violations.extend(check_file(root, path))
    return violations


def main() -> int:
    violations = check(Path(__file__).resolve().parent.parent)
    for violation in violations:
        print(violation)
    print(f"architecture contract: {len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
