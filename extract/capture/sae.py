"""A pretrained sparse autoencoder applied inside the capture: a layer's rows become sparse codes on the
device, before anything is copied to the host (issue 32, ``--sae LAYER=PATH``).

    encoder = load_sae("saes/blocks.6")            # SAELens's saved format, loaded by sae_lens
    encoder.check(ref, width=768, alias_of=...)    # its d_in and hook name against the layer
    stats = encoder.new_stats(x.device)
    codes = encoder.encode(x, stats)               # x: (rows, d_in) on any device

``codes.indices`` (rows, k) int32 and ``codes.values`` (rows, k) float16 hold each row's k largest
active latents, largest first; a row with fewer than k active latents is padded with index -1 and value
0. *Active* means a nonzero code. k is the SAE's own k for a top-k SAE (a ``k`` in its config), else the
``k`` given (``DEFAULT_K``). ``stats`` (``LatentStats``) accumulates on the device, in float64 and before
the top-k: each latent's firing count, sum and max, the rows with more than k active latents and the
mass (sum of codes) that the top-k dropped.

The codes are sae_lens's own: ``SAE.load_from_disk`` builds the architecture the config names
(standard ReLU, top-k, JumpReLU, gated, ...) and ``sae.encode`` does its math, including
``apply_b_dec_to_input`` and the run-time normalizations (``constant_norm_rescale``, ``layer_norm``).
Two normalizations need statistics that the saved weights do not hold (``expected_average_only_in``:
a scaling factor; ``covariance_whitening``: a whitening matrix); sae_lens folds them into the weights at
the end of training, and an intermediate checkpoint keeps them in ``activation_scaler.json`` beside the
weights. Such a checkpoint is folded here exactly as sae_lens's trainer folds it; without the file the
SAE is refused (its codes would be silently wrong).

Ties in the top-k go to the lower latent index, on any device: the selection runs ``torch.topk`` on an
int64 key that makes every entry distinct, the code's order-preserving 32 bits above the latent's
reversed index (``_keys``), so which of two equal codes wins never depends on topk's implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import SaeInvalidError, SaeMismatchError, SaeMissingError, SaeNotFoundError
from ..names.layers import LayerRef
from .sae_files import CFG, WEIGHTS, check_saved_sae

if TYPE_CHECKING:
    from sae_lens import SAE

# the errors and names of the saved format, importable from here as before they had a module of their own
__all__ = ["CFG", "WEIGHTS", "SaeEncoder", "SaeInvalidError", "SaeMismatchError", "SaeMissingError"]
__all__ += ["SaeNotFoundError", "load_sae", "top_codes"]
SCALER = "activation_scaler.json"  # sae_lens.constants.ACTIVATION_SCALER_CFG_FILENAME (training checkpoints)
INSTALL = "pip install 'extract[sae]'"
DEFAULT_K = 64
# Dense codes (rows x d_sae) held at once by ``encode``: a batch is encoded in row blocks of this many
# codes, so device memory stays bounded (float32 codes + int64 keys: 12 bytes a code, 0.8 GB).
BLOCK_CODES = 2**26
_NORMALIZED_AT_RUN_TIME = ("none", "constant_norm_rescale", "layer_norm")
_FOLDED_FROM_SCALER = ("expected_average_only_in", "covariance_whitening")
_INACTIVE = torch.iinfo(torch.int64).min

AliasOf = Callable[[str], "LayerRef | str | None"]


@dataclass
class SparseCodes:
    """Each row's k largest active latents, largest first (ties: lower latent first)."""

    indices: torch.Tensor  # (rows, k) int32, -1 past a row's active latents
    values: torch.Tensor  # (rows, k) float16, 0 where the index is -1


