//! `ferry probe`: against a running `ferry serve`, and its RDMA section.

mod common;

use common::{ferry_bin, ServeProcess};

#[test]
fn probe_says_which_path_each_buffer_of_a_peer_gets_and_why() {
    let serve = ServeProcess::start(4096);
    let output = std::process::Command::new(ferry_bin())
        .args(["probe", "--peer", &serve.name])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    let peer_line = text
        .lines()
        .find(|line| line.starts_with(&format!("peer {}:", serve.name)))
        .unwrap_or_else(|| panic!("no peer line in:\n{text}"));
    assert!(
        peer_line.contains("another process on this host"),
        "{peer_line}"
    );
    let buffer_line = text
        .lines()
        .find(|line| line.contains(&format!("buffer {:#x}", serve.buffer_addr)))
        .unwrap_or_else(|| panic!("no line for the peer's buffer in:\n{text}"));
    // Host memory on both sides: TCP carries it, and nvlink says why it does not.
    assert!(buffer_line.contains("): tcp ["), "{buffer_line}");
    assert!(buffer_line.contains("nvlink: "), "{buffer_line}");
}

/// Runs a program as PID 1 of a new PID namespace, as the first process of a pod's container
/// is, and kills it when the launcher dies.
const AS_PID_1: [&str; 4] = ["unshare", "--pid", "--fork", "--kill-child"];

#[test]
#[ignore = "needs root to create PID namespaces; .ci/run runs it"]
fn probe_names_the_pid_clash_of_two_processes_that_are_each_pid_1_of_their_namespace() {
    let serve = ServeProcess::start_under(&AS_PID_1, 4096, &[], &[]);
    let probe = |launcher: &[&str]| {
        let ferry = ferry_bin();
        let mut words = launcher.to_vec();
        words.extend([ferry.as_str(), "probe", "--peer", &serve.name]);
        let output = std::process::Command::new(words[0])
            .args(&words[1..])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "{text}");
        text
    };
    let clash = probe(&AS_PID_1);
    assert!(clash.contains("(pid 1 on host"), "{clash}");
    assert!(
        clash.lines().any(|line| line.starts_with(
            "  note: the peer's process has this probe's PID (1), in another PID namespace"
        )),
        "no PID-clash note in:\n{clash}"
    );
    // From the host's namespace the PIDs differ, and the note says what a PID-1 peer means.
    let plain = probe(&[]);
    assert!(
        plain
            .lines()
            .any(|line| line
                .starts_with("  note: the peer's process is PID 1 of its own PID namespace")),
        "no PID-1 note in:\n{plain}"
    );
    assert!(!plain.contains("has this probe's PID"), "{plain}");
}

/// On a machine without RDMA (CI's), `ferry probe` says so, why, and what carries transfers
/// between hosts instead; and it always says how far the RDMA path has been tested. The reason
/// differs by build: without the `rdma` feature it says to rebuild with it, with the feature it
/// names what rdma-core lacks here. Both name what would provide RDMA, so the assertion holds
/// for either binary (`FERRY_BIN` may point at one built with other features).
#[test]
fn probe_reports_rdma_unavailable_with_the_reason_and_the_tcp_fallback() {
    let output = std::process::Command::new(ferry_bin())
        .arg("probe")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    let line = text
        .lines()
        .find(|line| line.starts_with("RDMA: unavailable: "))
        .unwrap_or_else(|| panic!("no RDMA unavailable line in:\n{text}"));
    let reason = line
        .strip_prefix("RDMA: unavailable: ")
        .and_then(|rest| rest.strip_suffix("; transfers between hosts use TCP"))
        .unwrap_or_else(|| panic!("not `RDMA: unavailable: <reason>; ...TCP`: {line}"));
    assert!(
        reason.contains("rebuild with `--features rdma`") || reason.contains("rdma-core"),
        "the reason names neither the build feature nor rdma-core: {reason}"
    );
    assert!(
        text.lines().any(|line| line
            .contains("tested only against an in-memory verbs model, not on RDMA hardware")),
        "no caveat about RDMA testing in:\n{text}"
    );
}
