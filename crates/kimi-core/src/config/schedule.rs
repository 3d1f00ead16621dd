//! The layer schedule: which mixer and which feed-forward block each decoder layer uses.
//!
//! Two schemas give it (`shared/docs/kimi-linear-spec.md`, "Two config schemas"):
//! * hub: `linear_attn_config.kda_layers` / `full_attn_layers` (**1-indexed**) and
//!   `first_k_dense_replace` + `moe_layer_freq` (MoE iff `i >= first_k_dense_replace &&
//!   i % moe_layer_freq == 0`, the rule of the checkpoint's `modeling_kimi.py`);
//! * transformers-5 native: `layer_types` and `mlp_layer_types`, one entry per layer.
//!
//! Explicit `layer_types` wins over the hub lists; when both schemas are present they must
//! agree. There is no default pattern: the transformers class's default does not match the
//! released schedule (MLA also at layer 26), so a config giving neither is an error.

use super::fields::{as_uint, describe, invalid, Fields, MAX_DIM};
use super::{ConfigError, Ffn, Mixer};

/// The mixer of every layer.
pub(super) fn mixers(
    root: Fields<'_>,
    lac: Option<Fields<'_>>,
    num_layers: usize,
) -> Result<Vec<Mixer>, ConfigError> {
    let native = native_list(root, "layer_types", num_layers, |s| match s {
        "linear_attention" => Some(Mixer::Kda),
        "full_attention" => Some(Mixer::Mla),
        _ => None,
    })?;
    let hub = match lac {
        Some(lac) => hub_mixers(lac, num_layers)?,
        None => None,
    };
    match (native, hub) {
        (Some(native), Some(hub)) if native != hub => Err(disagreement(
            "layer_types",
            "linear_attn_config.kda_layers / full_attn_layers",
            &native,
            &hub,
        )),
        (Some(list), _) | (None, Some(list)) => Ok(list),
        (None, None) => Err(invalid(
            "layer_types",
            "neither `layer_types` nor `linear_attn_config.kda_layers` / `full_attn_layers` is \
             given; kimi-infer does not guess the layer schedule (the transformers default \
             pattern does not match the released checkpoints)",
        )),
    }
}

/// The feed-forward block of every layer. `has_experts` says whether the config names a
/// number of routed experts; without one the hub rule makes every layer dense, as the
/// checkpoint's `configuration_kimi.py` does (`is_moe` is `num_experts is not None`).
pub(super) fn ffns(
    root: Fields<'_>,
    num_layers: usize,
    has_experts: bool,
) -> Result<Vec<Ffn>, ConfigError> {
    let native = native_list(root, "mlp_layer_types", num_layers, |s| match s {
        "dense" => Some(Ffn::Dense),
        "sparse" => Some(Ffn::Moe),
        _ => None,
    })?;
    let hub = hub_ffns(root, num_layers, has_experts)?;
    match (native, hub) {
        (Some(native), Some(hub)) if native != hub => Err(disagreement(
            "mlp_layer_types",
            "first_k_dense_replace / moe_layer_freq",
            &native,
            &hub,
        )),
        (Some(list), _) | (None, Some(list)) => Ok(list),
        (None, None) if has_experts => Err(invalid(
            "mlp_layer_types",
            "the config has routed experts but neither `mlp_layer_types` nor \
             `first_k_dense_replace` says which layers use them (the two reference config \
             classes default differently, so kimi-infer does not guess)",
        )),
        (None, None) => Ok(vec![Ffn::Dense; num_layers]),
    }
}

/// Reads a native per-layer list of strings through `parse`.
fn native_list<T>(
    root: Fields<'_>,
    key: &'static str,
    num_layers: usize,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<Vec<T>>, ConfigError> {
    let Some(items) = root.array_opt(key)? else {
        return Ok(None);
    };
    if items.len() != num_layers {
        return Err(invalid(
            root.name(key),
            format!(
                "has {} entries but num_hidden_layers is {num_layers}",
                items.len()
            ),
        ));
    }
    let allowed = match key {
        "layer_types" => "\"linear_attention\" or \"full_attention\"",
        _ => "\"dense\" or \"sparse\"",
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            item.as_str().and_then(&parse).ok_or_else(|| {
                invalid(
                    format!("{}[{i}]", root.name(key)),
                    format!("expected {allowed}, found {}", describe(item)),
                )
            })
        })
        .collect::<Result<Vec<T>, _>>()
        .map(Some)
}

/// Mixers from the 1-indexed hub lists; either list alone is enough (the other layers are of
/// the other kind), both together must cover every layer exactly once.
fn hub_mixers(lac: Fields<'_>, num_layers: usize) -> Result<Option<Vec<Mixer>>, ConfigError> {
    let kda = one_indexed(lac, "kda_layers", num_layers)?;
    let full = one_indexed(lac, "full_attn_layers", num_layers)?;
    let (listed, rest) = match (&kda, &full) {
        (None, None) => return Ok(None),
        (Some(kda), None) => ((kda, Mixer::Kda), Mixer::Mla),
        (None, Some(full)) => ((full, Mixer::Mla), Mixer::Kda),
        (Some(kda), Some(full)) => return both_lists(lac, kda, full, num_layers).map(Some),
    };
    let mut out = vec![rest; num_layers];
    for &layer in listed.0 {
        if let Some(slot) = out.get_mut(layer) {
            *slot = listed.1;
        }
    }
    Ok(Some(out))
}

