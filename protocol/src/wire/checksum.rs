//! Chunk checksums: CRC-32C (Castagnoli; SSE4.2 / ARMv8 CRC instructions via the `crc32c`
//! crate). It covers the chunk header (with its checksum field zeroed) and the payload, so a
//! flipped offset is caught as surely as a flipped data byte.

/// CRC-32C of `header_without_crc` followed by `payload`.
pub fn chunk_crc(header_without_crc: &[u8], payload: &[u8]) -> u32 {
    let c = crc32c::crc32c(header_without_crc);
    crc32c::crc32c_append(c, payload)
}

/// CRC-32C of a byte slice (used by tests and benchmarks to compare whole layers).
pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// CRC-32C continued over more bytes.
pub fn crc_append(prev: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(prev, bytes)
}
