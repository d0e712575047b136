"""NIXL's ``nixl._api`` on ferry: ``nixl_agent``, ``nixl_agent_config`` and the handle types,
with NIXL 1.5's signatures and semantics, so vLLM's ``NixlConnector`` (pull and push), Dynamo
and LMCache run unchanged.

What differs from NIXL's own agent, by design:

- Backends (``"UCX"`` and the rest) are accepted and recorded; ferry picks the fastest link
  for each pair of buffers itself (NVLink between GPUs of one host, TCP otherwise).
- The agent listens on ``FERRY_NIXL_HOST`` (default: this host's address) at an ephemeral
  port, or at ``listen_port`` when ``enable_listen_thread`` is set; the metadata blob carries
  where, so peers need nothing else. ``FERRY_SECRET`` makes peers authenticate.
- A transfer fails (``check_xfer_state`` says ``"ERR"``, the reason logged) when it has not
  ended within ``FERRY_TRANSFER_TIMEOUT`` seconds (default 30): a dead peer never leaves a
  transfer in ``"PROC"``.
- A notification of any length may be sent with ``send_notif``; one attached to a transfer
  (``notif_msg``) must fit one ferry notification (64 KiB less a few bytes). It reaches the
  peer only after the transfer's data, also for READs, so the peer may reuse its blocks then.
"""

from __future__ import annotations

import array
import logging
import os
import pickle
import socket
import sys
import threading
from enum import Enum

from . import _nixl_bindings as nixlBind
from ._ferry import NixlAgent
from ._nixl_bindings import (
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    nixlInvalidParamError,
    nixlRegDList,
    nixlXferDList,
    nixlXferTelemetry,
)

logger = logging.getLogger("ferry_kv.nixl")

_PLUGINS = ["UCX"]
_PLUGIN_MEMS = ["DRAM_SEG", "VRAM_SEG"]
_OPS = ("READ", "WRITE")
_DEFAULT_TIMEOUT_S = 30.0


class nixl_thread_sync_t(Enum):
    """NIXL's thread-safety modes. ferry's agent is safe to call from any thread in each."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


class nixl_agent_config:
    """An agent's settings, as NIXL's: only ``listen_port`` (with ``enable_listen_thread``),
    ``capture_telemetry`` and ``backends`` change what ferry does."""

    def __init__(
        self,
        enable_prog_thread=True,
        enable_listen_thread=False,
        listen_port=DEFAULT_COMM_PORT,
        capture_telemetry=False,
        num_threads=0,
        backends=None,
        sync_mode=None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError("sync_mode must be a nixl_thread_sync_t")
        self.backends = ["UCX"] if backends is None else list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class _Handle:
    """A handle of the agent: released once, by ``release()`` or when garbage-collected."""

    __slots__ = ("_handle", "_agent", "_released", "_keep")

    def __init__(self, handle, agent, keep=()):
        self._handle = handle
        self._agent = agent
        self._released = False
        self._keep = keep

    def _free(self):
        raise NotImplementedError

    def release(self):
        """Releases the handle; a second call does nothing."""
        if not self._released:
            self._free()
            self._released = True

    def __index__(self):
        return self._handle

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - best effort at collection, as NIXL's handles
            pass

    def __repr__(self):
        return f"{type(self).__name__}({self._handle:#x}, released={self._released})"


class nixl_prepped_dlist_handle(_Handle):
    """A prepared descriptor list (``prep_xfer_dlist``)."""

    __slots__ = ()

    def _free(self):
        self._agent.release_list(self._handle)


class nixl_xfer_handle(_Handle):
    """A prepared transfer (``make_prepped_xfer``, ``initialize_xfer``); post it with
    ``transfer`` as often as needed."""

    __slots__ = ()

    def _free(self):
        self._agent.release_xfer(self._handle)


nixl_backend_handle = int


def _default_host():
    """``FERRY_NIXL_HOST``, else this host's address by its name, else the loopback."""
    host = os.environ.get("FERRY_NIXL_HOST")
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _timeout_s():
    text = os.environ.get("FERRY_TRANSFER_TIMEOUT")
    if text is None:
        return _DEFAULT_TIMEOUT_S
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"FERRY_TRANSFER_TIMEOUT={text!r} is not a number of seconds; set it to one or unset it"
        ) from None


def _name(agent_name):
    """An agent name as ``str``: NIXL hands names out as ``bytes`` and takes both."""
    return agent_name.decode() if isinstance(agent_name, (bytes, bytearray)) else str(agent_name)


