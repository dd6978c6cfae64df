"""What a text job costs before its first forward as the corpus grows: peak RSS of every rank, the
CPU-seconds and wall time of tokenizing and planning, and the whole run (issue 28, DESIGN.md "Text
at scale").

Only the command line and what the job prints are used, never extract's internals, so that the
same script measures the code before and after the text path is rewritten:

    python -m extract ...                                                     # 1 process
    python -m accelerate.commands.launch --multi_gpu --num_processes 2 ... -m extract ...   # 2 CPU ranks (gloo)

For each corpus size (tokens of real prose), mode (ragged ``--context-length 128``, packed
``--pack 128``) and process count, one job runs on a tiny GPT-2 (1 layer, n_embd 32, random weights)
with a byte-level BPE tokenizer trained here, hooked at ``transformer.h.0``, into a fresh store. While
it runs, every process of its tree is sampled every ``--interval`` seconds (``/proc/PID/status``
VmHWM and VmRSS, ``/proc/PID/stat`` utime + stime); a rank is a process whose environment has
``RANK`` (or the job itself with 1 process). The job's stderr is read as it comes (lines split at
``\\r`` too, for the progress bar), and two moments are taken from it:

- **plan**: the line ``extract: ... N samples in K chunks of C ...``, which rank 0 prints once the
  corpus is tokenized, the plan made and the store created, right before the loop;
- **first forward**: the first progress-bar line that counts more than 0 tokens (rank 0 has
  forwarded and handed over its first batch).

At each moment the CPU-seconds of every rank (utime + stime since it started) are read. Runs whose
corpus is larger than ``--full-up-to`` tokens are killed at the first forward (their total wall
time is not measured; their peak RSS is the peak up to the loop, which is the part that grows with
the corpus today).

The corpus: docstrings (``inspect.getdoc``) of many standard-library and installed modules, their
classes and methods, and the licence files and READMEs (METADATA) the installed packages ship, cut
into paragraph-sized documents (most under 128 tokens), repeated in seeded shuffles until the
documents hold the size's tokens (content tokens, untruncated). Corpora, model and tokenizer are
written once and kept under ``--workdir``.

    python benchmarks/text_scale.py                                   # 1M, 4M, 16M; both modes; 1 and 2 processes
    python benchmarks/text_scale.py --sizes 200k,1M --processes 1     # a quick look
    python benchmarks/text_scale.py --results "Text at scale (issue 28): after"   # the rewrite
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers.launches import descendants  # noqa: E402  (the suite's walk of a launch's process tree)

LAYER = "transformer.h.0"
DOCUMENT_CHARS = 500  # a document's characters at most: paragraphs, most under 128 tokens
CONTEXT = 128
PAGE_TICKS = os.sysconf("SC_CLK_TCK")
PLAN_LINE = re.compile(r"extract: .*?(\d+) (?:samples|tokens|documents) in (\d+) chunks? of (\d+)")
BAR_LINE = re.compile(r"extract:\s+\d+%\|.*?\|\s*(\d+)/(\d+)")

STDLIB = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html.parser", "http.client", "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "lzma", "mailbox", "math", "multiprocessing", "numbers", "operator",
    "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "pprint", "queue", "random",
    "re", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "sqlite3", "ssl",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zoneinfo", "doctest", "pdb", "turtle",
    "tkinter", "curses", "codecs", "locale", "array", "mmap", "signal", "sysconfig", "trace", "cProfile",
)  # fmt: skip
PACKAGES = (
    "numpy", "numpy.linalg", "numpy.random", "numpy.fft", "numpy.ma", "torch", "torch.nn", "torch.nn.functional",
    "torch.utils.data", "torch.distributed", "torch.optim", "tokenizers", "tqdm", "zarr", "accelerate",
    "transformers.tokenization_utils_base", "transformers.modeling_utils", "transformers.generation.utils",
    "pytest", "packaging.version", "yaml", "requests", "huggingface_hub", "safetensors", "PIL.Image",
)  # fmt: skip


# --------------------------------------------------------------------------------------- the corpus


def docstrings(names: tuple[str, ...]) -> list[str]:
    """The docstrings of these modules, their members and their classes' methods."""
    import importlib
    import inspect

    docs: list[str] = []
    seen: set[str] = set()

    def add(member: Any) -> None:
        try:
            doc = inspect.getdoc(member)
        except Exception:  # noqa: BLE001 - a lazy module's member may fail to load
            return
        if doc and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed, or no display (tkinter, turtle)
            continue
        add(module)
        root = name.split(".")[0]
        for _, member in sorted(vars(module).items()):
            if not (callable(member) and (getattr(member, "__module__", None) or "").startswith(root)):
                continue
            add(member)
            if inspect.isclass(member):
                for _, method in sorted(vars(member).items()):
                    if callable(method):
                        add(method)
    return docs


