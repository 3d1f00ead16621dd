//! TLS with rustls (ring as the crypto provider): a PEM certificate chain and private key
//! (`--ssl-certfile`, `--ssl-keyfile`, as vLLM and uvicorn name them) become the server's
//! `rustls::ServerConfig`, offering HTTP/1.1 by ALPN.

use std::path::Path;
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::ServerError;

/// Loads a certificate chain (`certfile`, leaf first) and its private key (`keyfile`,
/// PKCS#8, PKCS#1 or SEC1).
///
/// # Errors
///
/// [`ServerError::Config`] naming the flag and file: unreadable, no PEM certificate or key
/// in it, or a key that does not match the certificate.
pub fn load_tls(certfile: &Path, keyfile: &Path) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    let bad = |flag: &str, path: &Path, what: String| {
        ServerError::Config(format!("{flag} {}: {what}", path.display()))
    };
    let certs = CertificateDer::pem_file_iter(certfile)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| bad("--ssl-certfile", certfile, pem_error(e)))?;
    if certs.is_empty() {
        return Err(bad(
            "--ssl-certfile",
            certfile,
            "no PEM certificate (-----BEGIN CERTIFICATE-----) in the file".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(keyfile)
        .map_err(|e| bad("--ssl-keyfile", keyfile, pem_error(e)))?;
    // ring, the provider reqwest's rustls builds too (rustls 0.23.48 deprecates it for
    // lacking post-quantum key exchange; aws-lc-rs would add a second C library to build).
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServerError::Config(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            ServerError::Config(format!(
                "--ssl-certfile {} / --ssl-keyfile {}: {e}",
                certfile.display(),
                keyfile.display()
            ))
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

fn pem_error(e: rustls_pki_types::pem::Error) -> String {
    match e {
        rustls_pki_types::pem::Error::Io(io) => io.to_string(),
        rustls_pki_types::pem::Error::NoItemsFound => "no PEM item of the expected kind".into(),
        other => format!("not valid PEM: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_a_generated_pair_and_names_bad_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert");
        let (certfile, keyfile) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&certfile, cert.cert.pem()).expect("write");
        std::fs::write(&keyfile, cert.key_pair.serialize_pem()).expect("write");
        let config = load_tls(&certfile, &keyfile).expect("loads");
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);

        let missing = load_tls(&dir.path().join("nope.pem"), &keyfile).expect_err("missing");
        assert!(missing.to_string().contains("--ssl-certfile"), "{missing}");
        let swapped = load_tls(&keyfile, &certfile).expect_err("swapped");
        assert!(swapped.to_string().contains("--ssl-certfile"), "{swapped}");
        let other = rcgen::generate_simple_self_signed(vec!["x".into()]).expect("cert");
        std::fs::write(&keyfile, other.key_pair.serialize_pem()).expect("write");
        let mismatch = load_tls(&certfile, &keyfile).expect_err("mismatch");
        assert!(mismatch.to_string().contains("--ssl-keyfile"), "{mismatch}");
    }
}
