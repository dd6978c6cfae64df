"""The job: a ``JobSpec`` from flags or a TOML file, the plan of chunks and ranks, and the runner that
takes the job through model, data, capture and store (lifecycle, process group, signals, progress)."""