def _is_torch(obj):
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "data_ptr")


def _tensor_desc(tensor):
    """``(addr, len, devID, "")`` and the memory type of a contiguous tensor."""
    if not tensor.is_contiguous():
        raise nixlInvalidParamError(
            "NIXL_ERR_INVALID_PARAM: a registered tensor must be contiguous; register the storage it views"
        )
    device = tensor.get_device() if tensor.is_cuda else 0
    return (tensor.data_ptr(), tensor.numel() * tensor.element_size(), max(device, 0), ""), (
        "VRAM" if tensor.is_cuda else "DRAM"
    )


def _u64_bytes(rows, width):
    """Native-endian u64 bytes of a numpy array or of a sequence of row tuples."""
    if hasattr(rows, "astype") and hasattr(rows, "shape"):
        if len(rows.shape) != 2 or rows.shape[1] != width:
            raise nixlInvalidParamError(
                f"NIXL_ERR_INVALID_PARAM: a descriptor array is N x {width}, not {tuple(rows.shape)}"
            )
        return rows.astype("=u8", copy=False).tobytes(order="C")
    flat = array.array("Q")
    for row in rows:
        flat.extend(int(value) for value in row[:width])
    return flat.tobytes()


_index_scratch = threading.local()

def _index_bytes(indices, slot):
    """``indices`` (an integer array or a list) as native-endian int64s the agent reads in
    place, and how many bytes hold them. A numpy array is handed over as it is when it already
    is one of int64s in C order (vLLM's are), or else as numpy's C-order int64 copy of it;
    other sequences (lists, tuples, array subclasses) are converted into this thread's scratch
    bytearray ``slot`` (0 or 1), reused from call to call because a fresh buffer for a
    request's tens of thousands of indices cost more in page faults than planning the
    transfer. The agent reads an array while the call runs: it must not be written meanwhile."""
    if hasattr(indices, "astype"):
        values = indices.astype("=i8", order="C", copy=False)
        # Looked up rather than imported: an array of numpy's means numpy is loaded already.
        numpy = sys.modules.get("numpy")
        if numpy is not None and type(values) is numpy.ndarray:
            return values, values.nbytes
    else:
        values = array.array("q", indices)
    with memoryview(values) as view, view.cast("B") as source:
        count = source.nbytes
        scratch = getattr(_index_scratch, "slots", None)
        if scratch is None:
            scratch = _index_scratch.slots = [bytearray(), bytearray()]
        if len(scratch[slot]) < count:
            scratch[slot] = bytearray(max(count, 2 * len(scratch[slot])))
        scratch[slot][:count] = source
    return scratch[slot], count


