"""The store: its schema (identity, attributes, arrays), the zarr group a job writes and reads, the
background writer, the lock beside it, and verification. It speaks zarr's store API only."""
