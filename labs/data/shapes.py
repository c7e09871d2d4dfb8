"""Synthetic image-caption pairs: a coloured shape on a dark, noisy background, and a caption
naming it.

    ds = ShapesDataset(seed=0)
    # [3, 16, 16] float in [0, 1], [CAPTION_LEN] byte tokens ("a small red circle ...")
    image, caption = ds[3]
    # one step's global batch
    images, tokens, targets = global_batches(steps=5, batch_size=8, n_prefix=16)[0]

Nothing is downloaded: sample i is drawn from a generator seeded with (seed, i), so any rank
can render any sample and the data set is the same on every machine. Captions are
``"a {size} {colour} {shape}"`` in bytes (the course's tokenizer), padded with spaces to
``CAPTION_LEN``, so every sample has the same number of caption tokens (a mean loss per
micro-batch then averages to the mean over the batch, as the pipeline needs).

A training sequence is the image's ``n_prefix`` placeholder tokens (``IMAGE_TOKEN``; the model
puts the projected image features there, as LLaVA does with its ``<image>`` token) followed by
the caption: ``tokens`` is ``[B, n_prefix + CAPTION_LEN]``. ``targets`` is the next token where
a caption token comes next, ``IGNORE`` (-100, what ``F.cross_entropy`` skips) elsewhere: the
last image position predicts the caption's first byte, the last caption position nothing.

Batches come from ``torch.utils.data.DistributedSampler`` (``labs.data.make_loader``), as the
text labs' do: rank r of N gets a disjoint slice of one seeded permutation, and a step's global
batch is the ranks' batches concatenated in rank order.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from labs import data
from labs.data import ByteTokenizer

IMAGE_SIZE = 16
COLOURS = {
    "red": (0.95, 0.15, 0.1),
    "green": (0.15, 0.85, 0.2),
    "blue": (0.2, 0.3, 0.95),
    "yellow": (0.95, 0.9, 0.15),
    "magenta": (0.9, 0.2, 0.85),
    "cyan": (0.15, 0.9, 0.9),
    "white": (0.95, 0.95, 0.95),
    "orange": (0.95, 0.55, 0.1),
}
SHAPES = ("square", "circle", "triangle", "cross")
SIZES = {"small": (2, 3), "large": (5, 6)}  # half-width in pixels
CAPTION_LEN = 24  # len("a large magenta triangle"): the longest caption
IMAGE_TOKEN = 0  # byte 0 never occurs in a caption
IGNORE = -100  # F.cross_entropy's default ignore_index
DATASET_SIZE = 4096


def caption(size: str, colour: str, shape: str) -> str:
    """The caption of a shape, padded with spaces to ``CAPTION_LEN``."""
    return f"a {size} {colour} {shape}".ljust(CAPTION_LEN)


def render(
    shape: str,
    colour: str,
    half: int,
    cy: int,
    cx: int,
    *,
    noise: torch.Tensor,
    image_size: int = IMAGE_SIZE,
) -> torch.Tensor:
    """One image [3, S, S]: ``shape`` of half-width ``half`` centred at (cy, cx) over ``noise``
    [3, S, S]."""
    side = torch.arange(image_size)
    y, x = torch.meshgrid(side, side, indexing="ij")  # [S, S] each
    dy = (y - cy).abs()
    dx = (x - cx).abs()
    if shape == "square":
        mask = (dy <= half) & (dx <= half)
    elif shape == "circle":
        mask = dy**2 + dx**2 <= half**2 + 1
    elif shape == "triangle":  # apex up: wider towards the bottom
        mask = (y >= cy - half) & (y <= cy + half) & (2 * dx <= y - (cy - half))
    elif shape == "cross":
        mask = ((dy <= half) & (dx <= half // 3)) | ((dx <= half) & (dy <= half // 3))
    else:
        raise ValueError(f"shape={shape!r} is not one of {SHAPES}")
    rgb = torch.tensor(COLOURS[colour])[:, None, None]  # [3, 1, 1]
    return torch.where(mask, rgb, noise).clamp(0.0, 1.0)


class ShapesDataset(Dataset):
    """``n`` samples; item i is (image [3, S, S] float32, caption [CAPTION_LEN] int64), drawn from
    (seed, i)."""

    def __init__(self, n: int = DATASET_SIZE, *, seed: int = 0, image_size: int = IMAGE_SIZE):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if image_size < 2 * max(max(v) for v in SIZES.values()) + 2:
            raise ValueError(
                f"image_size={image_size} is too small for the large shapes; use image_size >= 14"
            )
        self.n = n
        self.seed = seed
        self.image_size = image_size
        self.tokenizer = ByteTokenizer()

    def __len__(self) -> int:
        return self.n

    def describe(self, i: int) -> dict:
        """The attributes of sample i (what its caption says and where the shape is)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)

        def pick(options: tuple) -> object:
            return options[int(torch.randint(len(options), (1,), generator=g))]

        size = pick(tuple(SIZES))
        colour = pick(tuple(COLOURS))
        shape = pick(SHAPES)
        half = pick(SIZES[size])
        cy, cx = (int(c) for c in torch.randint(half, self.image_size - half, (2,), generator=g))
        return {
            "size": size,
            "colour": colour,
            "shape": shape,
            "half": half,
            "cy": cy,
            "cx": cx,
            "generator": g,
        }

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.describe(i)
        noise = 0.1 + 0.05 * torch.randn(
            3, self.image_size, self.image_size, generator=d["generator"]
        )
        image = render(
            d["shape"],
            d["colour"],
            d["half"],
            d["cy"],
            d["cx"],
            noise=noise,
            image_size=self.image_size,
        )
        text = self.tokenizer.encode(caption(d["size"], d["colour"], d["shape"]))
        return image, torch.tensor(text, dtype=torch.long)


