"""clsys: distributed contrastive pretraining of text encoders."""

__version__ = "0.1.0"
