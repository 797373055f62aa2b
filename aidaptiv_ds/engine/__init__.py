"""The engine: moving bytes between pinned host memory and a disk, and what is known of the machine.

``_C`` is the compiled C++ engine (io_uring or a POSIX thread pool, O_DIRECT, the pinned pool); ``io`` is its
Python face; ``aio_handle`` offers DeepSpeed's aio_handle interface on it; ``backend`` names the I/O backends,
``tuning`` picks block size and queue depth from measured sweeps kept in ``machine_cache``; ``file_size_limit``
turns RLIMIT_FSIZE into an error instead of a signal.

What is known of this machine is read here: ``disk`` (the mount table, which mount and block
device a folder is on, its request limits, whether O_DIRECT works there) and ``machine`` (the CPU, the GPUs
through one nvidia-smi reader, memory and its cgroup limit, the memlock and other limits, huge pages, what is
built). The harness's rows, the planner, the host budget and ``aidaptiv-ds env`` read them.
"""
