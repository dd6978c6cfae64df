"""Text sources (``text:GLOB`` over jsonl, jsonl.gz, txt and Parquet; ``hf:`` datasets with a text
column), built from real text (the standard library's docstrings) and compared with an independent
read of the same files (json, gzip, pyarrow, datasets)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.text_models import real_documents, write_jsonl

from extract.data import DataOptions, Document, TextSource, build_dataset
from extract.data import text as text_module
from extract.errors import ExtractError

DOCS = real_documents(40)


def _source(spec: str, **options) -> TextSource:
    source = build_dataset(spec, None, 0, DataOptions(**options))
    assert isinstance(source, TextSource)
    return source


def _texts(documents) -> list:
    return [d.text if d.text is not None else d.input_ids for d in documents]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Every kind of file, with a label field or column ``y`` where files have fields:
    a.jsonl (10 lines), b.jsonl.gz (8), c.parquet (12 rows in row groups of 5), sub/d.txt, sub/e.txt."""
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(root / "a.jsonl", DOCS[:10], y=list(range(10)), id=[f"a{i}" for i in range(10)])
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d, "y": 100 + i}) + "\n" for i, d in enumerate(DOCS[10:18]))
    table = pa.table({"text": list(DOCS[18:30]), "y": pa.array(range(200, 212), pa.int64())})
    pq.write_table(table, root / "c.parquet", row_group_size=5)
    (root / "sub").mkdir()
    (root / "sub" / "d.txt").write_text(DOCS[30], encoding="utf-8")
    (root / "sub" / "e.txt").write_text(DOCS[31], encoding="utf-8")
    return root


def independent_read(files: list[Path], root: Path, label: str | None = None) -> list[tuple[str, object, int]]:
    """(key, text or ids, label) of every document, read with json, gzip and pyarrow alone."""
    rows = []
    for path in sorted(files, key=str):
        name = path.relative_to(root).as_posix()
        if path.suffix == ".txt":
            rows.append((name, path.read_text(encoding="utf-8"), -1))
        elif path.suffix == ".parquet":
            table = pq.read_table(path).to_pylist()
            rows += [(f"{name}/{i}", r.get("text", r.get("input_ids")), r[label] if label else -1)
                     for i, r in enumerate(table)]  # fmt: skip
        else:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as f:
                records = [json.loads(line) for line in f]
            rows += [(f"{name}/{i}", r.get("text", r.get("input_ids")), r[label] if label else -1)
                     for i, r in enumerate(records)]  # fmt: skip
    return rows


def test_every_kind_of_file_equals_an_independent_read(corpus):
    source = _source(f"text:{corpus}/**/*")
    expected = independent_read([p for p in corpus.rglob("*") if p.is_file()], corpus)
    assert len(expected) == 32 and len(source) == 32
    assert source.keys() == [k for k, _, _ in expected]
    assert [source.key(i) for i in range(len(source))] == source.keys()
    documents = list(source.documents(0, len(source)))
    assert _texts(documents) == [t for _, t, _ in expected] and set(DOCS[:32]) == set(_texts(documents))
    assert all(d.label == -1 and d.error == "" and d.input_ids is None for d in documents)
    assert source.classes is None and source.notice is None and source.image_root is None
    assert source.spec == f"text:{corpus}/**/*"
    assert source.describe(10) == f"{corpus}/b.jsonl.gz line 1" and source.describe(19) == f"{corpus}/c.parquet row 1"
    assert source.describe(30) == f"{corpus}/sub/d.txt"


def test_labels_and_keys_relative_to_the_literal_folder(corpus):
    source = _source(f"text:{corpus}/*.*", label_key="y")  # the txt files, which have no fields, are not matched
    files = [corpus / "a.jsonl", corpus / "b.jsonl.gz", corpus / "c.parquet"]
    expected = independent_read(files, corpus, label="y")
    documents = list(source.documents(0, len(source)))
    labels = [*range(10), *range(100, 108), *range(200, 212)]
    assert [d.label for d in documents] == [y for _, _, y in expected] == labels
    assert source.keys() == [k for k, _, _ in expected]
    one = _source(f"text:{corpus}/sub/d.txt")
    assert one.keys() == ["d.txt"] and _texts(one.documents(0, 1)) == [DOCS[30]]


