//! The kernel symbols the device loads from the embedded cubins, by module: pure data, so
//! that the test below (every kernel in `kernels/*.cu` is listed) runs in every build. A
//! kernel missing here fails only at its first launch, on the GPU machine.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Every kernel symbol, by module (the `kernels/<module>.cu` file stem).
pub(crate) const KERNELS: &[(&str, &[&str])] = &[
    (
        "elementwise",
        &[
            "embedding",
            "rms_norm",
            "rms_norm_warp",
            "rms_norm_vec",
            "add_rms_norm",
            "add_rms_norm_vec",
            "add_assign",
            "sigmoid",
            "silu_mul",
            "copy_cols",
            "concat_cols2",
            "gather_rows",
            "scatter_add_rows",
            "cast_f32_bf16",
            "cast_f32_f16",
            "cast_to_f32",
            "split_f32_bf16",
            "split_f32_f16",
            "sum_halves",
            "argmax_rows",
            "sigmoid_gate",
            "situ_mul",
        ],
    ),
    ("attn_res", &["attn_res_mix"]),
    (
        "mxfp4",
        &[
            "moe_mxfp4_mma_1_half",
            "moe_mxfp4_mma_1_split",
            "moe_mxfp4_mma_2_half",
            "moe_mxfp4_mma_2_split",
            "moe_mxfp4_mma_4_half",
            "moe_mxfp4_mma_4_split",
            "mxfp4_act_bf16",
            "mxfp4_from_blocks",
            "mxfp4_to_f32",
        ],
    ),
    (
        "int4_stream",
        &["moe_int4_stream_layer", "quant_gemv_int4_stream_1"],
    ),
    (
        "int4_experts",
        &[
            "moe_int4_mma_1_half",
            "moe_int4_mma_1_split",
            "moe_int4_mma_2_half",
            "moe_int4_mma_2_split",
            "moe_int4_mma_4_half",
            "moe_int4_mma_4_split",
        ],
    ),
    (
        "quant",
        &[
            "quant_gemv_q4z_1",
            "quant_gemv_q4z_2",
            "quant_gemv_q4z_4",
            "quant_gemv_q4z_8",
            "quant_gemv_q8z_1",
            "quant_gemv_q8z_2",
            "quant_gemv_q8z_4",
            "quant_gemv_q8z_8",
            "quant_gemv_f8s_1",
            "quant_gemv_f8s_2",
            "quant_gemv_f8s_4",
            "quant_gemv_f8s_8",
            "quant_gemv_q4a_1",
            "quant_gemv_q4a_2",
            "quant_gemv_q4a_4",
            "quant_gemv_q4a_8",
            "quant_gemv_reduce",
            "quant_gemv_narrow_pair",
            "quant_widen",
            "quant_embed",
            "quant_from_blocks",
        ],
    ),
    ("sampling", &["apply_penalties", "sample_rows"]),
    (
        "conv",
        &[
            "short_conv_silu",
            "short_conv_silu_w2",
            "short_conv_silu_w3",
            "short_conv_silu_w4",
            "short_conv_state",
        ],
    ),
    (
        "gemv",
        &[
            "gemv_bf16",
            "gemv_bf16_8",
            "gemv_bf16_pair",
            "gemv_bulk_1",
            "gemv_bulk_4",
            "gemv_bulk_8",
            "gemv_stream_1",
        ],
    ),
    (
        "kda",
        &[
            "kda_gate",
            "kda_recurrent_32",
            "kda_recurrent_64",
            "kda_recurrent_128",
            "kda_recurrent_split_64",
            "kda_recurrent_split_128",
            "kda_chunk_prep_64",
            "kda_chunk_prep_128",
            "kda_chunk_state_64",
            "kda_chunk_state_128",
            "kda_chunk_prep_mma_64",
            "kda_chunk_prep_mma_128",
            "kda_chunk_mma_64_split",
            "kda_chunk_mma_64_half",
            "kda_chunk_mma_128_split",
            "kda_chunk_mma_128_half",
            "kda_chunk_prep_blk_64",
            "kda_chunk_prep_blk_128",
            "kda_decode_64",
            "kda_decode_128",
        ],
    ),
    (
        "mla",
        &[
            "mla_flash_prefill",
            "mla_flash_prefill_vec",
            "mla_flash_prefill_mma",
            "mla_q_absorb",
            "mla_decode_partial",
            "mla_decode_partial_vec",
            "mla_decode_combine",
            "mla_uv_project",
            "mla_paged_write_rows",
            "mla_paged_gather",
            "mla_pack_bf16",
        ],
    ),
    (
        "mla_fp8",
        &[
            "mla_fp8_write_rows",
            "mla_fp8_gather",
            "mla_decode_partial_fp8",
            "mla_decode_partial_fp8_vec",
        ],
    ),
    (
        "moe",
        &[
            "moe_route",
            "moe_route_warp",
            "moe_mask_absent",
            "moe_lists",
            "moe_lists_count",
            "moe_count_layers",
            "moe_lists_place",
            "moe_expert_gemv",
            "moe_stream_1",
            "moe_stream_layer",
            "moe_route_one",
            "moe_combine",
            "moe_gather_bf16",
            "moe_silu_mul_bf16",
        ],
    ),
    (
        "moe_gemm",
        &[
            "moe_grouped_mma",
            "moe_mma_64_half",
            "moe_mma_64_split",
            "moe_mma_128_half",
            "moe_mma_128_split",
        ],
    ),
];

#[cfg(test)]
mod tests {
    /// Every kernel in `kernels/*.cu` is in [`super::KERNELS`] under its file's
    /// module: a kernel missing there fails at its first launch, on the GPU machine.
    #[test]
    fn kernel_list_names_every_kernel() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kimi-cuda-kernels/kernels");
        let mut missing = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("kernels dir") {
            let path = entry.expect("entry").path();
            if path.extension().and_then(|e| e.to_str()) != Some("cu") {
                continue;
            }
            let module = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or_default()
                .to_string();
            let text = std::fs::read_to_string(&path).expect("read .cu");
            let listed: &[&str] = super::KERNELS
                .iter()
                .find(|(m, _)| *m == module)
                .map(|(_, names)| *names)
                .unwrap_or(&[]);
            for chunk in text.split("__global__ void").skip(1) {
                // Skip `__launch_bounds__(..)` and similar attributes before the name.
                let mut rest = chunk.trim_start();
                while rest.starts_with("__") {
                    let close = rest.find(')').map_or(rest.len(), |i| i + 1);
                    rest = rest[close..].trim_start();
                }
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#')
                    .collect();
                if name.is_empty() || name.contains('#') {
                    continue; // macro-made names: their uses below
                }
                if !listed.contains(&name.as_str()) {
                    missing.push(format!("{module}: {name}"));
                }
            }
            // Kernels a macro makes: `SOME_KERNEL(name, ...)` at the start of a line.
            for line in text.lines() {
                let Some((mac, rest)) = line.split_once('(') else {
                    continue;
                };
                if !mac.ends_with("_KERNEL")
                    || !mac
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
                {
                    continue;
                }
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                // Past the macro's own definition (its parameters are upper case) and the
                // names it pastes together (`CONV_RUNS_KERNEL(2)`).
                if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
                    continue;
                }
                if !listed.contains(&name.as_str()) {
                    missing.push(format!("{module}: {name}"));
                }
            }
        }
        assert!(missing.is_empty(), "kernels not in KERNELS: {missing:?}");
    }
}
