"""timm, Hugging Face, OpenCLIP and factory models: the stored features equal each library's own
preprocessing + forward on real photographs; layer aliases, layouts and per-layer pooling; offline
errors. Everything is built offline with random or self-made weights."""

import logging
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import ROOT, TINY, patience
from helpers.cli import run_cli
from helpers.launches import Sequence
from PIL import Image

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")
open_clip = pytest.importorskip("open_clip")
skimage_data = pytest.importorskip("skimage.data")

OFFLINE = {"HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="session")
def photos(tmp_path_factory) -> tuple[Path, list[Path]]:
    """Real photographs (scikit-image ships them) as JPEGs in ImageFolder layout."""
    root = tmp_path_factory.mktemp("photos")
    files = []
    for folder, names in {"animals": ["chelsea", "astronaut"], "things": ["coffee", "rocket"]}.items():
        (root / folder).mkdir()
        for name in names:
            path = root / folder / f"{name}.jpg"
            Image.fromarray(getattr(skimage_data, name)()).convert("RGB").save(path, quality=90)
            files.append(path)
    return root, sorted(files)  # ImageFolder's order


def stored(out: Path, layer: str) -> np.ndarray:
    return zarr.open_group(out, mode="r")[f"features/{layer}"][:]


def hooked(model: torch.nn.Module, call: Callable[[], object], layers: dict[str, Callable]) -> dict[str, np.ndarray]:
    """Outputs of ``layers`` (module name -> reduction of its output) in one forward, by plain hooks."""
    outputs = {}
    modules = dict(model.named_modules())
    handles = [
        modules[name].register_forward_hook(lambda m, i, o, name=name, fn=fn: outputs.__setitem__(name, fn(o)))
        for name, fn in layers.items()
    ]
    with torch.no_grad():
        call()
    for handle in handles:
        handle.remove()
    return {name: value.float().numpy() for name, value in outputs.items()}


def close(a: np.ndarray, b: np.ndarray, tolerance: float = 1e-4) -> bool:
    return a.shape == b.shape and np.abs(a - b).max() <= tolerance * max(1.0, np.abs(b).max())


def run_ok(cli, *args) -> str:
    code, _, err = cli(*args, "--dtype", "float32", "--num-workers", "0", "--batch-size", "3")
    assert code == 0, err
    return err


# --- timm ------------------------------------------------------------------------------------


def timm_reference(
    name: str, files: list[Path], layers: dict[str, Callable], img_size: int, fixed_size: bool = False
) -> dict[str, np.ndarray]:
    """timm's own pipeline; a model with a fixed input size (ViT) is built for ``img_size``."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **({"img_size": img_size} if fixed_size else {})).eval()
    config = timm.data.resolve_model_data_config(model, args={"img_size": img_size})
    transform = timm.data.create_transform(**config)
    pixels = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
    return hooked(model, lambda: model(pixels), layers)


def test_timm_cnn_and_vit_equal_timms_own_pipeline(cli, photos, tmp_path):
    root, files = photos
    out = tmp_path / "resnet.zarr"
    run_ok(cli, "--model", "timm:resnet18", "--weights", "none", "--layers", "layer3", "layer4", "--pool", "layer4=avg",
           "--data", f"imagefolder:{root}", "--out", out, "--image-size", "48")  # fmt: skip
    expected = timm_reference(
        "resnet18", files, {"layer3": lambda o: o, "layer4": lambda o: o.mean((2, 3))}, img_size=48
    )
    assert close(stored(out, "layer3"), expected["layer3"]) and close(stored(out, "layer4"), expected["layer4"])
    attrs = zarr.open_group(out, mode="r").attrs.asdict()
    assert attrs["source"] == "timm" and attrs["pools"] == {"layer3": "none", "layer4": "avg"}
    # timm's resnet18.a1_in1k config: bicubic, crop_pct 0.95 (torchvision's preset: bilinear, 0.875)
    assert attrs["preprocessing"]["interpolation"] == "bicubic" and attrs["preprocessing"]["crop"] == [48, 48]
    assert attrs["preprocessing"]["resize"] == 50  # floor(48 / 0.95)
    assert "timm" in attrs["versions"]

    out = tmp_path / "vit.zarr"
    run_ok(cli, "--model", "timm:vit_tiny_patch16_224", "--weights", "none", "--layers", "blocks.*", "norm",
           "--pool", "cls", "norm=mean", "--data", f"imagefolder:{root}", "--out", out, "--image-size", "32")  # fmt: skip
    blocks = {f"blocks.{i}": (lambda o: o[:, 0]) for i in range(12)}
    expected = timm_reference("vit_tiny_patch16_224", files, {**blocks, "norm": lambda o: o.mean(1)}, 32, True)
    for name, values in expected.items():
        assert close(stored(out, name), values), name
    recorded = zarr.open_group(out, mode="r").attrs["preprocessing"]
    assert recorded["mean"] == [0.5, 0.5, 0.5] and recorded["std"] == [0.5, 0.5, 0.5]
    assert recorded["interpolation"] == "bicubic"


def test_timm_convnext_channels_last_inner_layers_pool_over_height_and_width(cli, photos, tmp_path):
    root, files = photos
    out = tmp_path / "convnext.zarr"
    inner = "stages.1.blocks.0.mlp"  # (B, H, W, C) inside the block
    whole = "stages.0.blocks.0.mlp"
    run_ok(cli, "--model", "timm:convnext_tiny", "--weights", "none", "--layers", inner, "stages.1.blocks.0.norm",
           "stages.1", whole, "--pool", "avg", "stages.1.blocks.0.norm=max", f"{whole}=none",
           "--data", f"imagefolder:{root}", "--out", out, "--image-size", "32")  # fmt: skip
    expected = timm_reference(
        "convnext_tiny",
        files,
        {
            inner: lambda o: o.mean((1, 2)),
            "stages.1.blocks.0.norm": lambda o: o.amax((1, 2)),
            "stages.1": lambda o: o.mean((2, 3)),
        },  # fmt: skip
        img_size=32,
    )
    for name, values in expected.items():
        assert values.shape == (4, 192), name  # channels, not one of the spatial axes
        assert close(stored(out, name), values), name
    attrs = zarr.open_group(out, mode="r").attrs.asdict()
    assert attrs["preprocessing"]["interpolation"] == "bicubic" and attrs["layouts"][whole] == "NHWC"
    kept = zarr.open_group(out, mode="r")[f"features/{whole}"]
    assert kept.shape == (4, 8, 8, 96)
    assert kept.metadata.dimension_names == ("sample", f"{whole}.height", f"{whole}.width", f"{whole}.channel")
    from extract import open_features

    pooled = open_features(out).load(whole, pool="avg")  # the reader pools the axes the store names
    assert close(pooled, kept[:].mean(axis=(1, 2)))
    code, listing, err = cli(
        "--model", "timm:convnext_tiny", "--weights", "none", "--list-layers", "--image-size", "32"
    )
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in listing.splitlines()}
    assert (
        rows[inner][-1] == "NHWC" and rows["stages.1"][-1] == "NCHW" and rows["stages.1.blocks.0.conv_dw"][-1] == "NCHW"
    )


def test_timm_checkpoint_loads_without_download(cli, photos, tmp_path):
    root, files = photos
    torch.manual_seed(5)
    trained = timm.create_model("resnet18", pretrained=False).eval()
    checkpoint = tmp_path / "resnet18.pt"
    torch.save({"state_dict": trained.state_dict()}, checkpoint)
    out = tmp_path / "ckpt.zarr"
    run_ok(cli, "--model", "timm:resnet18", "--checkpoint", checkpoint, "--layers", "layer2", "--pool", "avg",
           "--data", f"imagefolder:{root}", "--out", out, "--image-size", "32")  # fmt: skip
    config = timm.data.resolve_model_data_config(trained, args={"img_size": 32})
    transform = timm.data.create_transform(**config)
    pixels = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
    expected = hooked(trained, lambda: trained(pixels), {"layer2": lambda o: o.mean((2, 3))})
    assert close(stored(out, "layer2"), expected["layer2"])
    assert zarr.open_group(out, mode="r").attrs["weights"] == f"checkpoint {checkpoint}"


# --- Hugging Face ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def dinov2_dir(tmp_path_factory) -> Path:
    """A small Dinov2 with an image processor unlike ImageNet's (shorter side 40, crop 32, odd mean/std)."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    folder = tmp_path_factory.mktemp("dinov2")
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    torch.manual_seed(3)
    Dinov2Model(config).save_pretrained(folder)
    processor = BitImageProcessor(
        size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, resample=3,
        image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.4],
    )  # fmt: skip
    processor.save_pretrained(folder)
    return folder