def test_ranges_cross_files_and_row_groups(corpus):
    source = _source(f"text:{corpus}/**/*")
    everything = list(source.documents(0, len(source)))
    # boundaries: files at 10, 18, 30, 31; row groups of c.parquet at 23, 28
    edges = [0, 1, 9, 10, 11, 17, 18, 19, 22, 23, 24, 27, 28, 29, 30, 31, 32]
    for start in edges:
        for stop in edges:
            if start <= stop:
                assert list(source.documents(start, stop)) == everything[start:stop], (start, stop)
    with pytest.raises(ValueError):
        list(source.documents(5, 33))


def test_a_plain_jsonl_seeks_to_its_marks(tmp_path, monkeypatch):
    """Every range of a file with CRLF line ends and no final newline, read from the byte offsets kept
    at listing (a mark every 3 lines here), equals json's read of the lines."""
    monkeypatch.setattr(text_module, "LINES_PER_MARK", 3)
    lines = [json.dumps({"text": d}) for d in DOCS[:11]]
    (tmp_path / "c.jsonl").write_bytes("\r\n".join(lines).encode())
    source = _source(f"text:{tmp_path}/c.jsonl")
    assert source.files[0].marks == [0, *(sum(len(line) + 2 for line in lines[:k]) for k in (3, 6, 9))]
    expected = [json.loads(line)["text"] for line in lines]
    for start in range(12):
        for stop in range(start, 12):
            assert _texts(source.documents(start, stop)) == expected[start:stop]


def test_pre_tokenized_input_ids_in_jsonl_and_parquet(tmp_path):
    from helpers.text_models import gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    ids = [tokenizer(d)["input_ids"] for d in DOCS[:9]]
    with (tmp_path / "a.jsonl").open("w") as f:
        f.writelines(json.dumps({"input_ids": i, "label": n}) + "\n" for n, i in enumerate(ids[:4]))
    pq.write_table(pa.table({"input_ids": pa.array(ids[4:], pa.list_(pa.int32()))}), tmp_path / "b.parquet",
                   row_group_size=2)  # fmt: skip
    source = _source(f"text:{tmp_path}/*")
    expected = independent_read([tmp_path / "a.jsonl", tmp_path / "b.parquet"], tmp_path)
    documents = list(source.documents(0, len(source)))
    assert [d.input_ids for d in documents] == [t for _, t, _ in expected] == ids
    assert all(d.text is None for d in documents)
    # --text-key input_ids asks for them even beside a text field
    write_jsonl(tmp_path / "both.jsonl", DOCS[:2], input_ids=ids[:2])
    asked = _source(f"text:{tmp_path}/both.jsonl", text_key="input_ids")
    assert [d.input_ids for d in asked.documents(0, 2)] == ids[:2]
    assert _texts(_source(f"text:{tmp_path}/both.jsonl").documents(0, 2)) == list(DOCS[:2])


def test_parquet_class_names_from_a_dictionary_column_or_hugging_face_metadata(tmp_path):
    import datasets

    names = pa.array(["neg", "pos", "pos", "neg", "pos"]).dictionary_encode()
    pq.write_table(pa.table({"body": list(DOCS[:5]), "sentiment": names}), tmp_path / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"body": list(DOCS[5:7]), "sentiment": pa.array(["pos", "mixed"]).dictionary_encode()}),
                   tmp_path / "b.parquet")  # fmt: skip
    source = _source(f"text:{tmp_path}/*.parquet", text_key="body", label_key="sentiment")
    assert source.classes == ["neg", "pos", "mixed"]
    read = pq.read_table(tmp_path / "a.parquet").column("sentiment").to_pylist() + ["pos", "mixed"]
    assert [source.classes[d.label] for d in source.documents(0, 7)] == read
    assert _texts(source.documents(0, 7)) == list(DOCS[:7])

    features = datasets.Features({"text": datasets.Value("string"), "y": datasets.ClassLabel(names=["a", "b", "c"])})
    (tmp_path / "hf").mkdir()
    datasets.Dataset.from_dict({"text": list(DOCS[:6]), "y": [2, 0, 1, 1, 0, 2]}, features=features).to_parquet(
        tmp_path / "hf" / "train.parquet"
    )
    source = _source(f"text:{tmp_path}/hf/*.parquet", label_key="y")
    assert source.classes == ["a", "b", "c"] and [d.label for d in source.documents(0, 6)] == [2, 0, 1, 1, 0, 2]


