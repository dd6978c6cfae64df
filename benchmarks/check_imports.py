"""The GPU check's first step: versions, the CUDA device, and every module the check's steps import, each
imported here so that a missing wheel is named at once (one line each) rather than as a traceback halfway
through the run. Exits 1 if any is missing. The wheels that provide them are listed in benchmarks/README.md.

    python benchmarks/check_imports.py
"""

from __future__ import annotations

import importlib
import sys

# module -> the step that needs it (the distribution it comes from is in benchmarks/README.md's wheel list)
NEEDED = {
    "torch": "every step",
    "torchvision": "every image step, tests/test_cuda*.py",
    "accelerate": "every job (the process group)",
    "numpy": "every step",
    "PIL": "the image data (pillow)",
    "zarr": "every store",
    "numcodecs": "zarr's codecs",
    "crc32c": "the stores' checksums",
    "google_crc32c": "zarr's crc32c codec",
    "donfig": "zarr's configuration",
    "yaml": "donfig",
    "typing_extensions": "zarr",
    "packaging": "zarr, pytest, transformers",
    "pytest": "the CUDA tests (benchmarks/cuda_tests.sh)",
    "pluggy": "pytest",
    "iniconfig": "pytest",
    "transformers": "text jobs (tokens, tensor_parallel, sae), gpu_sources's Dinov2",
    "tokenizers": "transformers' tokenizers",
    "safetensors": "transformers' weights, sae_lens",
    "huggingface_hub": "transformers",
    "regex": "transformers",
    "tqdm": "transformers, the progress bar",
    "filelock": "transformers",
    "fsspec": "huggingface_hub",
    "timm": "gpu_sources (convnext_tiny)",
    "sae_lens": "the sae step (--sae)",
}


def main() -> int:
    import torch

    print("python", sys.version.split()[0])
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    missing = []
    for module, needed_by in NEEDED.items():
        try:
            imported = importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - any failure to import is what this step reports
            missing.append(module)
            print(f"MISSING {module} (for {needed_by}): {type(error).__name__}: {str(error).splitlines()[0][:160]}")
            continue
        print(f"{module} {getattr(imported, '__version__', '')}".rstrip())
    if missing:
        print(f"check_imports: {len(missing)} module(s) missing: {', '.join(missing)}; add their wheels "
              "(benchmarks/README.md, the GPU check's wheel list)")  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
