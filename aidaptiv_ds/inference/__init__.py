"""Generation with weights streamed from NVMe and a prompt cache on the SSD (``aidaptiv-ds generate``).

:class:`Generator` is the Python face; :mod:`.sources` reads a Hugging Face folder or a checkpoint,
:mod:`.streamed` lays weights into the swap space and streams them through pinned slots, :mod:`.kv_store`
keeps prompts' keys and values on the SSD, :mod:`.command` is the command line.
"""

from aidaptiv_ds.inference.generate import GenerationError, Generator, Result  # noqa: F401
