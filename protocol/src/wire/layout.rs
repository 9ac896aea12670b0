//! The expected shape of a hand-off state on the wire: which layers, which parts, how many
//! fp32 values each. Both sides derive it from the model config (the fingerprints match), the
//! prefill node also sends it in `Accepted`, and the receiver preallocates from it.
//!
//! A layout describes a *delta*: an MLA layer carries the latent rows of the new tokens only
//! (the decoder appends them to its cache); a KDA layer carries its full recurrent state and
//! conv windows (fixed size, they replace the decoder's).

use serde::{Deserialize, Serialize};

use crate::config::{AttnKind, TextConfig};
use crate::handoff::{HandoffState, KdaState, LayerState, MlaState};
use crate::wire::error::WireError;
use crate::wire::part::Part;

/// The shape of one layer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerLayout {
    /// Full KDA state: recurrent `[heads, head_dim, head_dim]`, three conv windows `[window, heads*head_dim]`.
    Kda { heads: u32, head_dim: u32, window: u32 },
    /// The new MLA latent rows: `[rows, width]`.
    Mla { width: u32, rows: u64 },
}

impl LayerLayout {
    pub fn parts(&self) -> &'static [Part] {
        match self {
            LayerLayout::Kda { .. } => &Part::KDA,
            LayerLayout::Mla { .. } => &Part::MLA,
        }
    }

    /// Number of fp32 values of `part`, or None when the layer has no such part or the size
    /// overflows (a peer-sent layout can hold anything).
    pub fn part_len(&self, part: Part) -> Option<u64> {
        match (*self, part) {
            (LayerLayout::Kda { heads, head_dim, .. }, Part::Recurrent) => (heads as u64).checked_mul(head_dim as u64)?.checked_mul(head_dim as u64),
            (LayerLayout::Kda { heads, head_dim, window }, Part::ConvQ | Part::ConvK | Part::ConvV) => {
                (window as u64).checked_mul(heads as u64)?.checked_mul(head_dim as u64)
            }
            (LayerLayout::Mla { width, rows }, Part::Latent) => rows.checked_mul(width as u64),
            _ => None,
        }
    }

    /// Bytes of `part` (fp32).
    pub fn part_bytes(&self, part: Part) -> Option<u64> {
        self.part_len(part)?.checked_mul(4)
    }

    /// Bytes of the whole layer, None on overflow.
    pub fn nbytes(&self) -> Option<u64> {
        self.parts().iter().try_fold(0u64, |acc, p| acc.checked_add(self.part_bytes(*p)?))
    }

    /// The layout of a layer state as it is (MLA rows from the latent length).
    pub fn of_state(st: &LayerState) -> LayerLayout {
        match st {
            LayerState::Kda(k) => {
                let w = k.heads * k.head_dim;
                LayerLayout::Kda { heads: k.heads as u32, head_dim: k.head_dim as u32, window: k.conv_q.len().checked_div(w).unwrap_or(0) as u32 }
            }
            LayerState::Mla(m) => LayerLayout::Mla { width: m.width as u32, rows: m.rows() as u64 },
        }
    }

    /// Checks that `st` has exactly this layout, naming the first difference.
    pub fn check_state(&self, st: &LayerState) -> Result<(), WireError> {
        match (self, st) {
            (LayerLayout::Kda { .. }, LayerState::Kda(k)) => {
                for (part, v) in [(Part::Recurrent, &k.recurrent), (Part::ConvQ, &k.conv_q), (Part::ConvK, &k.conv_k), (Part::ConvV, &k.conv_v)] {
                    let want = self.part_len(part).unwrap_or(u64::MAX);
                    if v.len() as u64 != want {
                        return Err(WireError::KdaPartLength { part, got: v.len(), want });
                    }
                }
                if let LayerLayout::Kda { heads, head_dim, .. } = *self {
                    if k.heads != heads as usize || k.head_dim != head_dim as usize {
                        return Err(WireError::KdaHeads { heads: k.heads, head_dim: k.head_dim, want_heads: heads, want_head_dim: head_dim });
                    }
                }
                Ok(())
            }
            (LayerLayout::Mla { width, rows }, LayerState::Mla(m)) => {
                if m.width != *width as usize || m.latent.len() as u64 != rows.saturating_mul(*width as u64) {
                    return Err(WireError::MlaLatent { values: m.latent.len(), width: m.width, want_rows: *rows, want_width: *width });
                }
                Ok(())
            }
            (LayerLayout::Kda { .. }, LayerState::Mla(_)) => Err(WireError::MlaStateForKdaLayer),
            (LayerLayout::Mla { .. }, LayerState::Kda(_)) => Err(WireError::KdaStateForMlaLayer),
        }
    }

    /// A zero-filled state of this layout (the receiver's preallocated buffers).
    pub(crate) fn alloc(&self) -> LayerState {
        match *self {
            LayerLayout::Kda { heads, head_dim, .. } => {
                let n = |p| vec![0f32; self.part_len(p).unwrap_or(0) as usize];
                LayerState::Kda(KdaState {
                    heads: heads as usize,
                    head_dim: head_dim as usize,
                    recurrent: n(Part::Recurrent),
                    conv_q: n(Part::ConvQ),
                    conv_k: n(Part::ConvK),
                    conv_v: n(Part::ConvV),
                })
            }
            LayerLayout::Mla { width, .. } => {
                LayerState::Mla(MlaState { width: width as usize, latent: vec![0f32; self.part_len(Part::Latent).unwrap_or(0) as usize] })
            }
        }
    }
}

