"""Where an object's memory is: the address and length ``Engine.register`` registers, and what
to keep alive while it is registered. No raw pointers are needed from the caller.

Three kinds of objects are understood, tried in this order:

- PyTorch tensors and untyped storages (host or GPU): ``data_ptr()`` and the span the strides
  cover, so a non-contiguous view registers the bytes from its first to its last element.
- Objects with ``__cuda_array_interface__`` (CuPy, Numba, JAX buffers …): its pointer, shape,
  strides and item size.
- Writable buffer-protocol objects (``bytearray``, NumPy arrays, ``memoryview``, ctypes
  arrays): the address comes from ``ctypes`` (``from_buffer``), which also holds the buffer
  export so a ``bytearray`` cannot be resized while registered.

GPU memory needs nothing special here: ferry detects from the address whether memory is host
or GPU memory (``cudaMalloc``, or PyTorch's expandable segments).
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple


class Span(NamedTuple):
    """The bytes of an object: first address, length, and what keeps them alive."""

    addr: int
    nbytes: int
    owner: Any


def span_of(obj: Any) -> Span:
    """The memory ``obj`` holds. Raises ``TypeError`` for an object whose memory cannot be
    found and ``ValueError`` for read-only, non-contiguous-buffer or empty memory."""
    if _is_torch(obj):
        span = _torch_span(obj)
    elif hasattr(obj, "__cuda_array_interface__"):
        span = _cuda_array_span(obj)
    else:
        span = _buffer_span(obj)
    if span.nbytes == 0:
        raise ValueError(f"{type(obj).__name__} holds no bytes; register memory of at least one byte")
    return span


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "data_ptr")


def _torch_span(obj: Any) -> Span:
    if not hasattr(obj, "stride"):
        # An untyped storage: one contiguous allocation.
        return Span(obj.data_ptr(), obj.nbytes(), obj)
    itemsize = obj.element_size()
    shape = tuple(obj.shape)
    strides = tuple(stride * itemsize for stride in obj.stride())
    return Span(obj.data_ptr() + _lowest(shape, strides), _extent(shape, strides, itemsize), obj)


def _cuda_array_span(obj: Any) -> Span:
    interface = obj.__cuda_array_interface__
    pointer, read_only = interface["data"]
    if read_only:
        raise ValueError(
            f"the {type(obj).__name__} is read-only; peers write registered memory, so register a writable array"
        )
    shape = tuple(interface["shape"])
    itemsize = int(interface["typestr"][2:])
    strides = interface.get("strides")
    if strides is None:
        # C-contiguous: the last axis is the fastest.
        byte_strides, step = [], itemsize
        for size in reversed(shape):
            byte_strides.insert(0, step)
            step *= size
        strides = byte_strides
    strides = tuple(strides)
    return Span(pointer + _lowest(shape, strides), _extent(shape, strides, itemsize), obj)


def _lowest(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Bytes (zero or negative) from element 0 to the lowest-addressed element; strides in bytes."""
    if any(size == 0 for size in shape):
        return 0
    return sum((size - 1) * stride for size, stride in zip(shape, strides) if stride < 0)


def _extent(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the lowest-addressed element to the end of the highest; strides in bytes."""
    if any(size == 0 for size in shape):
        return 0
    return sum((size - 1) * abs(stride) for size, stride in zip(shape, strides)) + itemsize


def _buffer_span(obj: Any) -> Span:
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"cannot register a {type(obj).__name__}: pass a torch tensor, an object with "
            "__cuda_array_interface__ or a writable buffer (bytearray, numpy array), or use "
            "register_address(addr, nbytes)"
        ) from None
    if view.readonly:
        raise ValueError(
            f"the {type(obj).__name__} is read-only; peers write registered memory, so register a "
            "writable buffer (a bytearray rather than bytes, for example)"
        )
    if not view.c_contiguous:
        raise ValueError(
            f"the {type(obj).__name__} is not contiguous; register the array it is a view of, or a contiguous copy"
        )
    if view.nbytes == 0:
        return Span(0, 0, obj)
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    window = (ctypes.c_char * flat.nbytes).from_buffer(flat)
    # The ctypes window holds the buffer export (and through it `obj`) while registered.
    return Span(ctypes.addressof(window), flat.nbytes, (obj, window))
