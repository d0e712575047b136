//! The wire protocol: frame header and bodies, encoded and decoded without any I/O.
//!
//! Every frame is a fixed 24-byte header followed by `len` body bytes:
//!
//! ```text
//! 0       4    5    6      8          16        20        24
//! | magic | v  |kind| flags|    id     |   len   | reserved|
//! ```
//!
//! Integers are little-endian. `id` pairs a request with its response. Each kind has its own
//! body-size limit, checked before anything is allocated or read, so a peer announcing a 4 GiB
//! frame is refused at the header.

mod body;
#[cfg(test)]
mod garbage;
mod header;
mod reader;
pub mod seal;

pub use body::{
    decode_ack, decode_hello, decode_read_request, decode_write_many_count,
    decode_write_many_table, encode_ack, encode_hello, encode_read_request,
    encode_write_many_table, Hello, WriteManyEntry, MAX_HELLO_BODY, MAX_NAME_BYTES,
    WRITE_MANY_ENTRY_LEN,
};
pub use header::{Header, Kind, Limits, HEADER_LEN, MAGIC, VERSION};
pub use reader::Reader;
