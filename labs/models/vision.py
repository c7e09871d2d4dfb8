"""A vision-language model: a small ViT image encoder, a projector, and the course decoder.

    images [B, 3, S, S] --encoder--> patch features [B, P, E] --projector--> prefix [B, P, H]
    tokens [B, P + C]: P image placeholders, then the caption (labs.data.shapes)
    decoder input = concat(prefix, tok_emb(caption)) [B, P + C, H]
        --> course decoder --> logits [B, P + C, V]

The encoder is SigLIP's vision tower (Zhai et al. 2023; ``transformers``' ``SiglipVisionModel`` with
``vision_use_head=False``, module for module, and a test checks they agree): a patch embedding (a
convolution with stride = kernel = patch size, i.e. one linear map per patch), learned position
embeddings, pre-norm blocks of bidirectional multi-head attention and a GELU MLP, with biases and
LayerNorm. The projector is LLaVA-1.5's two-layer MLP (Liu et al. 2023, "Improved Baselines with
Visual Instruction Tuning"); each patch becomes one prefix token, as in LLaVA. The decoder is the
course model unchanged (``labs.models.transformer``): the image tokens take the placeholders' places
and the causal decoder reads them before the caption, so every caption token can attend to the whole
image.

The parts differ in shape, which is the point of notebook 11: the encoder sees P patches at width E
with full attention, the decoder P + C tokens at width H causally, and only the decoder has the
vocabulary.

Shape legend: B batch, S image side, P patches (= prefix tokens), E encoder width, C caption tokens,
L = P + C decoder tokens, H decoder width, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from labs.data import shapes
from labs.models.transformer import ModelConfig, build_model, compute_dtype, run_blocks

if TYPE_CHECKING:
    from transformers import SiglipVisionModel


@dataclass(frozen=True)
class VisionConfig:
    image_size: int = 16  # S: square images
    patch_size: int = 4  # P = (S / patch)^2 patches: 16
    channels: int = 3
    n_layer: int = 2
    n_embd: int = 64  # E
    n_head: int = 4
    mlp_hidden: int = 128
    norm_eps: float = 1e-6  # SigLIP's

    def __post_init__(self):
        for name in (
            "image_size",
            "patch_size",
            "channels",
            "n_layer",
            "n_embd",
            "n_head",
            "mlp_hidden",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"VisionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}"
            )
        if self.n_embd % self.n_head:
            raise ValueError(
                f"VisionConfig n_embd={self.n_embd} is not divisible by n_head={self.n_head}"
            )

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size**2


@dataclass(frozen=True)
class MultimodalConfig:
    vision: VisionConfig = field(default_factory=VisionConfig)
    # 4 layers: a stage each on 4 ranks
    decoder: ModelConfig = field(default_factory=lambda: ModelConfig(n_layer=4))
    caption_len: int = shapes.CAPTION_LEN

    def __post_init__(self):
        if self.seq_len > self.decoder.seq_len:
            raise ValueError(
                f"the decoder reads n_prefix + caption_len = {self.seq_len} tokens but its rotary"
                f" table has decoder.seq_len={self.decoder.seq_len};"
                f" use decoder.seq_len >= {self.seq_len}"
            )

    @property
    def n_prefix(self) -> int:
        return self.vision.n_patches

    @property
    def seq_len(self) -> int:
        return self.n_prefix + self.caption_len


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            cfg.channels, cfg.n_embd, cfg.patch_size, stride=cfg.patch_size
        )
        self.position_embedding = nn.Embedding(cfg.n_patches, cfg.n_embd)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(images)  # [B, E, S/p, S/p]
        x = x.flatten(2).transpose(1, 2)  # [B, P, E]
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention: every patch sees every patch."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, P, E = x.shape
        q, k, v = (
            proj(x).view(B, P, self.n_head, -1).transpose(1, 2)  # [B, nh, P, hd] each
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v)  # [B, nh, P, hd]
        return self.out_proj(y.transpose(1, 2).reshape(B, P, E))  # [B, P, E]


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, cfg.mlp_hidden)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # [B, P, F_enc] -> [B, P, E]


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """images [B, C, S, S] -> patch features [B, P, E]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.layers = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.n_layer))
        self.post_layernorm = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(images)  # [B, P, E]
        for block in self.layers:
            x = block(x)
        return self.post_layernorm(x)


