//! Minimal NumPy `.npy` (format 1.0) writer for float32 matrices.

use std::io::Write;
use std::path::Path;

use anyhow::Context;

/// Writes `data` as a little-endian float32 array of `shape`.
pub fn write_f32(path: &Path, shape: &[usize], data: &[f32]) -> anyhow::Result<()> {
    anyhow::ensure!(
        shape.iter().product::<usize>() == data.len(),
        "npy: shape does not match data"
    );
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic (6) + version (2) + length (2) + header + newline must be a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let mut f =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(&bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
