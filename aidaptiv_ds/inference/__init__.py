"""Generation with weights streamed from NVMe and a prompt cache on the SSD (``aidaptiv-ds generate``).

:class:`Generator` is the Python face; :mod:`.sources` reads a Hugging Face folder or a checkpoint,
:mod:`.streamed` lays weights into the swap space and streams them through pinned slots (its parts:
:mod:`.weight_groups`, the parameter groups; :mod:`.weight_plan`, where each group lives; :mod:`.weight_layout`,
the groups written to memory and the swap file; :mod:`.weight_codec`, the lossless encoding of streamed layers),
:mod:`.expert_units`, :mod:`.expert_cache` and :mod:`.checkpoint_names` read a mixture-of-experts model's
routed experts one by one as its routers choose them, :mod:`.kv_store` keeps prompts' keys and values on the SSD;
the command line is :mod:`aidaptiv_ds.commands.generate`.
"""

from aidaptiv_ds.inference.generate import GenerationError, Generator, Result  # noqa: F401