def hf_reference(folder: Path, files: list[Path], model: torch.nn.Module | None = None):
    from transformers import AutoImageProcessor, AutoModel

    processor = AutoImageProcessor.from_pretrained(folder)
    model = model or AutoModel.from_pretrained(folder).eval()
    pixels = processor(images=[Image.open(f).convert("RGB") for f in files], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states


def test_hf_hidden_states_and_modules_equal_transformers(cli, photos, dinov2_dir, tmp_path):
    root, files = photos
    out = tmp_path / "hf.zarr"
    run_ok(cli, "--model", f"hf:{dinov2_dir}", "--layers", "hidden_states.0", "hidden_states.-1", "encoder.layer.1",
           "--pool", "hidden_states.0=cls", "encoder.layer.1=mean", "--data", f"imagefolder:{root}",
           "--out", out)  # fmt: skip
    hidden = hf_reference(dinov2_dir, files)
    assert close(stored(out, "hidden_states.0"), hidden[0][:, 0].numpy())
    assert close(stored(out, "hidden_states.3"), hidden[-1].numpy())  # -1 of 4 hidden states
    assert close(stored(out, "encoder.layer.1"), hidden[2].mean(1).numpy())
    attrs = zarr.open_group(out, mode="r").attrs.asdict()
    assert attrs["layers"] == ["hidden_states.0", "encoder.layer.1", "hidden_states.3"]
    assert attrs["resolved_layers"] == {  # what each alias is in the model
        "hidden_states.0": "embeddings", "encoder.layer.1": "encoder.layer.1", "hidden_states.3": "encoder.layer.2"
    }  # fmt: skip
    recorded = attrs["preprocessing"]
    assert recorded["source"] == "hf" and recorded["mean"] == [0.5, 0.4, 0.3] and recorded["std"] == [0.2, 0.3, 0.4]
    assert recorded["resize"] == 40 and recorded["crop"] == [32, 32] and recorded["interpolation"] == "bicubic"


def test_hf_random_init_is_seeded_from_the_config(cli, photos, dinov2_dir, tmp_path):
    from transformers import AutoConfig, AutoModel

    root, files = photos
    out = tmp_path / "none.zarr"
    run_ok(cli, "--model", f"hf:{dinov2_dir}", "--weights", "none", "--seed", "7", "--layers", "hidden_states.2",
           "--data", f"imagefolder:{root}", "--out", out)  # fmt: skip
    torch.manual_seed(7)
    model = AutoModel.from_config(AutoConfig.from_pretrained(dinov2_dir)).eval()
    assert close(stored(out, "hidden_states.2"), hf_reference(dinov2_dir, files, model)[2].numpy())
    pretrained = hf_reference(dinov2_dir, files)[2].numpy()
    assert not close(stored(out, "hidden_states.2"), pretrained)


def test_hf_list_layers_shows_the_aliases(cli, dinov2_dir):
    code, out, err = cli("--model", f"hf:{dinov2_dir}", "--list-layers")
    assert code == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert rows["hidden_states.0"][1:3] == ["->", "embeddings"]
    assert rows["hidden_states.3"][1:] == ["->", "encoder.layer.2", "(B,", "17,", "32)", "NLC"]
    assert rows["encoder.layer.0"][-1] == "NLC"
    code, _, err = cli("--model", f"hf:{dinov2_dir}", "--layers", "hidden_states.-5", "--data", "synthetic:2")
    assert code == 2 and "only 4 hidden_states" in err


@pytest.mark.parametrize(
    ("removed", "message"),
    [
        ("preprocessor_config.json", "has no preprocessor_config.json, so the image processor cannot be loaded"),
        ("model.safetensors", "has no model.safetensors or model.safetensors.index.json or pytorch_model.bin"),
    ],
)
def test_hf_directory_missing_a_file_names_it_in_one_line(cli, dinov2_dir, tmp_path, removed, message):
    folder = tmp_path / "incomplete"
    folder.mkdir()
    for file in dinov2_dir.iterdir():
        if file.name != removed:
            (folder / file.name).write_bytes(file.read_bytes())
    code, _, err = cli("--model", f"hf:{folder}", "--layers", "hidden_states.1", "--data", "synthetic:2",
                       "--out", tmp_path / "o.zarr")  # fmt: skip
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "chunks" not in err
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize("name", ["./hf_vitt", "models/dinov2/small", "{file}"])
def test_hf_path_that_is_not_a_directory_says_so(cli, dinov2_dir, tmp_path, name):
    name = name.format(file=dinov2_dir / "config.json")
    code, _, err = cli("--model", f"hf:{name}", "--layers", "hidden_states.1", "--out", tmp_path / "o.zarr")
    assert code == 2 and f"{name} is not a directory" in err and "alphanumeric" not in err, err
    assert len(err.strip().splitlines()) == 1


# --- OpenCLIP --------------------------------------------------------------------------------


def test_open_clip_image_tower_equals_open_clips_pipeline(cli, photos, tmp_path):
    root, files = photos
    out = tmp_path / "clip.zarr"
    run_ok(cli, "--model", "open_clip:ViT-S-32", "--weights", "none", "--image-size", "64", "--layers",
           "transformer.resblocks.1", "ln_post", "--pool", "cls", "--data", f"imagefolder:{root}", "--out", out)  # fmt: skip
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms("ViT-S-32", pretrained=None, force_image_size=64)
    visual = model.visual.eval()
    pixels = torch.stack([preprocess(Image.open(f)) for f in files])
    cls = {"transformer.resblocks.1": lambda o: o[:, 0], "ln_post": lambda o: o[:, 0]}
    expected = hooked(visual, lambda: visual(pixels), cls)
    for name, values in expected.items():
        assert close(stored(out, name), values), name
    recorded = zarr.open_group(out, mode="r").attrs["preprocessing"]
    assert recorded["source"] == "open_clip" and recorded["mean"][0] == pytest.approx(0.48145466)


# --- factories -------------------------------------------------------------------------------


def test_factory_brings_its_own_preprocessing(cli, photos, tmp_path):
    from helpers.tiny_models import tiny_with_transform

    root, files = photos
    out = tmp_path / "own.zarr"
    run_ok(cli, "--model", f"{TINY}:tiny_with_transform", "--layers", "conv", "--pool", "avg",
           "--data", f"imagefolder:{root}", "--out", out)  # fmt: skip
    model, transform = tiny_with_transform()
    pixels = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
    expected = hooked(model.eval(), lambda: model(pixels), {"conv": lambda o: o.mean((2, 3))})
    assert close(stored(out, "conv"), expected["conv"])
    assert zarr.open_group(out, mode="r").attrs["preprocessing"]["mean"] == [0.5, 0.5, 0.5]


def test_channels_last_map_of_unknown_layout_is_refused_then_pooled_as_told(cli, photos, tmp_path):
    root, files = photos
    base = ("--model", f"{TINY}:fixed_size_nhwc", "--layers", "mix", "--data", f"imagefolder:{root}")
    code, _, err = cli(*base, "--pool", "avg", "--out", tmp_path / "refused.zarr")
    assert code == 2 and "--layout mix=NHWC" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "refused.zarr").exists()
    out = tmp_path / "told.zarr"
    run_ok(cli, *base, "--pool", "avg", "--layout", "mix=NHWC", "--out", out)
    from helpers.tiny_models import fixed_size_nhwc
    from torchvision.models import ResNet18_Weights

    model = fixed_size_nhwc().eval()
    transform = ResNet18_Weights.IMAGENET1K_V1.transforms()
    pixels = torch.stack([transform(Image.open(f).convert("RGB")) for f in files])
    expected = hooked(model, lambda: model(pixels), {"mix": lambda o: o.mean((1, 2))})
    assert close(stored(out, "mix"), expected["mix"])


