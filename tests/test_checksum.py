"""Issue 45: zarr's ``crc32c`` codec computed by the ``crc32c`` package (``extract/store/checksum.py``):
the objects it writes are byte for byte zarr's own codec's, each reads the other's, a damaged object is
refused as zarr refuses it, and every array the store opens uses it."""

import numpy as np
import pytest
import zarr
from zarr.codecs import crc32c_

from extract.store import checksum
from extract.store.store import FeatureStore

ZARRS = "zarr.codecs.crc32c_.Crc32cCodec"


def _write(path, values, codec_name):
    with zarr.config.set({"codecs.crc32c": codec_name}):
        array = zarr.create_array(path, shape=values.shape, chunks=(7, values.shape[1]), dtype=values.dtype,
                                  compressors=[zarr.registry.get_codec_class("crc32c")()], fill_value=0)  # fmt: skip
        array[:] = values
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json")


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint16", "int64"])
def test_objects_are_zarrs_own_bytes_and_each_reads_the_others(tmp_path, dtype):
    values = np.random.default_rng(0).standard_normal((40, 13)).astype(dtype)
    ours = _write(tmp_path / "ours.zarr", values, checksum.QUALNAME)
    theirs = _write(tmp_path / "theirs.zarr", values, ZARRS)
    assert len(ours) == len(theirs) == 6
    for a, b in zip(ours, theirs, strict=True):
        data = a.read_bytes()
        assert data == b.read_bytes()
        # the suffix is the crc32c (Castagnoli) of the rest, little-endian, as the zarr v3 spec says
        import google_crc32c

        assert int.from_bytes(data[-4:], "little") == google_crc32c.value(data[:-4])
    for written, reader in (("ours", ZARRS), ("theirs", checksum.QUALNAME)):
        with zarr.config.set({"codecs.crc32c": reader}):
            np.testing.assert_array_equal(zarr.open_array(tmp_path / f"{written}.zarr", mode="r")[:], values)


@pytest.mark.parametrize("reader", [checksum.QUALNAME, ZARRS])
def test_a_flipped_byte_is_refused_as_zarr_refuses_it(tmp_path, reader):
    values = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    objects = _write(tmp_path / "a.zarr", values, checksum.QUALNAME)
    data = bytearray(objects[2].read_bytes())
    data[5] ^= 0x10
    objects[2].write_bytes(bytes(data))
    with zarr.config.set({"codecs.crc32c": reader}):
        array = zarr.open_array(tmp_path / "a.zarr", mode="r")
        np.testing.assert_array_equal(array[:14], values[:14])
        with pytest.raises(ValueError, match="Stored and computed checksum do not match"):
            array[14:21]


def test_the_store_writes_and_reads_through_it(tmp_path):
    store = FeatureStore.create(
        tmp_path / "s.zarr", shapes={"h": (8,)}, num_samples=16, chunk_size=8, dtype="float16", compressor="none",
        attrs={"status": "running", "layers": ["h"], "num_samples": 16, "chunk_size": 8},
    )  # fmt: skip
    for name in ("features/h", "labels", "done", "stats/h"):
        codec = store.array(name).metadata.codecs[-1]
        assert type(codec) is checksum.Crc32cCodec and isinstance(codec, crc32c_.Crc32cCodec)
        assert codec.to_dict() == {"name": "crc32c"}
