//! k3-prefill: the GPU node's library.
