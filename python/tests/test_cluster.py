"""Ferry's Python bindings on a cluster: run by every process of `ferry launch -n 2 -- python -m pytest`.

Each test runs on every rank; they meet in barriers, so every rank runs the same tests in the
same order.
"""

import os
import subprocess
import sys
import threading
import tempfile

import numpy as np
import pytest

import ferry

KEYS, LEN = 1000, 4


def run_alone(script, *args):
    """Runs `script` in a Python process of its own, as a cluster of one node (the 2-process
    cluster's variables replaced); returns its standard output, failing on a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k != "FERRY_COORDINATOR"}
    env.update(FERRY_RANK="0", FERRY_NODES="1")
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def cluster():
    node = ferry.Node.start([("params", KEYS, LEN), ("counts", 10, 1)])
    worker = node.worker()
    yield node, worker
    worker.close()
    node.finalize()


def test_every_rank_joined(cluster):
    node, _ = cluster
    assert node.nodes == 2
    assert 0 <= node.rank < node.nodes


def test_pushes_from_every_rank_add_up(cluster):
    node, w = cluster
    keys = np.arange(KEYS, dtype=np.uint64)
    w.push("params", keys, np.full((KEYS, LEN), node.rank + 1, dtype=np.float32))
    w.barrier()
    values = w.pull("params", keys)
    assert values.shape == (KEYS, LEN) and values.dtype == np.float32
    assert np.all(values == 3.0)  # 1 from rank 0, 2 from rank 1
    w.barrier()


def test_pull_into_a_callers_array_and_async_operations(cluster):
    node, w = cluster
    keys = np.array([5, 999, 5], dtype=np.uint64)
    out = np.zeros((3, LEN), dtype=np.float32)
    w.pull_into("params", keys, out)
    assert np.all(out == 3.0)
    ticket = w.push_async("counts", np.array([node.rank], dtype=np.uint64), np.ones(1, dtype=np.float32))
    w.wait(ticket)
    w.barrier()
    ticket = w.pull_async("counts", np.arange(2, dtype=np.uint64))
    assert w.wait_pull(ticket).tolist() == [[1.0], [1.0]]
    w.barrier()
    if node.rank == 0:
        w.wait(w.set_async("counts", np.array([9], dtype=np.uint64), np.array([7.5], dtype=np.float32)))
    w.barrier()
    assert w.pull("counts", np.array([9], dtype=np.uint64)).tolist() == [[7.5]]
    w.wait(w.localize_async("counts", np.array([9], dtype=np.uint64)))
    w.barrier()


def test_localize_moves_keys_here(cluster):
    node, w = cluster
    mine = np.arange(node.rank * 10, node.rank * 10 + 10, dtype=np.uint64)
    before = node.stats()["relocations_in"]
    w.localize("params", mine)
    w.pull("params", mine)
    assert node.stats()["relocations_in"] >= before
    w.barrier()


def test_intent_moves_keys_here_in_time(cluster):
    import time

    node, w = cluster
    # Keys homed at the other rank (range partitioning: rank 0 homes 0..500).
    theirs = np.arange((1 - node.rank) * 500 + 300, (1 - node.rank) * 500 + 310, dtype=np.uint64)
    before = node.stats()["intent_relocations"]
    clock = w.current_clock()
    w.intent("params", theirs, clock + 1, clock + 3)
    deadline = time.time() + 20
    while node.stats()["intent_relocations"] < before + len(theirs) and time.time() < deadline:
        time.sleep(0.01)
    assert node.stats()["intent_relocations"] >= before + len(theirs)
    assert w.advance_clock() == clock + 1
    with pytest.raises(ferry.FerryError):
        w.intent("params", theirs, 5, 2)
    w.barrier()


def test_waits_release_the_gil(cluster):
    _, w = cluster
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    for _ in range(20):
        w.pull("params", np.arange(KEYS, dtype=np.uint64))
    w.barrier()
    stop.set()
    thread.join()
    assert ticks, "another Python thread ran while the worker waited"


def test_errors_raise_ferry_error(cluster):
    _, w = cluster
    with pytest.raises(ferry.FerryError, match="outside table"):
        w.pull("params", np.array([KEYS + 5], dtype=np.uint64))
    with pytest.raises(ferry.FerryError, match="no table"):
        w.pull("nope", np.array([1], dtype=np.uint64))
    with pytest.raises(ferry.FerryError, match="expected 8 values"):
        w.push("params", np.array([1, 2], dtype=np.uint64), np.ones(3, dtype=np.float32))
    with pytest.raises(ferry.FerryError, match="C-contiguous"):
        w.pull_into("params", np.array([1, 2], dtype=np.uint64), np.zeros((LEN, 2), dtype=np.float32).T)
    with pytest.raises(ferry.FerryError, match="C-contiguous"):
        w.push("params", np.array([1], dtype=np.uint64), np.zeros(2 * LEN, dtype=np.float32)[::2])
    with pytest.raises(ferry.FerryError, match="uint64 or int64"):
        w.pull("params", np.array([1.5]))
    w.barrier()


def test_a_checkpoint_restores_on_one_node(cluster):
    import json
    import tempfile

    node, w = cluster
    # The same directory on every rank: named after this cluster's coordinator.
    tag = os.environ.get("FERRY_COORDINATOR", "local").replace(":", "-").replace(".", "-")
    directory = os.path.join(tempfile.gettempdir(), f"ferry-python-checkpoint-{tag}")
    keys = np.arange(20, dtype=np.uint64)
    if node.rank == 0:
        w.set("params", keys, np.arange(20 * LEN, dtype=np.float32).reshape(20, LEN))
    # Intent's relocations held on every node before the barrier: the intents declared by an
    # earlier test keep the node's intent service running, and a checkpoint without the hold
    # would be refused.
    with node.relocations_held():
        w.barrier()
        node.checkpoint(directory)
        w.barrier()
        with pytest.raises(ferry.FerryError, match="already holds a checkpoint"):
            node.checkpoint(directory)
    with pytest.raises(ferry.FerryError, match="hold_relocations"):
        node.checkpoint(directory + "-unheld")
    w.barrier()
    if node.rank == 0:
        # One process alone restores what the two wrote.
        script = (
            "import json, sys, numpy as np, ferry\n"
            f"node = ferry.Node.start([('params', {KEYS}, {LEN}), ('counts', 10, 1)], restore_from=sys.argv[1])\n"
            "w = node.worker()\n"
            "print(json.dumps(w.pull('params', np.arange(20, dtype=np.uint64)).tolist()))\n"
            "w.close()\n"
            "node.finalize()\n"
        )
        restored = np.array(json.loads(run_alone(script, directory).strip().splitlines()[-1]), dtype=np.float32)
        assert np.array_equal(restored, np.arange(20 * LEN, dtype=np.float32).reshape(20, LEN))
        # Read without a cluster: every table whole, as NumPy arrays.
        tables = ferry.read_checkpoint(directory)
        assert sorted(tables) == ["counts", "params"]
        assert tables["params"].shape == (KEYS, LEN) and tables["params"].dtype == np.float32
        assert np.array_equal(tables["params"][:20], np.arange(20 * LEN, dtype=np.float32).reshape(20, LEN))
        os.remove(os.path.join(directory, "node-1.manifest"))
        with pytest.raises(ferry.FerryError, match="node-1.manifest is missing"):
            ferry.read_checkpoint(directory)
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)
    w.barrier()


def test_a_node_in_a_with_block_finalizes_or_aborts(cluster):
    node, w = cluster
    if node.rank == 0:
        # One process alone: a block that raises aborts its node (the exception goes on), one
        # that ends finalizes it; either way the node is closed after the block.
        script = (
            "import numpy as np, ferry\n"
            "try:\n"
            "    with ferry.Node.start([('t', 10, 2)]) as node:\n"
            "        node.worker().close()\n"
            "        raise ValueError('boom')\n"
            "except ValueError:\n"
            "    pass\n"
            "try:\n"
            "    node.rank\n"
            "    raise SystemExit('the aborted node still answers')\n"
            "except ferry.FerryError:\n"
            "    pass\n"
            "with ferry.Node.start([('t', 10, 2)]) as node:\n"
            "    w = node.worker()\n"
            "    w.push('t', np.arange(3, dtype=np.uint64), np.ones((3, 2), dtype=np.float32))\n"
            "    assert w.pull('t', np.arange(3, dtype=np.uint64)).sum() == 6.0\n"
            "    w.close()\n"
            "try:\n"
            "    node.finalize()\n"
            "    raise SystemExit('finalized twice')\n"
            "except ferry.FerryError:\n"
            "    pass\n"
            "print('with-block ok')\n"
        )
        assert "with-block ok" in run_alone(script)
    w.barrier()


def test_a_refused_leave_keeps_the_node(cluster):
    node, w = cluster
    if node.rank == 0:
        # Alone and without backups a node cannot leave (nothing to hand its keys to): the
        # error says why, and the node goes on.
        script = (
            "import numpy as np, ferry\n"
            "node = ferry.Node.start([('t', 10, 2)])\n"
            "try:\n"
            "    node.leave()\n"
            "    raise SystemExit('a node of one left')\n"
            "except ferry.FerryError as e:\n"
            "    assert 'FERRY_BACKUPS=1' in str(e), e\n"
            "w = node.worker()\n"
            "w.push('t', np.arange(3, dtype=np.uint64), np.ones((3, 2), dtype=np.float32))\n"
            "w.close()\n"
            "node.finalize()\n"
            "print('refused leave ok')\n"
        )
        assert "refused leave ok" in run_alone(script)
    w.barrier()


def test_table_options_and_push_pull(cluster):
    node, w = cluster
    with pytest.raises(ferry.FerryError, match="partitioning 'diagonal'"):
        ferry.Table("t", 10, 2, partitioning="diagonal")
    with pytest.raises(ferry.FerryError, match="virtual-node count"):
        ferry.Table("t", 10, 2, partitioning="consistent:0")
    assert 'partitioning="consistent:128"' in repr(ferry.Table("t", 10, 2, partitioning="consistent"))
    with pytest.raises(ferry.FerryError, match="updater 'adagrad:x'"):
        ferry.Table("t", 10, 2, updater="adagrad:x")
    with pytest.raises(ferry.FerryError, match="outside table"):
        ferry.Table("t", 10, 2, replicated=[3, 10])
    with pytest.raises(ferry.FerryError, match="SEED or SEED:signed"):
        ferry.Table("t", 10, 2, feature_hashing="7:sign")
    assert "feature_hashing=\"7:signed\"" in repr(ferry.Table("t", 10, 2, feature_hashing="7:signed"))
    assert "dynamic=100" in repr(ferry.Table("ids", 0, 2, dynamic=100, init="normal:0.1"))
    with pytest.raises(ferry.FerryError, match="pass keys=0"):
        ferry.Table("ids", 10, 2, dynamic=100)
    with pytest.raises(ferry.FerryError, match="only a dynamic table"):
        ferry.Table("ids", 10, 2, init="zeros")
    with pytest.raises(ferry.FerryError, match="expected zeros"):
        ferry.Table("ids", 0, 2, dynamic=100, init="gauss")
    assert 'admission="count:2"' in repr(ferry.Table("ids", 0, 2, dynamic=100, admission="count:2"))
    # A dynamic table's replicated keys are raw ids, any uint64 (distinct ones counted).
    assert "replicated ids: 3" in repr(ferry.Table("ids", 0, 2, dynamic=100, replicated=[5, 2**64 - 1, 5, 7]))
    with pytest.raises(ferry.FerryError, match="at least 1"):
        ferry.Table("ids", 0, 2, dynamic=100, admission="count:0")
    assert 'eviction="ttl:0.5"' in repr(ferry.Table("ids", 0, 2, dynamic=100, eviction="ttl:0.5"))
    with pytest.raises(ferry.FerryError, match="expected never, lfu or ttl"):
        ferry.Table("ids", 0, 2, dynamic=100, eviction="fifo")
    with pytest.raises(ferry.FerryError, match="only a dynamic table"):
        ferry.Table("ids", 10, 2, eviction="lfu")
    t = ferry.Table("t", 10, 2, updater="sgd:0.5", partitioning="hash", codec="bf16", key_cache_min=64)
    assert t.name == "t" and "sgd" in repr(t)
    assert "replicated keys: 2" in repr(ferry.Table("hot", 10, 2, replicated=[0, 1]))
    # A plan of `ferry partition` (written by hand here, for one node): the examples it gives a
    # node, and a table homed by it; damaged plans and missing nodes raise.
    plan = os.path.join(tempfile.mkdtemp(), "one-node.plan")
    with open(plan, "w") as f:
        f.write("ferry-plan 1\nnodes 1\nkeys 10\nexamples 3\nbatch 1\ndata 0\nhomes\n" + "0\n" * 10 + "examples\n0\n0\n0\nend\n")
    assert ferry.plan_examples(plan, 0) == [0, 1, 2]
    with pytest.raises(ferry.FerryError, match="no node 1"):
        ferry.plan_examples(plan, 1)
    with pytest.raises(ferry.FerryError, match="not a plan"):
        ferry.plan_examples(__file__, 0)
    with pytest.raises(ferry.FerryError, match="reading the plan"):
        ferry.Table("t", 10, 2, plan="/nonexistent.plan")
    if node.rank == 0:
        # One process alone: a server-side SGD table, and push_pull's answer after its push.
        script = (
            "import os, tempfile, numpy as np, ferry\n"
            "os.environ['FERRY_SPILL_DIR'] = tempfile.mkdtemp()\n"
            "words = ferry.Table('words', 8, 1, feature_hashing='5:signed')\n"
            f"placed = ferry.Table('placed', 10, 1, plan={plan!r})\n"
            "ids = ferry.Table('ids', 0, 2, dynamic=16)\n"
            "recent = ferry.Table('recent', 0, 1, dynamic=16, eviction='ttl:0.1')\n"
            "with ferry.Node.start([ferry.Table('t', 10, 2, updater='sgd:0.5', partitioning='consistent:8'), ('plain', 4, 1), words, placed, ids, recent]) as node:\n"
            "    w = node.worker()\n"
            "    keys = np.arange(3, dtype=np.uint64)\n"
            "    w.set('t', keys, np.ones((3, 2), dtype=np.float32))\n"
            "    after = w.push_pull('t', keys, np.full((3, 2), 2.0, dtype=np.float32))\n"
            "    assert np.all(after == 0.0), after  # 1 - 0.5 * 2\n"
            "    # Raw ids of a feature-hashed table: any uint64, and strings' ids.\n"
            "    ids = np.array([2**64 - 1, ferry.feature_id('colour=blue')], dtype=np.uint64)\n"
            "    w.set('words', ids[:1], np.array([[-2.5]], dtype=np.float32))\n"
            "    assert w.pull('words', ids[:1])[0, 0] == -2.5\n"
            "    w.push('words', ids, np.ones((2, 1), dtype=np.float32))\n"
            "    w.push('placed', keys, np.ones((3, 1), dtype=np.float32))\n"
            "    assert np.all(w.pull('placed', keys) == 1.0)\n"
            "    # A dynamic table: raw ids created when first touched, at zeros here.\n"
            "    raw = np.array([2**64 - 1, 7, 2**40], dtype=np.uint64)\n"
            "    w.push('ids', raw, np.full((3, 2), 1.5, dtype=np.float32))\n"
            "    assert np.all(w.pull('ids', raw) == 1.5)\n"
            "    # pull_held reads what the table holds and creates nothing.\n"
            "    values, held = w.pull_held('ids', np.array([7, 8], dtype=np.uint64))\n"
            "    assert held.dtype == np.bool_ and list(held) == [True, False], held\n"
            "    assert values.shape == (2, 2) and np.all(values[0] == 1.5) and np.all(values[1] == 0.0), values\n"
            "    assert not w.pull_held('ids', np.array([8], dtype=np.uint64))[1][0]\n"
            "    # Ids of a table that evicts: unused for its time to live, they read as new.\n"
            "    import time\n"
            "    w.push('recent', raw, np.ones((3, 1), dtype=np.float32))\n"
            "    deadline = time.time() + 20\n"
            "    while node.stats().ids_evicted < 3 and time.time() < deadline:\n"
            "        time.sleep(0.05)\n"
            "    assert node.stats()['ids_evicted'] == 3, node.stats().as_dict()\n"
            "    assert np.all(w.pull('recent', raw) == 0.0)\n"
            "    # Its checkpoint names rows by id; read whole: (ids ascending, their rows).\n"
            "    import tempfile, os\n"
            "    d = os.path.join(tempfile.mkdtemp(), 'ck')\n"
            "    w.close()\n"
            "    node.checkpoint(d)\n"
            "    # The evicted ids spilled with the values they had (synced by the checkpoint).\n"
            "    spilled_ids, spilled = ferry.read_spill(os.path.join(os.environ['FERRY_SPILL_DIR'], 'recent.node-0.spill'))\n"
            "    assert sorted(int(i) for i in spilled_ids) == sorted(int(i) for i in raw) and np.all(spilled == 1.0), (spilled_ids, spilled)\n"
            "    ids, rows = ferry.read_checkpoint(d)['ids']\n"
            "    assert ids.dtype == np.uint64 and list(ids) == sorted(int(i) for i in raw), ids\n"
            "    assert rows.shape == (3, 2) and np.all(rows == 1.5), rows\n"
            "    w = node.worker()\n"
            "    w.close()\n"
            "print('table options ok')\n"
        )
        assert "table options ok" in run_alone(script)
    w.barrier()


def test_ranges_push_pull_async_sampling_and_typed_stats(cluster):
    node, w = cluster
    # Ranges: every rank pushes ones to keys 100..110; a range pull reads what key pulls read.
    w.push_range("params", 100, 110, np.ones((10, LEN), dtype=np.float32))
    w.barrier()
    assert np.all(w.pull_range("params", 100, 110) - w.pull("params", np.arange(100, 110, dtype=np.uint64)) == 0)
    with pytest.raises(ferry.FerryError, match="not within table"):
        w.pull_range("params", 10, KEYS + 1)
    # push_pull, asynchronously: its answer holds its own push.
    before = w.pull("params", np.array([200], dtype=np.uint64))
    ticket = w.push_pull_async("params", np.array([200], dtype=np.uint64), np.full((1, LEN), 0.5, dtype=np.float32))
    after = w.wait_pull(ticket)
    assert np.all(after - before >= 0.5 - 1e-6)
    w.barrier()
    # Sampling (NuPS): 64 keys of 500..600, weighted to the upper half only.
    weights = [0.0] * 50 + [1.0] * 50
    dist = w.register_distribution("params", 500, 600, "reuse:16:2", weights=weights)
    handle = w.prepare_sample(dist, 64)
    keys, values = w.pull_sample(handle, 40)
    more, _ = w.pull_sample(handle, 24)
    assert keys.dtype == np.uint64 and values.shape == (40, LEN)
    assert np.all((np.concatenate([keys, more]) >= 550) & (np.concatenate([keys, more]) < 600))
    with pytest.raises(ferry.FerryError, match="not a prepared sample"):
        w.pull_sample(handle, 1)  # handed out entirely: gone
    with pytest.raises(ferry.FerryError, match="weights"):
        w.register_distribution("params", 0, 10, weights=[1.0])
    # Statistics as an object, also read by name.
    stats = node.stats()
    assert isinstance(stats, ferry.Stats)
    assert stats.local_accesses > 0 and stats["local_accesses"] == stats.local_accesses
    assert stats.messages_by_kind["access"] >= 0 and sum(stats.bytes_by_kind.values()) == stats.bytes_sent
    # Two nodes have talked (barriers at least): both directions are counted.
    assert stats.bytes_sent > 0 and stats.bytes_received > 0 and stats["bytes_received"] == stats.bytes_received
    assert set(stats.as_dict()) >= {"local_accesses", "remote_accesses", "relocation_p99_s"}
    with pytest.raises(KeyError):
        stats["nothing"]
    w.barrier()
