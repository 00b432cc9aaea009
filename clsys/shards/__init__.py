"""The shard format's one home: how a stream is written (``writer``: deterministic WebDataset tars and their
publishing), described (``manifest``: ``manifest.json`` and its rules), read (``reader``: a shard whole,
checked, safely decoded) and what each stream kind's samples must hold (``fields``). ``data_prep`` writes
streams through it and training reads them through it; it imports neither (only ``clsys.storage``).
"""
