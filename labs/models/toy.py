"""Small models with the awkward cases parallel wrappers get wrong (after CS336's ``common.py``).

    model = AwkwardModel(seed=0)     # tied weights, a frozen parameter, one that gets no gradient,
                                     # 8,009 trainable elements: divisible by neither 2, 3 nor 4
    logits, loss = model(x, y)       # same interface as the course model: x, y are [B, T] token ids

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
    def __init__(self, vocab_size: int = 256, hidden: int = 24, seed: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)  # tied with the head below
        self.mix = nn.Linear(hidden, 37)  # 24*37 + 37 = 925 elements: odd sizes
        self.back = nn.Linear(37, hidden)
        self.frozen = nn.Linear(hidden, hidden)  # requires_grad=False: never reduced, never updated
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(
            torch.zeros(7, 4)
        )  # requires grad but is not used: grad stays None
        self.head = nn.Linear(hidden, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two uses
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for (
                p
            ) in self.parameters():  # the frozen layer too: requires_grad is not the same as zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def forward(self, idx, targets=None):
        x = self.embed(idx)  # [B, T, H]
        x = x + self.back(torch.tanh(self.mix(x)))  # [B, T, 37] -> [B, T, H]
        x = x + self.frozen(x)
        logits = self.head(x)  # [B, T, V]
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_awkward(seed: int = 0) -> AwkwardModel:
    return AwkwardModel(seed=seed)
