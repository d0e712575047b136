//! Text a peer controls (notification payloads, the sender names they claim), made safe to
//! print among the CLI's own lines: scripts parse stdout line by line, so nothing a peer sends
//! may start a line of its own or reach the terminal as an escape sequence.

/// `bytes` as one quoted line: invalid UTF-8 becomes U+FFFD, and quotes, backslashes, line
/// breaks and every other control character are escaped (`\n`, `\u{1b}`).
pub(crate) fn quoted(bytes: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(bytes))
}

#[cfg(test)]
mod tests {
    use super::quoted;

    #[test]
    fn a_payload_cannot_forge_a_line_or_send_escape_codes() {
        let forged = quoted(b"ok\nsegment: 10.0.0.9:1\r\x1b[2J\x07\"tail\xff");
        assert!(!forged.contains(['\n', '\r', '\x1b', '\x07']), "{forged}");
        assert_eq!(
            forged,
            concat!(
                r#""ok\nsegment: 10.0.0.9:1\r\u{1b}[2J\u{7}\"tail"#,
                "\u{fffd}\""
            )
        );
        assert_eq!(quoted(b"kv ready"), r#""kv ready""#);
    }
}