@dataclass
class LatentStats:
    """Per-latent statistics of the dense codes, before the top-k, accumulated on the device in float64
    (a chunk's: one ``new_stats`` per chunk; ``merge`` adds chunks). ``max`` is the largest code over the
    rows seen, zeros included (so 0 for a latent that never fired, -inf before any row)."""

    count: torch.Tensor  # (d_sae,) rows where the latent is active
    sum: torch.Tensor  # (d_sae,) sum of its codes
    max: torch.Tensor  # (d_sae,) largest code
    rows: torch.Tensor  # () rows seen
    rows_over_k: torch.Tensor  # () rows with more than k active latents (some dropped)
    dropped_mass: torch.Tensor  # () sum of the codes the top-k did not keep

    @classmethod
    def zeros(cls, d_sae: int, device: torch.device | str = "cpu") -> LatentStats:
        z = dict(dtype=torch.float64, device=device)
        return cls(
            count=torch.zeros(d_sae, **z),
            sum=torch.zeros(d_sae, **z),
            max=torch.full((d_sae,), -torch.inf, **z),
            rows=torch.zeros((), **z),
            rows_over_k=torch.zeros((), **z),
            dropped_mass=torch.zeros((), **z),
        )

    def update(self, codes: torch.Tensor, kept: torch.Tensor, k: int) -> None:
        """Add dense ``codes`` (rows, d_sae) whose top-k kept ``kept`` (rows, <=k) of each row."""
        active = codes != 0
        self.count += active.sum(0, dtype=torch.float64)
        self.sum += codes.sum(0, dtype=torch.float64)
        if len(codes):
            torch.maximum(self.max, codes.amax(0).to(torch.float64), out=self.max)
        self.rows += len(codes)
        self.rows_over_k += (active.sum(1) > k).sum(dtype=torch.float64)
        self.dropped_mass += codes.sum(dtype=torch.float64) - kept.sum(dtype=torch.float64)

    def merge(self, other: LatentStats) -> LatentStats:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name).to(getattr(self, f.name).device)
            torch.maximum(mine, theirs, out=mine) if f.name == "max" else mine.add_(theirs)
        return self

    def numpy(self) -> dict[str, np.ndarray]:
        """The statistics on the host (one sync), as the store writes them."""
        return {f.name: getattr(self, f.name).cpu().numpy() for f in fields(self)}


