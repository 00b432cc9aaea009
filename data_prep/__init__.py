"""Offline data preparation for clsys: raw corpora → WebDataset shards + manifest (``python -m data_prep``)."""

__version__ = "0.1.0"
