"""Small models for tests, loaded through ``--model tests/tiny_models.py:NAME``."""

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
