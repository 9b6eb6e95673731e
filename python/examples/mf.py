"""Matrix factorization with Ferry from Python: every process trains on its share of the users
of a planted low-rank matrix, pulling the rows of a mini-batch at once, taking SGD steps in
NumPy and pushing the changes; rank 0 reports test RMSE. Run: ferry launch -n 2 -- python mf.py
"""

import sys

import numpy as np

import ferry

USERS, ITEMS, RANK, EPOCHS, RATE, REG, BATCH = 200, 100, 4, 10, 0.05, 0.02, 32

truth = np.random.default_rng(7)
u_true, v_true = truth.uniform(-1, 1, (USERS, RANK)), truth.uniform(-1, 1, (ITEMS, RANK))


def planted(count, seed):
    pick = np.random.default_rng(seed)
    users, items = pick.integers(0, USERS, count), pick.integers(0, ITEMS, count)
    return users.astype(np.uint64), items.astype(np.uint64), np.einsum("ij,ij->i", u_true[users], v_true[items]).astype(np.float32)


train, test = planted(8000, 1), planted(800, 2)
node = ferry.Node.start([("users", USERS, RANK + 1), ("items", ITEMS, RANK + 1)])
w = node.worker()
if node.rank == 0:
    init = np.random.default_rng(11)
    for table, n in (("users", USERS), ("items", ITEMS)):
        w.set(table, np.arange(n, dtype=np.uint64), (init.random((n, RANK + 1)) - 0.5).astype(np.float32))
w.barrier()
mine = train[0] % node.nodes == node.rank
users, items, ratings = train[0][mine], train[1][mine], train[2][mine]
w.localize("users", np.unique(users))
first = last = None
for epoch in range(1, EPOCHS + 1):
    for start in range(0, len(ratings), BATCH):
        u, i, r = users[start : start + BATCH], items[start : start + BATCH], ratings[start : start + BATCH]
        p, q = w.pull("users", u), w.pull("items", i)
        err = r - (p[:, 0] + q[:, 0] + np.einsum("ij,ij->i", p[:, 1:], q[:, 1:]))
        dp, dq = np.empty_like(p), np.empty_like(q)
        dp[:, 0], dq[:, 0] = RATE * (err - REG * p[:, 0]), RATE * (err - REG * q[:, 0])
        dp[:, 1:] = RATE * (err[:, None] * q[:, 1:] - REG * p[:, 1:])
        dq[:, 1:] = RATE * (err[:, None] * p[:, 1:] - REG * q[:, 1:])
        w.push("users", u, dp)
        w.push("items", i, dq)
    w.barrier()
    if node.rank == 0:
        p, q = w.pull("users", test[0]), w.pull("items", test[1])
        pred = p[:, 0] + q[:, 0] + np.einsum("ij,ij->i", p[:, 1:], q[:, 1:])
        last = float(np.sqrt(np.mean((test[2] - pred) ** 2)))
        first = first if first is not None else last
        print(f"python-mf epoch {epoch} rmse {last:.4f}", flush=True)
    w.barrier()
stats = node.stats()
w.close()
node.finalize()
print(f"python-mf rank done: {stats['local_accesses']} local and {stats['remote_accesses']} remote key accesses", flush=True)
if first is not None:
    if not last < 0.8 * first:
        sys.exit(f"RMSE did not fall: {first:.4f} -> {last:.4f}")
    print(f"python-mf ok: RMSE {first:.4f} -> {last:.4f}", flush=True)
