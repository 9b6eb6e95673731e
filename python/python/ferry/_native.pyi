"""The native part of the `ferry` package (re-exported by `ferry`).

Keys are NumPy arrays or CPU torch tensors of `uint64`, or of `int64` without negative keys;
values `float32`; both C-contiguous, any shape, read in place. Every wait releases the GIL.
Failures raise `FerryError` with Ferry's message.
"""

from os import PathLike
from types import TracebackType
from typing import Any, Dict, List, Optional, Tuple, Type, TypeVar, Union

import numpy as np
import numpy.typing as npt

# A CPU torch tensor is accepted wherever an array is (read, or written, in place).
Tensor = Any
Keys = Union[npt.NDArray[np.uint64], npt.NDArray[np.int64], Tensor]
Values = Union[npt.NDArray[np.float32], Tensor]
Out = TypeVar("Out")
Path = Union[str, PathLike]

class FerryError(RuntimeError):
    """A Ferry operation failed; the message says why."""

def read_spill(path: Path) -> Tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """`(ids, values)` of a spill file (`FERRY_SPILL_DIR/TABLE.node-R.spill`): the ids a
    dynamic table's home evicted, in order, and their rows."""
def read_checkpoint(dir: Path) -> Dict[str, Union[npt.NDArray[np.float32], Tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]]]:
    """Reads a whole checkpoint (written by `Node.checkpoint` on any number of nodes, or by a
    training run's `--checkpoint-dir`) outside a cluster: every table's values by name, each of
    shape `(keys, value_len)` (optimizer state left out); a dynamic table's as a pair `(ids, rows)`,
    ids ascending. Raises `FerryError` naming the file
    when the checkpoint is incomplete or damaged."""

def feature_id(text: str) -> int:
    """The raw id of the string feature `text` (a word, a `field=value` pair), for a table made
    with `feature_hashing`: the same id in every process and binding."""

def plan_examples(path: Path, node: int) -> List[int]:
    """The examples a plan of `ferry partition` gives node `node`: their indices, in order (a
    table made with `plan=` homes the keys). Raises `FerryError` on a file that is not a plan,
    or on a node the plan does not have."""

class Table:
    """A table's configuration beyond `(name, keys, value_len)`: what a push does (`updater`:
    `add`, `sgd:LR`, `adagrad:LR[:EPS[:INIT]]`, `adam:LR[:BETA1:BETA2:EPS]` or
    `ftrl:ALPHA:BETA:L1:L2`, applied where each key lives), how keys are spread (`partitioning`:
    `range`, `hash`, or `consistent[:VIRTUAL_NODES]` for consistent hashing), which keys every node replicates, how values travel (`codec`), key lists
    cached from `key_cache_min` keys on, whether checkpoints leave it out (`scratch`), and
    whether workers address it by raw ids hashed into its `keys` buckets (`feature_hashing`:
    `"SEED"` or `"SEED:signed"`; ids are any uint64, or `feature_id` of a string), whether its
    keys are homed where a plan of `ferry partition` says (`plan`: the plan's path), or whether
    it is dynamic (`dynamic`: the ids each node holds as their home, with `keys=0`; workers
    address it by raw uint64 ids, each created when first touched): its new ids' values
    (`init`: `zeros`, `uniform:SCALE[:SEED]` or `normal:STD[:SEED]`), which new ids it creates
    (`admission`: `all`, `count:N` pushes or `probability:P[:SEED]`) and when it evicts ids
    (`eviction`: `never`, `lfu`, or `ttl:SECONDS`; see docs/DYNAMIC.md)."""

    def __init__(
        self,
        name: str,
        keys: int,
        value_len: int,
        *,
        updater: str = "add",
        partitioning: str = "range",
        replicated: Optional[List[int]] = None,
        codec: str = "f32",
        key_cache_min: int = 0,
        scratch: bool = False,
        feature_hashing: Optional[str] = None,
        plan: Optional[Path] = None,
        dynamic: Optional[int] = None,
        init: Optional[str] = None,
        admission: Optional[str] = None,
        eviction: Optional[str] = None,
    ) -> None: ...
    @property
    def name(self) -> str:
        """The table's name."""

class RelocationHold:
    """Intent's relocations held on a node for a `with` block (`Node.relocations_held()`)."""

    def __enter__(self) -> None: ...
    def __exit__(self, exc_type: Any = None, exc_value: Any = None, traceback: Any = None) -> bool: ...

class Stats:
    """A node's counters at one moment; also read by name (`stats["local_accesses"]`)."""

    local_accesses: int
    remote_accesses: int
    queued_accesses: int
    relocations_in: int
    relocations_out: int
    messages_sent: int
    bytes_sent: int
    bytes_received: int
    messages_by_kind: Dict[str, int]
    bytes_by_kind: Dict[str, int]
    relocation_p50_s: float
    relocation_p99_s: float
    blocking_p50_s: float
    blocking_p99_s: float
    replica_accesses: int
    intent_relocations: int
    late_accesses: int
    intent_replicas: int
    ids_created: int
    ids_known: int
    keys_free: int
    ids_evicted: int
    ids_deferred: int
    def as_dict(self) -> Dict[str, Any]:
        """Every counter by name."""
    def __getitem__(self, name: str) -> Any: ...

