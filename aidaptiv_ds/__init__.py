"""aidaptiv-ds: fine-tune language models larger than GPU memory by streaming model state through NVMe.

The C++ engine (``aidaptiv_ds._C``) moves bytes between pinned host memory and files with io_uring;
``aidaptiv_ds.io`` is its Python face. Everything that touches DeepSpeed internals lives in
``aidaptiv_ds.zero3``.
"""

__version__ = "0.1.0"
