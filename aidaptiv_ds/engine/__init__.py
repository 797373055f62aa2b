"""The engine: moving bytes between pinned host memory and a disk, and what is known of that disk.

``_C`` is the compiled C++ engine (io_uring or a POSIX thread pool, O_DIRECT, the pinned pool); ``io`` is its
Python face; ``aio_handle`` offers DeepSpeed's aio_handle interface on it; ``backend`` names the I/O backends,
``tuning`` picks block size and queue depth from measured sweeps kept in ``machine_cache``; ``disk`` says which
mount and block device a folder is on and whether O_DIRECT works there; ``file_size_limit`` turns RLIMIT_FSIZE
into an error instead of a signal.
"""
