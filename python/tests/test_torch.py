"""Ferry with PyTorch on a cluster: CPU tensors as keys, values and pull targets, and
`ferry.torch.Embedding` under autograd. Run by every process of `ferry launch -n 2 -- python -m
pytest tests/test_torch.py` in an environment with torch (skipped without it).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferry  # noqa: E402
import ferry.torch  # noqa: E402

KEYS, DIM = 100, 3


@pytest.fixture(scope="module")
def cluster():
    tables = [("emb", KEYS, DIM), ferry.Table("served", KEYS, DIM, updater="sgd:0.5", partitioning="hash")]
    with ferry.Node.start(tables) as node:
        worker = node.worker()
        yield node, worker
        worker.close()


def test_tensors_in_and_out_without_copies(cluster):
    node, w = cluster
    keys = torch.arange(10)  # int64, torch's index type
    assert keys.dtype == torch.int64
    w.push("emb", keys, torch.ones((10, DIM), requires_grad=True))
    w.barrier()
    out = torch.zeros((10, DIM))
    assert w.pull("emb", keys, out=out) is out, "the caller's tensor comes back"
    assert torch.all(out == 2.0)  # one push from each rank
    # `uint64` NumPy keys and a NumPy target work alike, as does pull_into with a tensor.
    assert np.all(w.pull("emb", np.arange(10, dtype=np.uint64)) == 2.0)
    target = torch.empty(10 * DIM)
    w.pull_into("emb", keys, target)
    assert torch.all(target == 2.0)
    w.barrier()


def test_wrong_tensors_are_refused_with_a_reason(cluster):
    _, w = cluster
    with pytest.raises(ferry.FerryError, match="negative"):
        w.pull("emb", torch.tensor([1, -2]))
    with pytest.raises(ferry.FerryError, match="float32"):
        w.push("emb", torch.tensor([1]), torch.ones((1, DIM), dtype=torch.float64))
    with pytest.raises(ferry.FerryError, match="uint64 or int64"):
        w.pull("emb", torch.tensor([1.0]))
    with pytest.raises(ferry.FerryError, match="C-contiguous"):
        w.pull("emb", torch.tensor([1, 2]), out=torch.zeros((DIM, 2)).T)
    w.barrier()


def test_the_embedding_pulls_rows_and_pushes_their_gradients(cluster):
    node, w = cluster
    emb = ferry.torch.Embedding(w, "emb", DIM, lr=0.5)
    ids = torch.tensor([[20 + node.rank, 30], [30, 40]])  # 30 twice; 40 on both ranks
    before = w.pull("emb", torch.tensor([20, 21, 30, 40]))
    w.barrier()
    rows = emb(ids)
    assert rows.shape == (2, 2, DIM)
    assert torch.equal(rows[0, 1], torch.from_numpy(before[2]))
    w.barrier()  # every rank has read the rows before any pushes its gradient
    # d(sum)/d(row) is 1 per occurrence: SGD subtracts lr × occurrences from each row.
    rows.sum().backward()
    w.barrier()
    after = w.pull("emb", torch.tensor([20, 21, 30, 40]))
    # 20 and 21 once (one rank each), 30 twice per rank, 40 once per rank: ×0.5.
    assert np.allclose(after - before, np.array([-0.5, -0.5, -2.0, -1.0])[:, None])
    # A prefetched batch is local to its forward; it still reads the same values.
    emb.prefetch(torch.tensor([50 + node.rank]))
    assert torch.equal(emb(torch.tensor([50 + node.rank])), torch.from_numpy(w.pull("emb", torch.tensor([50 + node.rank]))))
    w.barrier()


def test_an_intent_prefetch_brings_the_rows_by_the_intended_clock(cluster):
    import time

    node, w = cluster
    emb = ferry.torch.Embedding(w, "emb", DIM, lr=0.5)
    with pytest.raises(ValueError, match="clocks_ahead"):
        emb.prefetch(torch.tensor([1]), clocks_ahead=0)
    # Keys homed at the other rank (range partitioning: rank 0 homes 0..50).
    theirs = torch.arange((1 - node.rank) * 50 + 10, (1 - node.rank) * 50 + 15)
    expected = w.pull("emb", theirs)
    w.barrier()
    before = node.stats().intent_relocations
    emb.prefetch(theirs, clocks_ahead=1)
    w.advance_clock()  # the intended clock: the service moves the rows here by itself
    deadline = time.time() + 20
    while node.stats().intent_relocations < before + len(theirs) and time.time() < deadline:
        time.sleep(0.01)
    assert node.stats().intent_relocations >= before + len(theirs)
    local = node.stats().local_accesses
    assert torch.equal(emb(theirs), torch.from_numpy(expected))
    assert node.stats().local_accesses >= local + len(theirs), "the rows were read here"
    w.advance_clock()  # the intent's clock has passed
    w.barrier()


def test_a_server_side_updater_applies_the_embeddings_gradients(cluster):
    node, w = cluster
    # lr=None: the gradient itself is pushed, and the table's SGD (rate 0.5) applies it where
    # each key lives: the same rows as worker-side SGD at 0.5 above.
    emb = ferry.torch.Embedding(w, "served", DIM, lr=None)
    ids = torch.tensor([[20 + node.rank, 30], [30, 40]])
    before = w.pull("served", torch.tensor([20, 21, 30, 40]))
    w.barrier()
    emb(ids).sum().backward()
    w.barrier()
    after = w.pull("served", torch.tensor([20, 21, 30, 40]))
    assert np.allclose(after - before, np.array([-0.5, -0.5, -2.0, -1.0])[:, None])
    w.barrier()