@pytest.mark.parametrize(
    ("factory", "message"),
    [("needs_arguments", "the factory needs arguments (width)"), ("raises", "the factory raised RuntimeError: boom")],
)
def test_factory_errors_are_one_line(cli, factory, message, tmp_path):
    code, _, err = cli("--model", f"{TINY}:{factory}", "--layers", "x", "--out", tmp_path / "f.zarr")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_list_layers_on_a_fixed_size_vit_with_another_size_is_one_line(cli):
    code, _, err = cli("--model", "vit_b_16", "--weights", "none", "--list-layers", "--image-size", "64")
    assert code == 2 and "Wrong image height" in err and "--image-size" in err
    assert len(err.strip().splitlines()) == 1


# --- offline and missing libraries -----------------------------------------------------------


OFFLINE_DOWNLOADS = ["hf:some-org/not-cached", "open_clip:ViT-S-16:nonexistent_tag", "resnet18"]
OFFLINE_LISTS = ["timm:swin_tiny_patch4_window7_224", "open_clip:ViT-S-32", "timm:vit_tiny_patch16_224"]


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """One process with HF_HUB_OFFLINE (read when huggingface_hub is imported) and empty caches runs every
    offline command of this module in turn: the failed downloads and the layer listings."""
    folder = tmp_path_factory.mktemp("offline")
    home = {"HF_HOME": str(folder / "hf"), "TORCH_HOME": str(folder / "torch"), **OFFLINE}
    jobs = {f"download-{i}": ["--model", model, "--layers", "x", "--data", "synthetic:2", "--out", folder / f"o-{i}.zarr"]
            for i, model in enumerate(OFFLINE_DOWNLOADS)}  # fmt: skip
    jobs.update({f"list-{i}": ["--model", model, "--list-layers"] for i, model in enumerate(OFFLINE_LISTS)})
    sequence = Sequence(None, jobs, folder, env=home)
    launch = sequence.run(timeout=300)
    assert launch.returncode == 0, launch.stderr[-3000:]
    return sequence


