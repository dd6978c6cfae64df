"""The SAE encoder of the capture (``extract.capture.sae``) against sae_lens itself: small SAEs of each
architecture are built with SAELens's own constructors, saved with its ``save_model`` and loaded back by
``load_sae``; their sparse codes must be the top-k of ``sae.encode(x)`` chosen and ordered by numpy
(value descending, lower latent first), and their statistics numpy's over the dense codes."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from helpers.saes import top_k_codes

pytest.importorskip("sae_lens")

from extract.capture.sae import DEFAULT_K, load_sae, top_codes  # noqa: E402
from extract.errors import ExtractError, SaeMismatchError, SaeMissingError, SaeNotFoundError  # noqa: E402
from extract.names import LayerRef  # noqa: E402

D_IN, D_SAE, HOOK = 16, 64, "blocks.1.hook_resid_post"
TWINS = (3, 10)  # latent 10 is a copy of latent 3: their codes tie on every row


def _build(architecture: str, **extra):
    import sae_lens
    from sae_lens.saes.sae import SAEMetadata

    kinds = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        "gated": (sae_lens.GatedSAE, sae_lens.GatedSAEConfig),
    }
    sae_class, cfg_class = kinds[architecture]
    sae = sae_class(cfg_class(d_in=D_IN, d_sae=D_SAE, metadata=SAEMetadata(hook_name=HOOK), **extra))
    generator = torch.Generator().manual_seed(len(architecture))
    with torch.no_grad():
        for name, parameter in sae.named_parameters():  # not the initialisation's zeros: every term counts
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            if name == "threshold":
                parameter.abs_()
        for parameter in (sae.W_enc, getattr(sae, "b_enc", None), getattr(sae, "b_gate", None)):
            if parameter is not None:
                parameter[..., TWINS[1]] = parameter[..., TWINS[0]]
        if architecture == "gated":
            sae.r_mag[TWINS[1]], sae.b_mag[TWINS[1]] = sae.r_mag[TWINS[0]], sae.b_mag[TWINS[0]]
        if architecture == "jumprelu":
            sae.threshold[TWINS[1]] = sae.threshold[TWINS[0]]
    return sae


ARCHITECTURES = {"standard": {}, "topk": {"k": 8}, "jumprelu": {}, "gated": {}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each architecture saved by SAELens, with the module it was saved from."""
    out = {}
    for architecture, extra in ARCHITECTURES.items():
        sae = _build(architecture, **extra)
        path = tmp_path_factory.mktemp(architecture)
        sae.save_model(path)
        out[architecture] = (path, sae)
    return out


def _inputs(rows: int = 200, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, D_IN, generator=torch.Generator().manual_seed(seed))


def _reference_stats(dense: np.ndarray, kept: np.ndarray, k: int) -> dict[str, np.ndarray]:
    wide = dense.astype(np.float64)
    return {
        "count": (dense != 0).sum(0).astype(np.float64),
        "sum": wide.sum(0),
        "max": dense.max(0).astype(np.float64),
        "rows": np.float64(len(dense)),
        "rows_over_k": np.float64(((dense != 0).sum(1) > k).sum()),
        "dropped_mass": wide.sum() - kept.astype(np.float64).sum(),
    }


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_codes_are_sae_lens_encode_top_k_and_stats_are_numpys(saved, architecture):
    path, original = saved[architecture]
    own_k = ARCHITECTURES[architecture].get("k")
    k = own_k or 8  # below d_sae, so that rows drop latents and the dropped mass counts
    encoder = load_sae(path, k=None if own_k else k)
    assert encoder.k == k and encoder.architecture == architecture and encoder.own_k == own_k
    assert (encoder.d_in, encoder.d_sae, encoder.hook_name) == (D_IN, D_SAE, HOOK)
    x = _inputs()
    with torch.no_grad():
        dense = original.encode(x).numpy()
    want_indices, want_values = top_k_codes(dense, k)
    assert (want_indices[:, -1] == -1).any() or architecture == "topk" or (dense != 0).sum(1).min() >= k

    stats = encoder.new_stats()
    codes = encoder.encode(x, stats)
    assert codes.indices.dtype == torch.int32 and codes.values.dtype == torch.float16
    np.testing.assert_array_equal(codes.indices.numpy(), want_indices)
    np.testing.assert_array_equal(codes.values.numpy(), want_values.astype(np.float16))
    index, value = top_codes(torch.from_numpy(dense), k)  # before float16: float32, as sae_lens gave them
    np.testing.assert_allclose(value.numpy(), want_values, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(index.numpy(), want_indices)

    tied = (dense[:, TWINS[0]] > 0) & (np.isin(want_indices, TWINS).sum(1) == 2)
    assert tied.any()  # both twins kept: the lower comes first, next to each other
    for row in np.flatnonzero(tied):
        place = list(want_indices[row])
        assert place.index(TWINS[1]) == place.index(TWINS[0]) + 1

    got = stats.numpy()
    for name, want in _reference_stats(dense, want_values, k).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-9, atol=1e-9, err_msg=name)
    assert got["rows_over_k"] > 0 or architecture == "topk"


