"""The Python examples of README.md and docs/*.md run as written (issue 29: the README's S3 read-back
failed on its own demo store; issue 30: most of the README moved to docs/).

Every ```python block of README.md and of docs/*.md runs here, each in a fresh namespace, in a directory
holding the stores it reads. Those stores are made first by the pages' own commands (the first indented
command that writes each ``--out``, looked for in README.md, then in docs/*.md by name), made small:
``--data synthetic:64 --image-size 32 --num-workers 0``, and tiny local text models standing in for
``hf:/models/gpt2``, its fine-tune ``hf:/models/gpt2-chat`` and ``hf:/models/minilm`` (as many layers as the
commands name, so their layer names stay the pages'), and a tiny SAELens SAE at each path a ``--sae LAYER=PATH``
names. The store on S3 goes to moto's server (``tests/helpers/s3.py``) in the pages' bucket. A block
whose first line is ``# not run by tests/test_readme.py: REASON`` is skipped, saying REASON; any other
block that raises fails its test, naming its page and line.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers import ROOT, patience
from helpers.text_models import bert_tokenizer, gpt2_tokenizer, real_documents, save_text_model, write_jsonl

README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))  # README first: its commands are the ones used
NOT_RUN = "# not run by tests/test_readme.py:"
S3_STORE = "s3://features/demo.zarr"
LOCAL_STORES = ("demo.zarr", "tokens.zarr", "docs.zarr", "packed.zarr", "a.zarr", "b.zarr", "codes.zarr", "routing.zarr")
WIDTH, D_SAE = 16, 128  # the tiny models' width; latents up to 127 (the pages read latent 123)


def python_blocks() -> list[tuple[str, int, str]]:
    """(page, line of the opening fence, code) of every ```python block of every page."""
    blocks = []
    for page in PAGES:
        lines, start = page.read_text(encoding="utf-8").splitlines(), None
        for number, line in enumerate(lines, 1):
            if start is None and line.strip() == "```python":
                start = number
            elif start is not None and line.strip() == "```":
                blocks.append((page.relative_to(ROOT).as_posix(), start, "\n".join(lines[start : number - 1]) + "\n"))
                start = None
        assert start is None, f"{page.name}:{start}: a ```python block is never closed"
    return blocks


def readme_command(out: str) -> list[str]:
    """The arguments after ``-m extract`` of the pages' first command that writes ``--out out``."""
    pages = (page.read_text(encoding="utf-8") for page in PAGES)
    text = "\n".join(re.sub(r"\\\n\s*", " ", page) for page in pages)  # join continued lines
    for line in text.splitlines():
        if not line.startswith("    ") or "-m extract " not in line:
            continue
        words = shlex.split(line, comments=True)
        args = words[words.index("extract") + 1 :]
        if "--out" in args and args[args.index("--out") + 1] == out:
            return args
    raise AssertionError(f"neither README.md nor docs/*.md has a command writing --out {out}")


def small(args: list[str], models: dict[str, Path]) -> list[str]:
    """``args`` made small and offline: few images at 32 px, no DataLoader workers, tiny text models."""
    args = list(args)
    for i, arg in enumerate(args[:-1]):
        if arg == "--data" and args[i + 1].startswith("synthetic:"):
            args[i + 1] = "synthetic:64"
        if arg == "--model" and args[i + 1] in models:
            args[i + 1] = f"hf:{models[args[i + 1]]}"
    if "--image-size" in args:
        args[args.index("--image-size") + 1] = "32"
    elif not any(a.startswith("hf:") for a in args):
        args += ["--image-size", "32"]
    return [*args, "--num-workers", "0"]


