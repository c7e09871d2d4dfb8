"""The shipped corpus, a byte-level tokenizer, and seeded batches for one rank or for all.

    # rank 1's first batch
    x, y = rank_batches(steps=5, batch_size=4, seq_len=32, rank=1, world_size=2)[0]
    # both ranks' first batches, stacked
    x, y = global_batches(steps=5, batch_size=4, seq_len=32, world_size=2)[0]

The data set is the corpus cut into non-overlapping windows of ``seq_len + 1`` bytes
(inputs and next-byte targets). ``torch.utils.data.DistributedSampler`` gives each rank
a disjoint slice of one seeded permutation; a step's *global* batch is the ranks'
batches concatenated in rank order. The single-process reference trains on exactly
that global batch, which is why data-parallel losses can match it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocabulary 256, nothing to download or train."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, tokens: Iterable[int]) -> str:
        """The text of the bytes ``tokens`` (an invalid sequence becomes U+FFFD)."""
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def load_corpus() -> torch.Tensor:
    """The corpus as a 1-D tensor of token ids (int64)."""
    return torch.frombuffer(bytearray(CORPUS_PATH.read_bytes()), dtype=torch.uint8).long()


class TokenWindows(Dataset):
    """Non-overlapping windows of the corpus: item i is (x, y), each ``[seq_len]``, y = x shifted
    by one."""

    def __init__(self, seq_len: int, tokens: torch.Tensor | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = load_corpus() if tokens is None else tokens
        self.seq_len = seq_len
        self.n = (len(self.tokens) - 1) // seq_len
        if self.n < 1:
            raise ValueError(
                f"seq_len={seq_len} is longer than the corpus ({len(self.tokens)} tokens)"
            )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def make_loader(
    *,
    batch_size: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    dataset: Dataset | None = None,
) -> tuple[DataLoader, DistributedSampler]:
    """A loader over this rank's share of the data. Call ``sampler.set_epoch(e)`` each epoch,
    or every epoch repeats the first one's order (the classic DistributedSampler pitfall)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    dataset = dataset or TokenWindows(seq_len)
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    return loader, sampler


def rank_batches(
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    dataset: Dataset | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """The first ``steps`` batches this rank sees, ``[batch_size, seq_len]`` each, across epochs
    (``dataset``: another data set than the corpus's token windows; its samples' parts,
    batched)."""
    loader, sampler = make_loader(
        batch_size=batch_size,
        seq_len=seq_len,
        rank=rank,
        world_size=world_size,
        seed=seed,
        dataset=dataset,
    )
    if len(loader) == 0:
        if dataset is None:
            what = f"windows of {seq_len} do not fit the corpus"
        else:
            what = f"exceeds the {len(dataset)} samples"
        raise ValueError(f"batch_size={batch_size} x world_size={world_size} {what}")
    out = []
    epoch = 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            out.append(tuple(batch))
            if len(out) == steps:
                break
        epoch += 1
    return out


def global_batches(
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    world_size: int = 1,
    seed: int = 0,
    dataset: Dataset | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Each step's global batch: the ``world_size`` ranks' batches concatenated in rank order,
    ``[world_size * batch_size, seq_len]``. What a single process must train on to match."""
    per_rank = [
        rank_batches(
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            rank=r,
            world_size=world_size,
            seed=seed,
            dataset=dataset,
        )
        for r in range(world_size)
    ]
    out = []
    for s in range(steps):
        ranks = [per_rank[r][s] for r in range(world_size)]  # each a tuple of parts, (x, y)
        out.append(tuple(torch.cat(parts) for parts in zip(*ranks)))
    return out
