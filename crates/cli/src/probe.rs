//! `ferry probe`: what this machine offers, and with `--peer` which path a running engine's
//! buffers get from here and why ([`ferry::probe`] writes the report).

/// Prints [`ferry::probe::machine`] and, with `peer`, [`ferry::probe::routes`] from an engine
/// with `metadata`, the secret and the socket directory.
pub(crate) fn run(
    peer: Option<&str>,
    metadata: &str,
    secret: &crate::secret_file::SecretFile,
    socket_dir: &crate::socket_dir::SocketDirArg,
) -> Result<(), Box<dyn std::error::Error>> {
    print!("{}", ferry::probe::machine()?);
    if let Some(name) = peer {
        let engine = secret
            .apply(
                ferry::Links::default()
                    .nvlink(socket_dir.config(ferry::NvlinkConfig::default()))
                    .builder(),
            )?
            .metadata(ferry::metadata::from_url(metadata)?)
            .build_blocking()?;
        print!("{}", ferry::probe::routes(&engine, name)?);
    }
    Ok(())
}
