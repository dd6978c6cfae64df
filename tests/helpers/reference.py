"""An independent forward pass with plain hooks: what the store must equal."""

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision.models import ResNet18_Weights

POOLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda x: x,
    "avg": lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1),
    "max": lambda x: torch.nn.functional.adaptive_max_pool2d(x, 1).flatten(1),
    "avg:2": lambda x: torch.nn.functional.adaptive_avg_pool2d(x, 2),
    "cls": lambda x: x[:, 0],
    "mean": lambda x: x.mean(dim=1),
}


def preset(size: int):
    """torchvision's ImageNet classification preset at crop ``size``."""
    return ResNet18_Weights.IMAGENET1K_V1.transforms(crop_size=size, resize_size=round(size * 256 / 224))


def load_images(files: list[Path], size: int) -> torch.Tensor:
    transform = preset(size)
    return torch.stack([transform(Image.open(f).convert("RGB")) for f in files])


def resnet18(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return torchvision.models.resnet18().eval()


def reference(
    model: nn.Module, images: torch.Tensor, layers: dict[str, tuple[str, object]], pool: str = "none"
) -> dict[str, np.ndarray]:
    """``layers``: stored name -> (module name, selector or None); features as float32 numpy."""
    outputs: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    handles = []
    for stored, (module, selector) in layers.items():

        def hook(m, i, o, stored=stored, selector=selector):
            value = o if selector is None else o[selector]
            outputs[stored] = POOLS[pool](value.detach()).clone()

        handles.append(modules[module].register_forward_hook(hook))
    with torch.no_grad():
        model(images)
    for h in handles:
        h.remove()
    return {k: v.float().numpy() for k, v in outputs.items()}


def synthetic_images(count: int, size: int = 32) -> torch.Tensor:
    """The first ``count`` images of ``--data synthetic:N`` at ``--image-size size``, preprocessed."""
    from extract.data import SyntheticImages

    dataset = SyntheticImages(count, size, preset(size))
    return torch.stack([dataset[i][0] for i in range(count)])
