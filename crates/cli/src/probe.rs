//! `ferry probe`: what this machine offers, and with `--peer` which path a running engine's
//! buffers get from here and why ([`ferry::probe`] writes the report).

/// Prints [`ferry::probe::machine`] and, with `peer`, [`ferry::probe::routes`] from an engine
/// with `metadata` and the secret.
pub(crate) fn run(
    peer: Option<&str>,
    metadata: &str,
    secret: &crate::secret_file::SecretFile,
) -> Result<(), Box<dyn std::error::Error>> {
    print!("{}", ferry::probe::machine()?);
    if let Some(name) = peer {
        let engine = secret
            .apply(ferry::builder())?
            .metadata(ferry::metadata::from_url(metadata)?)
            .build_blocking()?;
        print!("{}", ferry::probe::routes(&engine, name)?);
    }
    Ok(())
}