def test_hf_datasets_with_a_text_column(tmp_path):
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["x", "y"]),
                                  "n": datasets.Value("int32")})  # fmt: skip
    rows = {"text": list(DOCS[:7]), "label": [1, 0, 1, 1, 0, 0, 1], "n": list(range(7))}
    split = {"train": datasets.Dataset.from_dict(rows, features=features),
             "test": datasets.Dataset.from_dict({k: v[:3] for k, v in rows.items()}, features=features)}  # fmt: skip
    datasets.DatasetDict(split).save_to_disk(tmp_path / "dd")
    reference = datasets.load_from_disk(str(tmp_path / "dd"))["train"]
    source = _source(f"hf:{tmp_path / 'dd'}:train")
    assert len(source) == len(reference) == 7 and source.keys() == [f"train/{i}" for i in range(7)]
    assert _texts(source.documents(0, 7)) == reference["text"]
    assert [d.label for d in source.documents(0, 7)] == reference["label"] and source.classes == ["x", "y"]
    assert list(source.documents(2, 5)) == list(source.documents(0, 7))[2:5]
    assert [d.label for d in _source(f"hf:{tmp_path / 'dd'}:test", label_key="n").documents(0, 3)] == [0, 1, 2]

    # token ids, and the only string column of a dataset without one named text
    ids = [[5, 6, 7], [], [8]]
    datasets.Dataset.from_dict({"input_ids": ids, "label": [3, 4, 5]}).save_to_disk(tmp_path / "ids")
    tokenized = _source(f"hf:{tmp_path / 'ids'}")
    assert [d.input_ids for d in tokenized.documents(0, 3)] == ids
    assert [d.label for d in tokenized.documents(0, 3)] == [3, 4, 5]
    assert tokenized.keys() == ["data/0", "data/1", "data/2"] and tokenized.classes is None
    datasets.Dataset.from_dict({"body": list(DOCS[:2]), "id": [1, 2]}).save_to_disk(tmp_path / "body")
    assert _texts(_source(f"hf:{tmp_path / 'body'}").documents(0, 2)) == list(DOCS[:2])


def test_an_hf_image_dataset_stays_an_image_source(tmp_path):
    import datasets

    from extract.data import Source

    features = datasets.Features({"img": datasets.Image(), "text": datasets.Value("string")})
    png = Path(__file__).with_name("conftest.py")  # any bytes: the listing is tested, not the decoding
    rows = {"img": [{"bytes": png.read_bytes(), "path": None}], "text": ["a caption"]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(tmp_path / "ds")
    assert isinstance(build_dataset(f"hf:{tmp_path / 'ds'}", lambda image: image, 32), Source)
    assert _texts(_source(f"hf:{tmp_path / 'ds'}", text_key="text").documents(0, 1)) == ["a caption"]


def test_the_listing_hash_changes_with_the_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:3])
    (tmp_path / "b.txt").write_text(DOCS[3])
    pq.write_table(pa.table({"text": list(DOCS[4:6])}), tmp_path / "c.parquet")
    spec = f"text:{tmp_path}/*"
    before = _source(spec).listing_sha256()
    assert _source(spec).listing_sha256() == before
    hashes = {before}
    edits = [
        lambda: (tmp_path / "a.jsonl").write_text((tmp_path / "a.jsonl").read_text().replace("a", "b", 1)),
        lambda: (tmp_path / "b.txt").write_text(DOCS[3] + "."),
        lambda: pq.write_table(pa.table({"text": [DOCS[4], DOCS[6]]}), tmp_path / "c.parquet"),
        lambda: (tmp_path / "b.txt").rename(tmp_path / "b2.txt"),
    ]
    for edit in edits:
        edit()
        hashes.add(_source(spec).listing_sha256())
    assert len(hashes) == len(edits) + 1


def _error(call) -> str:
    with pytest.raises(ExtractError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def _read_all(spec: str, **options) -> list[Document]:
    source = _source(spec, **options)
    return list(source.documents(0, len(source)))


def test_a_missing_text_field_names_the_file_line_and_fields(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "x"}\n{"text": "y"}\n{"body": "z", "id": 3}\n')
    message = _error(lambda: _read_all(f"text:{path}"))
    assert message.startswith(f"{path} line 3 has no field 'text' (it has: body, id); use --text-key body")
    message = _error(lambda: _read_all(f"text:{path}", text_key="body"))
    assert f"{path} line 1 has no field 'body' (it has: text)" in message
    message = _error(lambda: _read_all(f"text:{path}", label_key="y"))
    assert f"{path} line 1 has no field 'y' (--label-key)" in message


@pytest.mark.parametrize(
    ("line", "words"),
    [(b"{not json}", "is not JSON"), (b"", "is blank, not JSON"), (b'{"text": "caf\xe9"}', "is not UTF-8"),
     (b'["text"]', "is a list, not a JSON object")],
)  # fmt: skip
def test_a_bad_jsonl_line_names_file_and_line_or_is_skipped(tmp_path, line, words):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "one"}\n' + line + b'\n{"text": "three"}\n')
    message = _error(lambda: _read_all(f"text:{path}"))
    assert message.startswith(f"{path} line 2 {words}") and "--skip-bad-images" in message
    documents = _read_all(f"text:{path}", skip_bad=True)
    assert [d.text for d in documents] == ["one", "", "three"]
    assert documents[1].error.startswith(f"{path} line 2 {words}") and documents[0].error == documents[2].error == ""


