"""The seeds' two models, built the same way by every experiment (and by its single-process reference)."""

from __future__ import annotations

import torch
from torch import nn


def build_linear(in_features: int = 10, seed: int = 0) -> nn.Linear:
    """Seed 001's `nn.Linear(10, 1)` regression, initialised from `seed` so every rank and the reference agree."""
    torch.manual_seed(seed)
    return nn.Linear(in_features, 1)


class MLP(nn.Module):
    """Seed 001's `fc1 10→50 / fc2 50→1` model.

    The seed applies fc2 straight after fc1, which makes the whole thing one linear map; we put a ReLU
    between them so the two halves are a real two-layer network. `fc1` and `fc2` keep the seed's names
    because device maps and pipeline cuts address modules by name.
    """

    def __init__(self, in_features: int = 10, hidden_features: int = 50, out_features: int = 1):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def build_mlp(in_features: int = 10, hidden_features: int = 50, out_features: int = 1, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(in_features, hidden_features, out_features)