@pytest.mark.parametrize("model", ["timm:resnet18", *OFFLINE_DOWNLOADS])
def test_offline_download_fails_in_one_line(model, tmp_path, request):
    if model in OFFLINE_DOWNLOADS:
        sequence, number = request.getfixturevalue("offline"), OFFLINE_DOWNLOADS.index(model)
        job, out = sequence.result(f"download-{number}"), sequence.folder / f"o-{number}.zarr"
        (returncode,), stderr = job.codes, job.stderr
    else:  # no HF_HUB_OFFLINE: the unreachable hub is noticed at once
        home = {"HF_HOME": str(tmp_path / "hf"), "TORCH_HOME": str(tmp_path / "torch")}
        out = tmp_path / "o.zarr"
        result = run_cli(
            "--model", model, "--layers", "x", "--data", "synthetic:2", "--out", out, env=home, timeout=120
        )
        returncode, stderr = result.returncode, result.stderr
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("extract: error:"), stderr
    assert "Traceback" not in stderr
    if model.startswith("open_clip"):
        assert "tags:" in lines[0]
    else:
        assert "without network" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize(("model", "extra"), [("timm:resnet18", "timm"), ("hf:x", "hf"), ("open_clip:RN50", "clip")])
def test_missing_library_names_the_extra(cli, monkeypatch, model, extra):
    library = {"timm": "timm", "hf": "transformers", "clip": "open_clip"}[extra]
    monkeypatch.setitem(sys.modules, library, None)  # import now raises ImportError
    code, _, err = cli("--model", model, "--list-layers")
    assert code == 2 and f"pip install 'extract[{extra}]'" in err and len(err.strip().splitlines()) == 1