def test_a_gzip_line_and_a_txt_file_that_are_not_utf8(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wb") as f:
        f.write(b'{"text": "ok"}\n{"text": "\xff"}\n')
    assert "a.jsonl.gz line 2 is not UTF-8" in _error(lambda: _read_all(f"text:{tmp_path}/a.jsonl.gz"))
    (tmp_path / "b.txt").write_bytes(b"first line\nsecond \xc3\x28 line\n")
    assert _error(lambda: _read_all(f"text:{tmp_path}/b.txt")).startswith(f"{tmp_path}/b.txt line 2 is not UTF-8")
    (document,) = _read_all(f"text:{tmp_path}/b.txt", skip_bad=True)
    assert document.text == "" and "b.txt line 2 is not UTF-8" in document.error
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n')[:-6])  # truncated
    assert "c.jsonl.gz is not a readable gzip file" in _error(lambda: _source(f"text:{tmp_path}/c.jsonl.gz"))


@pytest.mark.parametrize(
    ("record", "options", "words"),
    [({"text": 42}, {}, "'text' is a number (42), not text"),
     ({"text": ["a"]}, {}, "'text' is a list, not text"),
     ({"text": None}, {}, "'text' is null"),
     ({"input_ids": [1, "2"]}, {}, "'input_ids' is a list holding a string, not a list of integer token ids"),
     ({"input_ids": [1, True]}, {}, "'input_ids' is a list holding a boolean"),
     ({"text": "x", "y": "cat"}, {"label_key": "y"}, "label 'y' (--label-key) is a string (\"cat\"), but"),
     ({"text": "x", "y": 2**63}, {"label_key": "y"}, "does not fit in int64"),
     ({"text": "x", "y": 1.0}, {"label_key": "y"}, "label 'y' (--label-key) is a number (1.0), not an integer")],
)  # fmt: skip
def test_a_field_of_the_wrong_type_is_named(tmp_path, record, options, words):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "fine", "y": 0}) + "\n" + json.dumps(record) + "\n")
    message = _error(lambda: _read_all(f"text:{path}", **options))
    assert message.startswith(f"{path} line 2: ") and words in message


def test_bad_listings_are_refused_naming_the_culprit(tmp_path):
    assert "no file matches it" in _error(lambda: _source(f"text:{tmp_path}/*.jsonl"))
    assert "is a folder" in _error(lambda: _source(f"text:{tmp_path}"))
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "notes.csv").write_text("a,b\n")
    message = _error(lambda: _source(f"text:{tmp_path}/*"))
    assert f"{tmp_path}/notes.csv has '.csv'" in message and all(e in message for e in (".jsonl", ".txt", ".parquet"))
    assert "is empty" in _error(lambda: _source(f"text:{tmp_path}/*.jsonl"))
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), tmp_path / "b.parquet")
    message = _error(lambda: _source(f"text:{tmp_path}/b.parquet"))
    assert message.endswith("b.parquet has no column 'text' (nor 'input_ids'); it has body, n; use --text-key body")
    message = _error(lambda: _source(f"text:{tmp_path}/b.parquet", text_key="n"))
    assert "column 'n' holds int64, not text" in message and "body (--text-key)" in message
    assert "no column 'y' (--label-key)" in _error(
        lambda: _source(f"text:{tmp_path}/b.parquet", text_key="body", label_key="y")
    )
    (tmp_path / "c.txt").write_text("x")
    assert ".txt file, which has no fields" in _error(lambda: _source(f"text:{tmp_path}/c.txt", label_key="y"))
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "d.parquet")
    assert f"{tmp_path}/d.parquet row 1: 'text' is null" in _error(lambda: _read_all(f"text:{tmp_path}/d.parquet"))
    pq.write_table(pa.table({"text": ["x"], "y": pa.array([2**63], pa.uint64())}), tmp_path / "e.parquet")
    assert "e.parquet row 0: label 'y' (--label-key) is 9223372036854775808, which does not fit in int64" in _error(
        lambda: _read_all(f"text:{tmp_path}/e.parquet", label_key="y")
    )


