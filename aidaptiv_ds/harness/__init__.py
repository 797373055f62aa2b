"""The harness: the product driven as a user drives it (the ``deepspeed`` launcher, ``aidaptiv-ds`` processes,
the files they write), never through its internals; it imports nothing of ``zero3``, ``activations`` or
``swap`` (tests/unit/test_layers.py).

``sweep`` runs a grid (``grid``) cell by cell (``sweep_cell``, ``cellrun``, ``launch``, ``outcome``), skipping
what a measured or predicted out-of-memory rules out (``sweep_skip``), under a host-memory cap (``hostcap``),
with ZeRO-Infinity at aidaptiv's memory beside it (``eqmem``), into result rows (``results``, ``machine``);
``report`` turns rows into tables (``report_tables``), comparisons with the published studies
(``report_studies``, ``published``) and figures (``report_figures``); ``run_report`` plots one run's
monitor series; ``capacity`` finds the longest sequence each backend trains; ``io_bench`` measures the I/O
engines; ``prebuild`` builds DeepSpeed's JIT ops once; ``environment`` is ``aidaptiv-ds env``.
"""
