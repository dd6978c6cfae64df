"""Variant (c) of ``token_throughput.py``: SAELens's ``CacheActivationsRunner`` on a local model directory
and a local dataset of token contexts. Run with the python of a venv that has ``sae-lens`` (it is kept
out of extract's venv: it pins its own transformers and torch); it imports nothing of extract.

Prints one line ``SAELENS_RESULT {json}``: the seconds of ``runner.run()`` (forwards, the shards
written with ``datasets``, their consolidation) and of building the runner (model load), the tokens
cached, and the rows and columns of the dataset it wrote, read back.

    /work/venv-sae/bin/python benchmarks/token_throughput_sae.py --model DIR --dataset DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import time

import datasets
import torch
from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a save_pretrained directory of a causal LM")
    p.add_argument("--dataset", required=True, help="a datasets save_to_disk directory with input_ids contexts")
    p.add_argument("--out", required=True, help="new_cached_activations_path (must not exist or be empty)")
    p.add_argument("--hook", default="transformer.h.1")
    p.add_argument("--d-in", type=int, default=768)
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    # The local dataset goes in as override_dataset: given as a path, ActivationsStore would call
    # load_dataset on it and ask the Hub for its sae_lens.json (no network here).
    contexts = datasets.load_from_disk(args.dataset)
    tokens = len(contexts) * args.context_length
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    # One buffer for the whole run: run() fills n_batches_in_buffer batches per buffer and drops a
    # buffer it cannot fill, so the buffer must divide the tokens (a 2 GB default would hold 650k).
    buffer_bytes = tokens * args.d_in * itemsize + args.d_in * itemsize // 2
    config = CacheActivationsRunnerConfig(
        dataset_path=args.dataset,
        model_name=args.model,
        model_class_name="AutoModelForCausalLM",
        model_batch_size=args.batch_size,
        hook_name=args.hook,
        d_in=args.d_in,
        training_tokens=tokens,
        context_size=args.context_length,
        new_cached_activations_path=args.out,
        shuffle=False,
        dtype=args.dtype,
        device="cpu",
        buffer_size_gb=buffer_bytes / 1e9,
        prepend_bos=False,  # the contexts are the tokenizer's own (GPT-2 adds no BOS)
    )
    assert config.n_buffers == 1 and config.n_tokens_in_buffer == tokens, (config.n_buffers, config.n_tokens_in_buffer)
    started = time.perf_counter()
    runner = CacheActivationsRunner(config, override_dataset=contexts)
    built = time.perf_counter() - started
    started = time.perf_counter()
    cached = runner.run()
    seconds = time.perf_counter() - started
    rows = len(cached)
    first = cached[0]
    print(
        "SAELENS_RESULT "
        + json.dumps(
            {
                "tokens": rows * args.context_length,
                "seconds": seconds,
                "build_seconds": built,
                "rows": rows,
                "columns": sorted(cached.column_names),
                "row_shape": [len(first[args.hook]), len(first[args.hook][0])],
                "token_ids_match": [list(first["token_ids"]) == list(contexts[0]["input_ids"][: args.context_length])],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