def test_blocks_and_merged_stats_equal_one_pass(saved):
    """Rows encoded in small blocks, and stats of two batches merged, equal one pass over all rows."""
    path, _ = saved["standard"]
    whole = load_sae(path, k=8)
    blocked = load_sae(path, k=8)
    blocked.block_codes = 7 * D_SAE  # 7 rows at a time
    x = _inputs(100, seed=1)
    one, first, second = whole.new_stats(), blocked.new_stats(), blocked.new_stats()
    codes = whole.encode(x, one)
    parts = [blocked.encode(x[:37], first), blocked.encode(x[37:], second)]
    np.testing.assert_array_equal(torch.cat([p.indices for p in parts]).numpy(), codes.indices.numpy())
    np.testing.assert_allclose(torch.cat([p.values for p in parts]).float().numpy(), codes.values.float().numpy())
    merged = first.merge(second).numpy()
    # the stats are of the float32 dense codes, whose matmul may round a last bit differently for a block
    # of 7 rows than for 100 (the BLAS picks its kernel by shape): equal to float32's precision, not bitwise
    for name, want in one.numpy().items():
        np.testing.assert_allclose(merged[name], want, rtol=1e-6, atol=1e-6, err_msg=name)


def test_default_k_pads_rows_with_minus_one(saved):
    path, original = saved["jumprelu"]
    encoder = load_sae(path)
    assert encoder.k == DEFAULT_K == D_SAE
    x = _inputs(50, seed=2)
    codes = encoder.encode(x)
    with torch.no_grad():
        active = (original.encode(x) != 0).sum(1).numpy()
    np.testing.assert_array_equal((codes.indices.numpy() >= 0).sum(1), active)
    assert (codes.values.numpy()[codes.indices.numpy() < 0] == 0).all() and active.max() < DEFAULT_K


def test_a_checkpoint_s_input_scaling_is_folded_as_sae_lens_folds_it(tmp_path):
    """``expected_average_only_in``: the codes are the unfolded SAE's of activations scaled by the
    checkpoint's factor (what sae_lens's ActivationScaler feeds it); without the factor it is refused."""
    sae = _build("standard", normalize_activations="expected_average_only_in")
    sae.save_model(tmp_path)
    with pytest.raises(SaeMismatchError, match="activation_scaler.json") as error:
        load_sae(tmp_path)
    assert "\n" not in str(error.value)
    (tmp_path / "activation_scaler.json").write_text(json.dumps({"scaling_factor": 2.5, "has_whitening": False}))
    x = _inputs(60, seed=3)
    with torch.no_grad():
        dense = sae.encode(x * 2.5).numpy()
    codes = load_sae(tmp_path, k=8).encode(x)
    want_indices, want_values = top_k_codes(dense, 8)
    np.testing.assert_array_equal(codes.indices.numpy(), want_indices)
    np.testing.assert_allclose(codes.values.float().numpy(), want_values, rtol=1e-3, atol=1e-3)


