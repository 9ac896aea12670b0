//! k3-decode: the decoder node's library.
