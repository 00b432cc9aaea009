"""Losses that are not tied to one objective (see ``pairwise`` for CSS-LM's pair classifiers)."""
