"""What of a storage URL may be printed. clsys names URLs in its console lines and error messages (a
library's error message quotes them too), and a URL can carry a secret: a password or a token in its
userinfo (``ftp://user:password@host/…``, ``https://TOKEN@host/…``), or a signature in its query (a
presigned ``?X-Amz-Signature=…``, an Azure SAS ``?sig=…``, ``?token=…``). ``redact`` rewrites every URL
in a text:

- the whole userinfo becomes ``***``: a user name alone is often a token (many services take one as
  the user name), and the host and path are what locate the object;
- every query value, and the fragment, become ``***``: each provider signs URLs with parameters of
  its own (X-Amz-*, X-Goog-*, sig, se, Policy, token, …); the names stay, to tell what kind of URL it was.

What clsys writes of a run for others to read (``redact_values``: its config in ``<run>/config.yaml``, a
checkpoint's clsys_state.json and TensorBoard's panels; the model card and clsys_export.json of an export,
which a user uploads to a hub) goes through it too. Nothing reads a secret back from those: the driver
resolves the config from its command line on every start, resume included, and hands it to the workers
in memory.

Local paths (file://) and s3:// keys are printed whole: there '?', '#', ':' and '@' are characters of a
name (and an s3:// URL carries no credentials: ``clsys.storage.parse`` refuses userinfo in one).

A password typed unencoded may hold '/', '?', '#' or '@', any of which ends a well-formed URL's authority
(``ftp://user:pa/ss@host/…``). So a ':' in the authority before any '@', with an '@' anywhere after it,
is taken for ``user:password``, up to the URL's last '@'. A port followed by an '@' later in the URL
(``ftp://host:21/a@b``) reads the same way: it is redacted, and refused by ``parse``, alike.
"""
from __future__ import annotations

import re

MARK = "***"
# A URL in a text ends at white space, a quote or an angle bracket; punctuation right before that end
# (the ':' of "URL: message", a closing parenthesis) is the text's, not the URL's. Its scheme is the run of
# scheme characters before "://" from its first letter (the characters before that letter are the text's). A
# match starts only where such a run starts, each part of it taken whole (possessive): tried at every letter of
# a run, as a plain pattern would, a long run of word characters with no "://" after it (a hostile tar
# member's name in an error message) took time quadratic in its length: 3 s for 20,000 characters.
_URL = re.compile(r"(?<![\w+.-])((?:(?![a-zA-Z])[\w+.-])*+)([a-zA-Z][\w+.-]*+)://([^\s'\"<>]*?)([:,;.!)\]]*)(?=[\s'\"<>]|$)")


def userinfo_end(rest: str) -> int:
    """Where the userinfo of a URL ends (the index of its '@' in ``rest``, what follows "scheme://");
    -1 when it has none."""
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if ":" in authority.partition("@")[0] and "@" in rest:
        return rest.rindex("@")  # user:password, the password maybe holding '/', '?', '#' or '@'
    return authority.rfind("@")


def _redact_url(match: re.Match) -> str:
    before, scheme, rest, trailing = match.groups()
    if scheme.lower() == "file":
        return match.group(0)
    if (end := userinfo_end(rest)) >= 0:
        rest = MARK + rest[end:]
    if scheme.lower() != "s3":
        path, query, fragment = re.fullmatch(r"([^?#]*)(?:\?([^#]*))?(#.*)?", rest, re.DOTALL).groups()
        rest = path
        if query is not None:
            rest += "?" + "&".join(_redact_param(item) for item in query.split("&"))
        if fragment:
            rest += f"#{MARK}"
    return f"{before}{scheme}://{rest}{trailing}"


def _redact_param(item: str) -> str:
    name, eq, _ = item.partition("=")
    if eq:
        return f"{name}={MARK}"
    return MARK if item else ""  # a bare item ("?TOKEN") may be the secret itself


def redact(text: str) -> str:
    """``text`` with the secrets of every URL in it replaced by ``***`` (see the module's docstring)."""
    return _URL.sub(_redact_url, text)


def redact_values(value):
    """``value`` (JSON-like: a config's ``to_dict()``, a record) with every string in it, at any depth,
    ``redact``-ed; other values as they are."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_values(item) for item in value)
    return value
