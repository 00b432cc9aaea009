"""``python -m data_prep pairs``: (query, positive, negatives) data → one format 2 stream per source.

command.py   the command: inputs cut into parts, dealt to workers, duplicates dropped, manifests written
read.py      each input format's reader, cutting a file into parts and a part into rows
compressed.py  gzip and zstd text inputs read as streams, a truncated one named
rows.py      what a row means: its columns, its checks, its pairs and their digests
dedup.py     the digests of a source's distinct pairs, by which duplicates are dropped
worker.py    a worker process or Ray actor: parses its parts, writes the new pairs to shards of its own
"""
