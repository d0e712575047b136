#!/usr/bin/env python3
"""Prints the path of every test binary in the JSON messages of `cargo test --no-run
--message-format=json` read from stdin, one a line (what gpu-build.sh and
replay-elsewhere.sh copy); of `cargo bench --bench NAME --no-run --message-format=json`, the
bench's binary (gpu-build.sh's and gpu-ab.sh's submit-bench)."""
import json
import sys

for line in sys.stdin:
    try:
        message = json.loads(line)
    except ValueError:
        continue
    if (message.get("reason") == "compiler-artifact" and message.get("profile", {}).get("test")
            and message.get("executable")):
        print(message["executable"])
