"""Evaluation of a text encoder, as training, the driver and ``python -m clsys.evaluate`` run it: STS scores
(``sts``) on the sets ``sts_data`` reads, and cross-lingual retrieval (``retrieval``: XQuAD, Tatoeba, re-ranking)."""