# --- declarations: dispatch, messages and kinds come from each source's ModelSource -------------


def test_declaring_the_sources_imports_no_optional_library():
    code = (
        "import sys, extract.models.registry, extract.data.registry, extract.cli.extract; "
        "print(sorted({'timm', 'transformers', 'open_clip', 'pyarrow', 'datasets'} & set(sys.modules)))"
    )
    result = patience.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, quiet=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_each_declared_prefix_dispatches_and_names_its_example():
    from extract.errors import ExtractError
    from extract.models import registry

    prefixed = [source for source in registry.SOURCES if source.prefixed]
    assert [source.name for source in prefixed] == ["timm", "hf", "open_clip"]
    for source in prefixed:
        assert registry.resolve(source.example)[0] is source  # the example names its own source
        with pytest.raises(ExtractError) as error:
            registry.resolve(f"{source.name}:")
        assert (
            str(error.value) == f"--model {source.name}:: name the model after '{source.name}:', e.g. {source.example}"
        )
    assert registry.resolve("resnet50") == (registry.TORCHVISION, "resnet50")
    assert registry.resolve("pkg.module:make") == (registry.FACTORY, "pkg.module:make")
    assert registry.model_kinds() == (
        "torchvision name, timm:NAME[.TAG], hf:ID_OR_DIR, open_clip:ARCH[:TAG_OR_FILE], "
        "or pkg.module:factory / file.py:factory"
    )


