//! Who an engine is: random 128-bit ids that stay unique across hosts, containers and PID
//! namespaces, where process ids repeat (every containerized service may be PID 1).

use serde::{Deserialize, Serialize};
use std::sync::OnceLock;

/// A random 128-bit identity, written as 32 lowercase hex digits.
///
/// Each engine has its own ([`crate::SegmentDescriptor::instance`]), and all engines of one
/// process share another ([`crate::SegmentDescriptor::process`]). Two descriptors with equal
/// ids come from the same engine (or process); ids are never reused, so a restarted service
/// gets new ones even when it has the same PID, host and port.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct InstanceId(u128);

impl InstanceId {
    /// A fresh id from the operating system's random source.
    ///
    /// # Errors
    /// When the operating system has no random source to read.
    pub fn random() -> std::io::Result<InstanceId> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes).map_err(std::io::Error::from)?;
        Ok(InstanceId(u128::from_le_bytes(bytes)))
    }

    /// The id shared by every engine of this process, made on first use.
    ///
    /// # Errors
    /// As [`Self::random`], on first use only.
    pub fn of_this_process() -> std::io::Result<InstanceId> {
        static PROCESS: OnceLock<InstanceId> = OnceLock::new();
        if let Some(id) = PROCESS.get() {
            return Ok(*id);
        }
        let fresh = InstanceId::random()?;
        Ok(*PROCESS.get_or_init(|| fresh))
    }

    /// The id from its raw value, for tests and tools that build descriptors.
    pub const fn from_u128(value: u128) -> InstanceId {
        InstanceId(value)
    }
}

impl std::fmt::Display for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl std::fmt::Debug for InstanceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InstanceId({self})")
    }
}

impl std::str::FromStr for InstanceId {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        if text.len() != 32 || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
            return Err(format!(
                "{text:?} is not an instance id (32 hex digits); run the same ferry version on both sides"
            ));
        }
        u128::from_str_radix(text, 16)
            .map(InstanceId)
            .map_err(|error| format!("{text:?} is not an instance id: {error}"))
    }
}

impl TryFrom<String> for InstanceId {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        text.parse()
    }
}

impl From<InstanceId> for String {
    fn from(id: InstanceId) -> String {
        id.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::InstanceId;

    #[test]
    fn ids_round_trip_through_text_and_junk_is_refused() {
        let id = InstanceId::random().unwrap();
        let text = id.to_string();
        assert_eq!(text.len(), 32);
        assert_eq!(text.parse::<InstanceId>(), Ok(id));
        assert_eq!(
            InstanceId::from_u128(0xab).to_string(),
            "000000000000000000000000000000ab"
        );
        for junk in ["", "ab", &"g".repeat(32), &"0".repeat(33), &"é".repeat(16)] {
            let error = junk.parse::<InstanceId>().unwrap_err();
            assert!(error.contains("not an instance id"), "{error}");
        }
    }

    #[test]
    fn engines_differ_and_the_process_id_is_stable() {
        assert_ne!(InstanceId::random().unwrap(), InstanceId::random().unwrap());
        assert_eq!(
            InstanceId::of_this_process().unwrap(),
            InstanceId::of_this_process().unwrap()
        );
    }
}