def with_prefix(captions: torch.Tensor, n_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Captions [B, C] -> (tokens, targets), each [B, n_prefix + C]: image placeholders then the
    caption; the target at position i is token i+1 where that is a caption token, IGNORE
    elsewhere."""
    if n_prefix < 1:
        raise ValueError(f"n_prefix must be >= 1, got {n_prefix}")
    B, C = captions.shape
    placeholders = torch.full((B, n_prefix), IMAGE_TOKEN, dtype=torch.long)  # [B, P]
    tokens = torch.cat([placeholders, captions], dim=1)  # [B, P+C]
    targets = torch.full_like(tokens, IGNORE)
    targets[:, n_prefix - 1 : -1] = captions  # position P-1+j predicts caption byte j
    return tokens, targets


def rank_batches(
    *,
    steps: int,
    batch_size: int,
    n_prefix: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's first ``steps`` batches: (images [b, 3, S, S], tokens [b, L], targets [b, L]),
    b = ``batch_size``, L = ``n_prefix`` + CAPTION_LEN; across epochs as
    ``labs.data.rank_batches``."""
    # the data set is fixed; ``seed`` orders it
    dataset = ShapesDataset(seed=0, image_size=image_size)
    batches = data.rank_batches(
        steps=steps,
        batch_size=batch_size,
        seq_len=1,
        rank=rank,
        world_size=world_size,
        seed=seed,
        dataset=dataset,
    )
    return [(images, *with_prefix(captions, n_prefix)) for images, captions in batches]


def global_batches(
    *,
    steps: int,
    batch_size: int,
    n_prefix: int,
    world_size: int = 1,
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each step's global batch, the ``world_size`` ranks' batches of ``batch_size`` in rank order:
    what a single process trains on to match ``world_size`` data-parallel ranks."""
    dataset = ShapesDataset(seed=0, image_size=image_size)
    batches = data.global_batches(
        steps=steps,
        batch_size=batch_size,
        seq_len=1,
        world_size=world_size,
        seed=seed,
        dataset=dataset,
    )
    return [(images, *with_prefix(captions, n_prefix)) for images, captions in batches]
