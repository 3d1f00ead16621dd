//! Checkpoint loading for kimi-infer.
//!
//! A [`Checkpoint`] is a Hugging Face model directory: `config.json` plus either one
//! `model.safetensors` or shards listed by `model.safetensors.index.json`. Every shard is
//! memory-mapped once and its header validated when the checkpoint is opened, so a truncated,
//! corrupt or inconsistent checkpoint fails at [`Checkpoint::open`] with an error naming the
//! file. Tensors are then borrowed as [`TensorView`]s, looked up by their safetensors names
//! (the hub names of `shared/docs/kimi-linear-spec.md` §2), never by PyTorch module names.
//!
//! ```no_run
//! use std::collections::HashSet;
//! use std::path::Path;
//!
//! # fn main() -> Result<(), kimi_weights::WeightsError> {
//! let ckpt = kimi_weights::Checkpoint::open(Path::new("/models/Kimi-Linear-48B-A3B-Instruct"))?;
//! let hidden = ckpt.config().hidden_size;
//! let norm = ckpt.get_shaped("model.norm.weight", &[hidden])?.to_f32_vec();
//! let mut used = HashSet::new();
//! used.insert("model.norm.weight".to_string());
//! // ... load every other tensor, recording its name ...
//! ckpt.check_all_used(&used)?;
//! # let _ = norm;
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

mod error;
mod header;
mod near;
mod view;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use kimi_core::{DType, ModelConfig};
use memmap2::Mmap;
use serde_json::Value;

pub use error::WeightsError;
pub use view::TensorView;

use error::{corrupt, io};
use header::RawTensor;

/// File name of a single-file checkpoint.
const SINGLE_FILE: &str = "model.safetensors";
/// File name of the shard index.
const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the model configuration.
const CONFIG_FILE: &str = "config.json";

/// An opened checkpoint directory: the parsed config and every tensor of every shard. The
/// tensors are those of its [`SafetensorsDir`] (`Deref`).
pub struct Checkpoint {
    config: ModelConfig,
    config_json: Value,
    files: SafetensorsDir,
}

/// The safetensors files of a model directory, whatever its config describes: one
/// `model.safetensors` or the shards `model.safetensors.index.json` lists, memory-mapped,
/// every header validated.
pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, Entry>,
    read_observer: Option<ReadObserver>,
}

/// Told the size in bytes of each tensor [`Checkpoint::get`] hands out: loaders read every
/// tensor once, so the sum against [`Checkpoint::total_bytes`] is their progress.
pub type ReadObserver = Arc<dyn Fn(u64) + Send + Sync>;

impl std::fmt::Debug for Checkpoint {
    /// A summary: the directory, the shards and the number of tensors (not every entry).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.files.fmt(f)
    }
}

impl std::fmt::Debug for SafetensorsDir {
    /// A summary: the directory, the shards and the number of tensors (not every entry).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field(
                "shards",
                &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("num_tensors", &self.tensors.len())
            .field("total_bytes", &self.total_bytes())
            .finish_non_exhaustive()
    }
}

/// One memory-mapped safetensors file.
#[derive(Debug)]
struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// Where one tensor lives.
#[derive(Debug)]
struct Entry {
    shard: usize,
    dtype: Option<DType>,
    dtype_name: String,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

impl Checkpoint {
    /// Opens a directory holding config.json and either model.safetensors or a sharded set
    /// described by model.safetensors.index.json. Every shard is memory-mapped and its header parsed.
    ///
    /// When both layouts are present the single file wins, as in transformers. Fails if
    /// `config.json` is not a supported Kimi Linear config, a shard is truncated or malformed,
    /// the index and the shards disagree, or a tensor is stored twice.
    pub fn open(dir: &Path) -> Result<Checkpoint, WeightsError> {
        let (config, config_json) = read_config(&dir.join(CONFIG_FILE))?;
        Ok(Checkpoint {
            config,
            config_json,
            files: SafetensorsDir::open(dir)?,
        })
    }

    /// The validated model configuration, parsed from config.json.
    pub fn config(&self) -> &kimi_core::ModelConfig {
        &self.config
    }

