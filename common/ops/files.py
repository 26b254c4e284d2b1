"""Reading a file a user named, with errors that name it the way the user gave it."""

from __future__ import annotations

import os
from pathlib import Path


def read_named(path: str | os.PathLike, name: str, kind: str = "file") -> bytes:
    """The file's bytes, or an OSError that says what `name` (a flag, "config file") was given and
    what is wrong with it: the bare errno message names neither."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{name} {path} does not exist") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{name} {path} is a directory, not a {kind}") from None
    except OSError as exc:
        raise OSError(f"{name} {path} cannot be read: {exc.strerror}") from None