def package_texts() -> list[str]:
    """Licence files and READMEs (the body of METADATA) of the installed packages."""
    import torch

    site = Path(torch.__file__).resolve().parent.parent
    texts: list[str] = []
    for info in sorted(site.glob("*.dist-info")):
        for path in sorted(
            p for p in info.rglob("*") if p.is_file() and re.match(r"(LICEN[CS]E|COPYING|NOTICE)", p.name)
        ):
            texts.append(path.read_text(errors="replace"))
        metadata = info / "METADATA"
        if metadata.is_file():
            texts.append(metadata.read_text(errors="replace").partition("\n\n")[2])
    return [t.strip() for t in dict.fromkeys(texts) if t.strip()]


def paragraphs(text: str, most: int = 500) -> list[str]:
    """``text`` cut into documents of at most about ``most`` characters: paragraphs (blank lines),
    short consecutive ones merged, long ones cut at line or word boundaries."""
    pieces: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        block = block.strip()
        while len(block) > most:
            cut = block.rfind("\n", 0, most)
            cut = cut if cut > most // 2 else block.rfind(" ", 0, most)
            cut = cut if cut > 0 else most
            pieces.append(block[:cut].strip())
            block = block[cut:].strip()
        if block:
            pieces.append(block)
    documents: list[str] = []
    for piece in pieces:
        if documents and len(documents[-1]) + len(piece) + 2 <= most // 2:
            documents[-1] += "\n\n" + piece
        else:
            documents.append(piece)
    return documents


def corpus_pool(workdir: Path, most: int = DOCUMENT_CHARS) -> list[str]:
    """The distinct documents of at most about ``most`` characters, in a fixed order; kept in
    ``workdir/pool.json`` (``pool-<most>.json`` for another size)."""
    path = workdir / ("pool.json" if most == DOCUMENT_CHARS else f"pool-{most}.json")
    if path.is_file():
        return json.loads(path.read_text())
    texts = docstrings(STDLIB) + docstrings(PACKAGES) + package_texts()
    pool = list(dict.fromkeys(d for text in texts for d in paragraphs(text, most)))
    random.Random(0).shuffle(pool)
    path.write_text(json.dumps(pool))
    return pool


def build_model(directory: Path, pool: list[str], vocab_size: int = 8000) -> Path:
    """A GPT-2 of 1 layer, n_embd 32, 2 heads, 128 positions (random weights, seed 0) with a byte-level
    BPE tokenizer trained on ``pool``; ``save_pretrained``, kept in ``directory``."""
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(pool, trainer)
    tokenizer = tf.GPT2TokenizerFast(
        tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=len(tokenizer), n_positions=CONTEXT, n_embd=32, n_layer=1, n_head=2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    scratch = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    tf.GPT2LMHeadModel(config).eval().save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    shutil.rmtree(directory, ignore_errors=True)
    scratch.rename(directory)
    return directory


def write_corpus(path: Path, pool: list[str], counts: list[int], tokens: int) -> dict[str, int]:
    """``path``: documents of the pool in seeded shuffles (a new one each pass) until their content
    tokens reach ``tokens``; returns what it holds. Kept: written once (``path.json`` beside it says
    what it holds)."""
    info = path.with_suffix(".json")
    if path.is_file() and info.is_file():
        return json.loads(info.read_text())
    rng = random.Random(tokens)
    order = list(range(len(pool)))
    total = documents = truncated = 0
    scratch = path.with_suffix(".tmp")
    with scratch.open("w", encoding="utf-8") as f:
        while total < tokens:
            rng.shuffle(order)
            for i in order:
                f.write(json.dumps({"text": pool[i]}) + "\n")
                total += counts[i]
                documents += 1
                truncated += max(0, counts[i] - CONTEXT)
                if total >= tokens:
                    break
    scratch.rename(path)
    held = {"tokens": total, "documents": documents, "bytes": path.stat().st_size, "beyond_context": truncated}
    info.write_text(json.dumps(held))
    return held


def size_of(text: str) -> int:
    """``16M``, ``200k``, ``1000000``: a token count."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def label_of(tokens: int) -> str:
    return f"{tokens / 1e6:g}M" if tokens >= 10**6 else f"{tokens / 1e3:g}k"


# ------------------------------------------------------------------------------ watching a job

AT_EXIT = """\
import atexit, json, os, sys


def _text_scale_peak():  # benchmarks/text_scale.py: this process's VmHWM as it exits
    folder = os.environ.get("TEXT_SCALE_PEAKS")
    if not folder:
        return
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        record = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv": sys.argv[:1],
                  "hwm_kib": int(status["VmHWM"].split()[0])}
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(record, f)
    except Exception:
        pass


