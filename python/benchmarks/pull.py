"""The Python binding's cost: a pull of 10 000 rows × 64 floats through `Worker.pull` (into a
new array, and into the caller's with `out=`) against the same pulls made from Rust in the same
process, on the same node and keys (`Worker._time_pulls`). One node (local rows: the copy is
all there is, so the binding's share shows most) or, under `ferry launch -n 2`, rank 0's pulls
of rows half of which live on the other node.

    python pull.py                      # one node
    ferry launch -n 2 -- python pull.py # two
    python pull.py --quick              # fewer repetitions (the test suite's smoke run)
"""

import argparse
import statistics
import time

import numpy as np

import ferry

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=10_000)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--repetitions", type=int, default=200)
parser.add_argument("--quick", action="store_true")
args = parser.parse_args()
reps = 10 if args.quick else args.repetitions
KEYS = 10 * args.rows

with ferry.Node.start([("t", KEYS, args.dim)]) as node:
    w = node.worker()
    keys = np.random.default_rng(1).choice(KEYS, args.rows, replace=False).astype(np.uint64)
    out = np.empty((args.rows, args.dim), dtype=np.float32)
    w.barrier()
    if node.rank == 0:
        w.pull("t", keys, out=out)  # warm: the rows' pages, the connections
        rounds = {"rust": [], "python": [], "python_out": []}
        for _ in range(5):
            rounds["rust"].append(w._time_pulls("t", keys, reps) / reps)
            started = time.perf_counter()
            for _ in range(reps):
                w.pull("t", keys)
            rounds["python"].append((time.perf_counter() - started) / reps)
            started = time.perf_counter()
            for _ in range(reps):
                w.pull("t", keys, out=out)
            rounds["python_out"].append((time.perf_counter() - started) / reps)
        rust, new, into = (statistics.median(rounds[k]) for k in ("rust", "python", "python_out"))
        print(
            f"pull of {args.rows} rows x {args.dim} on {node.nodes} node(s): Rust {rust * 1e3:.3f} ms, "
            f"Python {new * 1e3:.3f} ms ({new / rust:.2f}x), Python with out= {into * 1e3:.3f} ms ({into / rust:.2f}x)",
            flush=True,
        )
    w.barrier()
    w.close()
