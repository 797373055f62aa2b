"""The swap core, free of DeepSpeed: where state lives on disk and in the host budget.

``space`` (the locked folder, its files and extents), ``host_memory`` (the pinned budget, write-behind,
slot pools), ``store`` (ordering of requests that overlap on disk), ``layer_group_cache``, the layouts of
parameter partitions (``partition_layout``) and optimizer chunks (``chunk_layout``), and how a run's budget
is split (``budget_split``) and what the GPU retains between forward and backward (``retention``).
``checkpoint_format`` is the layout of a checkpoint of that state and its reader, and ``checkpoint_verify`` its
checksums and finite-value checks, shared by the save and load (``zero3``), the export (``job``) and generation
(``inference``).
"""
