"""Small models for tests, loaded through ``--model tests/helpers/tiny_models.py:NAME``."""

import os
import time

import torch
import torchvision
from torch import nn


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
    )


class TwoHeads(nn.Module):
    """A module returning a dict, to test ``name:key`` selectors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.conv(x)
        return {"map": y, "pooled": self.pool(y)}


class DictNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = TwoHeads()
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.heads(x)["pooled"].flatten(1))


def dict_net() -> nn.Module:
    torch.manual_seed(0)
    return DictNet()


class Loud(nn.Module):
    """Activations far beyond the float16 range, to test overflow reporting."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean(dim=(2, 3)))


def loud_net() -> nn.Module:
    torch.manual_seed(0)
    net = Loud()
    with torch.no_grad():
        net.conv.weight.mul_(1e6)
    return net


def loud_bias_net() -> nn.Module:
    """``Loud`` whose conv bias is beyond float16's range: even the set-up forward's zeros give 1e6 and more."""
    torch.manual_seed(0)
    net = Loud()
    with torch.no_grad():
        net.conv.bias.copy_(torch.tensor([2e6, -1e6, 3.5e5, 7e4]))
    return net


def massive_net() -> nn.Module:
    """A few massive channels, as in large language models: channel k's weights scaled by 10**k, so that
    channels 4 and 5 straddle float16's 65504 from image to image and the rest stay far below it."""
    torch.manual_seed(0)
    net = TinyConv()
    with torch.no_grad():
        net.conv.weight.mul_(torch.logspace(0, 5, 6).view(6, 1, 1, 1))
        net.conv.bias.zero_()
    return net


class OwnInf(nn.Module):
    """Sets channel 0 of its input to +inf: the model's own infinity, not a cast's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.full_like(x[:, :1], torch.inf), x[:, 1:]], dim=1)


class OwnInfNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=4)
        self.own = OwnInf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(self.conv(x)).mean(dim=(2, 3))


def own_inf_net() -> nn.Module:
    torch.manual_seed(0)
    return OwnInfNet()


class TinyConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 5, stride=4)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean(dim=(2, 3)))


def tiny_with_transform():
    """A factory that brings its own preprocessing (not ImageNet's)."""
    from torchvision import transforms

    torch.manual_seed(0)
    transform = transforms.Compose(
        [
            transforms.Resize(40, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(32),
            transforms.ToTensor(),
            transforms.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
        ]
    )
    return TinyConv(), transform


class Mix(nn.Module):
    """An elementwise op on a channels-last map: nothing about it tells the layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


class FixedSizeNHWC(nn.Module):
    """Takes 224-pixel inputs only (like a ViT) and computes in (B, H, W, C) after its stem."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 16, stride=16)
        self.mix = Mix()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-2:] == (224, 224), "FixedSizeNHWC takes 224x224 inputs"
        return self.head(self.mix(self.stem(x).permute(0, 2, 3, 1)).mean(dim=(1, 2)))


def fixed_size_nhwc() -> nn.Module:
    torch.manual_seed(0)
    return FixedSizeNHWC()


def needs_arguments(width: int) -> nn.Module:
    return nn.Linear(width, width)


def raises() -> nn.Module:
    raise RuntimeError("boom")


class Paced(nn.Module):
    """A small conv net whose every forward first sleeps ``TINY_PACE`` seconds (an environment variable,
    0 without it): a run lasts while a test signals it, at no CPU cost, and a rerun without the variable
    is quick. The variable is no part of the job, so both are the same job and the rerun resumes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(float(os.environ.get("TINY_PACE", "0")))
        return self.conv(x)


def paced_net() -> nn.Module:
    torch.manual_seed(0)
    return Paced()


def paced_by_seed() -> nn.Module:
    """``Paced`` with the weights of ``--seed`` (the job seeds torch before it calls the factory): two
    jobs that differ only in their seed store different features."""
    return Paced()
