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

    /// A secret made of `bytes`, used exactly as given. One that looks like typed text rather
    /// than random bytes (raw, hex or base64) is accepted with a warning in the log: one
    /// recorded handshake lets an attacker test guesses offline, so a phrase falls fast.
    ///
    /// # Errors
    /// [`Error::ApiMisuse`] when it has fewer than [`Self::MIN_LEN`] bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Secret> {
        let bytes = bytes.into();
        if bytes.len() < Self::MIN_LEN {
            return Err(Error::ApiMisuse(format!(
                "a shared secret of {} bytes is too short; use at least {} random bytes: `ferry secret` prints 32 in base64",
                bytes.len(),
                Self::MIN_LEN
            )));
        }
        if looks_like_text(&bytes) {
            tracing::warn!(
                "the shared secret looks like text, not random bytes: whoever records one handshake can test guesses offline; generate one with `ferry secret` (32 random bytes, base64)"
            );
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

/// Whether `bytes` look like text someone typed rather than random bytes: printable ASCII
/// that is neither hex (at least 32 digits, 16 bytes, using 10 of them or more) nor padded base64 of at least 16 bytes
/// with upper case, lower case and digits, as random bytes in base64 almost always have.
/// Binary bytes, and random bytes in either encoding, pass; so does text that happens to be
/// hex or base64, which this cannot tell apart.
pub(crate) fn looks_like_text(bytes: &[u8]) -> bool {
    if !bytes
        .iter()
        .all(|byte| byte.is_ascii_graphic() || *byte == b' ')
    {
        return false;
    }
    let mut seen = [false; 256];
    bytes
        .iter()
        .for_each(|&byte| seen[usize::from(byte)] = true);
    // Random hex uses most of its 16 digits; a repeated letter is hex too.
    let hex = bytes.len() >= 32
        && bytes.iter().all(u8::is_ascii_hexdigit)
        && seen.iter().filter(|&&seen| seen).count() >= 10;
    let body = bytes
        .strip_suffix(b"==")
        .or_else(|| bytes.strip_suffix(b"="))
        .unwrap_or(bytes);
    let base64 = bytes.len() >= 24
        && bytes.len() % 4 == 0
        && body
            .iter()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'+' | b'/'))
        && body.iter().any(u8::is_ascii_uppercase)
        && body.iter().any(u8::is_ascii_lowercase)
        && body.iter().any(u8::is_ascii_digit);
    !hex && !base64
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

    #[test]
    fn typed_text_looks_like_text_and_random_bytes_in_any_encoding_do_not() {
        for text in [
            &b"correct-horse-battery-staple"[..],
            b"mysecretpassword123456",
            b"the quick brown fox jumps over the lazy dog",
            b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            b"PASSWORDPASSWORDPASSWORDPASSWORD",
        ] {
            assert!(looks_like_text(text), "{}", String::from_utf8_lossy(text));
        }
        // Fixed bytes from a generator (the same in every run): raw, base64 and hex.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let random: Vec<u8> = (0..32)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        let hex: Vec<u8> = random
            .iter()
            .flat_map(|byte| format!("{byte:02x}").into_bytes())
            .collect();
        for secret in [
            &random[..],
            b"q0R8Yf2mL7vNw1ZcT9pKd3xJb6hUe4sGa5oQi8rVt0E=",
            b"3q2+7w0Rk9ZcT1pKd3xJbA==",
            &hex[..],
        ] {
            assert!(!looks_like_text(secret), "{secret:?}");
        }
    }
}
