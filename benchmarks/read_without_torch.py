"""What a numpy reader pays to start (issue 46): the CPU seconds (user + system of the child, from
``wait4``'s rusage, as ``/usr/bin/time -f %U+%S`` reports them) of a fresh ``python -c`` that reads one
layer of a store, for this tree and a "before" tree (another commit, unpacked with ``git archive``),
against zarr reading the same array alone; median of ``--repeat`` runs, the trees alternating.

The store: a complete image store, one float32 layer of (1024, 2048) (8 MiB, zstd as jobs write), with
labels and keys, written once at ``--store`` through ``FeatureStore``; and beside it (``-f16``) the
layer with 16384 rows stored in float16 (64 MiB), read as float32 (the default ``load``, a conversion:
numpy's cast in a process without torch, torch's in one with it).

    git archive main extract | tar -x -C /tmp/extract-before
    python benchmarks/read_without_torch.py --before-tree /tmp/extract-before --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LAYER, N, D, CHUNK = "fc", 1024, 2048, 128
N_FLOAT16 = 16384  # 64 MiB of float16, 128 MiB as float32

READS = {
    "import extract": "import extract",
    "open_features(p).load(layer)": "from extract import open_features\nopen_features(P).load(L)",
    "... + labels, keys": "from extract import open_features\nf = open_features(P)\nf.load(L); f.labels; f.keys",
    "zarr alone: open_group(p)[layer][:]": "import zarr\nzarr.open_group(P, mode='r')['features/' + L][:]",
    "float16 layer: open_features(p16).load(layer)": "from extract import open_features\nopen_features(P16).load(L)",
    "float16 layer, torch imported first": "import torch\nfrom extract import open_features\nopen_features(P16).load(L)",
}


def make_store(path: Path, dtype: str = "float32", n: int = N) -> None:
    import numpy as np

    from extract.store.store import FeatureStore

    rng = np.random.default_rng(0)
    values = rng.standard_normal((n, D)).astype(dtype)
    store = FeatureStore.create(
        path, shapes={LAYER: (D,)}, num_samples=n, chunk_size=CHUNK, dtype=dtype, compressor="zstd",
        attrs={"layers": [LAYER], "num_samples": n, "chunk_size": CHUNK, "status": "running", "dataset": "synthetic:0"},
    )  # fmt: skip
    for chunk, start in enumerate(range(0, n, CHUNK)):
        rows = slice(start, start + CHUNK)
        store.write_chunk(chunk, start, rows.stop, {LAYER: values[rows]}, np.arange(CHUNK) % 10, np.ones(CHUNK, bool))
    store.update_attrs(status="complete")
    import zarr

    group = zarr.open_group(path, mode="r+")  # keys, as a job writes them
    keys = group.create_array("keys", shape=(n,), chunks=(CHUNK,), dtype=str, dimension_names=("sample",))
    keys[:] = np.array([f"class{i % 10}/{i}.jpg" for i in range(n)], dtype=object)


def cpu_seconds(tree: Path, code: str, store: Path) -> tuple[float, float, bool]:
    """(CPU s, wall s, whether torch was imported) of one fresh interpreter running ``code``."""
    script = f"P, P16, L = {str(store)!r}, {str(store) + '-f16'!r}, {LAYER!r}\n{code}\nimport sys\n"
    script += "print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    began = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=tree, stdout=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    assert os.waitstatus_to_exitcode(status) == 0, code
    torch = child.stdout.read().strip() == "True"
    return usage.ru_utime + usage.ru_stime, wall, torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", type=Path, help="a tree holding extract/ of the commit to compare with")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--store", type=Path, default=Path("/tmp/read_without_torch.zarr"))
    args = parser.parse_args()
    if not args.store.exists():
        make_store(args.store)
        make_store(Path(f"{args.store}-f16"), "float16", N_FLOAT16)
    trees = {"after": HERE} | ({"before": args.before_tree.resolve()} if args.before_tree else {})
    print("| read | " + " | ".join(f"{name} CPU s | {name} wall s | {name} torch" for name in trees) + " |")
    print("| --- |" + " ---: | ---: | --- |" * len(trees))
    for label, code in READS.items():
        runs: dict[str, list[tuple[float, float, bool]]] = {name: [] for name in trees}
        for _ in range(args.repeat):
            for name, tree in trees.items():
                runs[name].append(cpu_seconds(tree, code, args.store))
        cells = []
        for name in trees:
            cpu = statistics.median(r[0] for r in runs[name])
            wall = statistics.median(r[1] for r in runs[name])
            cells.append(f"{cpu:.2f} | {wall:.2f} | {'yes' if any(r[2] for r in runs[name]) else 'no'}")
        print(f"| `{label}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
