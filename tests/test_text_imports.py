"""A text job imports no vision code of its own before its first forward (issue 45).

Deciding whether ``hf:DIR`` is text used to import transformers' image-processor mapping, which imports its
image utilities, torchvision and ``torch._dynamo``: 6% of a short packed job. What transformers' own model
loader imports (its ``modeling_utils`` pulls ``image_utils`` and so torchvision, when installed) is its
business; what extract imports is ours. The job runs in a subprocess that records, at the first forward of
any module, which modules are loaded and who imported each vision module first.
"""

import json
import os
import subprocess
import sys

from helpers import ROOT
from helpers.text_models import real_documents, save_text_model, write_jsonl

PROBE = r"""
import json, os, sys, traceback
import torch

VISION = ("torchvision", "transformers.image_processing", "transformers.models.auto.image_processing_auto")
importers = {}


class Who:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(VISION) and name not in importers:
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename
                      and not f.filename.startswith("<")]
            importers[name] = f"{frames[-1].filename}:{frames[-1].lineno}"
        return None


sys.meta_path.insert(0, Who())


def first_forward(module, args):
    json.dump({"modules": sorted(sys.modules), "importers": importers}, open(os.environ["PROBE_OUT"], "w"))
    os._exit(0)


torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
from extract.cli.startup import main

sys.argv = ["extract", *sys.argv[1:]]
sys.exit(main())
"""


def test_a_text_job_imports_no_vision_code_before_its_first_forward(tmp_path):
    model = save_text_model("gpt2", tmp_path / "gpt2")
    write_jsonl(tmp_path / "docs.jsonl", list(real_documents(4)))
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROBE_OUT": str(out), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--model", f"hf:{model}", "--layers", "transformer.h.0", "--data",
         f"text:{tmp_path / 'docs.jsonl'}", "--pack", "32", "--out", str(tmp_path / "s.zarr")],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]
    seen = json.loads(out.read_text())
    processing = [
        m
        for m in seen["modules"]
        if m.startswith(("transformers.image_processing", "transformers.models.auto.image_processing"))
    ]
    assert not processing, processing
    # torchvision, where loaded at all, came in through transformers' model loader, never through extract
    ours = {m: where for m, where in seen["importers"].items() if os.sep + "extract" + os.sep in where}
    assert not ours, ours
    assert not [m for m in seen["modules"] if m.startswith(("extract.models.torchvision", "extract.models.timm"))]


def test_vision_only_model_types_are_still_told_apart():
    from extract.models.hf import _vision_only

    assert _vision_only("dinov2") and _vision_only("vit") and _vision_only("convnextv2")
    assert not _vision_only("gpt2") and not _vision_only("llama") and not _vision_only("bert")
