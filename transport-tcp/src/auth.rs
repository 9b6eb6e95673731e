//! Cluster membership: who may join a job's rendezvous and mesh.
//!
//! Every connection made during set-up runs a challenge-response handshake: the connecting side
//! sends its greeting (magic, version, rank, node count) and a fresh nonce; the accepting side
//! answers with its own greeting, a fresh nonce and an HMAC-SHA256 over both greetings, both
//! nonces and the job id, keyed with the cluster secret; the connecting side checks it and
//! answers with its own MAC over the same transcript. Each side thereby proves that it knows the
//! secret and belongs to the same job, and neither MAC can be replayed into another connection
//! (both nonces are fresh). Without a secret the key is empty: the handshake then only keeps
//! different jobs apart, and nothing is authenticated (the engine allows that on loopback only).

use hmac::{Hmac, KeyInit, Mac};
use rand::RngCore;
use sha2::Sha256;

/// Bytes of a handshake nonce.
pub const NONCE: usize = 16;
/// Bytes of a MAC.
pub const MAC: usize = 32;

/// Who may join: the holders of `secret` in job `job`.
#[derive(Clone, Default)]
pub struct Membership {
    /// The shared cluster secret (`None`: no authentication).
    pub secret: Option<Vec<u8>>,
    /// The job's identity (jobs with different ids never connect).
    pub job: String,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret itself never reaches a log.
        f.debug_struct("Membership").field("secret", &self.secret.as_ref().map(|_| "<set>")).field("job", &self.job).finish()
    }
}

impl Membership {
    /// A fresh random nonce.
    pub fn nonce() -> [u8; NONCE] {
        let mut n = [0u8; NONCE];
        rand::rngs::OsRng.fill_bytes(&mut n);
        n
    }

    /// The MAC of `role` ("accept" or "connect") over the transcript `parts`.
    pub fn mac(&self, role: &str, parts: &[&[u8]]) -> [u8; MAC] {
        self.transcript(role, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is `role`'s MAC over `parts` (compared in constant time).
    pub fn verify(&self, role: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.transcript(role, parts).verify_slice(tag).is_ok()
    }

    /// HMAC-SHA256 keyed with the secret over the role, the job id and the parts, each
    /// length-prefixed so that no two transcripts run together.
    fn transcript(&self, role: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
        // HMAC takes keys of any length, the empty one included.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(self.secret.as_deref().unwrap_or_default()).expect("HMAC accepts any key length");
        for p in [role.as_bytes(), self.job.as_bytes()].iter().chain(parts) {
            mac.update(&(p.len() as u32).to_le_bytes());
            mac.update(p);
        }
        mac
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_depend_on_secret_job_role_and_transcript() {
        let a = Membership { secret: Some(b"s3cret".to_vec()), job: "7".into() };
        let tag = a.mac("accept", &[b"hello", b"nonce"]);
        assert!(a.verify("accept", &[b"hello", b"nonce"], &tag));
        assert!(!a.verify("connect", &[b"hello", b"nonce"], &tag), "roles differ");
        assert!(!a.verify("accept", &[b"hellon", b"once"], &tag), "parts are length-prefixed");
        let other_secret = Membership { secret: Some(b"guess".to_vec()), ..a.clone() };
        assert!(!other_secret.verify("accept", &[b"hello", b"nonce"], &tag));
        let other_job = Membership { job: "8".into(), ..a.clone() };
        assert!(!other_job.verify("accept", &[b"hello", b"nonce"], &tag));
        assert_ne!(Membership::nonce(), Membership::nonce());
        assert!(!format!("{a:?}").contains("s3cret"), "the secret is never printed");
    }
}
