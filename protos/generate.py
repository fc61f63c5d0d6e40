"""Generate the Python stubs of protos/pagedserve/v1/*.proto into a package folder.

    python protos/generate.py services/rpc/v1

The stubs import each other relatively, so the package can live anywhere: in a source checkout
it is services/rpc/v1 (imported as pagedserve.services.rpc.v1), and a wheel builds it in place.
"""

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PROTOS = sorted(PROTO_ROOT.glob("pagedserve/v1/*.proto"))


def generate(out_dir: Path) -> None:
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}",
                      f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", *map(str, PROTOS)])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    for path in (tmp / "pagedserve" / "v1").iterdir():
        text = re.sub(r"^from pagedserve\.v1 import ", "from . import ", path.read_text(), flags=re.M)
        (out_dir / path.name).write_text(text)
    (out_dir / "__init__.py").write_text('"""Generated from protos/pagedserve/v1; never edit."""\n')
    shutil.rmtree(tmp)


if __name__ == "__main__":
    generate(Path(sys.argv[1]))