    /// config.json as decoded JSON.
    pub fn config_json(&self) -> &serde_json::Value {
        &self.config_json
    }
}

impl std::ops::Deref for Checkpoint {
    type Target = SafetensorsDir;
    fn deref(&self) -> &SafetensorsDir {
        &self.files
    }
}

impl std::ops::DerefMut for Checkpoint {
    fn deref_mut(&mut self) -> &mut SafetensorsDir {
        &mut self.files
    }
}

impl SafetensorsDir {
    /// Opens the safetensors files of `dir`: `model.safetensors`, else the shards
    /// `model.safetensors.index.json` lists (the single file wins where both are present,
    /// as in transformers). Fails if a shard is truncated or malformed, the index and the
    /// shards disagree, or a tensor is stored twice.
    pub fn open(dir: &Path) -> Result<SafetensorsDir, WeightsError> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let (shards, tensors) = if single.is_file() {
            let (shard, raw) = open_shard(single)?;
            let mut tensors = HashMap::with_capacity(raw.len());
            add_shard_tensors(&mut tensors, &[], 0, &shard.path, raw)?;
            (vec![shard], tensors)
        } else if index.is_file() {
            open_sharded(dir, &index)?
        } else {
            return Err(WeightsError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        Ok(SafetensorsDir {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            read_observer: None,
        })
    }

    /// Reports every tensor [`Checkpoint::get`] hands out to `observer` from now on.
    pub fn set_read_observer(&mut self, observer: ReadObserver) {
        self.read_observer = Some(observer);
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether a tensor called `name` is stored (of any dtype).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The stored shape of `name`, if it is stored.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.tensors.get(name).map(|e| e.shape.as_slice())
    }

    /// Up to five stored names that nearly match `name` (same path with one module renamed,
    /// added or dropped, or a segment respelled), closest first.
    pub fn near_names(&self, name: &str) -> Vec<String> {
        near::near_names(name, self.tensors.keys().map(String::as_str))
    }

    /// The tensor called `name`. Fails with [`WeightsError::Missing`] (naming the tensor, the
    /// files searched and the stored names that nearly match) or
    /// [`WeightsError::UnsupportedDType`] for dtypes other than F32/F16/BF16/U8.
    pub fn get(&self, name: &str) -> Result<TensorView<'_>, WeightsError> {
        let Some((key, entry)) = self.tensors.get_key_value(name) else {
            return Err(WeightsError::Missing {
                name: name.to_string(),
                files: self.shards.iter().map(|s| s.path.clone()).collect(),
                near: self.near_names(name),
            });
        };
        let Some(shard) = self.shards.get(entry.shard) else {
            return Err(WeightsError::Missing {
                name: name.to_string(),
                files: Vec::new(),
                near: Vec::new(),
            });
        };
        let Some(dtype) = entry.dtype else {
            return Err(WeightsError::UnsupportedDType {
                name: key.clone(),
                file: shard.path.clone(),
                dtype: entry.dtype_name.clone(),
            });
        };
        // The range was checked against the file when it was opened.
        let bytes = shard
            .map
            .get(entry.start..entry.end)
            .ok_or_else(|| corrupt(&shard.path, format!("tensor `{key}` lies outside the file")))?;
        if let Some(observer) = &self.read_observer {
            observer(bytes.len() as u64);
        }
        Ok(TensorView {
            name: key,
            file: &shard.path,
            shape: &entry.shape,
            dtype,
            bytes,
        })
    }

    /// [`Checkpoint::get`], then checks the shape: a mismatch gives [`WeightsError::Shape`]
    /// naming the tensor, the file, and the expected and found shapes.
    pub fn get_shaped(
        &self,
        name: &str,
        expected: &[usize],
    ) -> Result<TensorView<'_>, WeightsError> {
        let view = self.get(name)?;
        if view.shape != expected {
            return Err(WeightsError::Shape {
                name: name.to_string(),
                file: view.file.to_path_buf(),
                expected: expected.to_vec(),
                found: view.shape.to_vec(),
            });
        }
        Ok(view)
    }

    /// Errors naming every tensor in the checkpoint that is not in `used` (unexpected tensors).
    pub fn check_all_used(&self, used: &HashSet<String>) -> Result<(), WeightsError> {
        let mut names: Vec<String> = self
            .tensors
            .keys()
            .filter(|n| !used.contains(*n))
            .cloned()
            .collect();
        if names.is_empty() {
            return Ok(());
        }
        names.sort_unstable();
        Err(WeightsError::Unexpected { names })
    }

    /// Total bytes of tensor data over all shards (headers not counted).
    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .values()
            .map(|e| (e.end - e.start) as u64)
            .sum()
    }
}

/// Reads and validates `config.json`.
fn read_config(path: &Path) -> Result<(ModelConfig, Value), WeightsError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let config_error = |source| WeightsError::Config {
        path: path.to_path_buf(),
        source,
    };
    let json: Value = serde_json::from_str(&text).map_err(|e| config_error(e.into()))?;
    let config = ModelConfig::from_json(&json).map_err(config_error)?;
    Ok((config, json))
}