atexit.register(_text_scale_peak)
"""


def at_exit_hook(workdir: Path) -> Path:
    """A folder holding a ``sitecustomize.py`` that makes every Python process of the job write its own
    VmHWM as it exits (``atexit``: normal exits only) into ``$TEXT_SCALE_PEAKS``: sampling misses what a
    process reaches in its last fraction of a second."""
    folder = workdir / "site"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(AT_EXIT)
    return folder


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of ``pid`` (its own threads, not its children), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / PAGE_TICKS
    except (OSError, IndexError, ValueError):
        return None


def memory_kib(pid: int) -> tuple[int, int] | None:
    """(VmHWM, VmRSS) of ``pid`` in KiB, None once it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return int(status["VmHWM"].split()[0]), int(status["VmRSS"].split()[0])
    except (OSError, KeyError, ValueError, IndexError):
        return None


def rank_of(pid: int, root: int, processes: int) -> int | None:
    """The rank ``pid`` runs (``RANK`` in its environment; the job itself with 1 process), else None."""
    if processes == 1:
        return 0 if pid == root else None
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return None
    if b"RANK" not in env or b"accelerate" in cmdline:
        return None
    return int(env[b"RANK"])


@dataclass
class Watched:
    """One process of the job's tree as last seen."""

    pid: int
    rank: int | None
    hwm_kib: int = 0
    rss_kib: int = 0
    cpu: float = 0.0
    command: str = ""


@dataclass
class Moment:
    """A line of the job's stderr and the ranks' CPU-seconds when it was read."""

    wall: float  # seconds since the launch
    line: str
    cpu: dict[int, float]  # rank -> CPU-seconds since that rank started
    hwm_kib: dict[int, int]  # rank -> VmHWM then


@dataclass
class Run:
    tokens: int  # corpus size (content tokens of its documents)
    mode: str
    processes: int
    command: list[str]
    stored: int = 0  # samples (= tokens) the plan line says
    chunks: int = 0
    plan: Moment | None = None
    first_forward: Moment | None = None
    wall: float | None = None  # whole run; None where stopped at the first forward
    stopped: bool = False
    code: int | None = None
    peak_kib: dict[int, int] = field(default_factory=dict)  # rank -> max VmHWM: sampled, or written at exit
    exit_kib: dict[int, int] = field(default_factory=dict)  # rank -> VmHWM the rank wrote as it exited
    launcher_kib: int = 0  # the launcher (accelerate), where there is one
    maxrss_kib: int = 0  # wait4's ru_maxrss: the largest of the launcher and every rank it waited for
    load: list[float] = field(default_factory=list)  # 1-minute load average at the launch and at the exit
    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds since the launch, stderr line)
    timeline: list[tuple[float, dict[int, float], dict[int, int]]] = field(default_factory=list)  # (s, cpu, rss KiB)


