//! K3's tokenizer: it lives in the protocol crate ([`k3_protocol::tokenizer`]) so that the prefill
//! node can tokenize too (`k3-prefill calibrate` text prompts); re-exported here for the decoder.

pub use k3_protocol::tokenizer::*;
