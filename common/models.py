"""The tutorials' two models, built the same way by every experiment (and by its single-process reference)."""

from __future__ import annotations

import torch
from torch import nn


def build_linear(in_features: int = 10, seed: int = 0) -> nn.Linear:
    """The DDP tutorial's `nn.Linear(10, 1)` regression (docs/tutorials.md), initialised from `seed` so every
    rank and the reference agree (the process's own random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, 1)


class MLP(nn.Module):
    """The DDP tutorial's `fc1 10→50 / fc2 50→1` model, deeper on request (fc1 ... fcN).

    The tutorial applies fc2 straight after fc1, which makes the whole thing one linear map; we put a ReLU
    after every layer but the last so the layers are a real network. The layers are named attributes
    (`fc1`, `fc2`, ...) because device maps and pipeline cuts address modules by name.
    """

    def __init__(
        self, in_features: int = 10, hidden_features: int = 50, out_features: int = 1, n_layers: int = 2
    ):
        super().__init__()
        widths = [in_features] + [hidden_features] * (n_layers - 1) + [out_features]
        self.layer_names = [f"fc{i + 1}" for i in range(n_layers)]
        for name, width_in, width_out in zip(self.layer_names, widths[:-1], widths[1:], strict=True):
            setattr(self, name, nn.Linear(width_in, width_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, name in enumerate(self.layer_names):
            x = getattr(self, name)(x)
            if index < len(self.layer_names) - 1:
                x = torch.relu(x)
        return x


def build_mlp(
    in_features: int = 10, hidden_features: int = 50, out_features: int = 1, seed: int = 0, n_layers: int = 2
) -> MLP:
    """Initialised from `seed`, the process's own random state left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLP(in_features, hidden_features, out_features, n_layers)
