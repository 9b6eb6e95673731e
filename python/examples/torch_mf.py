"""Matrix factorization in plain PyTorch on Ferry: user and item factors in `ferry.torch.Embedding`
tables (pulled per batch, their gradients pushed by autograd), a dense global bias in an ordinary
`torch.optim.SGD` loop, averaged over the processes every few batches by `torch.distributed`
(gloo). Every process trains on the ratings of its share of the users of a planted low-rank
matrix (their rows moved to it once); rank 0 reports the test RMSE and the epoch time.

    torchrun --nproc-per-node 2 torch_mf.py            # Ferry's rendezvous at MASTER_PORT + 1
    ferry launch -n 2 -- python torch_mf.py
    python torch_mf.py --baseline                      # torch.nn.Embedding(sparse=True), one process

The baseline trains the same model, data, batches and learning rate in one process with
`torch.nn.Embedding(sparse=True)` and `torch.optim.SGD`, on as many threads as the cluster has
processes. Prints `torch-mf ok: …` when the RMSE fell to a quarter of where it started.
"""

import argparse
import os
import sys
import time

import numpy as np
import torch

USERS, ITEMS, RANK, EPOCHS, LR, BATCH, AVERAGE_EVERY = 2000, 1000, 8, 12, 0.05, 64, 16

parser = argparse.ArgumentParser()
parser.add_argument("--baseline", action="store_true", help="torch.nn.Embedding(sparse=True) in one process")
parser.add_argument("--threads", type=int, default=2, help="the baseline's threads (the cluster's processes)")
parser.add_argument("--epochs", type=int, default=EPOCHS)
args = parser.parse_args()

truth = np.random.default_rng(7)
u_true, v_true = truth.normal(0, 0.5, (USERS, RANK)), truth.normal(0, 0.5, (ITEMS, RANK))


def planted(count, seed):
    pick = np.random.default_rng(seed)
    users, items = pick.integers(0, USERS, count), pick.integers(0, ITEMS, count)
    ratings = 3.0 + np.einsum("ij,ij->i", u_true[users], v_true[items])
    return torch.from_numpy(users), torch.from_numpy(items), torch.from_numpy(ratings.astype(np.float32))


train, test = planted(100_000, 1), planted(5_000, 2)
init = np.random.default_rng(11)
user_init = torch.from_numpy(init.normal(0, 0.3, (USERS, RANK)).astype(np.float32))
item_init = torch.from_numpy(init.normal(0, 0.3, (ITEMS, RANK)).astype(np.float32))


class Model(torch.nn.Module):
    """rating = bias + users[u] · items[i]: two embeddings and a dense bias."""

    def __init__(self, users, items):
        super().__init__()
        self.users, self.items = users, items
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, u, i):
        return self.bias + (self.users(u) * self.items(i)).sum(-1)


def rmse(model):
    with torch.no_grad():
        return float(torch.sqrt(torch.mean((model(test[0], test[1]) - test[2]) ** 2)))


def train_epochs(model, optimizer, users, items, ratings, epochs, after_step, report):
    order = np.random.default_rng(3)
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        perm = torch.from_numpy(order.permutation(len(ratings)))
        for step, start in enumerate(range(0, len(ratings), BATCH)):
            batch = perm[start : start + BATCH]
            optimizer.zero_grad()
            # Per-example SGD steps on the factors (a sum, not a mean, over the batch).
            loss = 0.5 * torch.sum((model(users[batch], items[batch]) - ratings[batch]) ** 2)
            loss.backward()
            optimizer.step()
            after_step(step)
        report(epoch, time.perf_counter() - started)


if args.baseline:
    torch.set_num_threads(args.threads)
    users = torch.nn.Embedding(USERS, RANK, sparse=True, _weight=user_init.clone())
    items = torch.nn.Embedding(ITEMS, RANK, sparse=True, _weight=item_init.clone())
    model = Model(users, items)
    optimizer = torch.optim.SGD([{"params": [users.weight, items.weight]}, {"params": [model.bias], "lr": LR / BATCH}], lr=LR)
    first = rmse(model)
    times = []

    def report(epoch, seconds):
        times.append(seconds)
        print(f"torch-mf baseline epoch {epoch} rmse {rmse(model):.4f} time {seconds:.3f}", flush=True)

    train_epochs(model, optimizer, *train, args.epochs, lambda step: None, report)
    last = rmse(model)
    print(f"torch-mf baseline: rmse {first:.4f} -> {last:.4f}, {np.median(times):.3f} s per epoch (median)", flush=True)
    sys.exit(0 if last < 0.25 * first else f"RMSE did not fall: {first:.4f} -> {last:.4f}")

import ferry  # noqa: E402  (after the baseline, which needs no Ferry)
import ferry.torch  # noqa: E402

torch.set_num_threads(1)
with ferry.Node.start([("users", USERS, RANK), ("items", ITEMS, RANK)]) as node:
    rank, nodes = node.rank, node.nodes
    distributed = nodes > 1 and "MASTER_ADDR" in os.environ
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    w = node.worker()
    if rank == 0:
        w.set("users", torch.arange(USERS), user_init)
        w.set("items", torch.arange(ITEMS), item_init)
    w.barrier()
    model = Model(ferry.torch.Embedding(w, "users", RANK, LR), ferry.torch.Embedding(w, "items", RANK, LR))
    optimizer = torch.optim.SGD([model.bias], lr=LR / BATCH)
    # Each process trains the ratings of its share of the users, whose rows it moves here once.
    mine = train[0] % nodes == rank
    first = rmse(model) if rank == 0 else None
    times = []

    def average_dense_parameters(step):
        # The dense bias: each process steps its own, and every AVERAGE_EVERY batches they take
        # the mean (local SGD: an all-reduce per batch would cost more than the batch). Without
        # torch.distributed, under `ferry launch`, each keeps its own.
        if distributed and step % AVERAGE_EVERY == AVERAGE_EVERY - 1:
            with torch.no_grad():
                dist.all_reduce(model.bias)
                model.bias /= nodes

    def report(epoch, seconds):
        w.barrier()
        if rank == 0:
            times.append(seconds)
            print(f"torch-mf epoch {epoch} rmse {rmse(model):.4f} time {seconds:.3f}", flush=True)
        w.barrier()

    # Equal shares (the batches must match in number for the all-reduce to pair them up).
    share = min(int((train[0] % nodes == r).sum()) for r in range(nodes))
    users, items, ratings = (t[mine][:share] for t in train)
    model.users.prefetch(users)
    train_epochs(model, optimizer, users, items, ratings, args.epochs, average_dense_parameters, report)
    last = rmse(model) if rank == 0 else None
    w.close()
if distributed:
    dist.destroy_process_group()
if rank == 0:
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "ferry launch"
    print(f"torch-mf on {nodes} processes ({launcher}): rmse {first:.4f} -> {last:.4f}, {np.median(times):.3f} s per epoch (median)", flush=True)
    if not last < 0.25 * first:
        sys.exit(f"RMSE did not fall: {first:.4f} -> {last:.4f}")
    print(f"torch-mf ok: rmse {first:.4f} -> {last:.4f}", flush=True)
