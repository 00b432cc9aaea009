"""The S3 backend (``s3://bucket/key``, any S3-compatible server).

store.py   the backend: objects, listings, multipart uploads, compare-and-swap by conditional requests
client.py  the client (one per process, retrying every request) and its failures as StorageErrors naming the URL
reader.py  a stream over one object that resumes a body broken while it is read
"""