def test_bad_hf_text_datasets_are_refused(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["x", "y"], "label": ["cat", "dog"], "input_ids": ["1", "2"]}).save_to_disk(
        tmp_path / "named"
    )
    named = _source(f"hf:{tmp_path / 'named'}")
    assert [d.label for d in named.documents(0, 2)] == [-1, -1] and named.classes is None
    assert (
        named.notice
        == "column 'label' holds Value('string'), not class ids: no labels are stored (--label-key names another)"
    )
    assert "column 'input_ids' (--text-key) holds Value('string'), not a list of integer token ids" in _error(
        lambda: _source(f"hf:{tmp_path / 'named'}", text_key="input_ids")
    )

    datasets.Dataset.from_dict({"a": list(DOCS[:2]), "b": list(DOCS[2:4]), "n": [1, 2]}).save_to_disk(tmp_path / "ds")
    assert "several text columns (a, b); choose one with --text-key" in _error(lambda: _source(f"hf:{tmp_path / 'ds'}"))
    assert "no column 'text' (--text-key); it has a, b, n" in _error(
        lambda: _source(f"hf:{tmp_path / 'ds'}", text_key="text")
    )
    assert "column 'n' (--text-key) holds Value('int64'), not text" in _error(
        lambda: _source(f"hf:{tmp_path / 'ds'}", text_key="n")
    )
    assert "column 'b' (--label-key) holds Value('string')" in _error(
        lambda: _source(f"hf:{tmp_path / 'ds'}", text_key="a", label_key="b")
    )
    datasets.Dataset.from_dict({"text": ["x", None]}).save_to_disk(tmp_path / "null")
    assert f"{tmp_path / 'null'} split data row 1: 'text' is null" in _error(
        lambda: _read_all(f"hf:{tmp_path / 'null'}")
    )


def test_a_call_opens_each_file_it_reads_once(corpus, monkeypatch):
    opened: list[str] = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real_open(path, *args, **kwargs)

    source = _source(f"text:{corpus}/*.jsonl")
    monkeypatch.setattr("builtins.open", counting_open)
    assert len(list(source.documents(0, 10))) == 10
    assert opened == [f"{corpus}/a.jsonl"]


def test_a_file_that_changed_since_the_listing_is_named(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:4])
    pq.write_table(pa.table({"text": list(DOCS[:6])}), tmp_path / "b.parquet", row_group_size=3)
    source = _source(f"text:{tmp_path}/*")
    write_jsonl(tmp_path / "a.jsonl", DOCS[:2])
    assert _error(lambda: list(source.documents(0, 4))) == (
        f"{tmp_path}/a.jsonl has 2 lines, 4 when it was listed; it changed"
    )
    pq.write_table(pa.table({"text": list(DOCS[:2])}), tmp_path / "b.parquet")
    message = _error(lambda: list(source.documents(4, 10)))
    assert message.startswith(f"cannot read {tmp_path}/b.parquet (") and message.endswith(
        "it changed since it was listed"
    )


def _listed_by_rank(rank: int, spec: str, init: str, out: Path) -> None:
    """In a forked child: join a 2-rank gloo group, list ``spec`` split across the ranks and write what it got."""
    import torch.distributed as dist

    from extract.data.registry import open_source
    from extract.data.source import DataRequest

    scanned = []
    real_scan = text_module._scan
    text_module._scan = lambda file, *a: scanned.append(file.name) or real_scan(file, *a)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ranks = type("Ranks", (), {"process_index": rank, "num_processes": 2})()
    try:
        source = open_source(DataRequest(spec, DataOptions(), ranks))
        result = {"keys": source.keys(), "hash": source.listing_sha256(), "scanned": scanned}
    except ExtractError as e:
        result = {"error": str(e)}
    out.write_text(json.dumps(result))
    dist.destroy_process_group()


def _two_ranks(tmp_path: Path, spec: str, name: str) -> list[dict]:
    children = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _listed_by_rank(rank, spec, f"file://{tmp_path / name}.init", tmp_path / f"{name}{rank}.json")
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    assert all(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 for pid in children)
    return [json.loads((tmp_path / f"{name}{rank}.json").read_text()) for rank in range(2)]


