"""timm and Hugging Face models through the CLI on CUDA (bf16 autocast) against the fp32 CPU run.

For each model: the CLI on CUDA over ``synthetic:N`` (img/s from the store's summary), the CLI on the
CPU (``CUDA_VISIBLE_DEVICES=``) over the first ``--compare`` samples (synthetic images depend only
on their index), and the features of those samples compared: relative max error (max |a - b| over
max |b|) and the smallest per-sample cosine similarity. bf16 keeps 8 bits of mantissa, so through a
dozen blocks features drift by a few percent; the tolerance below allows that and nothing more.

    python benchmarks/gpu_sources.py --json gpu_sources.json

Models are built offline: timm's convnext_tiny with random init (seeded), and a Dinov2 the size of
DINOv2 ViT-S/14 built from its config and saved with ``save_pretrained`` (random init), called as
``hf:DIR``. A library that does not import is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MAX_RELATIVE_ERROR = 0.05
MIN_COSINE = 0.99


def extract(args: list[str], cuda: bool) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-m", "extract", *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"extract {' '.join(args)} failed:\n{result.stderr[-3000:]}")


def hf_dinov2(folder: Path) -> str:
    import torch
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, patch_size=14, image_size=224)
    Dinov2Model(config).save_pretrained(folder)
    BitImageProcessor(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, resample=3,
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(folder)  # fmt: skip
    return f"hf:{folder}"


def compare(model: str, layers: list[str], pool: list[str], n: int, n_compare: int, work: Path) -> dict:
    import zarr

    common = ["--model", model, "--weights", "DEFAULT" if model.startswith("hf:") else "none", "--layers", *layers,
              "--pool", *pool, "--dtype", "float32", "--batch-size", "64"]  # fmt: skip
    extract([*common, "--data", f"synthetic:{n}", "--out", str(work / "cuda.zarr"), "--precision", "bf16"], True)
    extract(
        [*common, "--data", f"synthetic:{n_compare}", "--out", str(work / "cpu.zarr"), "--precision", "fp32"], False
    )
    gpu, cpu = zarr.open_group(work / "cuda.zarr", mode="r"), zarr.open_group(work / "cpu.zarr", mode="r")
    report = {"model": model, "images_per_second_cuda_bf16": gpu.attrs["summary"]["images_per_second"], "layers": {}}
    for layer in gpu.attrs["layers"]:
        a = gpu[f"features/{layer}"][:n_compare].reshape(n_compare, -1).astype(np.float64)
        b = cpu[f"features/{layer}"][:].reshape(n_compare, -1).astype(np.float64)
        relative = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        cosine = float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)).min())
        report["layers"][layer] = {
            "relative_max_error": round(relative, 5),
            "min_cosine": round(cosine, 5),
            "ok": relative <= MAX_RELATIVE_ERROR and cosine >= MIN_COSINE,
        }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--compare", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    reports, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = [
            ("timm", lambda: "timm:convnext_tiny", ["stages.2", "stages.3", "stages.3.blocks.2.mlp"], ["avg"]),
            ("transformers", lambda: hf_dinov2(work / "dinov2"), ["hidden_states.*"], ["cls"]),
        ]
        for library, model, layers, pool in cases:
            try:
                __import__(library)
            except ImportError:
                reports.append({"library": library, "skipped": f"{library} does not import"})
                print(f"{library}: skipped (not importable)", flush=True)
                continue
            case = work / library
            case.mkdir()
            report = compare(model(), layers, pool, args.samples, args.compare, case)
            reports.append(report)
            worst = max(v["relative_max_error"] for v in report["layers"].values())
            lowest = min(v["min_cosine"] for v in report["layers"].values())
            good = all(v["ok"] for v in report["layers"].values())
            ok &= good
            print(
                f"{report['model']}: {report['images_per_second_cuda_bf16']} img/s (CUDA, bf16); vs fp32 CPU: "
                f"relative max error {worst:.4f}, min cosine {lowest:.4f} -> {'ok' if good else 'FAIL'}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(reports, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