/// The fp32 values of `part` in a layer state (None if the layer has no such part).
pub fn part_values(st: &LayerState, part: Part) -> Option<&[f32]> {
    match (st, part) {
        (LayerState::Kda(k), Part::Recurrent) => Some(&k.recurrent),
        (LayerState::Kda(k), Part::ConvQ) => Some(&k.conv_q),
        (LayerState::Kda(k), Part::ConvK) => Some(&k.conv_k),
        (LayerState::Kda(k), Part::ConvV) => Some(&k.conv_v),
        (LayerState::Mla(m), Part::Latent) => Some(&m.latent),
        _ => None,
    }
}

pub(crate) fn part_values_mut(st: &mut LayerState, part: Part) -> Option<&mut [f32]> {
    match (st, part) {
        (LayerState::Kda(k), Part::Recurrent) => Some(&mut k.recurrent),
        (LayerState::Kda(k), Part::ConvQ) => Some(&mut k.conv_q),
        (LayerState::Kda(k), Part::ConvK) => Some(&mut k.conv_k),
        (LayerState::Kda(k), Part::ConvV) => Some(&mut k.conv_v),
        (LayerState::Mla(m), Part::Latent) => Some(&mut m.latent),
        _ => None,
    }
}

/// The layout of a whole (delta) state, one entry per decoder layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateLayout {
    pub layers: Vec<LayerLayout>,
}

impl HandoffState {
    /// Checks every layer's kind and size against the model — the layout of a state of
    /// `self.tokens` tokens ([`StateLayout::for_model`], [`StateLayout::check`]) — naming the
    /// first layer at fault. (Defined here, beside the one shape check it runs.)
    pub fn check(&self, c: &TextConfig) -> Result<(), WireError> {
        StateLayout::for_model(c, self.tokens).check(self)
    }
}

impl StateLayout {
    /// The delta layout of a prefill of `new_tokens` tokens for this model: every KDA layer in
    /// full, `new_tokens` latent rows per MLA layer.
    pub fn for_model(c: &TextConfig, new_tokens: usize) -> StateLayout {
        let la = &c.linear_attn_config;
        let layers = c
            .layer_plan()
            .iter()
            .map(|s| match s.attn {
                AttnKind::Kda => LayerLayout::Kda { heads: la.num_heads as u32, head_dim: la.head_dim as u32, window: c.conv_window() as u32 },
                AttnKind::Mla => LayerLayout::Mla { width: c.mla_latent_width() as u32, rows: new_tokens as u64 },
            })
            .collect();
        StateLayout { layers }
    }

    /// Checks that `st` has exactly this layout, layer by layer ([`LayerLayout::check_state`]),
    /// naming the first layer at fault.
    pub fn check(&self, st: &HandoffState) -> Result<(), WireError> {
        if st.layers.len() != self.layers.len() {
            return Err(WireError::StateLayers { got: st.layers.len(), want: self.layers.len() });
        }
        for (layer, (want, got)) in self.layers.iter().zip(&st.layers).enumerate() {
            want.check_state(got).map_err(|e| WireError::StateLayer { layer, source: Box::new(e) })?;
        }
        Ok(())
    }

    /// The layout of an existing state (e.g. a session file or a synthetic test state).
    pub fn of_state(st: &HandoffState) -> StateLayout {
        StateLayout { layers: st.layers.iter().map(LayerLayout::of_state).collect() }
    }

    /// Total bytes, None on overflow.
    pub fn nbytes(&self) -> Option<u64> {
        self.layers.iter().try_fold(0u64, |acc, l| acc.checked_add(l.nbytes()?))
    }

    /// MLA row count of the delta (all MLA layers must agree); None when there is no MLA layer.
    pub fn rows(&self) -> Option<u64> {
        self.layers.iter().find_map(|l| match l {
            LayerLayout::Mla { rows, .. } => Some(*rows),
            _ => None,
        })
    }

    /// Checks sizes for overflow, row counts for agreement, and the total against `max_bytes`.
    pub fn validate(&self, max_bytes: u64) -> Result<u64, WireError> {
        let total = self.nbytes().ok_or(WireError::StateSizeOverflow)?;
        if total > max_bytes {
            return Err(WireError::StateTooLarge { bytes: total, limit: max_bytes });
        }
        if let Some(r) = self.rows() {
            for (l, ly) in self.layers.iter().enumerate() {
                if let LayerLayout::Mla { rows, .. } = ly {
                    if *rows != r {
                        return Err(WireError::MlaRows { layer: l, rows: *rows, others: r });
                    }
                }
            }
        }
        Ok(total)
    }
}
