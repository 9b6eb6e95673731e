//! The README's example, compiled (and run by the test suite) so that it stays correct.

use ferry::{Config, Node, TableSpec};

fn main() -> ferry::Result<()> {
    // Rank, node count and rendezvous come from FERRY_RANK / FERRY_NODES / FERRY_COORDINATOR,
    // Slurm, Open MPI or PMI; alone, the node runs as a cluster of one.
    let mut node = Node::start(Config::from_env(vec![TableSpec::new("embeddings", 100_000, 64)])?)?;
    let table = node.table("embeddings")?;
    let mut worker = node.worker(); // one per trainer thread
    let keys = [17, 4_242, 99_001];
    worker.localize(table, &keys)?; // move them here
    let mut values = vec![0.0f32; keys.len() * 64];
    worker.pull(table, &keys, &mut values)?; // now local: a latch and a copy
    worker.push(table, &keys, &vec![0.01; keys.len() * 64])?; // cumulative update
    let ticket = worker.push_async(table, &[5], &[1.0; 64])?; // or asynchronously
    worker.wait(ticket)?;
    worker.barrier()?;
    drop(worker);
    node.finalize() // barrier, then every connection closed and every thread joined
}
