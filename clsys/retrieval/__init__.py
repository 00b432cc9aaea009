"""Retrieval over a corpus held in parts (chunks in one process, slices on other processes), and hard-negative
mining built on it: ``topk`` (the exact top-k of a corpus from the top-k of its parts, what a recipe's retrieval
bank and the miner share), ``corpus`` (which texts a mining run embeds, each numbered by its digest and owned by
one worker), ``negatives`` (the false-negative filter), ``worker`` (a mining worker: its slice's embeddings and
their top-k), ``work`` (the progress a mining run keeps under its output, to be continued). ``python -m
clsys.mine`` runs them on Ray."""