class Watch:
    """Samples the tree of ``job`` every ``interval`` s, reads its stderr, and kills it (by pid, its
    tree) after the first forward when ``stop_at_forward``."""

    def __init__(self, job: subprocess.Popen, run: Run, interval: float, stop_at_forward: bool, started: float):
        self.job, self.run, self.interval, self.stop_at_forward = job, run, interval, stop_at_forward
        self.started = started
        self.seen: dict[int, Watched] = {}
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def sample(self) -> None:
        with self.lock:
            root = self.job.pid
            for pid in [root, *descendants(root)]:
                watched = self.seen.get(pid)
                if watched is None or (watched.rank is None and self.run.processes > 1):
                    rank = rank_of(pid, root, self.run.processes)
                    try:
                        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
                    except OSError:
                        continue
                    watched = self.seen.setdefault(pid, Watched(pid, rank, command=command))
                    watched.rank = rank
                memory, cpu = memory_kib(pid), cpu_seconds(pid)
                if memory is not None:
                    watched.hwm_kib = max(watched.hwm_kib, memory[0])
                    watched.rss_kib = memory[1]
                if cpu is not None:
                    watched.cpu = max(watched.cpu, cpu)
            ranks = [w for w in self.seen.values() if w.rank is not None]
            self.run.timeline.append(
                (
                    round(time.perf_counter() - self.started, 2),
                    {w.rank: w.cpu for w in ranks},
                    {w.rank: w.rss_kib for w in ranks},
                )
            )

    def moment(self, line: str) -> Moment:
        self.sample()
        ranks = [w for w in self.seen.values() if w.rank is not None]
        return Moment(
            time.perf_counter() - self.started, line, {w.rank: w.cpu for w in ranks}, {w.rank: w.hwm_kib for w in ranks}
        )

    def _read(self) -> None:
        assert self.job.stderr is not None
        pending = b""
        while chunk := self.job.stderr.read1(65536):  # type: ignore[attr-defined]
            pending += chunk
            *lines, pending = re.split(rb"[\r\n]", pending)
            for raw in lines:
                self._line(raw.decode(errors="replace").strip())
        if pending:
            self._line(pending.decode(errors="replace").strip())

    def _line(self, line: str) -> None:
        if not line:
            return
        run = self.run
        plan = PLAN_LINE.search(line)
        if plan and run.plan is None:
            run.plan = self.moment(line)
            run.stored, run.chunks = int(plan.group(1)), int(plan.group(2))
        bar = BAR_LINE.search(line)
        if bar and run.first_forward is None and int(bar.group(1)) > 0:
            run.first_forward = self.moment(line)
            if self.stop_at_forward:
                self.kill()
        if not bar:
            run.lines.append((round(time.perf_counter() - self.started, 2), line))

    def kill(self) -> None:
        """SIGKILL the job's tree, by pid: the ranks first, then the launcher."""
        self.run.stopped = True
        for pid in [*descendants(self.job.pid), self.job.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self) -> None:
        for watched in self.seen.values():
            if watched.rank is not None:
                self.run.peak_kib[watched.rank] = max(self.run.peak_kib.get(watched.rank, 0), watched.hwm_kib)
            elif watched.pid == self.job.pid:
                self.run.launcher_kib = watched.hwm_kib


def command_for(args: argparse.Namespace, model: Path, corpus: Path, out: Path, mode: str, processes: int) -> list[str]:
    job = [
        "--model", f"hf:{model}", "--layers", LAYER, "--data", f"text:{corpus}", "--out", str(out),
        *(["--context-length", str(CONTEXT)] if mode == "ragged" else ["--pack", str(CONTEXT)]),
        *args.extra,
    ]  # fmt: skip
    if processes == 1:
        return [sys.executable, "-m", "extract", *job]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
    ]  # fmt: skip
    return [*launch, "-m", "extract", *job]


def run_job(args: argparse.Namespace, command: list[str], run: Run, out: Path, stop_at_forward: bool) -> Run:
    shutil.rmtree(out, ignore_errors=True)
    run.load.append(os.getloadavg()[0])
    peaks = args.workdir / "peaks"
    shutil.rmtree(peaks, ignore_errors=True)
    peaks.mkdir()
    hook = at_exit_hook(args.workdir)
    env = {
        **os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1", "TEXT_SCALE_PEAKS": str(peaks),
    }  # fmt: skip
    started = time.perf_counter()
    job = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watch = Watch(job, run, args.interval, stop_at_forward, started)
    deadline = started + args.timeout
    status = None
    while status is None:
        watch.sample()
        pid, status, usage = os.wait4(job.pid, os.WNOHANG)
        if pid == 0:
            status = None
            if time.perf_counter() > deadline:
                print(f"  timeout after {args.timeout} s: killed", flush=True)
                watch.kill()
            time.sleep(args.interval)
    job.returncode = os.waitstatus_to_exitcode(status)
    run.wall = None if run.stopped else time.perf_counter() - started
    run.code, run.maxrss_kib = job.returncode, usage.ru_maxrss
    run.load.append(os.getloadavg()[0])
    watch.reader.join(timeout=10)
    watch.finish()
    for path in peaks.glob("*.json"):
        record = json.loads(path.read_text())
        if run.processes == 1:
            rank = 0 if record["pid"] == job.pid else None
        else:
            rank = None if record["rank"] is None or "accelerate" in record["argv"][0] else int(record["rank"])
        if rank is not None:
            run.exit_kib[rank] = record["hwm_kib"]
            run.peak_kib[rank] = max(run.peak_kib.get(rank, 0), record["hwm_kib"])
    shutil.rmtree(out, ignore_errors=True)
    return run


# -------------------------------------------------------------------------------------- the report


def slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return b, my - b * mx


def mib(kib: float) -> str:
    return f"{kib / 1024:.0f}"


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def before_loop(run: Run, rank: int) -> int:
    """``rank``'s VmHWM (KiB) when the plan line was read: its peak before the loop; 0 if unknown."""
    return run.plan.hwm_kib.get(rank, 0) if run.plan else 0


def serial_window(run: Run, busy: float = 0.25, sustained: int = 3) -> tuple[float, float] | None:
    """With several ranks: (wall seconds, rank 0's CPU-seconds) from the end of the other ranks' last
    sustained busy stretch before the plan line (``sustained`` samples running in which one of them grew
    its CPU by at least ``busy`` of a core: their tokenization) to the plan line. In that window the
    others wait for rank 0 but for short blips (receiving, the store's opening): it is what rank 0 does
    alone before the loop (today the gather of the token ids, packing, creating the store), plus any
    imbalance of the tokenization. None with 1 process or without a plan line."""
    if run.processes < 2 or run.plan is None:
        return None
    others = range(1, run.processes)
    samples = [(t, {int(k): v for k, v in cpu.items()}) for t, cpu, _ in run.timeline if t <= run.plan.wall]
    samples = [(t, cpu) for t, cpu in samples if all(rank in cpu for rank in others)]
    flags = [
        any(c1[rank] - c0[rank] >= busy * (t1 - t0) for rank in others)
        for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False)
    ]
    for end in range(len(flags) - 1, sustained - 2, -1):
        if all(flags[end - sustained + 1 : end + 1]):
            t, cpu = samples[end + 1]
            return run.plan.wall - t, run.plan.cpu.get(0, 0.0) - cpu.get(0, 0.0)
    return None