def _keys(codes: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (code descending, latent ascending), distinct within a row; inactive
    (zero) codes below every active one. float32 bits read as int32 order positive floats; flipping the
    low 31 bits of negative ones orders those too."""
    bits = codes.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    reversed_index = torch.arange(codes.shape[1] - 1, -1, -1, device=codes.device, dtype=torch.int64)
    keys = ordered * 2**32 + reversed_index
    return keys.masked_fill_(codes == 0, _INACTIVE)


def top_codes(codes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest active entries of each row of float32 ``codes`` (rows, d): int64 indices (-1 where a
    row has fewer) and float32 values (0 there), largest first, ties by lower index."""
    rows, width = codes.shape
    taken = min(k, width)
    index = torch.topk(_keys(codes), taken, dim=1, sorted=True).indices
    values = codes.gather(1, index)
    active = values != 0
    index = index.masked_fill_(~active, -1)
    if taken < k:  # an SAE narrower than k: the columns past its width are all padding
        index = torch.cat([index, index.new_full((rows, k - taken), -1)], 1)
        values = torch.cat([values, values.new_zeros((rows, k - taken))], 1)
    return index, values


@dataclass
class SaeEncoder:
    """A loaded SAE (``sae``, sae_lens's module) and what the capture needs to know of it."""

    path: Path
    sae: SAE
    k: int  # codes kept per row
    architecture: str
    d_in: int
    d_sae: int
    hook_name: str | None
    apply_b_dec_to_input: bool
    normalize_activations: str  # as saved (a folded one is recorded as it was)
    dtype: str
    own_k: int | None  # a top-k SAE's k
    block_codes: int = BLOCK_CODES
    values_dtype: str = "float16"  # the stored codes

    def raw(self, rows: torch.Tensor) -> torch.Tensor:
        """The layer's rows as stored beside the codes: themselves."""
        return rows

    def describe(self) -> dict[str, Any]:
        """What a store records of the SAE."""
        keys = ("architecture", "d_in", "d_sae", "hook_name", "k", "own_k", "apply_b_dec_to_input")
        keys += ("normalize_activations", "dtype")
        return {"path": str(self.path), **{k: getattr(self, k) for k in keys}}

    def new_stats(self, device: torch.device | str = "cpu") -> LatentStats:
        return LatentStats.zeros(self.d_sae, device)

    def check(self, layer: str | LayerRef, width: int, alias_of: AliasOf | None = None) -> None:
        """Refuse, in one line naming both, a layer whose width is not the SAE's ``d_in`` or that is not
        the SAE's hook. The layer matches when its name (or alias) is the hook name, or when
        ``alias_of(hook_name)`` (the model's TransformerLens aliases) resolves to it. An SAE that
        recorded no hook name is checked on its width alone."""
        name = layer.name if isinstance(layer, LayerRef) else layer
        if width != self.d_in:
            raise SaeMismatchError(
                f"--sae {name}={self.path}: the SAE reads d_in={self.d_in} but layer '{name}' is {width} wide; "
                f"give it for a layer of width {self.d_in}"
            )
        if self.hook_name is None or self.hook_name in _names(layer):
            return
        target = alias_of(self.hook_name) if alias_of is not None else None
        if target is not None and _same(target, layer):
            return
        resolved = f" (in this model that is '{_name(target)}')" if target is not None else ""
        raise SaeMismatchError(
            f"--sae {name}={self.path}: the SAE was trained on hook '{self.hook_name}'{resolved}, not on layer "
            f"'{name}'; give it for the layer of that hook"
        )

    def to(self, device: torch.device | str) -> SaeEncoder:
        if torch.device(device) != self.sae.device:
            self.sae.to(device)
        return self

    @torch.no_grad()
    def encode(self, x: torch.Tensor, stats: LatentStats | None = None) -> SparseCodes:
        """Sparse codes of ``x`` (rows, d_in), on x's device; ``stats`` (if given) accumulates this
        batch. Rows are encoded in blocks of ``block_codes`` dense codes; nothing waits on the host."""
        if x.ndim != 2 or x.shape[1] != self.d_in:
            raise SaeMismatchError(
                f"SAE {self.path} encodes rows of {self.d_in}, got a tensor of shape {tuple(x.shape)}"
            )
        self.to(x.device)
        indices = torch.empty((len(x), self.k), dtype=torch.int32, device=x.device)
        values = torch.empty((len(x), self.k), dtype=torch.float16, device=x.device)
        step = max(1, self.block_codes // self.d_sae)
        for start in range(0, len(x), step):
            codes = self.sae.encode(x[start : start + step]).float()
            index, value = top_codes(codes, self.k)
            if stats is not None:
                stats.update(codes, value, self.k)
            indices[start : start + step] = index
            values[start : start + step] = value
        return SparseCodes(indices, values)


def _names(layer: str | LayerRef) -> set[str]:
    """Every name a layer goes by: its alias and its module (with the element it selects)."""
    if not isinstance(layer, LayerRef):
        return {layer}
    module = layer.module if layer.selector is None else f"{layer.module}:{layer.selector}"
    return {n for n in (layer.alias, module) if n is not None}


def _name(target: LayerRef | str) -> str:
    """The tensor an alias resolves to (``transformer.h.2:0``), which the hook name alone does not say."""
    return target.target if isinstance(target, LayerRef) else target


def _same(target: LayerRef | str, layer: str | LayerRef) -> bool:
    if isinstance(target, LayerRef) and isinstance(layer, LayerRef):
        return (target.module, target.selector) == (layer.module, layer.selector)
    return bool(_names(target) & _names(layer))


def load_sae(path: str | Path, k: int | None = None, device: str = "cpu", dtype: str | None = None) -> SaeEncoder:
    """The SAE saved (``SAE.save_model``) in directory ``path``, loaded by sae_lens onto ``device``
    (``dtype``: the config's unless given). ``k``: codes kept per row; by default the SAE's own k for a
    top-k SAE, else ``DEFAULT_K``."""
    path = Path(path)
    saved = check_saved_sae(path)  # a torn, contradictory or foreign file: one line, before sae_lens sees it
    try:
        from sae_lens import SAE
    except ImportError:
        raise SaeMissingError(f"--sae needs sae_lens, which is not installed: {INSTALL}") from None
    try:
        sae = SAE.load_from_disk(path, device=device, dtype=dtype)
    # an architecture or a field this sae_lens does not know, a tensor it does not expect
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise SaeMismatchError(
            f"--sae {path}: sae_lens cannot load it ({type(error).__name__}: {str(error).splitlines()[0]}); "
            f"architecture '{saved.get('architecture')}'"
        ) from None
    return _encoder(path, sae, k)


def _encoder(path: Path, sae: SAE, k: int | None) -> SaeEncoder:
    cfg, metadata = sae.cfg, sae.cfg.metadata
    if metadata.get("hook_head_index") is not None:
        raise SaeMismatchError(
            f"--sae {path}: the SAE reads one attention head (hook_head_index={metadata.hook_head_index}), "
            "which this version cannot select; use an SAE of the whole hook"
        )
    normalization = cfg.normalize_activations
    if normalization in _FOLDED_FROM_SCALER:
        _fold_scaler(path, sae)
    elif normalization not in _NORMALIZED_AT_RUN_TIME:
        raise SaeMismatchError(f"--sae {path}: normalize_activations='{normalization}' is not one this version knows")
    if cfg.reshape_activations == "hook_z":  # the capture hands flat rows (rows, n_heads * d_head)
        sae.turn_off_forward_pass_hook_z_reshaping()
    own_k = getattr(cfg, "k", None)
    return SaeEncoder(
        path=path,
        sae=sae.eval(),
        k=int(k if k is not None else own_k or DEFAULT_K),
        architecture=cfg.architecture(),
        d_in=cfg.d_in,
        d_sae=cfg.d_sae,
        hook_name=metadata.get("hook_name"),
        apply_b_dec_to_input=bool(cfg.apply_b_dec_to_input),
        normalize_activations=normalization,
        dtype=cfg.dtype,
        own_k=int(own_k) if own_k is not None else None,
    )


def _fold_scaler(path: Path, sae: SAE) -> None:
    """Fold a checkpoint's input scaling or whitening into the weights, as sae_lens's trainer does at
    the end of training (``SAETrainer.fit``), so that ``encode`` takes the raw activations."""
    normalization = sae.cfg.normalize_activations
    if not (path / SCALER).is_file():
        raise SaeMismatchError(
            f"--sae {path}: normalize_activations='{normalization}' needs statistics that are not saved with "
            f"the weights and there is no {SCALER} beside them; save the SAE after training (sae_lens folds them)"
        )
    from sae_lens.training.activation_scaler import ActivationScaler

    scaler = ActivationScaler()
    scaler.load(path / SCALER)
    if normalization == "expected_average_only_in" and scaler.scaling_factor is not None:
        sae.fold_activation_norm_scaling_factor(scaler.scaling_factor)
    elif normalization == "covariance_whitening" and scaler.whitening is not None:
        w = scaler.whitening
        sae.fold_activation_whitening(mean=w.mean, whitening_matrix=w.matrix, unwhitening_matrix=w.inverse_matrix)
    else:
        raise SaeMismatchError(
            f"--sae {path}: {SCALER} holds no statistics for normalize_activations='{normalization}'"
        )
