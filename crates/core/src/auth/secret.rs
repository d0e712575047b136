//! The shared secret, where it comes from, and which engine's secret a thread works for.

use crate::error::{Error, Result};
use hmac::{Hmac, KeyInit};
use sha2::Sha256;
use std::cell::RefCell;
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

thread_local! {
    static ENGINE_SECRET: RefCell<Option<Secret>> = const { RefCell::new(None) };
}

/// Marks the calling thread as one of an engine's I/O threads, working with `secret`.
pub(crate) fn enter_engine(secret: Option<Secret>) {
    ENGINE_SECRET.with(|current| *current.borrow_mut() = secret);
}

/// Makes the calling thread work for an engine with `secret` until dropped, then restores
/// what it worked for before: for a caller's thread that runs the first steps of a transfer.
pub(crate) struct EngineScope {
    previous: Option<Secret>,
}

impl EngineScope {
    pub(crate) fn enter(secret: Option<Secret>) -> EngineScope {
        EngineScope {
            previous: ENGINE_SECRET.with(|current| current.replace(secret)),
        }
    }
}

impl Drop for EngineScope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        ENGINE_SECRET.with(|current| *current.borrow_mut() = previous);
    }
}

/// The shared secret of the engine whose I/O thread calls this; `None` on other threads and
/// for engines without one.
///
/// Transports that open side channels of their own (the nvlink transport's fd-passing client)
/// authenticate with it: they run on the engine's threads, so each engine of a process uses
/// its own secret.
pub fn engine_secret() -> Option<Secret> {
    ENGINE_SECRET.with(|current| current.borrow().clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_scope_lends_its_secret_to_the_thread_and_gives_the_old_one_back() {
        let outer = Secret::new(b"outer-secret-0123456789".to_vec()).unwrap();
        let inner = Secret::new(b"inner-secret-0123456789".to_vec()).unwrap();
        let proof = |secret: Option<Secret>| {
            use hmac::Mac;
            secret.map(|secret| secret.mac().chain_update(b"x").finalize().into_bytes())
        };
        std::thread::spawn(move || {
            assert!(engine_secret().is_none());
            enter_engine(Some(outer.clone()));
            {
                let _scope = EngineScope::enter(Some(inner.clone()));
                assert_eq!(proof(engine_secret()), proof(Some(inner)));
            }
            assert_eq!(proof(engine_secret()), proof(Some(outer)));
        })
        .join()
        .unwrap();
    }

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
