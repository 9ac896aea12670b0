//! The parts of a layer's hand-off state (KDA recurrent state and conv windows, MLA latent rows):
//! the tag chunks carry on the wire and the suffix of the golden tensor names.

use serde::{Deserialize, Serialize};

/// One tensor of a layer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[repr(u8)]
pub enum Part {
    /// KDA recurrent state `[heads, k, v]`.
    Recurrent = 0,
    /// KDA conv window of q `[window, heads*head_dim]`.
    ConvQ = 1,
    ConvK = 2,
    ConvV = 3,
    /// MLA latent rows `[rows, kv_lora + rope]`.
    Latent = 4,
}

impl Part {
    pub const KDA: [Part; 4] = [Part::Recurrent, Part::ConvQ, Part::ConvK, Part::ConvV];
    pub const MLA: [Part; 1] = [Part::Latent];

    pub fn from_u8(v: u8) -> Option<Part> {
        Some(match v {
            0 => Part::Recurrent,
            1 => Part::ConvQ,
            2 => Part::ConvK,
            3 => Part::ConvV,
            4 => Part::Latent,
            _ => return None,
        })
    }

    /// The golden tensor-name suffix (`kda.{l}.recurrent`, `mla.{l}.latent`).
    pub fn name(self) -> &'static str {
        match self {
            Part::Recurrent => "recurrent",
            Part::ConvQ => "conv_q",
            Part::ConvK => "conv_k",
            Part::ConvV => "conv_v",
            Part::Latent => "latent",
        }
    }
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
