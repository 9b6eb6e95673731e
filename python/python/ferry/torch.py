"""PyTorch on Ferry: an embedding module whose rows live in a Ferry table.

`Embedding(worker, table, dim, lr)` behaves like `torch.nn.Embedding(sparse=True)` trained with
plain SGD at rate `lr`: `forward(ids)` pulls the rows of the batch's distinct ids from Ferry
(wherever they live in the cluster) and returns them as a tensor that autograd tracks; the
backward pass pushes `-lr × gradient` of exactly those rows, which Ferry adds where each key
lives — the update of every worker of every node, with no optimizer state on the trainer.
With `lr=None` the backward pass pushes the gradient itself, for a table whose server-side
updater (`ferry.Table(..., updater="adagrad:0.1")`, SGD or Adam alike) applies it where the key
lives, with the key's optimizer state kept there. Dense
parameters of the same model stay ordinary `torch.nn.Parameter`s in an ordinary `torch.optim`
loop (synchronise them with `torch.distributed` as usual; under `torchrun` Ferry's rendezvous
uses the port after `MASTER_PORT`, so the two do not meet).

`prefetch(ids)` starts moving the rows of a coming batch to this node (an asynchronous
`localize`) so that its `forward` finds them local; the next `forward` waits for it first.
`prefetch(ids, clocks_ahead=k)` instead declares an intent (AdaPM): the worker will use the
rows in its clock `current_clock() + k`, and Ferry's intent service relocates or replicates
them by itself, in time, without this worker waiting for anything. The trainer then counts
its batches with `worker.advance_clock()` (one clock a batch, say); intents of keys several
workers want at once make replicas rather than moving a key back and forth.

The gradient pushes are asynchronous: training goes on while they travel, and this worker's
own later pulls see them all the same (a worker's operations on a key take effect in order).
At most `PUSHES_IN_FLIGHT` of a module's pushes are outstanding; `flush()` waits for them all,
as does the worker's `barrier()` (before another worker or node reads the rows, say).

Keys are the ids themselves (`int64`, as torch indexes; non-negative). The tensors handed to
Ferry are read and written in place: no copy beyond the one into and out of the table.
"""

import collections
from typing import Deque, Optional

import torch

from ._native import Worker

__all__ = ["Embedding", "PUSHES_IN_FLIGHT"]

#: A module's gradient pushes outstanding at once before the oldest is waited for.
PUSHES_IN_FLIGHT = 4


class _Rows(torch.autograd.Function):
    """The rows of `ids` (distinct) pulled from the module's table; their gradient goes back to
    the table as a push. `anchor` is a parameter of no elements that requires grad, so that
    autograd calls `backward` even when nothing else before the lookup does."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, module: "Embedding", ids: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.ids = module, ids
        rows = torch.empty((ids.numel(), module.dim), dtype=torch.float32)
        module.worker.pull(module.table, ids, out=rows)
        return rows

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.module._apply_gradient(ctx.ids, grad)
        return None, None, None


class Embedding(torch.nn.Module):
    """An embedding table of `dim` floats per id, held by Ferry's table `table` and reached
    through `worker` (one per thread), trained by SGD at rate `lr`, or by the table's own
    updater with `lr=None` (see the module documentation)."""

    def __init__(self, worker: Worker, table: str, dim: int, lr: Optional[float]):
        super().__init__()
        if dim <= 0:
            raise ValueError(f"dim must be positive, not {dim}")
        self.worker, self.table, self.dim = worker, table, dim
        self.lr = None if lr is None else float(lr)
        # Makes autograd call the lookup's backward; it has no elements and never changes.
        self.anchor = torch.nn.Parameter(torch.empty(0))
        self._prefetching: Optional[int] = None
        self._pushes: Deque[int] = collections.deque()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (any shape): a tensor of shape `ids.shape + (dim,)`."""
        self._wait_for_prefetch()
        distinct, where = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = _Rows.apply(self.anchor, self, distinct.contiguous())
        return rows[where].reshape(*ids.shape, self.dim)

    def prefetch(self, ids: torch.Tensor, clocks_ahead: Optional[int] = None) -> None:
        """Starts moving the rows of `ids` (a coming batch) to this node: now, by a `localize`
        the next `forward` waits for; or, with `clocks_ahead=k` (at least 1), as an intent for
        the worker's clock `current_clock() + k` that the intent service acts on in time."""
        distinct = torch.unique(ids.reshape(-1)).contiguous()
        if clocks_ahead is None:
            self._wait_for_prefetch()
            self._prefetching = self.worker.localize_async(self.table, distinct)
            return
        if clocks_ahead < 1:
            raise ValueError(f"clocks_ahead must be at least 1 (a clock still to come), not {clocks_ahead}")
        clock = self.worker.current_clock() + clocks_ahead
        self.worker.intent(self.table, distinct, clock, clock + 1)

    def _wait_for_prefetch(self) -> None:
        if self._prefetching is not None:
            ticket, self._prefetching = self._prefetching, None
            self.worker.wait(ticket)

    def flush(self) -> None:
        """Waits until every gradient push of this module has been applied."""
        while self._pushes:
            self.worker.wait(self._pushes.popleft())

    def _apply_gradient(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        # The table's updater applies a raw gradient; plain SGD here otherwise.
        step = grad.to(torch.float32).contiguous() if self.lr is None else (grad.to(torch.float32) * -self.lr).contiguous()
        self._pushes.append(self.worker.push_async(self.table, ids, step))
        while len(self._pushes) > PUSHES_IN_FLIGHT:
            self.worker.wait(self._pushes.popleft())

    def extra_repr(self) -> str:
        return f"table={self.table!r}, dim={self.dim}, lr={self.lr}"

