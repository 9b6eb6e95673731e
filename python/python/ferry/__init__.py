"""Ferry, a parameter store for distributed training: Python bindings.

`Node.start(tables)` joins the cluster the environment describes (Ferry's variables, or those of
torchrun, Slurm, Open MPI or PMI), `node.worker()` gives a worker per thread, and pulls, pushes,
sets and localizes take NumPy arrays or CPU torch tensors: `uint64` (or non-negative `int64`)
keys and `float32` values. Every wait releases the GIL. Failures raise `FerryError` with Ferry's
message. `ferry.torch` (imported on its own, it needs PyTorch) holds an embedding module backed by
a Ferry table.
"""

from ._native import FerryError, Node, RelocationHold, Stats, Table, Worker, feature_id, plan_examples, read_checkpoint, read_spill

__all__ = ["FerryError", "Node", "RelocationHold", "Stats", "Table", "Worker", "feature_id", "plan_examples", "read_checkpoint", "read_spill"]
