//! Datasets: a local cache filled from package archives, and loaders for plain formats.
//!
//! Real data comes from Python packages that ship it (`recbole` for MovieLens-100k and a film
//! knowledge graph, `pykeen` for the Nations, Kinships and UMLS graphs). `fetch` downloads the
//! pinned archive with the ordinary package client, extracts only the data files and checks
//! their SHA-256. Loaders read plain formats — rating rows, TSV triples — so any file of that
//! shape works too.

mod fetch;
pub mod ratings;
pub mod triples;

pub use fetch::{DATASETS, Dataset, cache_dir, dataset_path, fetch};