def table(runs: list[Run]) -> str:
    header = (
        "| corpus tokens | mode | procs | stored tokens | chunks | RSS MiB to plan, rank 0 | rank 1 | "
        "peak RSS MiB, rank 0 | rank 1 | launcher | wall to plan s | wall to 1st fwd s | CPU-s to plan, rank 0 | "
        "rank 1 | rank 0 alone: wall s, CPU-s | total wall s | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in runs:
        cpu = r.plan.cpu if r.plan else {}
        two = r.processes > 1
        end = "stopped at 1st fwd" if r.stopped else fmt(r.wall)
        window = serial_window(r)
        alone = "-" if window is None else f"{window[0]:.1f}, {window[1]:.1f}"
        if r.code not in (0, None) and not r.stopped:
            end += f" (exit {r.code})"
        rows.append(
            f"| {label_of(r.tokens)} | {r.mode} | {r.processes} | {r.stored} | {r.chunks} | "
            f"{mib(before_loop(r, 0))} | {mib(before_loop(r, 1)) if two else '-'} | "
            f"{mib(r.peak_kib.get(0, 0))} | {mib(r.peak_kib.get(1, 0)) if two else '-'} | "
            f"{mib(r.launcher_kib) if two else '-'} | {fmt(r.plan.wall if r.plan else None)} | "
            f"{fmt(r.first_forward.wall if r.first_forward else None)} | {fmt(cpu.get(0))} | "
            f"{fmt(cpu.get(1)) if two else '-'} | {alone} | {end} | {', '.join(f'{x:.1f}' for x in r.load)} |"
        )
    return header + "\n".join(rows) + "\n"


def slopes(runs: list[Run]) -> tuple[str, dict[tuple[str, int, int], dict[str, Any]]]:
    """Per (mode, processes, rank): the growth per stored token between sizes of the peak RSS before the
    loop and over the run, and the least-squares fits of those and of CPU-seconds and wall time to the
    plan line."""
    lines = [
        "| mode | procs | rank | RSS to plan: bytes/token, each step | fit | peak RSS: bytes/token, each step | fit | "
        "peak RSS MiB at 0 (fit) | CPU µs/token to plan (fit) | wall µs/token to plan (fit) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fits: dict[tuple[str, int, int], dict[str, Any]] = {}
    for mode in dict.fromkeys(r.mode for r in runs):
        for processes in sorted({r.processes for r in runs}):
            group = [r for r in runs if r.mode == mode and r.processes == processes and r.stored and r.plan]
            group.sort(key=lambda r: r.stored)
            if len(group) < 2:
                continue
            xs = [float(r.stored) for r in group]

            def steps(ys: list[float], xs: list[float] = xs) -> str:
                return ", ".join(
                    f"{(b - a) / (x1 - x0):.1f}" for a, b, x0, x1 in zip(ys, ys[1:], xs, xs[1:], strict=False)
                )

            for rank in range(processes):
                before = [before_loop(r, rank) * 1024.0 for r in group]
                peak = [r.peak_kib.get(rank, 0) * 1024.0 for r in group]
                cpu = [r.plan.cpu.get(rank, 0.0) for r in group if r.plan]
                wall = [r.plan.wall for r in group if r.plan]
                fit = {
                    "before": slope(xs, before),
                    "rss": slope(xs, peak),
                    "cpu": slope(xs, cpu),
                    "wall": slope(xs, wall),
                }
                fits[(mode, processes, rank)] = fit
                lines.append(
                    f"| {mode} | {processes} | {rank} | {steps(before)} | {fit['before'][0]:.1f} | {steps(peak)} | "
                    f"{fit['rss'][0]:.1f} | {fit['rss'][1] / 2**20:.0f} | {fit['cpu'][0] * 1e6:.2f} | "
                    f"{fit['wall'][0] * 1e6:.2f} |"
                )
    return "\n".join(lines) + "\n", fits


def extrapolation(runs: list[Run], fits: dict[tuple[str, int, int], dict[str, Any]], tokens: float = 1e9) -> str:
    """``tokens`` (1B) on 8 and 64 ranks, from the slopes over the sizes (per stored token).

    - Peak RSS of rank 0: its intercept and slope at the largest process count measured (2), times
      ``tokens``, taken to hold for any number of ranks (today rank 0 gathers every rank's token ids);
      and a model q = g + o/P (g: what rank 0 holds per token whatever the ranks, o: its share of what
      the ranks split), from the slopes q1 at 1 and q2 at 2 processes: o = 2 (q1 - q2), g = 2 q2 - q1.
    - The serial part: the slope of "rank 0 alone" (``serial_window``, 2 processes; wall seconds and
      rank 0's CPU-seconds) times ``tokens``.
    - To the first forward with P ranks, one core each: the 2-process wall intercept to the plan line
      (start-up) + serial CPU x tokens + (rank 0's CPU slope at 1 process - serial CPU slope) x tokens / P.
      A CPU-seconds model: the wall times measured here are stretched by the shared cores."""
    lines = [
        "| mode | rank 0 RSS B/token: 1 proc, 2 procs (rank 1) | rank 0 peak RSS at 1B (2-proc slope) | "
        "g + o/P model: 8 ranks, 64 ranks | serial µs/token: wall, rank 0 CPU | serial part at 1B: wall, CPU | "
        "parallel CPU µs/token | to 1st forward at 1B: 8 ranks | 64 ranks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def hours(seconds: float) -> str:
        return f"{seconds / 3600:.2f} h" if abs(seconds) >= 360 else f"{seconds:.0f} s"

    for mode in dict.fromkeys(key[0] for key in fits):
        one, two, other = fits.get((mode, 1, 0)), fits.get((mode, 2, 0)), fits.get((mode, 2, 1))
        if not (one and two):
            continue
        r1, r2 = one["rss"][0], two["rss"][0]
        g, o = 2 * r2 - r1, 2 * (r1 - r2)
        model = [two["rss"][1] + (g + o / ranks) * tokens for ranks in (8, 64)]
        group = sorted((r for r in runs if r.mode == mode and r.processes == 2 and r.plan), key=lambda r: r.stored)
        windows = [(r.stored, serial_window(r)) for r in group]
        xs = [float(x) for x, w in windows if w is not None]
        serial_wall = slope(xs, [w[0] for _, w in windows if w is not None])[0] if len(xs) > 1 else 0.0
        serial_cpu = slope(xs, [w[1] for _, w in windows if w is not None])[0] if len(xs) > 1 else 0.0
        parallel = one["cpu"][0] - serial_cpu
        start = two["wall"][1]
        first = [start + serial_cpu * tokens + parallel * tokens / ranks for ranks in (8, 64)]
        lines.append(
            f"| {mode} | {r1:.1f}, {r2:.1f} ({other['rss'][0] if other else float('nan'):.1f}) | "
            f"{(two['rss'][1] + r2 * tokens) / 2**30:.1f} GiB | "
            f"{model[0] / 2**30:.1f} GiB, {model[1] / 2**30:.1f} GiB | {serial_wall * 1e6:.2f}, {serial_cpu * 1e6:.2f} | "
            f"{hours(serial_wall * tokens)}, {hours(serial_cpu * tokens)} | {parallel * 1e6:.2f} | "
            f"{hours(first[0])} | {hours(first[1])} |"
        )
    return "\n".join(lines) + "\n"


EXPLAIN = """\
What the columns mean:
- corpus tokens: the documents' content tokens (untruncated); stored tokens: the samples of the plan
  line (ragged: after truncation to 128; packed: contexts x 128, BOS and separators included).
- peak RSS: the largest VmHWM (/proc/PID/status) of the rank's process (rank: RANK in its
  environment, or the job itself with 1 process), sampled every {interval} s and written by the
  process itself as it exits (atexit, from a sitecustomize.py put on the job's PYTHONPATH); runs
  stopped at the first forward give the peak up to then. RSS to plan: its VmHWM when the plan line
  was read (the peak before the loop). launcher: accelerate's own process (sampled).
- wall to plan: seconds from the launch to the plan line ("extract: ... N samples in K chunks ...",
  printed by rank 0 once the corpus is tokenized, the plan made and the store created); wall to 1st
  fwd: to the first progress-bar line counting more than 0 tokens.
- CPU-s to plan: utime + stime of the rank's process when the plan line was read (start-up and
  imports included; the slopes over the sizes leave those out).
- rank 0 alone (2 processes): from the moment rank 1 went idle before the plan line (its CPU grew
  by less than a quarter of a core over two samples running, and stayed so: it waits for rank 0) to
  the plan line, the wall seconds and rank 0's CPU-seconds: what rank 0 does while the others wait.
- total wall: launch to exit. load: the machine's 1-minute load average at the launch and at the
  exit (2 cores: above 2, the job shared its cores with other work, and wall times stretch).
- RSS bytes/token: growth of peak RSS between consecutive sizes over the growth in stored tokens;
  fit: least squares over all sizes (and its value at 0 tokens). CPU and wall µs/token: the same fit
  of CPU-s and wall seconds to the plan line.
"""


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, nproc {os.cpu_count()} ({len(os.sched_getaffinity(0))} usable), Python {platform.python_version()}"


# ------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1M,4M,16M", help="corpus sizes in tokens (default 1M,4M,16M)")
    parser.add_argument(
        "--modes", default="ragged,packed", help="ragged (--context-length 128) and/or packed (--pack 128)"
    )
    parser.add_argument("--processes", default="1,2", help="process counts (default 1,2)")
    parser.add_argument(
        "--full-up-to", default="16M", help="larger corpora are killed at the first forward (default 16M: none)"
    )
    parser.add_argument("--document-chars", type=int, default=DOCUMENT_CHARS,
                        help="a document's characters at most (default 500: paragraphs, most under 128 tokens; "
                        "360 gives short documents of about 60 tokens, as chat turns or docstrings)")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/extract-text-scale"))
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples of /proc")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds a run may take before it is killed")
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("--results", default="Text at scale (issue 28): before",
                        help="heading of the section appended to benchmarks/RESULTS.md ('' to skip)")  # fmt: skip
    parser.add_argument("--from-json", type=Path, help="no runs: report the runs saved in this --json file")
    parser.add_argument("extra", nargs="*", help="more arguments for every job (after --)")
    args = parser.parse_args(argv)
    sizes = [size_of(s) for s in args.sizes.split(",")]
    modes = args.modes.split(",")
    counts = [int(p) for p in args.processes.split(",")]
    full_up_to = size_of(args.full_up_to)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        runs = [load_run(r) for r in saved["runs"]]
        return report(args, runs, saved["machine"], saved["argv"], saved["date"], size_of(saved["full_up_to"]))
    this_machine = machine()
    print(f"machine: {this_machine}", flush=True)
    model = build_model(args.workdir / "gpt2-1x32", corpus_pool(args.workdir))  # one tokenizer for every size
    pool = corpus_pool(args.workdir, args.document_chars)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    suffix = "" if args.document_chars == DOCUMENT_CHARS else f"-{args.document_chars}"
    counts_path = args.workdir / f"pool{suffix}-tokens.json"
    if counts_path.is_file():
        token_counts = json.loads(counts_path.read_text())
    else:
        token_counts = [len(ids) for ids in tokenizer(pool, add_special_tokens=False)["input_ids"]]
        counts_path.write_text(json.dumps(token_counts))
    print(
        f"pool: {len(pool)} documents, {sum(token_counts)} tokens ({sum(token_counts) / len(pool):.0f} a document), "
        f"{sum(map(len, pool)) / 2**20:.1f} MiB; "
        f"{sum(c > CONTEXT for c in token_counts)} longer than {CONTEXT} tokens",
        flush=True,
    )
    corpora = {}
    for tokens in sizes:
        path = args.workdir / f"corpus{suffix}-{label_of(tokens)}.jsonl"
        held = write_corpus(path, pool, token_counts, tokens)
        corpora[tokens] = path
        print(f"corpus {label_of(tokens)}: {held['documents']} documents, {held['tokens']} tokens, "
              f"{held['bytes'] / 2**20:.0f} MiB ({path})", flush=True)  # fmt: skip

    runs: list[Run] = []
    for tokens in sizes:
        for mode in modes:
            for processes in counts:
                out = args.workdir / "out.zarr"
                command = command_for(args, model, corpora[tokens], out, mode, processes)
                run = Run(tokens, mode, processes, command)
                stop = tokens > full_up_to
                print(f"{label_of(tokens)} {mode} {processes} proc{'' if stop is False else ' (stopped at the first forward)'}: ",
                      end="", flush=True)  # fmt: skip
                run_job(args, command, run, out, stop)
                runs.append(run)
                print(
                    f"stored {run.stored}, peak RSS MiB {[mib(run.peak_kib[k]) for k in sorted(run.peak_kib)]} "
                    f"(at exit {[mib(run.exit_kib[k]) for k in sorted(run.exit_kib)]}) "
                    f"(wait4 max {mib(run.maxrss_kib)}), plan at {fmt(run.plan.wall if run.plan else None)} s, "
                    f"first forward at {fmt(run.first_forward.wall if run.first_forward else None)} s, "
                    f"wall {fmt(run.wall)}, exit {run.code}",
                    flush=True,
                )
                if run.code != 0 and not run.stopped:
                    print("\n".join(line for _, line in run.lines[-20:]), file=sys.stderr)

    shown_argv = argv if argv is not None else sys.argv[1:]
    if args.json:
        record = {"machine": this_machine, "argv": shown_argv, "date": time.strftime("%Y-%m-%d"),
                  "full_up_to": args.full_up_to, "runs": [dump_run(r) for r in runs]}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1))
    return report(args, runs, this_machine, shown_argv, time.strftime("%Y-%m-%d"), full_up_to)


