"""What starting ``extract`` costs: every subcommand's ``--help``, and a tiny job from process start
to its first forward, for this tree and a "before" tree (another commit, unpacked with ``git archive``).

- ``--help``: wall seconds and CPU seconds (user + system of the child, from ``wait4``'s rusage) of
  ``python -m extract COMMAND --help``; median of ``--repeat`` runs, the trees alternating.
- start -> first forward: a tiny image job (resnet18, random weights, ``synthetic:16`` at 32 px) and a
  tiny text job (a 2-layer GPT-2 of width 16 saved to a directory, 8 short jsonl documents). "First
  forward" is the first call of any ``nn.Module`` forward in the job's process: the child is started
  through a small prelude that, once ``torch.nn.modules.module`` is imported (by whatever imports it
  first), registers torch's global forward pre-hook, which writes ``time.time()`` at its first call.
  That is the set-up forward (capture's shape probe), the first moment the model computes anything; the
  wall and CPU seconds to the end of the job come with it. The prelude imports nothing of torch itself.
  Also reported: which of torchvision.ops, torch._dynamo and transformers were imported before it.

    git archive main | tar -x -C /tmp/extract-before
    python benchmarks/startup.py --before-tree /tmp/extract-before --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
COMMANDS = ("run", "list-layers", "verify", "probe", "compare", "report", "export", "top")
WATCHED = ("torchvision.ops", "torch._dynamo", "transformers")

# Run as ``python -c PRELUDE OUT_FILE extract-args...``: the hook on torch's first import, then the command.
PRELUDE = r"""
import importlib.abc, importlib.util, json, sys, time
out = sys.argv[1]
WATCHED = WATCHED_NAMES

def first_forward(module, args):
    record = {"t": time.time(), "loaded": [m for m in WATCHED if m in sys.modules]}
    handle.remove()
    with open(out, "w") as f:
        json.dump(record, f)

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.nn.modules.module":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            global handle
            run(module)
            handle = module.register_module_forward_pre_hook(first_forward)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Hook())
sys.argv = ["extract", *sys.argv[2:]]
from extract.cli.startup import main
sys.exit(main())
""".replace("WATCHED_NAMES", repr(WATCHED))


def timed(argv: list[str], tree: Path, cwd: Path) -> tuple[float, float, int]:
    """(wall s, CPU s of the child, exit status) of one process."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status)


def tiny_text_model(root: Path) -> Path:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    words = "the a of to and in is it that was for on are with as".split()
    vocab = {w: i for i, w in enumerate(["<unk>", "<|endoftext|>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<|endoftext|>",
                                      bos_token="<|endoftext|>")  # fmt: skip
    config = tf.GPT2Config(vocab_size=len(vocab), n_positions=128, n_embd=16, n_layer=2, n_head=2)
    tf.GPT2LMHeadModel(config).eval().save_pretrained(root / "gpt2")
    fast.save_pretrained(root / "gpt2")
    (root / "corpus.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(words[i:] + words[:i])}) + "\n" for i in range(8))
    )
    return root / "gpt2"


def job(kind: str, tree: Path, work: Path, run: int) -> dict[str, float | list[str]]:
    out_file = work / f"forward-{run}.json"
    out_file.unlink(missing_ok=True)
    if kind == "image":
        args = ["--model", "resnet18", "--weights", "none", "--layers", "layer4", "--data", "synthetic:16",
                "--image-size", "32", "--num-workers", "0"]  # fmt: skip
    else:
        args = ["--model", f"hf:{work / 'gpt2'}", "--weights", "none", "--layers", "transformer.h.1",
                "--data", f"text:{work / 'corpus.jsonl'}", "--num-workers", "0"]  # fmt: skip
    args += ["--out", str(work / f"{kind}-{run}.zarr")]
    start = time.time()
    wall, cpu, status = timed([sys.executable, "-c", PRELUDE, str(out_file), *args], tree, work)
    if status != 0:
        raise SystemExit(f"{kind} job failed with {status} in {tree}: {args}")
    record = json.loads(out_file.read_text())
    return {"to_first_forward_s": record["t"] - start, "job_wall_s": wall, "job_cpu_s": cpu,
            "loaded_before_forward": record["loaded"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-tree", type=Path, required=True, help="the source tree to compare against")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the medians here")
    args = parser.parse_args()
    trees = {"before": args.before_tree.resolve(), "after": HERE}
    results: dict[str, dict[str, dict[str, list]]] = {name: {} for name in trees}
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        tiny_text_model(work)
        for run in range(args.repeat):
            for name, tree in trees.items():  # alternating, so that a busy minute hits both
                for command in COMMANDS:
                    wall, cpu, status = timed([sys.executable, "-m", "extract", command, "--help"], tree, work)
                    assert status == 0, (name, command, status)
                    results[name].setdefault(f"{command} --help", {}).setdefault("wall_s", []).append(wall)
                    results[name][f"{command} --help"].setdefault("cpu_s", []).append(cpu)
                for kind in ("image", "text"):
                    for key, value in job(kind, tree, work, run).items():
                        results[name].setdefault(f"{kind} job", {}).setdefault(key, []).append(value)
    medians = {
        name: {
            what: {
                k: (statistics.median(v) if not isinstance(v[0], list) else sorted(set(sum(v, []))))
                for k, v in values.items()
            }  # fmt: skip
            for what, values in by_what.items()
        }
        for name, by_what in results.items()
    }
    print(f"median of {args.repeat} runs; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}")
    for what in medians["after"]:
        for key in medians["after"][what]:
            before, after = medians["before"][what][key], medians["after"][what][key]
            shown = (lambda v: f"{v:.2f}") if isinstance(after, float) else (lambda v: ",".join(v) or "-")
            print(f"{what:22} {key:22} before {shown(before):>40}  after {shown(after):>40}")
    if args.json:
        args.json.write_text(json.dumps(medians, indent=2) + "\n")


if __name__ == "__main__":
    main()
