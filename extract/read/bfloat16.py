"""xarray over a store with bfloat16 layers: their ``uint16`` bits decoded, lazily, as float32.

zarr 3.1 has no bfloat16, so a ``--dtype bfloat16`` layer is stored as its bits with the attribute
``extract_dtype: "bfloat16"`` (``extract.store.dtypes``); ``xr.open_zarr`` shows those bits as they are.
``decode_bfloat16`` gives the dataset back with each such variable as float32 values (exact), read only
when indexed, as xarray's own decoders (scale and offset, fill values) do::

    ds = decode_bfloat16(xr.open_zarr("tokens.zarr", group="features", consolidated=False))
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..store import dtypes as storage


def _float32(bits: Any) -> np.ndarray:
    return storage.to_float32(np.asarray(bits))


def decode_bfloat16(dataset: Any) -> Any:
    """``dataset`` (an ``xarray.Dataset``) with every bfloat16 variable decoded to float32."""
    import xarray as xr

    try:  # xarray's own lazy element-wise wrapper, as its CF decoders use it
        from xarray.coding.common import lazy_elemwise_func
    except ImportError:  # an xarray that moved it: decode eagerly, the same values
        lazy_elemwise_func = None
    decoded = {}
    for name, variable in dataset.variables.items():
        if variable.attrs.get(storage.MARK) != storage.BFLOAT16 or variable.dtype != np.uint16:
            continue
        attrs = {key: value for key, value in variable.attrs.items() if key != storage.MARK}
        data = (
            lazy_elemwise_func(variable._data, _float32, np.float32)  # noqa: SLF001 - the backend's lazy array
            if lazy_elemwise_func is not None
            else _float32(variable.values)
        )
        decoded[name] = xr.Variable(variable.dims, data, attrs, variable.encoding)
    return dataset.assign(decoded) if decoded else dataset