/// Combines both hub lists, which must be disjoint and cover every layer.
fn both_lists(
    lac: Fields<'_>,
    kda: &[usize],
    full: &[usize],
    num_layers: usize,
) -> Result<Vec<Mixer>, ConfigError> {
    let mut out: Vec<Option<Mixer>> = vec![None; num_layers];
    for &layer in kda {
        if let Some(slot) = out.get_mut(layer) {
            *slot = Some(Mixer::Kda);
        }
    }
    for &layer in full {
        if let Some(slot) = out.get_mut(layer) {
            if slot.is_some() {
                return Err(invalid(
                    lac.name("full_attn_layers"),
                    format!(
                        "layer {} (1-indexed) is also listed in kda_layers",
                        layer + 1
                    ),
                ));
            }
            *slot = Some(Mixer::Mla);
        }
    }
    let uncovered: Vec<usize> = out
        .iter()
        .enumerate()
        .filter(|(_, m)| m.is_none())
        .map(|(i, _)| i + 1)
        .collect();
    if !uncovered.is_empty() {
        return Err(invalid(
            lac.name("kda_layers"),
            format!(
                "{} (1-indexed) in neither kda_layers nor full_attn_layers; together they must \
                 list every layer 1..={num_layers} exactly once",
                match uncovered.as_slice() {
                    [one] => format!("layer {one} is"),
                    many => format!("layers {} are", short_list(many)),
                }
            ),
        ));
    }
    Ok(out.into_iter().flatten().collect())
}

/// Reads a 1-indexed layer list and returns it 0-indexed; entries must be in range and unique.
fn one_indexed(
    lac: Fields<'_>,
    key: &'static str,
    num_layers: usize,
) -> Result<Option<Vec<usize>>, ConfigError> {
    let Some(items) = lac.array_opt(key)? else {
        return Ok(None);
    };
    let mut seen = vec![false; num_layers];
    let mut out = Vec::with_capacity(items.len());
    for (j, item) in items.iter().enumerate() {
        let field = format!("{}[{j}]", lac.name(key));
        let layer = as_uint(&field, item, MAX_DIM)?;
        let index = usize::try_from(layer)
            .ok()
            .and_then(|l| l.checked_sub(1))
            .filter(|&i| i < num_layers);
        let Some(index) = index else {
            return Err(invalid(
                field,
                format!(
                    "layer {layer} is out of range: this list is 1-indexed, so entries run from 1 \
                     to num_hidden_layers ({num_layers})"
                ),
            ));
        };
        match seen.get_mut(index) {
            Some(flag) if *flag => {
                return Err(invalid(lac.name(key), format!("lists layer {layer} twice")));
            }
            Some(flag) => *flag = true,
            None => {}
        }
        out.push(index);
    }
    Ok(Some(out))
}

/// FFNs from the hub rule, if `first_k_dense_replace` is given.
fn hub_ffns(
    root: Fields<'_>,
    num_layers: usize,
    has_experts: bool,
) -> Result<Option<Vec<Ffn>>, ConfigError> {
    let Some(first_dense) = root.count_opt(&["first_k_dense_replace"])? else {
        return Ok(None);
    };
    let freq = root.positive_opt(&["moe_layer_freq"])?.unwrap_or(1);
    let is_moe = |i: usize| has_experts && i >= first_dense && i.checked_rem(freq) == Some(0);
    Ok(Some(
        (0..num_layers)
            .map(|i| if is_moe(i) { Ffn::Moe } else { Ffn::Dense })
            .collect(),
    ))
}

/// The error for two schemas that give different schedules, naming the first layers that differ.
fn disagreement<T: std::fmt::Debug + PartialEq>(
    native: &str,
    hub: &str,
    a: &[T],
    b: &[T],
) -> ConfigError {
    let diffs: Vec<String> = a
        .iter()
        .zip(b)
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, (x, y))| format!("layer {i}: {x:?} vs {y:?}"))
        .collect();
    let shown: Vec<&str> = diffs.iter().take(4).map(String::as_str).collect();
    let more = if diffs.len() > shown.len() {
        format!(" and {} more", diffs.len() - shown.len())
    } else {
        String::new()
    };
    invalid(
        native,
        format!(
            "both schemas are present and disagree: `{native}` and `{hub}` give different \
             schedules ({}{more}; 0-indexed, `{native}` first)",
            shown.join(", ")
        ),
    )
}

/// Formats up to eight numbers, then an ellipsis.
fn short_list(items: &[usize]) -> String {
    let shown: Vec<String> = items.iter().take(8).map(usize::to_string).collect();
    let tail = if items.len() > 8 { ", …" } else { "" };
    format!("{}{tail}", shown.join(", "))
}

/// Spellings of the routed-expert count (`attribute_map` of the transformers class, plus the
/// DeepSeek name).
pub(super) const EXPERT_KEYS: &[&str] = &["num_experts", "num_local_experts", "n_routed_experts"];

/// Whether any spelling of the routed-expert count is present.
pub(super) fn names_experts(root: Fields<'_>) -> bool {
    EXPERT_KEYS.iter().any(|k| root.get(k).is_some())
}
