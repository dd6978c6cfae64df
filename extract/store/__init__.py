"""The store: its schema (format, codecs, identity and attributes), the chunk geometry every stage
shares, the zarr group a job writes and reads, the background writer, the lock beside it, and
verification. It speaks zarr's store API (``objects``), never paths inside the store."""
