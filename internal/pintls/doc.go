// Package pintls makes ephemeral TLS 1.3 identities whose certificates are
// pinned by fingerprint instead of verified against a CA, and binds
// application-level proofs to a TLS session.
//
// A process makes one Identity (an ECDSA P-256 key and a self-signed
// certificate) when it starts; peers learn its Fingerprint out of band
// (soft0 carries it in its endpoints) and accept only that certificate
// (ClientConfig). Where no fingerprint can be known beforehand, a shared
// secret proven over Binding authenticates the session instead: a relay
// between two TLS sessions cannot forward such a proof, since each
// session exports different keying material.
//
// Everything here is safe for concurrent use; an Identity is immutable.
package pintls