# --- no process-wide side effects: hub settings and loggers ----------------------------------


@pytest.fixture
def no_network(monkeypatch):
    """As on a machine without network: no host name resolves, and no proxy would resolve it."""

    def unresolvable(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def hub_calls(monkeypatch, owner, attribute: str, cache: Path) -> list[tuple[bool, bool]]:
    """Spy on ``owner.attribute`` (a hub download or a from_pretrained): per call, the hub's own
    offline setting at that moment and whether the call asked for the cache only. Reads ``cache``."""
    from huggingface_hub import constants

    calls = []
    real = getattr(owner, attribute)

    def spy(*args, **kwargs):
        calls.append((constants.HF_HUB_OFFLINE, kwargs.get("local_files_only", False)))
        return real(*args, **{**kwargs, "cache_dir": str(cache)})

    monkeypatch.setattr(owner, attribute, spy)
    return calls


@pytest.mark.parametrize(
    ("model", "what"),
    [
        ("timm:resnet18", "timm's pretrained weights for resnet18"),
        ("open_clip:ViT-B-32:laion2b_s34b_b79k", "OpenCLIP weights ViT-B-32:laion2b_s34b_b79k"),
        ("hf:some-org/not-cached", "the image processor of hf:some-org/not-cached"),
    ],
)
def test_an_unreachable_hub_is_read_from_its_cache_without_changing_its_settings(
    model, what, no_network, monkeypatch, tmp_path
):
    import huggingface_hub
    from huggingface_hub import constants

    from extract.errors import ExtractError
    from extract.models import build_model

    before = constants.HF_HUB_OFFLINE
    if model.startswith("hf:"):
        calls = hub_calls(monkeypatch, transformers.AutoImageProcessor, "from_pretrained", tmp_path)
    else:
        calls = hub_calls(monkeypatch, huggingface_hub, "hf_hub_download", tmp_path)
    with pytest.raises(ExtractError, match=f"could not load {what} .*; without network"):
        build_model(model, "DEFAULT", None, 0, None)
    assert calls and all(setting == before and cache_only for setting, cache_only in calls), calls
    assert constants.HF_HUB_OFFLINE == before


def test_timm_weights_in_the_hub_cache_load_without_network(no_network, monkeypatch, tmp_path):
    import huggingface_hub
    from safetensors.torch import save_file

    from extract.models import build_model

    weights = timm.create_model("resnet18").state_dict()
    repository, commit = tmp_path / "models--timm--resnet18.a1_in1k", "0" * 40  # the hub cache's layout
    (repository / "snapshots" / commit).mkdir(parents=True)
    save_file(weights, repository / "snapshots" / commit / "model.safetensors")
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    calls = hub_calls(monkeypatch, huggingface_hub, "hf_hub_download", tmp_path)
    loaded = build_model("timm:resnet18", "DEFAULT", None, 1, None)
    assert loaded.weights == "timm pretrained resnet18.a1_in1k" and calls == [(calls[0][0], True)]
    assert all(torch.equal(value, weights[name]) for name, value in loaded.model.state_dict().items())


def test_open_clip_is_silenced_alone_while_it_builds(monkeypatch, caplog):
    from extract.models import build_model

    create = open_clip.create_model_and_transforms

    def create_while_others_log(*args, **kwargs):
        logging.getLogger("another.library").warning("another library's warning")
        logging.warning("the user's own warning on the root logger")
        return create(*args, **kwargs)

    monkeypatch.setattr(open_clip, "create_model_and_transforms", create_while_others_log)
    filters = list(logging.getLogger().filters)
    with caplog.at_level(logging.INFO):
        build_model("open_clip:ViT-S-32", "none", None, 0, None)
    said = [record.getMessage() for record in caplog.records]
    assert "another library's warning" in said and "the user's own warning on the root logger" in said
    assert not any("No pretrained weights loaded" in message for message in said), said
    assert logging.getLogger().filters == filters and logging.root.manager.disable == logging.NOTSET
    caplog.clear()
    with caplog.at_level(logging.INFO):  # what OpenCLIP says on its own, so that the check above can fail
        create("ViT-S-32")
    assert any("No pretrained weights loaded" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("model", OFFLINE_LISTS)
@pytest.mark.slow  # processes under accelerate launch, SLURM or a storm of kills
def test_list_layers_builds_without_weights_offline(model, offline):
    job = offline.result(f"list-{OFFLINE_LISTS.index(model)}")
    assert job.codes == [0], job.stderr
    rows = {line.split()[0]: line.split() for line in job.stdout.splitlines() if line.strip()}
    if "swin" in model:  # Swin's stages compute in (B, H, W, C): timm's output_fmt says so
        assert rows["layers.0"][-1] == "NHWC" and rows["layers.0"][2:6] == ["(B,", "56,", "56,", "96)"]
    elif "ViT-S-32" in model:
        assert rows["transformer.resblocks.0"][-1] == "NLC"
    else:
        assert rows["blocks.0"][2:] == ["(B,", "197,", "192)", "NLC"]


def test_synthetic_data_reaches_every_source_as_pil_images(cli, dinov2_dir, tmp_path):
    """timm's and HF's transforms take PIL images (timm's Normalize refuses uint8 tensors)."""
    for model, extra in ((f"hf:{dinov2_dir}", ()), ("timm:resnet18", ("--weights", "none", "--image-size", "32"))):
        out = tmp_path / f"{model.split(':')[0]}.zarr"
        run_ok(cli, "--model", model, *extra, "--layers", "hidden_states.1" if "hf" in model else "layer1",
               "--data", "synthetic:3", "--out", out)  # fmt: skip
        assert not np.isnan(stored(out, "hidden_states.1" if "hf" in model else "layer1")).any()
