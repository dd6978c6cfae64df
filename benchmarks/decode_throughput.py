"""JPEG decoding throughput: PIL in full, ``--decode draft`` and (on CUDA) batched nvjpeg, per CPU
core on 500x375 and 2000x1500 JPEGs; then end-to-end img/s of the CLI with a light model (where
loading is the bottleneck) from a folder and from tar shards of the same files.

    python benchmarks/decode_throughput.py                     # writes its section of RESULTS.md
    python benchmarks/decode_throughput.py --no-results --json decode.json

Images: scikit-image's photographs (no download) resized to each size with mild noise, saved as
JPEG quality 90. Decode variants run in this process on one thread, interleaved image by image and
timed in the thread's CPU time (img/s per core, steady on a shared machine), median of the repeats; each decode includes the model's transform (resize 256, crop 224, normalize),
as a DataLoader worker does it. End to end: ``python -m extract`` in a subprocess, resnet18 up to
``conv1`` (truncated forward) at 224 px, 2 DataLoader workers; img/s from the store's summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.models import ResNet18_Weights

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extract.data.decode import Decoding  # noqa: E402
from extract.models.base import preprocessing_record as describe_preprocessing  # noqa: E402

PHOTOS = ("coffee", "chelsea", "astronaut", "rocket", "camera", "coins", "hubble_deep_field", "immunohistochemistry")
SIZES = {"500x375": (500, 375), "2000x1500": (2000, 1500)}
SECTION = "## Decode throughput and data sources"


def make_set(root: Path, size: tuple[int, int], count: int) -> list[Path]:
    folder = root / f"{size[0]}x{size[1]}" / "images"
    files = sorted(folder.glob("*.jpg"))
    if len(files) >= count:
        return files[:count]
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    try:
        import skimage.data

        def source(i: int) -> Image.Image:
            return Image.fromarray(getattr(skimage.data, PHOTOS[i % len(PHOTOS)])()).convert("RGB")
    except ImportError:  # e.g. on a GPU machine without scikit-image: smooth random images

        def source(i: int) -> Image.Image:
            base = np.random.default_rng(i).integers(0, 256, size=(60, 80, 3), dtype=np.uint8)
            return Image.fromarray(base).resize((640, 480), Image.BICUBIC)

    for i in range(count):
        photo = source(i)
        w, h = photo.size
        crop = rng.integers(0, 8, size=2)  # vary the content a little per image
        photo = photo.crop((crop[0], crop[1], w - 7 + crop[0], h - 7 + crop[1])).resize(size, Image.LANCZOS)
        pixels = np.asarray(photo).astype(np.int16) + rng.integers(-6, 7, size=(size[1], size[0], 3))
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=90)
    return sorted(folder.glob("*.jpg"))[:count]


def make_shards(files: list[Path], root: Path, per_shard: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if not list(root.glob("*.tar")):
        for shard, start in enumerate(range(0, len(files), per_shard)):
            with tarfile.open(root / f"shard-{shard:04d}.tar", "w") as tar:
                for file in files[start : start + per_shard]:
                    tar.add(file, arcname=f"{file.stem}.jpg")
    return root


def per_core(sets: dict[str, list[bytes]], repeats: int) -> dict[str, dict[str, float]]:
    transform = ResNet18_Weights.IMAGENET1K_V1.transforms()  # resize 256, crop 224, ImageNet mean/std
    described = describe_preprocessing(transform)
    variants = {"pil": Decoding(transform), "draft": Decoding(transform, "draft", preprocessing=described)}
    # Interleaved image by image and timed in this thread's CPU time: other processes on a shared
    # machine then change neither the ratio nor (much) the rate per core.
    results: dict[str, dict[str, list[float]]] = {}
    for repeat in range(repeats):
        for name, images in sets.items():
            spent = dict.fromkeys(variants, 0)
            for number, data in enumerate(images):
                order = list(variants.items())
                for variant, decoding in order if (repeat + number) % 2 == 0 else order[::-1]:
                    start = time.thread_time_ns()
                    decoding(data)
                    spent[variant] += time.thread_time_ns() - start
            for variant, nanoseconds in spent.items():
                results.setdefault(name, {}).setdefault(variant, []).append(len(images) * 1e9 / nanoseconds)
    if torch.cuda.is_available():
        from extract.data.gpu_decode import GpuDecoder, collate_encoded

        nv = Decoding(transform, "nvjpeg")
        decoder = GpuDecoder(nv, described, torch.device("cuda"), 224, str)
        for name, images in sets.items():
            items = [(nv(data), 0, i, "") for i, data in enumerate(images)]
            for _ in range(repeats + 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for at in range(0, len(items), 64):
                    batch, _, indices, errors = collate_encoded(items[at : at + 64])
                    decoder(batch, indices, errors)
                torch.cuda.synchronize()
                results[name].setdefault("nvjpeg (GPU, batch 64)", []).append(
                    len(items) / (time.perf_counter() - start)
                )
            results[name]["nvjpeg (GPU, batch 64)"].pop(0)  # warm-up
    return {name: {v: statistics.median(r) for v, r in rates.items()} for name, rates in results.items()}


def loading(specs: dict[str, str], repeats: int) -> dict[str, float]:
    """img/s per core of a source's item (read + decode + transform), the work of a DataLoader
    worker: the sources interleaved sample by sample, timed in this thread's CPU time."""
    from extract.data import build_dataset

    transform = ResNet18_Weights.IMAGENET1K_V1.transforms()
    sources = {name: build_dataset(spec, transform, 224) for name, spec in specs.items()}
    count = min(len(s) for s in sources.values())
    rates: dict[str, list[float]] = {}
    for repeat in range(repeats):
        spent = dict.fromkeys(sources, 0)
        for index in range(count):
            order = list(sources.items())
            for name, source in order if (repeat + index) % 2 == 0 else order[::-1]:
                start = time.thread_time_ns()
                source[index]
                spent[name] += time.thread_time_ns() - start
        for name, nanoseconds in spent.items():
            rates.setdefault(name, []).append(count * 1e9 / nanoseconds)
    return {name: statistics.median(values) for name, values in rates.items()}


