"""The job: a ``JobSpec`` from flags or a TOML file, the plan of chunks and ranks, and the runner that
takes the job through model, data, capture and store (process group, signals, progress); the store's life
cycle is the store's own (``extract.store.life``)."""
