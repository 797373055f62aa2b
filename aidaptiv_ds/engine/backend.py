"""Which engine does the I/O: the one ``Backend`` enum of the package.

The ``"aidaptiv"`` config block, the ``AIDAPTIV_BACKEND`` variable and the engine's Python face
(:mod:`aidaptiv_ds.engine.io`) all name backends with it. It lives apart from :mod:`aidaptiv_ds.engine.io` so that the
config can be validated without loading the compiled engine.
"""

from __future__ import annotations

import enum
from typing import Union


class Backend(str, enum.Enum):
    """Which engine does the I/O. AUTO tries io_uring and falls back to POSIX, saying why."""

    IO_URING = "io_uring"
    POSIX = "posix"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: Union[str, "Backend"], source: str = "backend") -> "Backend":
        """A backend from its name (case-insensitive; "uring", "iouring" and "io-uring" mean io_uring)."""
        if isinstance(value, Backend):
            return value
        name = str(value).strip().lower()
        aliases = {"uring": "io_uring", "iouring": "io_uring", "io-uring": "io_uring"}
        try:
            return cls(aliases.get(name, name))
        except ValueError:
            raise ValueError(f"{source} {value!r} is not a backend: expected auto, io_uring or posix") from None
