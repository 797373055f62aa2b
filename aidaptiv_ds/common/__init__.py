"""Leaves of the house: modules that import nothing of ours.

``sizes`` (units, alignment, dtype widths, size strings), ``durable`` (fsync'd files and atomic renames),
``malloc_threshold`` (glibc heap settings), ``metrics`` (peak memory, monitor series).
"""
