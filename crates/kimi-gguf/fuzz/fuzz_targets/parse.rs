//! Parses arbitrary bytes as a GGUF file. Any panic, abort or out-of-memory is a bug: a
//! malformed file must give a `GgufError`. When parsing succeeds, everything a caller can
//! read is read, and every dequantizable tensor is dequantized.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = kimi_gguf::GgufFile::from_vec(data.to_vec()) else {
        return;
    };
    for (key, value) in file.metadata() {
        assert_eq!(file.get(key), Some(value));
        let _ = (file.get_u64(key), file.get_f32(key), file.get_str(key), file.get_array(key));
    }
    for info in file.tensors() {
        let tensor = file.tensor(&info.name).expect("a listed tensor can be looked up");
        assert_eq!(tensor.bytes.len() as u64, info.size_bytes);
        let _ = info.shape_outer_first();
        if let Ok(values) = tensor.to_f32() {
            assert_eq!(values.len() as u64, info.num_elements());
        }
    }
});
