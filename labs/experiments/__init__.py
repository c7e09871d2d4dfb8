"""Experiments: each runs one lab on N ranks and checks it against reference, theory and torch."""
