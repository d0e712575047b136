"""NIXL's ``_bindings`` names on ferry: the constants, the exception classes (``str(error)``
starts with NIXL's status name and goes on to say what to do), the descriptor lists and the
telemetry record, as NIXL 1.5's ``nixl._bindings`` defines them."""

from __future__ import annotations

from enum import IntEnum

from ._ferry import (
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = ""
HAVE_UCX_GPU_DEVICE_API = False


class nixl_mem_t(IntEnum):
    """Memory kinds. ferry moves DRAM and VRAM; it detects which from the address itself."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(IntEnum):
    """Transfer directions."""

    NIXL_READ = 0
    NIXL_WRITE = 1


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG
NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE

_MEM_NAMES = {
    "DRAM": DRAM_SEG,
    "cpu": DRAM_SEG,
    "VRAM": VRAM_SEG,
    "cuda": VRAM_SEG,
    "BLOCK": BLK_SEG,
    "OBJ": OBJ_SEG,
    "FILE": FILE_SEG,
}


def mem_type(name):
    """The ``nixl_mem_t`` of a name NIXL takes (``"DRAM"``, ``"VRAM"``, ``"cpu"``, ``"cuda"``),
    or of a ``nixl_mem_t``; ferry moves only DRAM and VRAM."""
    kind = name if isinstance(name, nixl_mem_t) else _MEM_NAMES.get(name)
    if kind is None:
        raise KeyError(f"{name!r} is not a NIXL memory type; pass 'DRAM' or 'VRAM'")
    if kind not in (DRAM_SEG, VRAM_SEG):
        raise nixlNotSupportedError(
            f"NIXL_ERR_NOT_SUPPORTED: ferry moves DRAM and VRAM, not {kind.name}; use NIXL's own "
            "package (FERRY_NIXL=0) for storage backends"
        )
    return kind


class nixlXferDList:
    """A list of ``(addr, len, devID)`` transfer descriptors of one memory type."""

    def __init__(self, type, descs=None, init_size=0):
        self._type = mem_type(type)
        self._descs = [] if descs is None else [_xfer_desc(desc) for desc in _rows(descs, 3)]

    def getType(self):
        return self._type

    def descCount(self):
        return len(self._descs)

    def isEmpty(self):
        return not self._descs

    def addDesc(self, desc):
        self._descs.append(_xfer_desc(desc))

    append = addDesc

    def remDesc(self, index):
        del self._descs[index]

    def clear(self):
        self._descs.clear()

    def index(self, desc):
        return self._descs.index(_xfer_desc(desc))

    def __getitem__(self, index):
        return self._descs[index]

    def __setitem__(self, index, desc):
        self._descs[index] = _xfer_desc(desc)

    def __len__(self):
        return len(self._descs)

    def __iter__(self):
        return iter(self._descs)

    def __eq__(self, other):
        return (
            isinstance(other, nixlXferDList)
            and self._type == other._type
            and self._descs == other._descs
        )

    def __repr__(self):
        return f"nixlXferDList({self._type.name}, {self._descs!r})"


class nixlRegDList(nixlXferDList):
    """A list of ``(addr, len, devID, meta)`` registration descriptors of one memory type;
    it holds the objects (tensors) the memory came from while registered."""

    def __init__(self, type, descs=None, init_size=0, owners=()):
        self._type = mem_type(type)
        self._descs = [] if descs is None else [_reg_desc(desc) for desc in _rows(descs, 4)]
        self._owners = list(owners)

    def addDesc(self, desc):
        self._descs.append(_reg_desc(desc))

    append = addDesc

    def trim(self):
        """The same descriptors without their meta strings, as a transfer list."""
        return nixlXferDList(self._type, [desc[:3] for desc in self._descs])

    def __eq__(self, other):
        return (
            isinstance(other, nixlRegDList)
            and self._type == other._type
            and self._descs == other._descs
        )

    def __repr__(self):
        return f"nixlRegDList({self._type.name}, {self._descs!r})"

    def __getstate__(self):
        return {"_type": self._type, "_descs": self._descs, "_owners": []}


class nixlXferTelemetry:
    """How a transfer's last post went: ``startTime`` (microseconds since the epoch),
    ``postDuration`` and ``xferDuration`` (microseconds; 0 until it ended), ``totalBytes``,
    ``descCount``."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime, postDuration, xferDuration, totalBytes, descCount):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self):
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"nixlXferTelemetry({fields})"


def _rows(descs, width):
    """The rows of a numpy array or a sequence of tuples."""
    if hasattr(descs, "tolist") and hasattr(descs, "shape"):
        if len(descs.shape) != 2 or descs.shape[1] != 3:
            raise ValueError(f"a descriptor array is N x 3 (addr, len, devID), not {tuple(descs.shape)}")
        return [tuple(row) + ("",) * (width - 3) for row in descs.tolist()]
    return list(descs)


def _xfer_desc(desc):
    if not isinstance(desc, tuple) or len(desc) < 3:
        raise TypeError(f"a transfer descriptor is a tuple (addr, len, devID), not {desc!r}")
    addr, length, device = desc[:3]
    return (int(addr), int(length), int(device))


def _reg_desc(desc):
    if not isinstance(desc, tuple) or len(desc) not in (3, 4):
        raise TypeError(f"a registration descriptor is a tuple (addr, len, devID, meta), not {desc!r}")
    meta = desc[3] if len(desc) == 4 else ""
    if isinstance(meta, str):
        meta = meta.encode()
    return (int(desc[0]), int(desc[1]), int(desc[2]), bytes(meta))
