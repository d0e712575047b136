//! `ferry serve --echo`: answers each notification to the engine its operator named, never to
//! the sender a notification claims to be from (`Notification::from` is that claim, and
//! anyone who reaches the listener can write any name there).

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};

/// The engine answers go to: the `--reply-to` name, replaced by every `reply-to NAME` line on
/// stdin (a parent whose engine starts after this process names it that way).
pub(crate) struct ReplyTo {
    name: Arc<Mutex<Option<String>>>,
    /// Peers answered before, so an answer costs no metadata lookup.
    peers: Mutex<HashMap<String, ferry::Peer>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one assignment or insert, so a poisoned value is still consistent.
    mutex.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl ReplyTo {
    /// Starts with `given` and follows stdin from now on, confirming each name on stdout.
    pub(crate) fn new(given: Option<String>) -> ReplyTo {
        let name = Arc::new(Mutex::new(given));
        let follow = Arc::clone(&name);
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                let Some(named) = line.strip_prefix("reply-to ").map(str::trim) else {
                    continue;
                };
                *lock(&follow) = Some(named.to_owned());
                let mut stdout = std::io::stdout().lock();
                let _ = writeln!(stdout, "reply-to: {named}");
                let _ = stdout.flush();
            }
        });
        ReplyTo {
            name,
            peers: Mutex::default(),
        }
    }

    /// Sends `text` to the configured engine; without one, logs that nothing was answered.
    pub(crate) fn answer(
        &self,
        engine: &ferry::Engine,
        text: &str,
    ) -> Result<(), Box<dyn std::error::Error>> {
        let Some(name) = lock(&self.name).clone() else {
            tracing::warn!(
                "a notification arrived but no engine to answer was named: give --reply-to NAME"
            );
            return Ok(());
        };
        let cached = lock(&self.peers).get(&name).cloned();
        let peer = match cached {
            Some(peer) => peer,
            None => {
                let peer = engine.connect_blocking(&name)?;
                lock(&self.peers).insert(name, peer.clone());
                peer
            }
        };
        futures::executor::block_on(engine.notify(&peer, text.as_bytes().to_vec()))?;
        Ok(())
    }
}
