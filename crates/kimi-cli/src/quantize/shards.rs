//! The output files of `quantize`, and resuming an interrupted run.
//!
//! Tensors go into shards of whole layers (about `--max-shard-gb` each, the rest of the
//! model with the first layer), as `save_pretrained` names them
//! (`model-00001-of-00004.safetensors` + `model.safetensors.index.json`; one shard is
//! `model.safetensors`). Each shard is written as `NAME.partial` and renamed when whole, and
//! `quantize-plan.json`, written first, records the request and which tensors each shard
//! holds. `--resume` on the same request keeps the shards already renamed and redoes the
//! rest (calibrating only the layers left); `config.json` comes last, so a directory without
//! it is never mistaken for a finished checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};

use super::Entry;

/// The file recording the request and the shards.
pub const PLAN_FILE: &str = "quantize-plan.json";

/// One output file and the entries (indices into the entry list) it holds, in order.
pub struct Shard {
    pub file: String,
    pub entries: Vec<usize>,
    /// Whether a previous run finished it.
    pub done: bool,
}

/// The shards of `entries`: whole layers (`layer` of each entry's name; `None` for tensors
/// outside the layers), in layer order, a new shard where the next layer would take one past
/// `max_bytes`.
pub fn plan(
    entries: &[Entry],
    layer: impl Fn(&str) -> Option<usize>,
    max_bytes: usize,
) -> Vec<Shard> {
    let mut by_layer: BTreeMap<Option<usize>, Vec<usize>> = BTreeMap::new();
    for (i, e) in entries.iter().enumerate() {
        by_layer.entry(layer(&e.name)).or_default().push(i);
    }
    let mut shards: Vec<(usize, Vec<usize>)> = Vec::new();
    for (_, ids) in by_layer {
        let bytes: usize = ids.iter().map(|&i| entries[i].bytes()).sum();
        match shards.last_mut() {
            Some((b, v)) if *b + bytes <= max_bytes || v.is_empty() => {
                *b += bytes;
                v.extend(ids);
            }
            _ => shards.push((bytes, ids)),
        }
    }
    if shards.is_empty() {
        shards.push((0, Vec::new()));
    }
    let n = shards.len();
    shards
        .into_iter()
        .enumerate()
        .map(|(i, (_, entries))| Shard {
            file: match n {
                1 => "model.safetensors".to_string(),
                _ => format!("model-{:05}-of-{n:05}.safetensors", i + 1),
            },
            entries,
            done: false,
        })
        .collect()
}

/// The plan file's content for `request` and `shards`.
pub fn plan_json(request: &Value, entries: &[Entry], shards: &[Shard]) -> Value {
    let files: Map<String, Value> = shards
        .iter()
        .map(|s| {
            let names: Vec<&str> = s
                .entries
                .iter()
                .map(|&i| entries[i].name.as_str())
                .collect();
            (s.file.clone(), json!(names))
        })
        .collect();
    json!({"request": request, "shards": files})
}

/// Prepares `out`: a new or empty directory, or with `resume` one holding the same plan,
/// whose finished shards are marked done (a shard counts as finished when its file has the
/// size its header and tensors give).
pub fn prepare(
    out: &Path,
    plan: &Value,
    shards: &mut [Shard],
    sizes: &[usize],
    resume: bool,
) -> anyhow::Result<()> {
    let empty = !out.exists() || std::fs::read_dir(out)?.next().is_none();
    if !empty {
        let path = out.join(PLAN_FILE);
        if !resume {
            bail!(
                "--out {} exists and is not empty{}",
                out.display(),
                if path.is_file() {
                    " (it holds an interrupted run: add --resume to finish it)"
                } else {
                    ""
                }
            );
        }
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "--resume: {} has no {PLAN_FILE}: it is not the output of an interrupted run",
                out.display()
            )
        })?;
        let previous: Value = serde_json::from_str(&text)
            .with_context(|| format!("--resume: {} is not valid JSON", path.display()))?;
        if previous["request"] != plan["request"] {
            bail!(
                "--resume: {} was started with other arguments ({}); give the same ones, or \
                 another --out",
                out.display(),
                previous["request"]
            );
        }
        if previous["shards"] != plan["shards"] {
            bail!(
                "--resume: {} was planned over other tensors; the source changed",
                out.display()
            );
        }
        for (shard, &size) in shards.iter_mut().zip(sizes) {
            let file = out.join(&shard.file);
            shard.done = std::fs::metadata(&file).is_ok_and(|m| m.len() == size as u64);
        }
    } else if resume {
        eprintln!(
            "note: --resume: {} holds no run yet; starting one",
            out.display()
        );
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    std::fs::write(out.join(PLAN_FILE), serde_json::to_string_pretty(plan)?)?;
    Ok(())
}

/// The safetensors header of `ids` (padded to 8 bytes) and the data bytes after it.
pub fn header(entries: &[Entry], ids: &[usize]) -> anyhow::Result<(Vec<u8>, usize)> {
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for &i in ids {
        for (name, dtype, shape, bytes) in &entries[i].outputs {
            header.insert(
                name.clone(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
        }
    }
    let mut bytes = serde_json::to_vec(&Value::Object(header))?;
    while bytes.len() % 8 != 0 {
        bytes.push(b' ');
    }
    Ok((bytes, offset))
}

/// `model.safetensors.index.json` for several shards.
pub fn index(entries: &[Entry], shards: &[Shard], total: usize) -> Value {
    let mut map = Map::new();
    for s in shards {
        for &i in &s.entries {
            for (name, ..) in &entries[i].outputs {
                map.insert(name.clone(), Value::String(s.file.clone()));
            }
        }
    }
    json!({"metadata": {"total_size": total}, "weight_map": map})
}