def tiny_text_models(root: Path) -> dict[str, Path]:
    """Stand-ins for the README's ``hf:/models/gpt2`` (12 blocks: ``hidden_states.12`` exists), a fine-tune
    of it with the same tokenizer, ``hf:/models/gpt2-chat`` (other weights), and ``hf:/models/minilm``
    (6 layers, as all-MiniLM-L6), with 16-wide layers and random weights; and ``hf:/models/mixtral``, a
2-block Mixtral (``save_text_model``)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    gpt2, chat, minilm = root / "gpt2", root / "gpt2-chat", root / "minilm"
    tokenizer = gpt2_tokenizer()
    config = tf.GPT2Config(vocab_size=len(tokenizer), n_positions=1024, n_embd=WIDTH, n_layer=12, n_head=2,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    for directory in (gpt2, chat):  # one tokenizer, saved twice: the stores' tokenizer digests agree
        tf.GPT2LMHeadModel(config).eval().save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    tokenizer = bert_tokenizer()
    config = tf.BertConfig(vocab_size=len(tokenizer), hidden_size=WIDTH, num_hidden_layers=6, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    tf.BertModel(config).eval().save_pretrained(minilm)
    tokenizer.save_pretrained(minilm)
    mixtral = save_text_model("mixtral", root / "mixtral")  # 2 mixture-of-experts blocks, 4 experts, top 2
    return {"hf:/models/gpt2": gpt2, "hf:/models/gpt2-chat": chat, "hf:/models/minilm": minilm,
            "hf:/models/mixtral": mixtral}  # fmt: skip


def tiny_saes(args: list[str]) -> None:
    """A SAELens SAE (``d_in`` the tiny models' width, random non-zero weights) saved at every PATH of the
    command's ``--sae LAYER=PATH ...``, its ``hook_name`` LAYER."""
    import sae_lens
    import torch
    from sae_lens.saes.sae import SAEMetadata

    if "--sae" not in args:
        return
    specs = args[args.index("--sae") + 1 :]
    specs = specs[: next((i for i, a in enumerate(specs) if a.startswith("--")), len(specs))]
    generator = torch.Generator().manual_seed(1)
    for spec in specs:
        layer, path = spec.split("=", 1)
        sae = sae_lens.StandardSAE(
            sae_lens.StandardSAEConfig(d_in=WIDTH, d_sae=D_SAE, metadata=SAEMetadata(hook_name=layer))
        )
        with torch.no_grad():  # not the initialisation's zeros: every latent can fire
            for parameter in sae.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        sae.save_model(path)


def run_command(args: list[str]) -> None:
    from extract.cli.extract import main

    assert main(args) == 0, f"README command failed: python -m extract {shlex.join(args)}"


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A directory holding the README's local stores (and the data its text commands read), made by
    its commands; and the tiny text models."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("readme")
    models = tiny_text_models(tmp_path_factory.mktemp("models"))
    documents = real_documents(40)
    (root / "corpus").mkdir()
    write_jsonl(root / "corpus" / "a.jsonl", documents[:20])
    write_jsonl(root / "corpus" / "b.jsonl", documents[20:])
    stars = [i % 5 + 1 for i in range(len(documents))]
    pq.write_table(pa.table({"text": list(documents), "stars": stars}), root / "reviews.parquet")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)  # the commands' relative paths (corpus/*.jsonl, demo.zarr) are the README's
        for out in LOCAL_STORES:
            args = small(readme_command(out), models)
            tiny_saes(args)
            run_command(args)
    return root, models


def _id(block: tuple[str, int, str]) -> str:
    return f"{block[0]}:{block[1]}"


@pytest.mark.parametrize("block", python_blocks(), ids=_id)
def test_a_readme_python_block_runs(block, stores, request, monkeypatch):
    page, line, code = block
    first = code.lstrip().splitlines()[0]
    if first.startswith(NOT_RUN):
        pytest.skip(first.removeprefix(NOT_RUN).strip())
    root, models = stores
    if "s3://" in code:
        assert S3_STORE in code, f"{page}:{line} reads a store on S3 that no command in the pages makes"
        s3 = request.getfixturevalue("s3")  # moto's server, and this process's environment pointing at it
        client = s3.server.client()
        if "features" not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
            client.create_bucket(Bucket="features")
            run_command(small(readme_command(S3_STORE), models))
    monkeypatch.chdir(root)
    exec(compile(code, f"{page}:{line}", "exec"), {"__name__": "readme"})


def test_every_block_is_found_and_few_are_not_run():
    """The parsing above sees the pages' blocks (the README's three examples among them), and the list of
    blocks not run stays short."""
    blocks = python_blocks()
    not_run = [f"{page}:{line}" for page, line, code in blocks if code.lstrip().startswith(NOT_RUN)]
    in_readme = [line for page, line, code in blocks if page == "README.md"]
    assert len(blocks) >= 10 and len(not_run) <= 2 and len(in_readme) >= 3, (len(blocks), not_run, in_readme)


def launch_commands() -> list[list[str]]:
    """The README's ``accelerate launch ... -m extract ...`` lines, as words."""
    lines = README.read_text(encoding="utf-8").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("    accelerate launch ")]


def test_the_readme_launch_commands_run(tmp_path):
    """The README's launch lines that a CPU can run (synthetic data, random weights) run as written, made
    small: under ``accelerate launch --cpu`` (one process) and ``--multi_gpu --num_processes 2`` (two
    ranks on gloo), each store complete and equal, array for array, to the one a plain ``python -m extract``
    of the same flags writes."""
    import sys

    import numpy as np
    from helpers.launches import environment, free_port

    from extract import open_features

    commands = launch_commands()
    runnable = [words for words in commands if "--data" in words and "synthetic:" in words[words.index("--data") + 1]]
    assert len(commands) >= 3 and [w[2] for w in runnable] == ["--cpu", "--multi_gpu"], commands
    for words in runnable:
        options, args = words[2 : words.index("-m")], small(words[words.index("extract") + 1 :], {})
        out = args[args.index("--out") + 1]
        launch = [sys.executable, "-m", "accelerate.commands.launch", *options, "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]  # fmt: skip
        done = patience.run(
            [*launch, "-m", "extract", *args], cwd=tmp_path, env=environment(), capture_output=True, text=True,
            quiet=600,
        )  # fmt: skip
        assert done.returncode == 0, f"README command failed: {shlex.join(words)}\n{done.stderr[-3000:]}"
        alone = [*args[: args.index("--out") + 1], "alone-" + out, *args[args.index("--out") + 2 :]]
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(tmp_path)
            run_command(alone)
        launched, reference = open_features(tmp_path / out), open_features(tmp_path / ("alone-" + out))
        assert len(launched) == len(reference) == 64
        for layer in ("layer3", "layer4"):
            np.testing.assert_array_equal(launched.load(layer), reference.load(layer))
        np.testing.assert_array_equal(launched.labels, reference.labels)
