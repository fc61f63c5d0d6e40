"""The wheel claims one import name, `pagedserve`: the layer folders are installed under it, and
the gRPC stubs are generated into it at build time (they are never committed)."""

import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

LAYERS = ("services", "scheduler_svc", "worker_svc", "kernels")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # a checkout has its own stubs (make proto)
            return
        generate = runpy.run_path(str(Path(__file__).parent / "protos" / "generate.py"))["generate"]
        generate(Path(self.build_lib) / "pagedserve" / "services" / "rpc" / "v1")  # + internal/v1


packages = ["pagedserve", *(f"pagedserve.{p}" for p in find_packages(where="pagedserve"))]
package_dir = {"pagedserve": "pagedserve"}
for layer in LAYERS:
    for package in [layer, *find_packages(include=[f"{layer}.*"])]:
        packages.append(f"pagedserve.{package}")
        package_dir[f"pagedserve.{package}"] = package.replace(".", "/")

setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildPyWithStubs})
