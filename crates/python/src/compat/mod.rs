//! What the address-based compatible APIs (`ferry_kv.mooncake`, `ferry_kv.nixl`) share: one
//! engine session that takes raw addresses, the planner that turns flat entries into paged
//! block copies, and the notification form that carries the sender's name.

pub(crate) mod notify;
pub(crate) mod paged;
pub(crate) mod plan;
pub(crate) mod regions;
pub(crate) mod session;
