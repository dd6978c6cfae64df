"""More MoE families under --tensor-parallel 2 (issue 48), beyond the six the tests run: each built tiny from
its config class's defaults with small overrides (hidden 32, 2 layers, 4 heads, 4 experts, top-2; random
weights, seed 0; ``save_pretrained``), run as an extract job by 1 process and by 2 with ``--tensor-parallel 2``
(gloo; the experts split by transformers' expert plan) on 10 standard-library docstrings at context 64.
Per family: both exit statuses, the largest rank's share of the parameter bytes, the largest |difference| of
``model.layers.1`` and of each ``BLOCK@router``'s logits between the two runs, and whether each token's
top-k experts are the same. A family whose tiny config does not build is listed with the reason.

    python benchmarks/moe_families.py --json families.json           # ~1.5 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

FAMILIES = ("glm4_moe", "deepseek_v2", "granitemoe", "granitemoeshared", "phimoe", "minimax", "qwen3_next",
            "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "flex_olmo")  # fmt: skip
OVERRIDES = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
    moe_intermediate_size=24, shared_expert_intermediate_size=24, head_dim=8, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, moe_k=2, moe_num_experts=4, max_position_embeddings=256,
    first_k_dense_replace=0, n_group=1, topk_group=1, decoder_sparse_step=1, q_lora_rank=16, kv_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1, pad_token_id=None, moe_layer_freq=1,
    mlp_only_layers=[], partial_rotary_factor=1.0,
)  # fmt: skip
MLA = ("deepseek_v2",)  # multi-head latent attention: as many KV heads as heads


def build(family: str, folder: Path, tokenizer) -> list[str]:
    """The tiny model of ``family`` saved to ``folder``; its routers, as ``BLOCK@router`` finds them."""
    import torch
    import transformers as tf

    config_class = tf.models.auto.configuration_auto.CONFIG_MAPPING[family]
    config = config_class()
    settings = {**OVERRIDES, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    if family in MLA:
        settings["num_key_value_heads"] = 4
    for key, value in settings.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    config = config_class.from_dict(config.to_dict())
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model(input_ids=torch.tensor([[5, 6, 7, 8]]), use_cache=False)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    from extract.capture.moe import moe_blocks, router_name

    return [router_name(model, block) for block in moe_blocks(model)]


def main() -> int:
    import zarr
    from helpers.launches import Sequence
    from helpers.text_models import llama_tokenizer, real_documents, write_jsonl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-moe-families"))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    for folder in ("one", "two"):
        (work / folder).mkdir(parents=True)
    write_jsonl(work / "docs.jsonl", real_documents(10, seed=9))
    tokenizer = llama_tokenizer()
    report: dict[str, dict] = {}
    one, two = {}, {}
    for family in args.families:
        try:
            routers = build(family, work / family, tokenizer)
        except Exception as e:  # a family whose tiny config does not build: say why, go on
            report[family] = {"built": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        layers = ["model.layers.1", *(router.rsplit(".", 1)[0] + "@router" for router in routers)]
        job = ["--model", f"hf:{work / family}", "--layers", *layers, "--data", f"text:{work / 'docs.jsonl'}",
               "--context-length", "64", "--chunk-size", "32", "--tokens-per-batch", "96", "--dtype", "float32"]  # fmt: skip
        one[family] = [*job, "--out", str(work / "one" / f"{family}.zarr")]
        two[family] = [*job, "--tensor-parallel", "2", "--out", str(work / "two" / f"{family}.zarr")]
        report[family] = {"built": True, "routers": routers}
    alone, paired = Sequence(None, one, work / "one"), Sequence(2, two, work / "two")
    launched = paired.start()
    alone.run(timeout=900)
    launched.communicate(timeout=900)
    for family in one:
        codes = alone.result(family).codes, paired.result(family).codes
        entry = report[family]
        entry["exit"] = codes
        if codes != ([0], [0, 0]):
            err = paired.result(family).stderr if codes[0] == [0] else alone.result(family).stderr
            entry["error"] = next((line for line in err.splitlines() if "error" in line.lower()), err[-300:])
        else:
            stores = [zarr.open_group(work / run / f"{family}.zarr", mode="r") for run in ("one", "two")]
            whole = stores[0].attrs["runs"][-1]["parameter_bytes"][0]
            entry["share"] = max(stores[1].attrs["runs"][-1]["parameter_bytes"]) / whole
            entry["max_abs"] = {layer: float(np.abs(stores[0]["features"][layer][:] - stores[1]["features"][layer][:]).max())
                                for layer in stores[0]["features"]}  # fmt: skip
            entry["same_experts"] = {
                layer: bool(np.array_equal(*(np.sort(s[f"latents/{layer}/indices"][:], axis=1) for s in stores)))
                for layer in (stores[0]["latents"] if "latents" in stores[0] else [])
            }
    print(
        "| family | exit (1 process; 2) | largest rank's share | residual max abs | router logits max abs | same experts |"
    )
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for family, entry in report.items():
        if "share" not in entry:
            print(f"| {family} | {entry.get('exit', 'not built')} | | | | {entry.get('error', '')} |")
            continue
        routers = [v for k, v in entry["max_abs"].items() if k.endswith("@router")]
        print(f"| {family} | 0; 0, 0 | {entry['share']:.3f} | {entry['max_abs']['model.layers.1']:.1e} | "
              f"{max(routers) if routers else float('nan'):.1e} | "
              f"{all(entry['same_experts'].values()) if entry['same_experts'] else 'no @router (router not found)'} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