def test_width_and_hook_mismatches_are_one_line_naming_both(saved):
    path, _ = saved["standard"]
    encoder = load_sae(path)
    block = LayerRef("transformer.h.1", 0)
    aliases = {
        HOOK: LayerRef("transformer.h.1", 0, alias=HOOK),
        "blocks.2.hook_resid_post": LayerRef("transformer.h.2", 0),
    }
    encoder.check(HOOK, D_IN)  # the layer asked for by the hook's own name
    encoder.check(LayerRef("transformer.h.1", 0, alias=HOOK), D_IN)
    encoder.check(block, D_IN, alias_of=aliases.get)  # the HF module the alias resolves to

    with pytest.raises(SaeMismatchError) as error:
        encoder.check(block, D_IN + 1, alias_of=aliases.get)
    message = str(error.value)
    assert f"d_in={D_IN}" in message and f"'transformer.h.1:0' is {D_IN + 1} wide" in message

    with pytest.raises(SaeMismatchError) as error:
        encoder.check(LayerRef("transformer.h.2", 0), D_IN, alias_of=aliases.get)
    message = str(error.value)
    # the hook is named with the tensor it resolves to in this model: which layer to give the SAE for
    assert f"hook '{HOOK}' (in this model that is 'transformer.h.1:0')" in message and "'transformer.h.2:0'" in message

    with pytest.raises(SaeMismatchError, match=f"hook '{HOOK}', not on layer 'transformer.h.1'"):
        encoder.check("transformer.h.1", D_IN)  # no resolver: only the hook's own name matches
    assert issubclass(SaeMismatchError, ValueError) and issubclass(SaeMismatchError, ExtractError)


def test_a_directory_that_is_not_an_sae_names_the_missing_file(saved, tmp_path):
    with pytest.raises(SaeNotFoundError, match=r"no such directory.*cfg\.json") as error:
        load_sae(tmp_path / "absent")
    assert isinstance(error.value, FileNotFoundError)
    with pytest.raises(SaeNotFoundError, match=r"it has no cfg\.json"):
        load_sae(tmp_path)
    (tmp_path / "cfg.json").write_text("{}")
    with pytest.raises(SaeNotFoundError, match=r"it has no sae_weights\.safetensors") as error:
        load_sae(tmp_path)
    assert "\n" not in str(error.value)


def test_missing_sae_lens_names_the_extra(saved, monkeypatch):
    path, _ = saved["standard"]
    monkeypatch.setitem(sys.modules, "sae_lens", None)  # ``import sae_lens`` now raises ImportError
    with pytest.raises(SaeMissingError, match=r"pip install 'extract\[sae\]'") as error:
        load_sae(path)
    assert isinstance(error.value, ImportError) and "\n" not in str(error.value)


@pytest.mark.cuda
def test_codes_on_cuda_equal_the_cpu_s(saved):
    path, _ = saved["topk"]
    x = _inputs(4096, seed=4)
    cpu_stats, gpu_stats = load_sae(path).new_stats(), load_sae(path).new_stats("cuda")
    cpu = load_sae(path).encode(x, cpu_stats)
    gpu = load_sae(path, device="cuda").encode(x.cuda(), gpu_stats)
    assert gpu.indices.is_cuda and gpu_stats.count.is_cuda
    np.testing.assert_array_equal(gpu.indices.cpu().numpy(), cpu.indices.numpy())
    np.testing.assert_allclose(gpu.values.float().cpu().numpy(), cpu.values.float().numpy(), rtol=2e-3, atol=2e-3)
    for name, want in cpu_stats.numpy().items():
        np.testing.assert_allclose(gpu_stats.numpy()[name], want, rtol=1e-4, atol=1e-3, err_msg=name)
