"""The other side of the NIXL tests: one ``nixl_agent`` in its own process, with host pools,
driven by JSON lines on stdin (one answer line each on stdout). vLLM exchanges agent metadata
over its own side channel; this pipe plays that channel.

Usage: ``nixl_peer.py NAME REGIONS BLOCKS BLOCK_BYTES``. Each region is one pool of ``BLOCKS``
blocks. Block ``b`` of region ``r`` holds ``value(r, b, seed)`` after ``fill``. The process
exits on ``exit``, on end of input, or after ``FERRY_TEST_PEER_LIFETIME_S`` seconds.
"""

import json
import os
import sys
import threading
import time

import numpy as np

from ferry_kv.nixl import nixl_agent, nixl_agent_config


def value(region, block, seed):
    """The byte every position of a filled block holds."""
    return (seed * 31 + region * 7 + block) % 251 + 1


def main():
    name, regions, blocks, block = sys.argv[1], *map(int, sys.argv[2:5])
    lifetime = float(os.environ.get("FERRY_TEST_PEER_LIFETIME_S", "120"))
    timer = threading.Timer(lifetime, lambda: os._exit(3))
    timer.daemon = True
    timer.start()
    agent = nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))
    pools = [np.zeros(blocks * block, dtype=np.uint8) for _ in range(regions)]
    descs = agent.get_reg_descs([(p.ctypes.data, p.nbytes, 0, "") for p in pools], "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    rows = np.array([[p.ctypes.data, block, 0, block, blocks] for p in pools], dtype=np.uint64)
    remotes = {}
    received = []
    lock = threading.Lock()
    overwrite = threading.Event()

    def watch():
        # Overwrites every pool the moment a notification arrives: a reader whose
        # notification came before its read finished would see these bytes.
        while True:
            for sender, msgs in agent.get_new_notifs().items():
                if overwrite.is_set():
                    for pool in pools:
                        pool[:] = 0xEE
                with lock:
                    received.extend((sender, msg.hex()) for msg in msgs)
            time.sleep(0.0002)

    threading.Thread(target=watch, daemon=True).start()
    say({"metadata": agent.get_agent_metadata().hex(), "addrs": [p.ctypes.data for p in pools]})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "exit":
            break
        if op == "add":
            remote = agent.add_remote_agent(bytes.fromhex(command["metadata"]))
            remotes[remote.decode()] = remote
            say({"name": remote.decode()})
        elif op == "fill":
            for r, pool in enumerate(pools):
                for b in range(blocks):
                    pool[b * block : (b + 1) * block] = value(r, b, command["seed"])
            if command.get("overwrite_on_notif"):
                overwrite.set()
            else:
                overwrite.clear()
            say({"filled": True})
        elif op == "dump":
            say({"pools": [pool.tobytes().hex() for pool in pools]})
        elif op == "notifs":
            deadline = time.monotonic() + command.get("wait_s", 0)
            while True:
                with lock:
                    if len(received) >= command.get("count", 0) or time.monotonic() > deadline:
                        taken = list(received)
                        received.clear()
                        break
                time.sleep(0.001)
            say({"notifs": taken})
        elif op == "send_notif":
            agent.send_notif(remotes[command["to"]], notif_msg=bytes.fromhex(command["msg"]))
            say({"sent": True})
        elif op == "write":
            # Push mode: write this process's blocks into the peer's, as vLLM's prefill does.
            remote_rows = np.array(command["rows"], dtype=np.uint64)
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type="DRAM")
            remote = agent.prep_xfer_dlist(remotes[command["to"]], remote_rows, mem_type="DRAM")
            handle = agent.make_prepped_xfer(
                "WRITE",
                local,
                np.array(command["local_ids"], dtype=np.int64),
                remote,
                np.array(command["remote_ids"], dtype=np.int64),
                notif_msg=bytes.fromhex(command["notif"]),
            )
            agent.transfer(handle)
            deadline = time.monotonic() + 20
            state = agent.check_xfer_state(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0005)
                state = agent.check_xfer_state(handle)
            telemetry = agent.get_xfer_telemetry(handle)
            agent.release_xfer_handle(handle)
            agent.release_dlist_handle(remote)
            agent.release_dlist_handle(local)
            say({"state": state, "bytes": telemetry.totalBytes})
        else:
            say({"error": f"unknown op {op}"})


def say(answer):
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
