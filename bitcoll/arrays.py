"""Array intake: the arrays the collectives read and write besides numpy arrays.

Every collective takes, for its input and for ``out``:

* a ``numpy.ndarray``, used as it is;
* a torch tensor in CPU memory (recognised only when torch is already imported: bitcoll never
  imports torch itself), viewed through DLPack (``numpy.from_dlpack``) without a copy, so an
  ``out`` tensor is written in place. ``torch.bfloat16`` tensors (numpy has no bfloat16 and
  refuses them through DLPack) are viewed through their bits, ``tensor.view(torch.int16)``.
  A tensor that requires grad is a :class:`~bitcoll.errors.UsageError` (DLPack cannot export
  it): pass ``tensor.detach()``;
* any other object with ``__dlpack__`` whose ``__dlpack_device__`` is host memory (CPU, CUDA or
  ROCm pinned host memory, CUDA managed memory): ``numpy.from_dlpack(x)``, no copy (JAX CPU
  arrays, for instance);
* any object that exports the buffer protocol (``memoryview``, ``bytearray``,
  ``array.array``, ``mmap``): ``numpy.asarray(memoryview(x))``, no copy (read-only buffers
  such as ``bytes`` serve as inputs only).

An array in the memory of another device (``__dlpack_device__`` not host memory, e.g. a CUDA
tensor) is a UsageError naming the device: copy it to the host first. Anything else is a
UsageError naming its type. bfloat16 is carried as its raw bits (``uint16``) together with a
flag; see :func:`to_numpy`.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import UsageError

__all__ = ["HostArray", "BFLOAT16", "HOST_DEVICES", "to_numpy", "type_name", "bf16_tensor"]

Array = npt.NDArray[Any]

HostArray = Any
"""What the collectives accept as arrays (the type checker cannot express it): a numpy array,
a host-memory DLPack exporter (torch CPU tensor, JAX CPU array) or a buffer-protocol object."""

BFLOAT16 = "bfloat16"
"""The name bitcoll gives the bfloat16 element type (in messages and frame signatures)."""

#: DLPack device types whose memory the CPU reads directly (numpy.from_dlpack accepts them):
#: kDLCPU, kDLCUDAHost, kDLROCMHost, kDLCUDAManaged.
HOST_DEVICES = frozenset({1, 3, 11, 13})

_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal",
                 9: "vpi", 10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed",
                 14: "oneapi", 15: "webgpu", 16: "hexagon", 17: "maia"}

_COPY_HINT = ("bitcoll's collectives work on host memory: copy it to the CPU first "
              "(torch: t.cpu(); JAX: jax.device_get(a); CuPy: a.get())")


def _torch() -> Any:
    """The torch module if this process has imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def to_numpy(x: object, name: str = "x") -> tuple[Array, bool]:
    """A numpy view of the array ``x`` (see the module docstring) and whether its elements
    are bfloat16.

    Returns ``(a, bf16)``: ``a`` has ``x``'s shape and strides and shares its memory (no
    copy is ever made); for bfloat16 (``bf16`` True) ``a`` holds the raw bits as ``uint16``.
    The dtype is not checked here. Raises UsageError for an object that is no array, an
    array on another device, a tensor that requires grad, or a DLPack export that numpy
    refuses (its message says why).
    """
    if isinstance(x, np.ndarray):
        return x, False
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return _from_torch(torch, x, name)
    device = getattr(x, "__dlpack_device__", None)
    if device is not None or hasattr(x, "__dlpack__"):
        if device is not None:
            _check_device(device, name)
        try:
            dl: Any = x
            return np.from_dlpack(dl), False
        except (BufferError, RuntimeError, TypeError, ValueError, AttributeError) as exc:
            raise UsageError(f"{name} ({type(x).__name__}) cannot be read through DLPack: "
                             f"{exc}", argument=name) from exc
    try:
        view = memoryview(x)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(f"{name} must be a numpy.ndarray or a CPU array that exports "
                         f"__dlpack__ or the buffer protocol (a torch CPU tensor, a memoryview, "
                         f"...), got {type(x).__name__}", argument=name) from None
    try:
        return np.asarray(view), False
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{name} ({type(x).__name__}) exports a buffer numpy cannot read "
                         f"(format {view.format!r}): {exc}", argument=name) from exc


def _check_device(device: Any, name: str) -> None:
    try:
        kind, index = device()
        kind, index = int(kind), int(index)
    except Exception as exc:
        raise UsageError(f"{name}: __dlpack_device__() failed: {exc}", argument=name) from exc
    if kind not in HOST_DEVICES:
        label = _DEVICE_NAMES.get(kind, f"type {kind}")
        raise UsageError(f"{name} is on device {label}:{index} (DLPack device ({kind}, "
                         f"{index})); {_COPY_HINT}", argument=name)


def _from_torch(torch: Any, t: Any, name: str) -> tuple[Array, bool]:
    if t.device.type != "cpu":
        raise UsageError(f"{name} is a tensor on device {t.device}; {_COPY_HINT}", argument=name)
    if t.requires_grad:
        raise UsageError(f"{name} is a tensor that requires grad, which cannot be shared "
                         f"through DLPack: pass {name}.detach() (the collectives do not "
                         f"take part in autograd)", argument=name)
    bf16 = t.dtype == torch.bfloat16
    try:
        if bf16:
            return np.from_dlpack(t.view(torch.int16)).view(np.uint16), True
        return np.from_dlpack(t), False
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise UsageError(f"{name} (a torch tensor of dtype {t.dtype}) cannot be read "
                         f"through DLPack: {exc}", argument=name) from exc


def type_name(a: Array, bf16: bool) -> str:
    """The element type of an intake result as users see it (``"bfloat16"`` for bf16)."""
    return BFLOAT16 if bf16 else str(a.dtype)


def bf16_tensor(bits: Array) -> Any:
    """A ``torch.bfloat16`` tensor sharing the memory of ``bits`` (``uint16`` raw bits, any
    shape): the return value of a collective on bfloat16 input without ``out``. torch must
    already be imported (it always is: bfloat16 input comes from a torch tensor)."""
    torch = _torch()
    if torch is None:
        raise UsageError("bfloat16 results are returned as torch tensors; import torch")
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
