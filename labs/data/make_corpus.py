"""Generate ``corpus.txt``, the tiny text the course trains on (about 200 KB).

    python -m labs.data.make_corpus          # rewrites labs/data/corpus.txt (deterministic)

The text is generated, so it carries no licence questions and needs no download:
short sentences about ranks, tensors and collectives, built from templates and word
lists with a seeded random generator. It has enough structure (spelling, grammar,
recurring phrases) for a tiny model's loss to fall visibly within a few steps, and
it is the same bytes on every machine.
"""

from __future__ import annotations

import random
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

SUBJECTS = [
    "rank zero",
    "rank one",
    "rank two",
    "rank three",
    "every rank",
    "the last stage",
    "the first stage",
    "the router",
    "the optimizer",
    "the scheduler",
    "each worker",
    "the parent process",
    "the pipeline",
    "the expert",
    "the attention layer",
    "the embedding",
    "the head",
    "the launcher",
]
VERBS = [
    "sends",
    "receives",
    "reduces",
    "gathers",
    "scatters",
    "shards",
    "broadcasts",
    "averages",
    "frees",
    "saves",
    "loads",
    "computes",
    "recomputes",
    "splits",
    "prefetches",
    "overlaps",
]
OBJECTS = [
    "the gradients",
    "a bucket of gradients",
    "its shard of the weights",
    "the activations",
    "the key and value blocks",
    "the logits",
    "the optimizer state",
    "a micro-batch",
    "the tokens",
    "the partial sums",
    "the loss",
    "the parameters",
    "the attention scores",
    "the hidden states",
]
PLACES = [
    "to the next rank",
    "from the previous rank",
    "across the node",
    "inside the node",
    "over the ring",
    "before the backward pass",
    "after the forward pass",
    "during the warm-up",
    "in the steady state",
    "at the end of the step",
    "while the next layer computes",
    "on every step",
]
FACTS = [
    "A ring all-reduce sends two times n minus one over n of the tensor from every rank.",
    "Data parallelism keeps a full copy of the model on every rank and averages the gradients.",
    "ZeRO shards the optimizer state first, then the gradients, then the parameters themselves.",
    "Tensor parallelism splits each weight matrix by columns or by rows"
    " across the ranks of a node.",
    "A pipeline cuts the model into stages and feeds them micro-batches to keep every stage busy.",
    "The bubble of a pipeline shrinks when there are many more micro-batches than stages.",
    "Ring attention passes key and value blocks around the ring"
    " and merges partial softmax results.",
    "A mixture of experts sends each token to a few experts"
    " and adds their outputs with router weights.",
    "Activation checkpointing saves memory by computing the forward pass"
    " a second time in backward.",
    "The same seed gives the same weights, the same data and the same losses on every machine.",
]
NUMBERS = ["one", "two", "three", "four", "eight", "sixteen", "thirty two", "sixty four"]


def sentence(rng: random.Random) -> str:
    """One sentence: a fact, a "with n ranks" sentence, or one or two clauses from the lists."""
    kind = rng.random()
    if kind < 0.15:
        return rng.choice(FACTS)
    if kind < 0.3:
        n = rng.choice(NUMBERS)
        return (
            f"With {n} ranks, {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{rng.choice(PLACES)}."
        ).capitalize()
    clause = (
        f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}"
    )
    if rng.random() < 0.4:
        clause += f", and {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    return clause[0].upper() + clause[1:] + "."


def generate(n_bytes: int = 200_000, seed: int = 1234) -> str:
    """Paragraphs of 3 to 7 sentences until the text reaches ``n_bytes``."""
    rng = random.Random(seed)
    paragraphs = []
    size = 0
    while size < n_bytes:
        paragraph = " ".join(sentence(rng) for _ in range(rng.randint(3, 7)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 2
    return "\n\n".join(paragraphs) + "\n"


if __name__ == "__main__":
    CORPUS_PATH.write_text(generate())
    print(f"wrote {CORPUS_PATH} ({CORPUS_PATH.stat().st_size} bytes)")
