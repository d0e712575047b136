//! Mooncake's `TransferNotify(name, msg)` carried in one ferry notification: a marker, the
//! name's length, the name, then the message. A notification from a ferry engine that does not
//! speak this form is read as the sender's claimed name and the whole payload.

/// Marks a payload that carries a name and a message.
const MARKER: &[u8; 4] = b"mcn1";

/// The payload carrying `name` and `msg`.
pub(crate) fn encode(name: &[u8], msg: &[u8]) -> Vec<u8> {
    let length = u32::try_from(name.len()).unwrap_or(u32::MAX);
    let name = &name[..length as usize];
    let mut payload = Vec::with_capacity(MARKER.len() + 4 + name.len() + msg.len());
    payload.extend_from_slice(MARKER);
    payload.extend_from_slice(&length.to_le_bytes());
    payload.extend_from_slice(name);
    payload.extend_from_slice(msg);
    payload
}

/// The name and message of `payload`, sent by a peer that claims to be `from`.
pub(crate) fn decode(from: &str, payload: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let split = payload.strip_prefix(MARKER.as_slice()).and_then(|rest| {
        let (length, rest) = rest.split_first_chunk::<4>()?;
        let length = usize::try_from(u32::from_le_bytes(*length)).ok()?;
        (length <= rest.len()).then(|| rest.split_at(length))
    });
    match split {
        Some((name, msg)) => (name.to_vec(), msg.to_vec()),
        None => (from.as_bytes().to_vec(), payload.to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_messages_come_back_as_sent() {
        let payload = encode(b"decode-0", b"req-42 done");
        assert_eq!(
            decode("x:1", &payload),
            (b"decode-0".to_vec(), b"req-42 done".to_vec())
        );
        assert_eq!(decode("x:1", &encode(b"", b"")), (Vec::new(), Vec::new()));
    }

    #[test]
    fn foreign_or_cut_payloads_are_the_message_of_the_claimed_sender() {
        assert_eq!(
            decode("10.0.0.1:7", b"plain"),
            (b"10.0.0.1:7".to_vec(), b"plain".to_vec())
        );
        let mut cut = encode(b"decode-0", b"m");
        cut.truncate(10);
        assert_eq!(decode("p:1", &cut), (b"p:1".to_vec(), cut.clone()));
    }
}
