"""Small models with the awkward cases parallel wrappers get wrong (after CS336's ``common.py``).

    # tied weights, a frozen parameter, one that gets no gradient,
    # 8,009 trainable elements: divisible by neither 2, 3 nor 4
    model = AwkwardModel(seed=0)
    # same interface as the course model: x, y are [B, T] token ids
    logits, loss = model(x, y)

A data-parallel or ZeRO implementation that broadcasts, reduces and updates these
correctly handles the real model too; one that zips parameters by position, reduces a
tied weight twice, waits for a gradient that never comes, or shards 1,021 elements
over 4 ranks without padding, fails here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class AwkwardModel(nn.Module):
    """Embedding (tied with the head) -> a residual tanh MLP of odd width 37 -> a frozen linear
    layer -> head; plus a parameter the forward never uses."""

    def __init__(self, vocab_size: int = 256, hidden: int = 24, seed: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)  # tied with the head below
        self.mix = nn.Linear(hidden, 37)  # 24*37 + 37 = 925 elements: odd sizes
        self.back = nn.Linear(37, hidden)
        # requires_grad=False: never reduced, never updated
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        # requires grad but is not used: grad stays None
        self.unused = nn.Parameter(torch.zeros(7, 4))
        self.head = nn.Linear(hidden, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two uses
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            # the frozen layer too: requires_grad is not the same as zero
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(idx)  # [B, T, H]
        x = x + self.back(torch.tanh(self.mix(x)))  # [B, T, 37] -> [B, T, H]
        x = x + self.frozen(x)
        logits = self.head(x)  # [B, T, V]
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_awkward(seed: int = 0) -> AwkwardModel:
    """The awkward model with weights from ``seed``."""
    return AwkwardModel(seed=seed)
