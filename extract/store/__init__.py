"""The store: its schema (format, codecs, identity and attributes), the chunk geometry every stage
shares, the zarr group a job writes and reads (``store.py``, with its concerns beside it: ``arrays``,
``paths``, ``skeleton``, ``opening``, ``integrity``, ``text_arrays``, ``indexes``), the storage dtypes
(bfloat16 as its bits: ``dtypes``), one ``Location`` for a path or a URL, the background writer, the lock
beside it, and verification. An open store is read, listed, sized and pruned through zarr's store API
(``objects``); claiming ``--out`` and building the store beside it and renaming it into place are
filesystem steps."""
