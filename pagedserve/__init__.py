"""pagedserve's protobuf contracts as Python: `pagedserve.v1` holds the code `make proto` generates
from protos/pagedserve/v1/*.proto (not in git). This file is, so the package exists when pip
installs the project in editable mode, before the stubs are generated."""