def test_two_ranks_split_the_listing_and_get_the_same_source(corpus, tmp_path):
    spec = f"text:{corpus}/**/*"
    alone = _source(spec)
    ranks = _two_ranks(tmp_path, spec, "good")
    assert [r["keys"] for r in ranks] == [alone.keys()] * 2
    assert [r["hash"] for r in ranks] == [alone.listing_sha256()] * 2
    names = [f.name for f in alone.files]
    assert [r["scanned"] for r in ranks] == [names[0::2], names[1::2]]
    # a bad file scanned by rank 1 stops both ranks with the same line
    (tmp_path / "bad").mkdir()
    write_jsonl(tmp_path / "bad" / "a.jsonl", DOCS[:2])
    (tmp_path / "bad" / "b.jsonl.gz").write_bytes(b"not gzip")
    errors = [r["error"] for r in _two_ranks(tmp_path, f"text:{tmp_path}/bad/*", "bad")]
    assert errors[0] == errors[1] and "b.jsonl.gz is not a readable gzip file" in errors[0]


def test_string_labels_become_classes_in_sorted_order(tmp_path):
    """A string label field is a class name: the corpus's distinct names, sorted, are its classes (as a
    ClassLabel's names are), and each document's label is its name's index; null is no label."""
    write_jsonl(tmp_path / "a.jsonl", DOCS[:6], topic=["sports", "arts", None, "science", "arts", "sports"])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        topics = ["zoology", "arts", "é"]
        f.writelines(json.dumps({"text": d, "topic": t}) + "\n" for d, t in zip(DOCS[6:9], topics, strict=True))
    source = _source(f"text:{tmp_path}/*", label_key="topic")
    assert source.classes == ["arts", "science", "sports", "zoology", "é"]
    documents = list(source.documents(0, len(source)))
    assert [d.label for d in documents] == [2, 0, -1, 1, 0, 2, 3, 0, 4]
    assert [source.classes[d.label] for d in documents if d.label >= 0] == [
        "sports", "arts", "science", "arts", "sports", "zoology", "arts", "é",
    ]  # fmt: skip
    before = source.listing_sha256()
    write_jsonl(tmp_path / "a.jsonl", DOCS[:6], topic=["sport", "arts", None, "science", "arts", "sports"])
    assert _source(f"text:{tmp_path}/*", label_key="topic").listing_sha256() != before


def test_labels_of_two_kinds_are_refused_when_listed_naming_the_first_of_the_other(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS[:3], y=[None, 1, "cat"])
    message = _error(lambda: _source(f"text:{tmp_path}/a.jsonl", label_key="y"))  # listed, not read
    assert message == (
        f"{tmp_path}/a.jsonl line 3: label 'y' (--label-key) is a string (\"cat\"), but {tmp_path}/a.jsonl line 2 "
        "holds an integer (1); labels are all class ids or all class names: make them one kind"
    )
    write_jsonl(tmp_path / "a.jsonl", DOCS[:2], y=[0, 1])
    write_jsonl(tmp_path / "b.jsonl", DOCS[2:5], y=[None, "cat", "dog"])
    message = _error(lambda: _source(f"text:{tmp_path}/*.jsonl", label_key="y"))
    assert message.startswith(f"{tmp_path}/b.jsonl line 2: labels 'y' (--label-key) are class names (strings), ")
    assert f"but {tmp_path}/a.jsonl line 1 holds class ids (integers)" in message and "\n" not in message
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x", "y": 0}) + "\n" + json.dumps({"text": "z", "y": 2.5}))
    message = _error(lambda: _source(f"text:{tmp_path}/b.jsonl", label_key="y"))
    assert message.startswith(f"{tmp_path}/b.jsonl line 2: label 'y' (--label-key) is a number (2.5), not an integer")


def test_a_line_that_is_not_json_is_left_to_the_reading_when_labels_are_listed(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = json.dumps({"text": "x", "y": "b"}) + "\n{oops\n" + json.dumps({"text": "z", "y": "a"}) + "\n"
    path.write_text("\ufeff" + lines, encoding="utf-8")  # a BOM too: line 1 is read as the reading reads it
    documents = _read_all(f"text:{path}", label_key="y", skip_bad=True)
    assert [d.label for d in documents] == [1, -1, 0] and "line 2 is not JSON" in documents[1].error
