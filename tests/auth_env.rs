//! `FERRY_SECRET` supplies the secret when the builder got none, and a secret given to the
//! builder wins over it. Its own test binary: the variable is process-wide.

use ferry::{AuthFailure, Error};
use std::time::Duration;

#[tokio::test]
async fn the_environment_supplies_the_secret_and_the_builder_overrides_it() {
    std::env::set_var(ferry::auth::SECRET_ENV, "from-the-environment-0123456789");
    let from_env = ferry::builder()
        .transfer_timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let same = ferry::builder()
        .secret(b"from-the-environment-0123456789".to_vec())
        .build()
        .await
        .unwrap();
    let other = ferry::builder()
        .secret(b"given-to-the-builder-0123456789".to_vec())
        .build()
        .await
        .unwrap();
    std::env::remove_var(ferry::auth::SECRET_ENV);

    let _pool = from_env.allocate(4096).unwrap();
    same.connect(from_env.name()).await.unwrap();
    match other.connect(from_env.name()).await {
        Err(Error::Unauthenticated { reason, .. }) => {
            assert_eq!(reason, AuthFailure::PeerProofMismatch)
        }
        outcome => panic!("expected Error::Unauthenticated, got {outcome:?}"),
    }
}
