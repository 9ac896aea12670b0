//! The handshake and request intake as decisions without I/O: what a prefill node answers to
//! a decoder's `Hello` ([`answer_hello`]), what a decoder makes of the node's `HelloAck`
//! ([`check_ack`]), and whether a `PrefillRequest` is well-formed ([`validate_request`]).
//! The QUIC side (`transport`) reads and writes the messages and turns a refusal into its
//! error, naming the peer.

use crate::fingerprint::Fingerprint;
use crate::wire::frame::{CHUNK_HEADER_LEN, FRAME_HEADER_LEN};
use crate::wire::{Capabilities, ErrorCode, Hello, HelloAck, PrefillRequest, StateDtype, WireError, PROTOCOL_VERSION};

/// What a node says of itself in the handshake.
#[derive(Debug, Clone, PartialEq)]
pub struct Announce {
    pub model_fingerprint: Fingerprint,
    /// The model's state identity (`Checkpoint::state_identity`), if known.
    pub state_identity: Option<Fingerprint>,
    pub capabilities: Capabilities,
    pub node_name: String,
}

/// Why a handshake is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The peer speaks another protocol version.
    VersionMismatch { ours: u32, theirs: u32 },
    /// The peer runs another model, and its states are not interchangeable with ours.
    FingerprintMismatch { ours: Fingerprint, theirs: Fingerprint },
    /// The peer runs a state-compatible model, which the decoder was not told to accept
    /// (`--accept-compatible-states`).
    CompatibleModelNotAccepted { ours: Fingerprint, theirs: Fingerprint, state_identity: Fingerprint },
    /// The capabilities do not meet: no common dtype, or frames too small for a chunk.
    Capability { message: String },
}

impl Refusal {
    /// The wire error code the refusal is sent with.
    pub fn code(&self) -> ErrorCode {
        match self {
            Refusal::VersionMismatch { .. } => ErrorCode::VersionMismatch,
            Refusal::FingerprintMismatch { .. } | Refusal::CompatibleModelNotAccepted { .. } => ErrorCode::FingerprintMismatch,
            Refusal::Capability { .. } => ErrorCode::CapabilityMismatch,
        }
    }
}

/// Two models' states are interchangeable: both give a state identity and they are equal.
pub fn state_compatible(ours: Option<Fingerprint>, theirs: Option<Fingerprint>) -> bool {
    ours.is_some() && ours == theirs
}

/// The node's answer to a `Hello`: its `HelloAck` (sent to every Hello, so the decoder can
/// name both sides in its own error) and, when the handshake cannot go on, why.
pub fn answer_hello(node: &Announce, hello: &Hello) -> (HelloAck, Option<Refusal>) {
    let ack = HelloAck {
        protocol_version: PROTOCOL_VERSION,
        model_fingerprint: node.model_fingerprint,
        state_identity: node.state_identity,
        capabilities: node.capabilities.clone(),
        node_name: node.node_name.clone(),
        max_frame_size: node.capabilities.max_frame_size.min(hello.capabilities.max_frame_size),
    };
    let refusal = if hello.protocol_version != PROTOCOL_VERSION {
        Some(Refusal::VersionMismatch { ours: PROTOCOL_VERSION, theirs: hello.protocol_version })
    } else if hello.model_fingerprint != node.model_fingerprint && !state_compatible(node.state_identity, hello.state_identity) {
        Some(Refusal::FingerprintMismatch { ours: node.model_fingerprint, theirs: hello.model_fingerprint })
    } else if !hello.capabilities.dtypes.contains(&StateDtype::F32) {
        Some(Refusal::Capability { message: "the peer cannot take fp32 state".into() })
    } else if ack.max_frame_size < (FRAME_HEADER_LEN + CHUNK_HEADER_LEN + 4) as u32 {
        Some(Refusal::Capability { message: format!("max frame size {} is too small", ack.max_frame_size) })
    } else {
        None
    };
    (ack, refusal)
}

/// What a decoder may do with a node's `HelloAck`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckVerdict {
    /// The node runs our model.
    SameModel,
    /// The node runs another model whose states are interchangeable with ours (same state
    /// identity), and the decoder accepts such states.
    CompatibleStates { state_identity: Fingerprint },
}

