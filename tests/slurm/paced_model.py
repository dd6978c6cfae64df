"""ResNet-18 (random init, seed 0) that waits EXTRACT_TEST_PACE seconds (default 0) before each
batch: SLURM tests use it for jobs that last long enough to be preempted mid-run while leaving the
shared CPUs idle. Without the variable it is an ordinary model, so a reference run is fast."""

import os
import time

import torch
import torchvision
from torch import nn


def resnet18_paced() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    pace = float(os.environ.get("EXTRACT_TEST_PACE", "0"))
    if pace > 0:
        model.register_forward_pre_hook(lambda module, args: time.sleep(pace))
    return model