class Projector(nn.Module):
    """LLaVA-1.5's projector: Linear(E, H) -> GELU -> Linear(H, H), one prefix token per patch."""

    def __init__(self, vision_embd: int, text_embd: int):
        super().__init__()
        self.fc1 = nn.Linear(vision_embd, text_embd)
        self.fc2 = nn.Linear(text_embd, text_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # [B, P, E] -> [B, P, H]


def fuse(decoder: nn.Module, prefix: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's input: the image prefix [B, P, H] in place of the placeholders, then the
    embedded caption: [B, P + C, H]. Any decoder with a ``tok_emb`` (a tensor-parallel one too)."""
    return torch.cat([prefix, decoder.tok_emb(tokens[:, prefix.shape[1] :])], dim=1)  # [B, L, H]


def decode(decoder: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The course decoder after its embedding: the blocks, norm and head, [B, L, H] -> logits [B, L,
    V] (a tensor-parallel decoder returns its vocabulary shard [B, L, V/tp])."""
    return decoder.lm_head(decoder.norm(run_blocks(decoder.layers, h, decoder.cfg)))


def caption_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the caption positions (targets != IGNORE), in at least fp32
    (``compute_dtype``)."""
    wide = logits.to(compute_dtype(logits.dtype))
    return F.cross_entropy(wide.flatten(0, 1), targets.flatten(), ignore_index=shapes.IGNORE)


class MultimodalModel(nn.Module):
    """``encoder`` -> ``projector`` -> ``decoder`` (the course ``Transformer``)."""

    def __init__(self, cfg: MultimodalConfig, decoder: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.encoder = VisionEncoder(cfg.vision)
        self.projector = Projector(cfg.vision.n_embd, cfg.decoder.n_embd)
        self.decoder = decoder

    def forward(
        self, images: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """images [B, C, S, S], tokens [B, L] -> logits [B, L, V]; with targets also the caption
        loss."""
        prefix = self.projector(self.encoder(images))  # [B, P, H]
        logits = decode(self.decoder, fuse(self.decoder, prefix, tokens))  # [B, L, V]
        return logits if targets is None else (logits, caption_loss(logits, targets))


def init_vision(module: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Deterministic initialisation from ``seed``: N(0, std) for every weight with >= 2 dims (the
    patch convolution, linear layers, position table), zero biases, LayerNorm weight 1 and bias
    0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.fill_(1.0 if ("norm" in name and name.endswith("weight")) else 0.0)
    return module


def build_multimodal(
    cfg: MultimodalConfig, seed: int = 0, device: torch.device | str = "cpu"
) -> MultimodalModel:
    """The model with weights from ``seed``: the decoder is ``build_model(cfg.decoder, seed)``, the
    course model itself; encoder and projector are drawn from ``seed + 1``."""
    model = MultimodalModel(cfg, build_model(cfg.decoder, seed=seed))
    init_vision(model.encoder, seed + 1)
    init_vision(model.projector, seed + 1_000_003)
    return model.to(device)


@torch.no_grad()
def describe(model: MultimodalModel, images: torch.Tensor) -> list[str]:
    """Greedy captions for ``images`` [B, C, S, S] (what the model says it sees)."""
    cfg = model.cfg
    tok = shapes.ByteTokenizer()
    tokens = torch.full((images.shape[0], cfg.n_prefix), shapes.IMAGE_TOKEN, dtype=torch.long)
    prefix = model.projector(model.encoder(images))
    for _ in range(cfg.caption_len):
        logits = decode(model.decoder, fuse(model.decoder, prefix, tokens))  # [B, L, V]
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return [tok.decode(row[cfg.n_prefix :]).rstrip() for row in tokens]


def hf_siglip_name(name: str) -> str:
    """The ``transformers.SiglipVisionModel`` name of an encoder parameter
    (``layers.0.mlp.fc1.weight`` -> ``encoder.layers.0.mlp.fc1.weight``; embeddings and
    post_layernorm keep theirs)."""
    return name.replace("layers.", "encoder.layers.", 1) if name.startswith("layers.") else name


def to_hf_siglip(encoder: VisionEncoder) -> SiglipVisionModel:
    """A ``SiglipVisionModel`` (no pooling head) holding copies of ``encoder``'s weights."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    c = encoder.cfg
    hf = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=c.n_embd,
            intermediate_size=c.mlp_hidden,
            num_hidden_layers=c.n_layer,
            num_attention_heads=c.n_head,
            num_channels=c.channels,
            image_size=c.image_size,
            patch_size=c.patch_size,
            layer_norm_eps=c.norm_eps,
            hidden_act="gelu_pytorch_tanh",
            vision_use_head=False,
            attn_implementation="sdpa",
        )
    )
    state = {hf_siglip_name(n): p.detach() for n, p in encoder.named_parameters()}
    missing = set(hf.state_dict()) - set(state)
    if missing:
        raise ValueError(
            f"SigLIP parameters without a counterpart in the encoder: {sorted(missing)}"
        )
    hf.load_state_dict(state, strict=False)
    return hf.eval()