class nixl_agent:
    """NIXL's agent on a ferry engine; see the module's doc for what differs."""

    def __init__(self, agent_name, nixl_conf=None, instantiate_all=False):
        conf = nixl_conf if nixl_conf is not None else nixl_agent_config()
        host = _default_host()
        port = conf.port if conf.enable_listen else 0
        listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.name = str(agent_name)
        self._agent = NixlAgent(self.name, listen, host, _timeout_s(), bool(conf.capture_telemetry))
        self.notifs = {}
        self.backends = {}
        self.backend_mems = {}
        self.backend_options = {}
        self.plugin_list = list(_PLUGINS)
        self.plugin_b_options = {plugin: {} for plugin in _PLUGINS}
        self.plugin_mem_types = {plugin: list(_PLUGIN_MEMS) for plugin in _PLUGINS}
        self.nixl_mems = {
            "DRAM": nixlBind.DRAM_SEG,
            "VRAM": nixlBind.VRAM_SEG,
            "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG,
            "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG,
            "cuda": nixlBind.VRAM_SEG,
        }
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        for backend in self.plugin_list if instantiate_all else conf.backends:
            self.create_backend(backend)
        logger.info("NIXL agent %s runs on ferry engine %s", self.name, self._agent.engine)

    # Plugins and backends: recorded for callers that list them; ferry picks the link.

    def get_plugin_list(self):
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend):
        return list(self.plugin_mem_types.get(backend, []))

    def get_plugin_params(self, backend):
        return dict(self.plugin_b_options.get(backend, {}))

    def get_backend_mem_types(self, backend):
        return list(self.backend_mems.get(backend, []))

    def get_backend_params(self, backend):
        return dict(self.backend_options.get(backend, {}))

    def create_backend(self, backend, initParams=None):
        """Records ``backend``; ferry moves every registration over its fastest link."""
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = list(_PLUGIN_MEMS)
        self.backend_options[backend] = dict(initParams or {})

    # Descriptors and registration.

    def get_reg_descs(self, descs, mem_type=None):
        """A ``nixlRegDList`` of tensors, 4-tuples ``(addr, len, devID, meta)`` or an N x 3
        array, or None (the reason logged) for anything else."""
        try:
            return self._reg_descs(descs, mem_type)
        except (TypeError, ValueError, KeyError, nixlInvalidParamError) as error:
            logger.error("get_reg_descs: %s", error)
            return None

    def _reg_descs(self, descs, mem_type):
        if isinstance(descs, nixlRegDList):
            return descs
        if _is_torch(descs):
            descs = [descs]
        if isinstance(descs, list) and descs and _is_torch(descs[0]):
            rows, kinds = zip(*(_tensor_desc(tensor) for tensor in descs))
            if len(set(kinds)) != 1:
                raise ValueError("tensors of one list must all be on the GPU or all on the host")
            return nixlRegDList(mem_type or kinds[0], list(rows), owners=descs)
        if mem_type is None:
            raise ValueError("pass mem_type ('DRAM' or 'VRAM') with descriptor tuples or arrays")
        return nixlRegDList(mem_type, descs)

    def get_xfer_descs(self, descs, mem_type=None):
        """A ``nixlXferDList`` of tensors, 3-tuples ``(addr, len, devID)`` or an N x 3 array,
        or None (the reason logged) for anything else."""
        try:
            if isinstance(descs, nixlXferDList):
                return descs
            return self._reg_descs(descs, mem_type).trim()
        except (TypeError, ValueError, KeyError, nixlInvalidParamError) as error:
            logger.error("get_xfer_descs: %s", error)
            return None

    def register_memory(self, reg_list, mem_type=None, backends=None):
        """Registers the memory of ``reg_list`` (see ``get_reg_descs``); the registered
        ``nixlRegDList``. Peers can reach it once they load this agent's metadata again."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise nixlInvalidParamError(
                "NIXL_ERR_INVALID_PARAM: register_memory takes tensors, (addr, len, devID, meta) "
                "tuples with mem_type, or an N x 3 array with mem_type"
            )
        kind = descs.getType().name.replace("_SEG", "")
        self._agent.register([(addr, length, device, kind) for addr, length, device, _ in descs])
        return descs

    def deregister_memory(self, dereg_list, backends=None):
        """Deregisters what ``register_memory`` returned."""
        self._agent.deregister([desc[0] for desc in dereg_list])

    # Metadata and remote agents.

    def get_agent_metadata(self):
        """What a peer passes to ``add_remote_agent``: this agent's name, where to reach it and
        what it registered."""
        return self._agent.metadata()

    def add_remote_agent(self, metadata):
        """Loads a peer's metadata; the peer's name, as ``bytes`` like NIXL's."""
        return self._agent.add_remote(bytes(metadata)).encode()

    def remove_remote_agent(self, agent):
        """Forgets a peer; lists prepared for it stop working. Unknown names are ignored."""
        self._agent.remove_remote(_name(agent))

    def check_remote_metadata(self, remote_name, descs=None):
        """Whether the peer is loaded and, with ``descs``, registered all of them."""
        rows = None
        if descs is not None:
            rows = _u64_bytes([desc[:3] for desc in descs], 3)
        return self._agent.check_remote(_name(remote_name), rows)

    # Transfers.

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=None):
        """Prepares descriptors of this agent (``agent_name`` ``"NIXL_INIT_AGENT"`` or ``""``)
        or of a loaded peer: an N x 5 array ``(addr, len, devID, stride, count)`` (each row
        ``count`` descriptors ``stride`` apart; needs ``mem_type``), an N x 3 array, 3-tuples,
        or a ``nixlXferDList``."""
        name = _name(agent_name)
        agent = None if name in ("NIXL_INIT_AGENT", NIXL_INIT_AGENT) else name
        shape = getattr(xfer_list, "shape", None)
        if shape is not None and len(shape) == 2 and shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            nixlBind.mem_type(mem_type)
            handle = self._agent.prep_list(agent, _u64_bytes(xfer_list, 5), 5)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            if descs is None:
                raise nixlInvalidParamError(
                    "NIXL_ERR_INVALID_PARAM: prep_xfer_dlist takes an N x 5 or N x 3 array, "
                    "(addr, len, devID) tuples or a nixlXferDList"
                )
            handle = self._agent.prep_list(agent, _u64_bytes(list(descs), 3), 3)
        return nixl_prepped_dlist_handle(handle, self._agent)

    def make_prepped_xfer(
        self,
        operation,
        local_xfer_side,
        local_indices,
        remote_xfer_side,
        remote_indices,
        notif_msg=b"",
        backends=None,
        skip_desc_merge=False,
    ):
        """A transfer of descriptors ``local_indices`` of one prepared list with
        ``remote_indices`` of a peer's (lists or 1-D integer arrays), ``"READ"`` or
        ``"WRITE"``, with ``notif_msg`` delivered to the peer after the data."""
        handle = self._agent.make_xfer(
            _op(operation),
            int(local_xfer_side),
            *_index_bytes(local_indices, 0),
            int(remote_xfer_side),
            *_index_bytes(remote_indices, 1),
            _msg(notif_msg),
        )
        return nixl_xfer_handle(handle, self._agent)

    def initialize_xfer(self, operation, local_descs, remote_descs, remote_agent, notif_msg=b"", backends=None):
        """A transfer of every descriptor of ``local_descs`` with the same place in
        ``remote_descs`` (``nixlXferDList``s) of ``remote_agent``."""
        local = self.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs)
        remote = self.prep_xfer_dlist(remote_agent, remote_descs)
        count = len(local_descs)
        indices = list(range(count))
        handle = self._agent.make_xfer(
            _op(operation),
            int(local),
            *_index_bytes(indices, 0),
            int(remote),
            *_index_bytes(indices, 1),
            _msg(notif_msg),
        )
        local.release()
        remote.release()
        return nixl_xfer_handle(handle, self._agent)

    def transfer(self, handle, notif_msg=b""):
        """Posts the transfer (again, once an earlier post ended); ``"DONE"`` or ``"PROC"``
        (``"ERR"`` when it failed at once, the reason logged). A non-empty ``notif_msg``
        replaces the one it was made with."""
        message = _msg(notif_msg)
        return self._agent.post_xfer(int(handle), message or None)

    def check_xfer_state(self, handle):
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (the reason logged)."""
        return self._agent.xfer_state(int(handle))

    def get_xfer_telemetry(self, handle):
        """A ``nixlXferTelemetry`` of the transfer's last post; raises
        ``nixlNoTelemetryError`` when the agent was made without ``capture_telemetry``."""
        return nixlXferTelemetry(*self._agent.xfer_telemetry(int(handle)))

    def query_xfer_backend(self, handle):
        """The backend name NIXL would report; ferry's links all answer as ``"UCX"``."""
        return "UCX"

    def release_xfer_handle(self, handle):
        """Releases a transfer; raises ``nixlRepostActiveError`` while it still moves."""
        handle.release()

    def release_dlist_handle(self, handle):
        """Releases a prepared list."""
        handle.release()

    # Notifications.

    def send_notif(self, remote_agent_name, notif_msg, backend=None):
        """Sends ``notif_msg`` (any length) to a loaded peer."""
        self._agent.send_notif(_name(remote_agent_name), _msg(notif_msg))

    def get_new_notifs(self, backends=None):
        """The notifications that arrived since the last call, by sender agent name, each
        sender's in the order sent."""
        notifs = {}
        for sender, msg in self._agent.notifications():
            notifs.setdefault(sender, []).append(msg)
        return notifs

    def update_notifs(self, backends=None):
        """Adds the new notifications to ``self.notifs``; returns it."""
        for sender, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(sender, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name, lookup_tag, backends=None, tag_is_prefix=True):
        """Whether a notification from the peer matching ``lookup_tag`` (a prefix, or the whole
        message) arrived; it is taken out of ``self.notifs``."""
        name = _name(remote_agent_name)
        msgs = self.update_notifs().get(name, [])
        for index, msg in enumerate(msgs):
            if msg.startswith(lookup_tag) if tag_is_prefix else msg == lookup_tag:
                del msgs[index]
                return True
        return False

    # Descriptor serialisation, as NIXL's (pickle).

    def get_serialized_descs(self, descs):
        return pickle.dumps(descs)

    def deserialize_descs(self, serdes):
        return pickle.loads(serdes)


def _op(operation):
    if operation not in _OPS:
        raise KeyError(f"operation {operation!r} is neither 'READ' nor 'WRITE'")
    return operation


def _msg(notif_msg):
    if isinstance(notif_msg, str):
        return notif_msg.encode()
    return bytes(notif_msg)
