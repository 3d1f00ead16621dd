//! Stored tensor names that nearly match a missing one, for the error message.
//!
//! Names are compared as dotted paths, one segment at a time: renaming, adding or dropping a
//! module (`mlp` → `block_sparse_moe`, a `language_model.` wrapper, `forget_gate.` inserted)
//! costs about one, a small spelling change (`q_conv1d` → `conv1d`) a fraction of one. So the
//! tensor of the same layer under another module name ranks before the same tensor of another
//! layer.

/// At most this many suggestions.
pub(crate) const MAX_NEAR: usize = 5;

/// Distance above which a name is not suggested: two whole segments, and never more than
/// half the wanted name's segments (so `lm_head.weight` suggests no `model.norm.weight`).
fn limit(segments: usize) -> f64 {
    (0.5 * segments as f64).min(2.0)
}

/// Up to [`MAX_NEAR`] of `names` closest to `wanted`, closest first (ties by name).
pub(crate) fn near_names<'a>(wanted: &str, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let want: Vec<&str> = wanted.split('.').collect();
    let max = limit(want.len());
    let mut scored: Vec<(f64, &str)> = names
        .filter(|n| *n != wanted)
        .filter_map(|n| {
            let d = path_distance(&want, &n.split('.').collect::<Vec<_>>());
            (d <= max).then_some((d, n))
        })
        .collect();
    scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(b.1)));
    scored
        .into_iter()
        .take(MAX_NEAR)
        .map(|(_, n)| n.to_string())
        .collect()
}

/// Edit distance over path segments: inserting or deleting a segment costs 1, replacing one
/// its character edit distance over the longer segment's length (0 to 1).
fn path_distance(a: &[&str], b: &[&str]) -> f64 {
    let mut prev: Vec<f64> = (0..=b.len()).map(|j| j as f64).collect();
    let mut cur = vec![0.0; b.len() + 1];
    for (i, sa) in a.iter().enumerate() {
        cur[0] = (i + 1) as f64;
        for (j, sb) in b.iter().enumerate() {
            let replace = prev[j] + segment_distance(sa, sb);
            cur[j + 1] = replace.min(prev[j + 1] + 1.0).min(cur[j] + 1.0);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// Character edit distance of two segments over the longer one's length.
fn segment_distance(a: &str, b: &str) -> f64 {
    if a == b {
        return 0.0;
    }
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let replace = prev[j] + usize::from(ca != cb);
            cur[j + 1] = replace.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()] as f64 / a.len().max(b.len()) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const STORED: [&str; 9] = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.block_sparse_moe.gate_proj.weight",
        "model.layers.0.block_sparse_moe.up_proj.weight",
        "model.layers.0.block_sparse_moe.down_proj.weight",
        "model.layers.1.block_sparse_moe.gate_proj.weight",
        "model.layers.1.self_attn.conv1d.weight",
        "model.layers.1.self_attn.forget_gate.A_log",
        "language_model.lm_head.weight",
    ];

    fn near(wanted: &str) -> Vec<String> {
        near_names(wanted, STORED.iter().copied())
    }

    #[test]
    fn a_renamed_module_of_the_same_layer_comes_first() {
        let got = near("model.layers.0.mlp.gate_proj.weight");
        assert_eq!(got[0], "model.layers.0.block_sparse_moe.gate_proj.weight");
        assert!(got.len() <= MAX_NEAR);
        assert!(!got
            .iter()
            .any(|n| n.contains("norm") || n.contains("embed")));
    }

    #[test]
    fn inserted_dropped_and_respelled_segments_are_found() {
        assert_eq!(
            near("model.layers.1.self_attn.A_log")[0],
            "model.layers.1.self_attn.forget_gate.A_log"
        );
        assert_eq!(
            near("model.layers.1.self_attn.q_conv1d.weight")[0],
            "model.layers.1.self_attn.conv1d.weight"
        );
        assert_eq!(near("lm_head.weight"), ["language_model.lm_head.weight"]);
    }

    #[test]
    fn unrelated_names_are_not_suggested() {
        assert!(near("vision_tower.patch_embed.proj.weight").is_empty());
        let got = near("model.norm.weight");
        assert!(!got.iter().any(|n| n == "model.norm.weight"), "{got:?}");
    }

    #[test]
    fn at_most_five_closest_first() {
        let many: Vec<String> = (0..20)
            .map(|i| format!("model.layers.{i}.mlp.up_proj.weight"))
            .collect();
        let got = near_names(
            "model.layers.3.mlp.gate_proj.weight",
            many.iter().map(String::as_str),
        );
        assert_eq!(got.len(), MAX_NEAR);
        assert_eq!(got[0], "model.layers.3.mlp.up_proj.weight");
    }
}
