"""How messages show a name that comes from data: a tar member's, a block's column, a manifest's shard.

Such a name has no bound: a PAX header gives a member a name of any length (1 MiB of it fits in a 2 KB
``.tar.gz``), and a message that quoted it whole would be a line of megabytes in every log that holds it.
"""
from __future__ import annotations

NAME_CHARS = 200  # the most characters of a name a message shows


def clip(name: str) -> str:
    """``name`` whole when it is at most ``NAME_CHARS`` characters long, else its start and its end around an
    ellipsis, followed by its length: both ends, as a key or a URL tells itself apart at either."""
    if len(name) <= NAME_CHARS:
        return name
    half = NAME_CHARS // 2
    return f"{name[:half]}…{name[-half:]} ({len(name):,} characters)"
