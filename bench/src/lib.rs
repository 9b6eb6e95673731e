//! Ferry's benchmarks and ML workloads, shared by the `ferry-bench` binary and the `ferry`
//! command (`ferry data fetch`, `ferry demo`, `ferry train`).

pub mod cluster;
pub mod data;
pub mod micro;
pub mod rawtcp;
pub mod relocate;
pub mod replicate;
pub mod report;
pub mod train;
