//! Writing checkpoint shards in the release layout: the one safetensors shard writer (header
//! first, then the tensors' bytes in header order, streamed, never held together), the shard
//! names and `model.safetensors.index.json`. Synthetic models (`synth`) and pruned ones
//! (`prune`) are written through it.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::tensors::TensorSpec;

/// The index file of a checkpoint directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Shard file name in the release convention (`i` 0-based, of `n`).
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// The safetensors header of `specs` laid out back to back, in order: the 8-byte length prefix
/// and the JSON header, padded with spaces to a multiple of 8.
pub fn header_bytes(specs: &[TensorSpec]) -> Vec<u8> {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut off = 0usize;
    for s in specs {
        let end = off + s.nbytes();
        let shape: Vec<String> = s.shape.iter().map(|d| d.to_string()).collect();
        json.push_str(&format!(
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            serde_json::to_string(&s.name).expect("a string serialises"),
            s.dtype.name(),
            shape.join(",")
        ));
        off = end;
    }
    json.push('}');
    while (8 + json.len()) % 8 != 0 {
        json.push(' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out
}

/// One shard being written: its header (for the tensors it will hold, in order) is written on
/// [`ShardWriter::create`]; the tensors' bytes follow through [`ShardWriter::write`], in header
/// order; [`ShardWriter::finish`] checks that exactly the header's data bytes arrived.
pub struct ShardWriter {
    path: PathBuf,
    file: BufWriter<File>,
    planned: u64,
    written: u64,
}

impl ShardWriter {
    /// Creates `path` and writes the header of `specs`.
    pub fn create(path: &Path, specs: &[TensorSpec]) -> std::io::Result<ShardWriter> {
        let mut file = BufWriter::with_capacity(8 << 20, File::create(path)?);
        file.write_all(&header_bytes(specs))?;
        let planned = specs.iter().map(|s| s.nbytes() as u64).sum();
        Ok(ShardWriter { path: path.to_path_buf(), file, planned, written: 0 })
    }

    /// Appends tensor bytes (a whole tensor or a piece of one, in header order).
    pub fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.file.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes the shard (and fsyncs it with `sync`); an error if the data bytes written differ
    /// from the header's. Returns the data bytes.
    pub fn finish(self, sync: bool) -> std::io::Result<u64> {
        if self.written != self.planned {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} data bytes written, the header holds {}", self.written, self.planned),
            ));
        }
        let f = self.file.into_inner().map_err(|e| e.into_error())?;
        if sync {
            f.sync_all()?;
        }
        Ok(self.written)
    }
}

/// `model.safetensors.index.json`: every tensor's shard and the data bytes of all shards.
pub fn index_json(weight_map: &BTreeMap<String, String>, total_size: u64) -> serde_json::Value {
    serde_json::json!({ "metadata": { "total_size": total_size }, "weight_map": weight_map })
}

/// Writes [`index_json`] as [`INDEX_FILE`] into `dir`.
pub fn write_index(dir: &Path, weight_map: &BTreeMap<String, String>, total_size: u64) -> std::io::Result<PathBuf> {
    let path = dir.join(INDEX_FILE);
    let text = serde_json::to_string_pretty(&index_json(weight_map, total_size)).expect("JSON serialises");
    std::fs::write(&path, text)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensors::{DType, Init};

    fn spec(name: &str, shape: Vec<usize>) -> TensorSpec {
        TensorSpec { name: name.into(), shape, dtype: DType::BF16, init: Init::Linear }
    }

    #[test]
    fn a_written_shard_reads_back_and_a_short_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let specs = [spec("a", vec![2, 3]), spec("b.c", vec![4])];
        let path = dir.path().join(shard_file_name(0, 1));
        let mut w = ShardWriter::create(&path, &specs).unwrap();
        let a: Vec<u8> = (0..12).collect();
        let b: Vec<u8> = (100..108).collect();
        w.write(&a[..5]).unwrap();
        w.write(&a[5..]).unwrap();
        w.write(&b).unwrap();
        assert_eq!(w.finish(false).unwrap(), 20);
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("a").unwrap().shape(), &[2, 3]);
        assert_eq!(st.tensor("a").unwrap().data(), &a[..]);
        assert_eq!(st.tensor("b.c").unwrap().data(), &b[..]);
        assert_eq!(shard_file_name(0, 1), "model-00001-of-00001.safetensors");

        let mut w = ShardWriter::create(&dir.path().join("short.safetensors"), &specs).unwrap();
        w.write(&a).unwrap();
        let e = w.finish(false).unwrap_err();
        assert!(e.to_string().contains("12 data bytes written, the header holds 20"), "{e}");
    }
}
