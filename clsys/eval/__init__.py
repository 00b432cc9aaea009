"""Evaluation of a text encoder, as training, the driver and ``python -m clsys.evaluate`` run it: STS scores
(``sts``) on the sets ``sts_data`` reads, cross-lingual retrieval (``retrieval``: XQuAD, Tatoeba, re-ranking), and
retrieval over BEIR / MTEB folders (``beir``: nDCG@10, MRR@10, Recall@100)."""
