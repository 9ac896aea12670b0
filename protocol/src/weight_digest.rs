//! The weight digests of a checkpoint (data only): what [`crate::fingerprint`] computes from the
//! shards and caches beside them, and what an open [`crate::checkpoint::Checkpoint`] holds so that
//! they are computed once. Below both, so that the checkpoint can hold them without importing the
//! code that makes them.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Digest of one tensor's bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorDigest {
    /// SHA-256 over the SHA-256 of each [`crate::fingerprint::PIECE`]-byte piece (hex): the identity.
    pub sha256: String,
    /// CRC32C of all bytes (kept in the cache format; the checks on use compare the SHA-256,
    /// which a forged cache cannot match).
    pub crc32c: u32,
    pub bytes: u64,
}

/// Size, mtime and name of one shard when its digests were made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardStamp {
    pub name: String,
    pub size: u64,
    pub mtime_ns: u128,
}

/// The digests of every tensor of a checkpoint, and the shard stamps they were made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightDigest {
    pub version: u32,
    pub shards: Vec<ShardStamp>,
    pub tensors: HashMap<String, TensorDigest>,
}