/// The decoder's check of the node's `HelloAck`: protocol version, then model (or state
/// identity, when `accept_compatible_states`).
pub fn check_ack(decoder: &Announce, accept_compatible_states: bool, ack: &HelloAck) -> Result<AckVerdict, Refusal> {
    if ack.protocol_version != PROTOCOL_VERSION {
        return Err(Refusal::VersionMismatch { ours: PROTOCOL_VERSION, theirs: ack.protocol_version });
    }
    if ack.model_fingerprint == decoder.model_fingerprint {
        return Ok(AckVerdict::SameModel);
    }
    let Some(state_identity) = decoder.state_identity.filter(|_| state_compatible(decoder.state_identity, ack.state_identity)) else {
        return Err(Refusal::FingerprintMismatch { ours: decoder.model_fingerprint, theirs: ack.model_fingerprint });
    };
    if !accept_compatible_states {
        return Err(Refusal::CompatibleModelNotAccepted { ours: decoder.model_fingerprint, theirs: ack.model_fingerprint, state_identity });
    }
    Ok(AckVerdict::CompatibleStates { state_identity })
}

/// A request the node can serve: image rows that match their positions and lie inside the
/// prompt, and at least one data stream.
pub fn validate_request(r: &PrefillRequest) -> Result<(), WireError> {
    if let Some(im) = &r.image_embeddings {
        let want = im.positions.len() as u64 * im.width as u64;
        if im.rows.len() as u64 != want {
            return Err(WireError::ImageEmbeddingSize { values: im.rows.len(), positions: im.positions.len(), width: im.width, want });
        }
        if let Some(&position) = im.positions.iter().find(|p| **p as usize >= r.tokens.len()) {
            return Err(WireError::ImageEmbeddingPosition { position, tokens: r.tokens.len() });
        }
    }
    if r.options.streams == 0 {
        return Err(WireError::NoStreams);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{ImageEmbeddings, PrefillOptions, SessionId};

    fn fp(b: u8) -> Fingerprint {
        Fingerprint([b; 32])
    }

    fn caps(max_frame_size: u32) -> Capabilities {
        Capabilities { dtypes: vec![StateDtype::F32], max_frame_size, backend: "cpu".into(), max_streams: 4 }
    }

    fn node(model: u8, state: Option<u8>) -> Announce {
        Announce { model_fingerprint: fp(model), state_identity: state.map(fp), capabilities: caps(1 << 20), node_name: "node".into() }
    }

    fn hello(model: u8, state: Option<u8>) -> Hello {
        Hello {
            protocol_version: PROTOCOL_VERSION,
            model_fingerprint: fp(model),
            state_identity: state.map(fp),
            capabilities: caps(1 << 16),
            node_name: "dec".into(),
        }
    }

    #[test]
    fn a_matching_hello_is_answered_with_the_smaller_frame_size_and_no_refusal() {
        let (ack, refusal) = answer_hello(&node(1, Some(9)), &hello(1, Some(9)));
        assert_eq!(refusal, None);
        assert_eq!(ack.max_frame_size, 1 << 16);
        assert_eq!((ack.protocol_version, ack.model_fingerprint, ack.state_identity), (PROTOCOL_VERSION, fp(1), Some(fp(9))));
        assert_eq!(ack.node_name, "node");
    }

    #[test]
    fn another_protocol_version_is_refused_naming_both_versions() {
        let mut h = hello(1, None);
        h.protocol_version = PROTOCOL_VERSION + 1;
        let (ack, refusal) = answer_hello(&node(1, None), &h);
        assert_eq!(ack.protocol_version, PROTOCOL_VERSION, "the ack is sent to every Hello");
        assert_eq!(refusal, Some(Refusal::VersionMismatch { ours: PROTOCOL_VERSION, theirs: PROTOCOL_VERSION + 1 }));
        assert_eq!(refusal.unwrap().code(), ErrorCode::VersionMismatch);
    }

    #[test]
    fn another_model_is_refused_unless_its_states_are_interchangeable() {
        let (_, r) = answer_hello(&node(1, Some(9)), &hello(2, Some(8)));
        assert_eq!(r, Some(Refusal::FingerprintMismatch { ours: fp(1), theirs: fp(2) }));
        assert_eq!(r.unwrap().code(), ErrorCode::FingerprintMismatch);
        // no state identity on either side: only the same model will do
        let (_, r) = answer_hello(&node(1, None), &hello(2, None));
        assert!(matches!(r, Some(Refusal::FingerprintMismatch { .. })));
        // the same state identity: the node serves it (the decoder decides)
        let (_, r) = answer_hello(&node(1, Some(9)), &hello(2, Some(9)));
        assert_eq!(r, None);
    }

    #[test]
    fn a_peer_without_fp32_state_or_with_tiny_frames_is_refused_as_a_capability_mismatch() {
        let mut h = hello(1, None);
        h.capabilities.dtypes.clear();
        let (_, r) = answer_hello(&node(1, None), &h);
        assert_eq!(r, Some(Refusal::Capability { message: "the peer cannot take fp32 state".into() }));
        assert_eq!(r.unwrap().code(), ErrorCode::CapabilityMismatch);
        let mut h = hello(1, None);
        h.capabilities.max_frame_size = (FRAME_HEADER_LEN + CHUNK_HEADER_LEN) as u32;
        let (ack, r) = answer_hello(&node(1, None), &h);
        assert_eq!(r, Some(Refusal::Capability { message: format!("max frame size {} is too small", ack.max_frame_size) }));
    }

    fn ack_of(model: u8, state: Option<u8>) -> HelloAck {
        answer_hello(&node(model, state), &hello(model, state)).0
    }

    #[test]
    fn the_decoder_takes_its_own_model_and_refuses_another() {
        let me = node(1, Some(9));
        assert_eq!(check_ack(&me, false, &ack_of(1, Some(9))), Ok(AckVerdict::SameModel));
        assert_eq!(check_ack(&me, true, &ack_of(2, Some(8))), Err(Refusal::FingerprintMismatch { ours: fp(1), theirs: fp(2) }));
        let mut other_version = ack_of(1, Some(9));
        other_version.protocol_version = 0;
        assert_eq!(check_ack(&me, false, &other_version), Err(Refusal::VersionMismatch { ours: PROTOCOL_VERSION, theirs: 0 }));
    }

    #[test]
    fn a_state_compatible_node_is_taken_only_when_the_decoder_accepts_such_states() {
        let me = node(1, Some(9));
        let theirs = ack_of(2, Some(9));
        assert_eq!(check_ack(&me, false, &theirs), Err(Refusal::CompatibleModelNotAccepted { ours: fp(1), theirs: fp(2), state_identity: fp(9) }));
        assert_eq!(check_ack(&me, true, &theirs), Ok(AckVerdict::CompatibleStates { state_identity: fp(9) }));
        // a decoder without a state identity cannot take another model at all
        assert!(matches!(check_ack(&node(1, None), true, &theirs), Err(Refusal::FingerprintMismatch { .. })));
    }

    fn request(tokens: u32, streams: u16, image: Option<ImageEmbeddings>) -> PrefillRequest {
        PrefillRequest {
            session: SessionId([0; 16]),
            base: None,
            tokens: (0..tokens).collect(),
            image_embeddings: image,
            options: PrefillOptions { streams, ..Default::default() },
        }
    }

    #[test]
    fn requests_are_validated_for_streams_and_image_rows() {
        assert!(validate_request(&request(8, 2, None)).is_ok());
        assert!(validate_request(&request(8, 2, Some(ImageEmbeddings { positions: vec![3, 7], width: 2, rows: vec![0.0; 4] }))).is_ok());
        assert!(matches!(validate_request(&request(8, 0, None)), Err(WireError::NoStreams)));
        let short = ImageEmbeddings { positions: vec![3, 4], width: 2, rows: vec![0.0; 3] };
        assert!(matches!(validate_request(&request(8, 1, Some(short))), Err(WireError::ImageEmbeddingSize { values: 3, positions: 2, width: 2, want: 4 })));
        let outside = ImageEmbeddings { positions: vec![8], width: 1, rows: vec![0.0] };
        assert!(matches!(validate_request(&request(8, 1, Some(outside))), Err(WireError::ImageEmbeddingPosition { position: 8, tokens: 8 })));
    }
}
