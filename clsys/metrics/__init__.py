"""Training health: what rank 0 logs to TensorBoard and how (``health``: the writer, throughput, FLOP/s and MFU,
the collapse alarm), and the event files' copy on the run's storage (``event_sync``)."""