def end_to_end(data: str, decode: str, out: Path) -> float:
    command = [sys.executable, "-m", "extract", "--model", "resnet18", "--weights", "none", "--layers", "conv1",
               "--pool", "avg", "--data", data, "--out", str(out), "--overwrite", "--num-workers", "2",
               "--batch-size", "32", "--decode", decode, "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-2000:])
    import zarr

    return float(zarr.open_group(out, mode="r").attrs["summary"]["images_per_second"])


def write_results(text: str) -> None:
    path = ROOT / "benchmarks" / "RESULTS.md"
    content = path.read_text()
    if SECTION in content:
        head, _, rest = content.partition(SECTION)
        tail = rest[rest.find("\n## ") :] if "\n## " in rest else ""
        content = head + text.rstrip() + "\n" + tail
    else:
        content = content.rstrip() + "\n\n" + text
    path.write_text(content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-decode-bench"))
    parser.add_argument("--small", type=int, default=240, help="number of 500x375 JPEGs")
    parser.add_argument("--large", type=int, default=48, help="number of 2000x1500 JPEGs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--e2e-repeats", type=int, default=2)
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--no-results", action="store_true", help="do not write RESULTS.md")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    files = {
        "500x375": make_set(args.workdir, SIZES["500x375"], args.small),
        "2000x1500": make_set(args.workdir, SIZES["2000x1500"], args.large),
    }
    load_before = os.getloadavg()
    rates = per_core({name: [f.read_bytes() for f in fs] for name, fs in files.items()}, args.repeats)
    e2e: dict[str, list[float]] = {}
    shards = make_shards(files["500x375"], args.workdir / "shards-500x375", per_shard=50)
    folder_small = args.workdir / "500x375"
    load_rates = loading({"imagefolder": f"imagefolder:{folder_small}", "tar shards (wds)": f"wds:{shards}"},
                         args.repeats)  # fmt: skip
    if not args.no_e2e:
        folder_large = args.workdir / "2000x1500"
        runs = {
            "500x375, imagefolder": (f"imagefolder:{folder_small}", "pil"),
            "500x375, tar shards (wds)": (f"wds:{shards}", "pil"),
            "2000x1500, imagefolder": (f"imagefolder:{folder_large}", "pil"),
            "2000x1500, imagefolder, --decode draft": (f"imagefolder:{folder_large}", "draft"),
        }
        if torch.cuda.is_available():
            runs["2000x1500, imagefolder, --decode nvjpeg"] = (f"imagefolder:{folder_large}", "nvjpeg")
        for repeat in range(args.e2e_repeats):
            order = list(runs.items())
            for name, (data, decode) in order if repeat % 2 == 0 else order[::-1]:
                e2e.setdefault(name, []).append(end_to_end(data, decode, args.workdir / "e2e.zarr"))
    load_after = os.getloadavg()
    medians = {name: statistics.median(values) for name, values in e2e.items()}
    report = {"per_core": rates, "loading": load_rates, "end_to_end": medians, "load_before": load_before,
              "load_after": load_after}  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if not args.no_results:
        write_results(render(report, args))


def render(report: dict, args: argparse.Namespace) -> str:
    rates, e2e = report["per_core"], report["end_to_end"]
    variants = list(next(iter(rates.values())))
    lines = [
        SECTION, "",
        "`benchmarks/decode_throughput.py` (written by the script; see its docstring for the method).",
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.python_version()}, torch {torch.__version__}, "
        f"Pillow {Image.__version__}, CUDA {'yes: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no'}. "
        f"Load average (1/5/15 min) before {tuple(round(x, 2) for x in report['load_before'])}, after "
        f"{tuple(round(x, 2) for x in report['load_after'])}: the machine is shared, so absolute rates are "
        "pessimistic; ratios come from interleaved runs in one process.", "",
        f"    python benchmarks/decode_throughput.py --small {args.small} --large {args.large} --repeats {args.repeats} "
        f"--e2e-repeats {args.e2e_repeats}",
        "",
        "Decode + transform (resize 256, crop 224, normalize), img/s per core (thread CPU time; nvjpeg: wall, "
        "GPU), median of interleaved repeats:", "",
        "| JPEGs | " + " | ".join(variants) + " | draft / pil |",
        "| --- | " + " | ".join("---:" for _ in variants) + " | ---: |",
    ]  # fmt: skip
    for name, values in rates.items():
        cells = " | ".join(f"{values[v]:.1f}" for v in variants)
        lines.append(f"| {name} | {cells} | **{values['draft'] / values['pil']:.2f}x** |")
    loading = report["loading"]
    lines += ["", "Loading one sample (read + decode + transform, what a worker does), the same 500x375 JPEGs from "
              "a folder and from tar shards of 50, img/s per core (thread CPU time, interleaved sample by sample):",
              "", "| source | img/s per core |", "| --- | ---: |"]  # fmt: skip
    lines += [f"| {name} | {value:.1f} |" for name, value in loading.items()]
    if e2e:
        lines += ["", "End to end, `python -m extract`, resnet18 to conv1 at 224 px, 2 workers, wall-clock img/s "
                  "(median; at this load, noisy: runs of one variant differ by up to 2x):", "",
                  "| data | img/s |", "| --- | ---: |"]  # fmt: skip
        lines += [f"| {name} | {value:.1f} |" for name, value in e2e.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
