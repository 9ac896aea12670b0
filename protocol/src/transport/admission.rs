//! Who may start a handshake with the prefill node: a bounded number at once, QUIC Retry for
//! unvalidated peers under load, a bounded number per address, and a bound on established
//! connections.

use std::sync::{Arc, Mutex as StdMutex};

/// Who may start a handshake: a bounded number at once, Retry (address validation) for
/// unvalidated peers under load, a bounded number per IP, and a bound on established connections.
/// Counts of what the accept loop refused are kept for metrics and tests.
#[derive(Clone)]
pub(crate) struct Admission {
    handshakes: Arc<tokio::sync::Semaphore>,
    max_handshakes: usize,
    retry_above: usize,
    per_ip: Arc<StdMutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    max_per_ip: usize,
    established: Arc<std::sync::atomic::AtomicUsize>,
    max_established: usize,
    counts: Arc<StdMutex<AdmissionCounts>>,
}

/// What the accept loop did with incoming connections (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionCounts {
    /// Answered with a QUIC Retry (address validation under load).
    pub retried: u64,
    /// Refused: too many handshakes, connections, or connections from one address.
    pub refused: u64,
    /// Given a handshake slot.
    pub admitted: u64,
    /// Most handshakes in progress at once so far.
    pub peak_handshakes: usize,
}

/// A handshake slot (and, once established, a connection slot) of one peer; freed on drop.
pub(crate) struct PeerSlot {
    ip: std::net::IpAddr,
    admission: Admission,
    _handshake: Option<tokio::sync::OwnedSemaphorePermit>,
    established: bool,
}

impl PeerSlot {
    pub(crate) fn established(mut self) -> PeerSlot {
        self._handshake = None;
        self.established = true;
        self.admission.established.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        if self.established {
            self.admission.established.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        let mut m = self.admission.per_ip.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

impl Admission {
    /// What the accept loop did so far.
    pub(crate) fn counts(&self) -> AdmissionCounts {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn new(t: &crate::transport::Tuning) -> Admission {
        let max_handshakes = t.max_handshakes.max(1);
        Admission {
            handshakes: Arc::new(tokio::sync::Semaphore::new(max_handshakes)),
            max_handshakes,
            retry_above: t.retry_above,
            per_ip: Default::default(),
            max_per_ip: t.max_connections_per_ip.max(1),
            established: Default::default(),
            max_established: t.max_connections.max(1),
            counts: Default::default(),
        }
    }

    /// Decides for one incoming connection: `None` when it was answered with Retry or refused.
    pub(crate) fn admit(&self, incoming: quinn::Incoming) -> Option<(quinn::Incoming, PeerSlot)> {
        let remote = incoming.remote_address();
        let in_progress = self.max_handshakes - self.handshakes.available_permits();
        let count = |f: &dyn Fn(&mut AdmissionCounts)| f(&mut self.counts.lock().unwrap_or_else(|e| e.into_inner()));
        if !incoming.remote_address_validated() && in_progress >= self.retry_above && incoming.may_retry() {
            // Stateless: only a peer that really owns its address comes back, with a token.
            if let Err(e) = incoming.retry() {
                e.into_incoming().refuse();
            }
            count(&|c| c.retried += 1);
            return None;
        }
        let refuse = |incoming: quinn::Incoming| {
            incoming.refuse();
            count(&|c| c.refused += 1);
        };
        if self.established.load(std::sync::atomic::Ordering::Relaxed) >= self.max_established {
            tracing::warn!(%remote, "refusing a connection: {} connections are open, the most allowed", self.max_established);
            refuse(incoming);
            return None;
        }
        let Ok(permit) = self.handshakes.clone().try_acquire_owned() else {
            tracing::warn!(%remote, "refusing a connection: {} handshakes in progress, the most allowed", self.max_handshakes);
            refuse(incoming);
            return None;
        };
        {
            let mut m = self.per_ip.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.entry(remote.ip()).or_insert(0);
            if *n >= self.max_per_ip {
                drop(m);
                tracing::warn!(%remote, "refusing a connection: {} connections from this address, the most allowed", self.max_per_ip);
                refuse(incoming);
                return None;
            }
            *n += 1;
        }
        let now = self.max_handshakes - self.handshakes.available_permits();
        count(&|c| {
            c.admitted += 1;
            c.peak_handshakes = c.peak_handshakes.max(now);
        });
        Some((incoming, PeerSlot { ip: remote.ip(), admission: self.clone(), _handshake: Some(permit), established: false }))
    }
}
