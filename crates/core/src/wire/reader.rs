use crate::error::ProtocolViolation;

/// Reads fixed-size fields from a body without ever slicing past its end.
#[derive(Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader over `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes }
    }

    /// The next `len` bytes, or `TooShort` naming `what`.
    pub fn take(&mut self, len: usize, what: &'static str) -> Result<&'a [u8], ProtocolViolation> {
        if self.bytes.len() < len {
            return Err(ProtocolViolation::TooShort {
                what,
                needed: len - self.bytes.len(),
            });
        }
        let (head, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        Ok(head)
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self, what: &'static str) -> Result<u32, ProtocolViolation> {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(raw))
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self, what: &'static str) -> Result<u64, ProtocolViolation> {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(raw))
    }

    /// Succeeds only when every byte was consumed.
    pub fn finish(self) -> Result<(), ProtocolViolation> {
        match self.bytes.len() {
            0 => Ok(()),
            left => Err(ProtocolViolation::TrailingBytes(left)),
        }
    }
}