/// Memory-maps one safetensors file and validates its header.
fn open_shard(path: PathBuf) -> Result<(Shard, Vec<RawTensor>), WeightsError> {
    let file = File::open(&path).map_err(io(&path))?;
    let len = file.metadata().map_err(io(&path))?.len();
    if len < 8 {
        return Err(corrupt(
            &path,
            format!("the file is {len} bytes long, too short for a safetensors header"),
        ));
    }
    // SAFETY: the mapping is only ever read, through `&[u8]`, and lives as long as the
    // `Checkpoint`. Memory maps are unsafe because another process may modify or truncate the
    // file while it is mapped, which would change or invalidate the bytes under us. As with
    // ripgrep's mmap searching, kimi-infer treats checkpoint files as read-only for the
    // lifetime of the process; modifying them while a model is loaded is the user's risk
    // (at worst wrong weights or a SIGBUS, as with any memory-mapped file).
    let map = unsafe { Mmap::map(&file) }.map_err(io(&path))?;
    let raw = header::parse(&path, &map)?;
    Ok((Shard { path, map }, raw))
}

/// Adds the tensors of shard `index` to `tensors`; a name already present elsewhere is a
/// [`WeightsError::Duplicate`].
fn add_shard_tensors(
    tensors: &mut HashMap<String, Entry>,
    shards: &[Shard],
    index: usize,
    path: &Path,
    raw: Vec<RawTensor>,
) -> Result<(), WeightsError> {
    for t in raw {
        if let Some(existing) = tensors.get(&t.name) {
            let first = shards
                .get(existing.shard)
                .map_or_else(|| path.to_path_buf(), |s| s.path.clone());
            return Err(WeightsError::Duplicate {
                name: t.name,
                files: vec![first, path.to_path_buf()],
            });
        }
        let entry = Entry {
            shard: index,
            dtype: t.dtype,
            dtype_name: t.dtype_name,
            shape: t.shape,
            start: t.start,
            end: t.end,
        };
        tensors.insert(t.name, entry);
    }
    Ok(())
}

/// Opens every shard named by the index and checks that the index and the shards agree.
fn open_sharded(
    dir: &Path,
    index_path: &Path,
) -> Result<(Vec<Shard>, HashMap<String, Entry>), WeightsError> {
    let weight_map = read_index(index_path)?;
    let index_error = |reason: String| WeightsError::Index {
        path: index_path.to_path_buf(),
        reason,
    };
    // Shard file name -> tensors the index puts there; sorted, so shards open in name order.
    let mut by_file: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (tensor, file) in &weight_map {
        by_file
            .entry(file.as_str())
            .or_default()
            .push(tensor.as_str());
    }
    let mut shards = Vec::with_capacity(by_file.len());
    let mut tensors = HashMap::with_capacity(weight_map.len());
    for (file, listed) in &by_file {
        let path = dir.join(file);
        if !path.is_file() {
            return Err(index_error(format!(
                "weight_map puts {} tensors (such as `{}`) in {file}, but {} does not exist",
                listed.len(),
                listed.first().copied().unwrap_or("?"),
                path.display()
            )));
        }
        let (shard, raw) = open_shard(path)?;
        let shard_path = shard.path.clone();
        add_shard_tensors(&mut tensors, &shards, shards.len(), &shard_path, raw)?;
        shards.push(shard);
    }
    for (tensor, file) in &weight_map {
        let actual = tensors.get(tensor).and_then(|e| shards.get(e.shard));
        if actual.is_none_or(|s| s.path.file_name() != Some(file.as_ref())) {
            let found = actual.map_or_else(
                || "no shard holds it".to_string(),
                |s| format!("it is in {}", s.path.display()),
            );
            return Err(index_error(format!(
                "weight_map says tensor `{tensor}` is in {file}, but {file} does not contain it ({found})"
            )));
        }
    }
    Ok((shards, tensors))
}

/// Reads `weight_map` of a shard index: tensor name -> shard file name.
fn read_index(path: &Path) -> Result<Vec<(String, String)>, WeightsError> {
    let index_error = |reason: String| WeightsError::Index {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| index_error(format!("not valid JSON: {e}")))?;
    let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
        return Err(index_error("has no `weight_map` object".into()));
    };
    if map.is_empty() {
        return Err(index_error("`weight_map` is empty".into()));
    }
    map.iter()
        .map(|(tensor, file)| {
            let Some(file) = file.as_str() else {
                return Err(index_error(format!(
                    "weight_map entry `{tensor}` is not a file name"
                )));
            };
            let mut parts = Path::new(file).components();
            if !matches!(
                (parts.next(), parts.next()),
                (Some(Component::Normal(_)), None)
            ) {
                return Err(index_error(format!(
                    "weight_map entry `{tensor}` names {file:?}, which is not a plain file name in \
                     the checkpoint directory"
                )));
            }
            Ok((tensor.clone(), file.to_string()))
        })
        .collect()
}
