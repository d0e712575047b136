//! What the address-based compatible APIs (`ferry_kv.mooncake`, `ferry_kv.nixl`) share: one
//! engine session that takes raw addresses (the engine itself plans their flat entries into
//! paged block copies), and the notification form that carries the sender's name.

pub(crate) mod moving;
pub(crate) mod notify;
pub(crate) mod paged;
pub(crate) mod regions;
pub(crate) mod session;
pub(crate) mod spans;
pub(crate) mod templates;
