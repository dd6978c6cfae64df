"""The storage dtypes (``--dtype``) and how their bytes are written and read back.

float16 and float32 are zarr's own. bfloat16 is not: zarr 3.1's data-type registry has no bfloat16 (nor
does numpy, without ``ml_dtypes``), so a bfloat16 layer is a ``uint16`` array of the values' bits,
marked with the attribute ``extract_dtype: "bfloat16"`` (docs/store-format.md). Any zarr reader opens
it; one that knows the mark reads the bits as ``torch.bfloat16`` (a view: no conversion) or as float32
(exact: a bfloat16 is the upper half of a float32). Its fill value is bfloat16's NaN, so unwritten rows
read as NaN, as in the float arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import zarr

if TYPE_CHECKING:  # torch is loaded by the functions that take tensors: the store and verify need none
    import torch

BFLOAT16 = "bfloat16"
MARK = "extract_dtype"  # the attribute that says what a uint16 array of bits holds
NAN_BITS = 0x7FC0  # bfloat16's quiet NaN
_INFINITY = {
    np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
    np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000),
}


def zarr_dtype(name: str) -> str:
    """The zarr array's dtype for storage dtype ``name``."""
    return "uint16" if name == BFLOAT16 else name


def fill_value(name: str) -> Any:
    return NAN_BITS if name == BFLOAT16 else np.nan


def attributes(name: str) -> dict[str, str]:
    """The attributes a layer's array gets for storage dtype ``name``."""
    return {MARK: BFLOAT16} if name == BFLOAT16 else {}


def is_bfloat16(array: zarr.Array) -> bool:
    """Whether ``array`` holds bfloat16 bits."""
    return array.dtype == np.uint16 and array.attrs.get(MARK) == BFLOAT16


def stored_name(array: zarr.Array) -> str:
    """The storage dtype of a layer's array: ``bfloat16``, ``float16``, ``float32``."""
    return BFLOAT16 if is_bfloat16(array) else str(np.dtype(array.dtype))


def host_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that holds a staged batch of ``dtype`` (bfloat16: its bits)."""
    import torch

    return np.dtype(np.uint16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def host_values(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy, the same memory (bfloat16: its bits, as ``uint16``)."""
    import torch

    return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def nan(dtype: np.dtype) -> Any:
    """NaN in a host array of ``host_dtype`` (bfloat16's bits in a ``uint16`` one)."""
    return np.uint16(NAN_BITS) if dtype == np.uint16 else np.nan


def to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32 values, exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_stored(values: np.ndarray, array: zarr.Array) -> np.ndarray:
    """``values`` as ``array`` stores them, as floats: after the cast to its dtype (bfloat16: the bits'
    values, as float32)."""
    if is_bfloat16(array):
        return to_float32(values)
    return np.asarray(values, dtype=array.dtype)


def as_tensor(values: np.ndarray, bfloat16: bool) -> torch.Tensor:
    """Values read from a layer's array as a tensor, the same memory (bfloat16 bits: a bfloat16 view)."""
    import torch

    tensor = torch.from_numpy(values)
    return tensor.view(torch.bfloat16) if bfloat16 else tensor


def numpy_view(tensor: torch.Tensor, array: zarr.Array) -> np.ndarray | None:
    """``tensor``'s memory as the numpy dtype ``array`` stores, when its values are the stored values
    unconverted (zarr then decodes straight into it); None when they need a conversion."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy() if is_bfloat16(array) else None
    if is_bfloat16(array):
        return None
    values = tensor.numpy()
    return values if values.dtype == array.dtype else None


def count_infinite(values: np.ndarray) -> int:
    """±inf values in a host array of ``host_dtype``, counted on the bits (half the time of ``np.isinf``)."""
    if values.dtype == np.uint16:  # bfloat16 bits
        return int(np.count_nonzero((values & 0x7FFF) == 0x7F80))
    if values.dtype not in _INFINITY:
        return int(np.count_nonzero(np.isinf(values)))
    view, magnitude, infinity = _INFINITY[values.dtype]
    return int(np.count_nonzero((values.view(view) & magnitude) == infinity))


def read_dtype(array: zarr.Array, as_torch: bool) -> str:
    """The dtype a layer reads as when the reader keeps the stored one: bfloat16 in torch, float32 in
    numpy (which has no bfloat16); the array's own otherwise."""
    if is_bfloat16(array):
        return BFLOAT16 if as_torch else "float32"
    return str(np.dtype(array.dtype))
