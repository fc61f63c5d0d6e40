"""Generate the Python stubs of both contracts, public and internal, beside each other.

    python protos/generate.py services/rpc/v1

writes protos/pagedserve/v1/*.proto into that folder (the public API, pagedserve.v1) and
protos/pagedserve/internal/v1/*.proto into ../internal/v1 (pagedserve.internal.v1). The stubs
import each other relatively, so the packages can live anywhere: in a source checkout they are
services/rpc/v1 and services/rpc/internal/v1 (imported as pagedserve.services.rpc...), and a
wheel builds them in place.
"""

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGES = ("pagedserve/v1", "pagedserve/internal/v1")


def _package_dirs(out_dir: Path) -> dict[str, Path]:
    return {"pagedserve/v1": out_dir, "pagedserve/internal/v1": out_dir.parent / "internal" / "v1"}


def generate(out_dir: Path) -> None:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    include = Path(protoc.__file__).parent / "_proto"
    protos = sorted(p for package in PACKAGES for p in (PROTO_ROOT / package).glob("*.proto"))
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                      f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", *map(str, protos)])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    for package, target in _package_dirs(out_dir).items():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        dotted = re.escape(package.replace("/", "."))
        for path in (tmp / package).iterdir():
            text = re.sub(rf"^from {dotted} import ", "from . import ", path.read_text(),
                          flags=re.M)
            (target / path.name).write_text(text)
        (target / "__init__.py").write_text(f'"""Generated from protos/{package}; never edit."""\n')
    (out_dir.parent / "internal" / "__init__.py").write_text(
        '"""The internal contract\'s generated stubs (protos/pagedserve/internal)."""\n')
    shutil.rmtree(tmp)


if __name__ == "__main__":
    generate(Path(sys.argv[1]))
