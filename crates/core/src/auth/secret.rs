//! The shared secret, where it comes from, and which engine's secret a thread works for.

use crate::error::{Error, Result};
use hmac::{Hmac, KeyInit};
use sha2::Sha256;
use std::path::Path;
use std::sync::Arc;

/// The environment variable an engine builder reads its secret from when none was set.
pub const SECRET_ENV: &str = "FERRY_SECRET";

/// A shared secret that peers prove they hold before they are served. Cheap to clone; its
/// bytes never appear in `Debug` output or logs.
#[derive(Clone)]
pub struct Secret(Arc<Hmac<Sha256>>);

impl Secret {
    /// Fewest bytes a secret may have; shorter ones are too easy to guess from a recorded proof.
    pub const MIN_LEN: usize = 16;

    /// A secret made of `bytes`, used exactly as given.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when it has fewer than [`Self::MIN_LEN`] bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret> {
        let bytes = bytes.into();
        if bytes.len() < Self::MIN_LEN {
            return Err(Error::ApiMisuse(format!(
                "a shared secret of {} bytes is too short; use at least {} random bytes, e.g. `head -c 32 /dev/urandom | base64`",
                bytes.len(),
                Self::MIN_LEN
            )));
        }
        let key = Hmac::<Sha256>::new_from_slice(&bytes).map_err(|error| {
            Error::ApiMisuse(format!("the shared secret cannot key HMAC-SHA256: {error}"))
        })?;
        Ok(Secret(Arc::new(key)))
    }

    /// The secret in the environment variable [`SECRET_ENV`], used exactly as given; `None`
    /// when it is unset.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when it is set but too short (an empty value included).
    pub fn from_env() -> Result<Option<Secret>> {
        match std::env::var_os(SECRET_ENV) {
            None => Ok(None),
            Some(value) => Secret::new(value.into_encoded_bytes())
                .map(Some)
                .map_err(|error| Error::ApiMisuse(format!("{SECRET_ENV}: {error}"))),
        }
    }

    /// HMAC-SHA256 keyed with the secret, ready for the message.
    pub(crate) fn mac(&self) -> Hmac<Sha256> {
        Hmac::clone(&self.0)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The bytes of the secret file `path`, trailing whitespace (a final newline) removed: what
/// `--secret-file` hands to [`crate::EngineBuilder::secret`].
///
/// # Errors
/// [`Error::Io`] when the file cannot be read.
pub fn read_secret_file(path: impl AsRef<Path>) -> Result<Vec<u8>> {
    let path = path.as_ref();
    let mut bytes = std::fs::read(path).map_err(|error| {
        Error::io(
            format!("reading the shared secret from {}", path.display()),
            error,
        )
    })?;
    let kept = bytes.trim_ascii_end().len();
    bytes.truncate(kept);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_secrets_are_refused_and_files_lose_their_final_newline() {
        let error = Secret::new(b"short".to_vec()).unwrap_err();
        assert!(
            matches!(&error, Error::ApiMisuse(text) if text.contains("too short")),
            "{error}"
        );
        let path = std::env::temp_dir().join(format!("ferry-secret-{}", std::process::id()));
        std::fs::write(&path, b"0123456789abcdef-secret\n").unwrap();
        let secret = Secret::new(read_secret_file(&path).unwrap()).unwrap();
        std::fs::remove_file(&path).unwrap();
        let proof = |secret: &Secret| {
            use hmac::Mac;
            secret
                .mac()
                .chain_update(b"message")
                .finalize()
                .into_bytes()
        };
        let expected = Secret::new(b"0123456789abcdef-secret".to_vec()).unwrap();
        assert_eq!(proof(&secret), proof(&expected));
        assert_eq!(format!("{secret:?}"), "Secret(..)");
    }
}