def dump_run(run: Run) -> dict[str, Any]:
    return {
        **run.__dict__,
        "plan": run.plan and run.plan.__dict__,
        "first_forward": run.first_forward and run.first_forward.__dict__,
    }


def load_run(record: dict[str, Any]) -> Run:
    """A run as ``dump_run`` wrote it (JSON made the ranks strings)."""

    def moment(m: dict[str, Any] | None) -> Moment | None:
        if m is None:
            return None
        return Moment(m["wall"], m["line"], {int(k): v for k, v in m["cpu"].items()},
                      {int(k): v for k, v in m["hwm_kib"].items()})  # fmt: skip

    run = Run(**{k: v for k, v in record.items() if k not in ("plan", "first_forward")})
    run.plan, run.first_forward = moment(record["plan"]), moment(record["first_forward"])
    run.peak_kib = {int(k): v for k, v in run.peak_kib.items()}
    run.exit_kib = {int(k): v for k, v in run.exit_kib.items()}
    return run


def report(args: argparse.Namespace, runs: list[Run], where: str, argv: list[str], date: str, full_up_to: int) -> int:
    """Print the tables; append them to RESULTS.md under ``--results``."""
    report_table = table(runs)
    slope_table, fits = slopes(runs)
    extra = extrapolation(runs, fits)
    print("\n" + report_table + "\n" + slope_table + "\n" + extra + "\n" + EXPLAIN.format(interval=args.interval))
    if args.results:
        example = runs[-1].command if runs else []
        shown = " ".join(str(a).replace(str(args.workdir), "$WORK") for a in example)
        stopped = ", ".join(f"{label_of(r.tokens)} {r.mode} {r.processes}p" for r in runs if r.stopped) or "none"
        section = (
            f"\n## {args.results}\n\n"
            f"`python benchmarks/text_scale.py {' '.join(argv)}` ({where}; {date}; under `nice -n 10`, "
            f"`OMP_NUM_THREADS=1`). Stopped at the first forward (corpora over {label_of(full_up_to)} tokens): "
            f"{stopped}. The last job's command (WORK = `{args.workdir}`):\n\n    {shown}\n\n"
            f"{report_table}\n{slope_table}\n{extra}\n{EXPLAIN.format(interval=args.interval)}"
        )
        with (ROOT / "benchmarks" / "RESULTS.md").open("a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
