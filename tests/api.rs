//! The public handles can move between threads and tasks, as an embedding server needs.

use ferry::{Batch, Completion, Engine, Error, Notifications, Peer, Region, Transfer};

fn send_and_sync<T: Send + Sync>() {}
fn send<T: Send>() {}

#[test]
fn handles_are_send_and_sync() {
    send_and_sync::<Engine>();
    send_and_sync::<Peer>();
    send_and_sync::<Region>();
    send_and_sync::<Transfer>();
    send_and_sync::<Completion>();
    send_and_sync::<Error>();
    send_and_sync::<Notifications>();
    send::<Batch>();
}

#[test]
fn errors_tell_the_caller_what_to_do() {
    let engine = Engine::builder().build_blocking().unwrap();
    let error = engine.connect_blocking("127.0.0.1:1").unwrap_err();
    assert!(
        error
            .to_string()
            .contains("check that its engine is running"),
        "{error}"
    );
    let error = Engine::builder()
        .listen("0.0.0.0:0")
        .build_blocking()
        .unwrap_err();
    assert!(error.to_string().contains("advertise"), "{error}");
}