class Node:
    """This process's node of a Ferry cluster."""

    @staticmethod
    def start(tables: List[Union[Tuple[str, int, int], Table]], restore_from: Optional[Path] = None) -> "Node":
        """Starts this process's node with `tables`, a list of `(name, keys, value_len)` or
        `Table`s; the cluster (rank, node count, coordinator, secret, timeouts) comes from the
        environment.
        Blocks until every node has joined. With `restore_from`, the node starts from the
        checkpoint in that directory (`FERRY_RESTORE` does the same)."""
    @property
    def rank(self) -> int:
        """This node's rank."""
    @property
    def nodes(self) -> int:
        """The number of nodes."""
    def worker(self) -> "Worker":
        """A new worker (use one per thread)."""
    def stats(self) -> "Stats":
        """The node's counters: key accesses by where they were served, relocations, messages
        and bytes sent (by kind too), latencies, replicas, intent."""
    def checkpoint(self, dir: Path) -> None:
        """Writes this node's part of a checkpoint into `dir` (one directory per checkpoint): a
        collective call every node makes with the same directory, after a barrier every worker
        reached, the workers going on after a second barrier."""
    def hold_relocations(self) -> None:
        """Holds the relocations intent signalling makes on this node, for a checkpoint; returns
        once those in flight landed. Where workers declare intents, call it on every node, then
        a barrier, before `checkpoint`, and `release_relocations` after."""
    def release_relocations(self) -> None:
        """Ends `hold_relocations`: the grants that waited are taken up."""
    def relocations_held(self) -> "RelocationHold":
        """`with node.relocations_held(): ...` holds intent's relocations for the block
        (`hold_relocations` on entry, `release_relocations` on leaving, also on an exception):
        the block makes the barrier, the checkpoint and the barrier after it."""
    def finalize(self) -> None:
        """Leaves the cluster cleanly (a barrier with every other node); close every worker
        first."""
    def abort(self) -> None:
        """Stops the node at once, without the barrier of `finalize`: its peers see it as lost."""
    def __enter__(self) -> "Node": ...
    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc_value: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> bool:
        """Finalizes the node, or aborts it when the block raised (the exception goes on)."""

class Worker:
    """A worker: pulls, pushes, sets and localizes keys of the node's tables (one per thread)."""

    def pull(self, table: str, keys: Keys, out: Optional[Out] = None) -> Union[npt.NDArray[np.float32], Out]:
        """The values of `keys` as a new array of shape `(len(keys), value_len)`; with `out` (an
        array or CPU tensor of `len(keys) × value_len` floats), written into it and `out`
        returned."""
    def pull_held(self, table: str, keys: Keys) -> Tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]:
        """`(values, held)`: the values of those of `keys` the table holds (the others' rows at
        their initial values) and which it holds. Creates no key of a dynamic table, whatever
        its admission."""
    def pull_into(self, table: str, keys: Keys, out: Values) -> None:
        """Writes the values of `keys` into `out`, a C-contiguous array of
        `len(keys) × value_len` elements, without an intermediate copy."""
    def push(self, table: str, keys: Keys, values: Values) -> None:
        """Adds `values` (`len(keys) × value_len` floats, any shape) to the keys' values."""
    def push_pull(self, table: str, keys: Keys, values: Values) -> npt.NDArray[np.float32]:
        """Pushes `values` to the keys and returns their values right after, in one round
        trip per node."""
    def push_pull_async(self, table: str, keys: Keys, values: Values) -> int:
        """Starts a push-pull; returns a ticket for `wait_pull`."""
    def pull_range(self, table: str, start: int, end: int) -> npt.NDArray[np.float32]:
        """The values of keys `start..end` (end exclusive), of shape `(end - start, value_len)`."""
    def push_range(self, table: str, start: int, end: int, values: Values) -> None:
        """Pushes `values` (`(end - start) × value_len` floats) to keys `start..end`."""
    def register_distribution(self, table: str, start: int, end: int, scheme: str = "independent", weights: Optional[List[float]] = None) -> int:
        """Registers a distribution over keys `start..end` (uniform, or by `weights`), drawn by
        `scheme` (`independent`, `reuse[:POOL:USES]`, `postpone[:POOL:USES]`, `local`, `L1`–`L4`);
        returns its number for `prepare_sample`."""
    def prepare_sample(self, distribution: int, n: int) -> int:
        """Draws `n` samples; returns a handle for `pull_sample`."""
    def pull_sample(self, handle: int, count: int) -> Tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
        """The next `count` samples of `handle`: their keys and values."""
    def set(self, table: str, keys: Keys, values: Values) -> None:
        """Replaces the keys' values with `values`."""
    def localize(self, table: str, keys: Keys) -> None:
        """Moves the keys to this node and waits until they are here."""
    def pull_async(self, table: str, keys: Keys) -> int:
        """Starts a pull; returns a ticket for `wait_pull`."""
    def push_async(self, table: str, keys: Keys, values: Values) -> int:
        """Starts a push (the values are copied before this returns); returns a ticket for
        `wait`."""
    def set_async(self, table: str, keys: Keys, values: Values) -> int:
        """Starts a set (the values are copied before this returns); returns a ticket for
        `wait`."""
    def localize_async(self, table: str, keys: Keys) -> int:
        """Starts moving keys to this node; returns a ticket for `wait`."""
    def wait(self, ticket: int) -> None:
        """Waits for a push, set or localize ticket."""
    def wait_pull(self, ticket: int) -> npt.NDArray[np.float32]:
        """Waits for a pull ticket; returns its values, of shape `(keys, value_len)`."""
    def intent(self, table: str, keys: Keys, start: int, end: int) -> None:
        """Declares that this worker will need the keys in its clocks `start..end`, so that the
        node moves them here in time (intent signalling)."""
    def advance_clock(self) -> int:
        """Completes this worker's clock and returns the new one."""
    def current_clock(self) -> int:
        """The clock this worker is in (the number of clocks it completed)."""
    def barrier(self) -> None:
        """Waits for this worker's asynchronous operations, then for every worker of every
        node."""
    def close(self) -> None:
        """Releases the worker (outstanding tickets are forgotten); needed before
        `Node.finalize`."""
