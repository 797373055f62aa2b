"""`aidaptiv-ds train` with one fault injected at a chosen point: the job the fault-injection suite runs.

    python tests/faults/fault_job.py FAULT[+FAULT...] STEP [DELAY_S] -- TRAIN ARGS...

STEP counts optimizer steps of this process from 0; DELAY_S (default 0) waits that long into the step
before the fault (kill9-step). The faults, each as a real job would meet it:

  eio-read       from the forward of STEP on, every pread(2) fails with EIO (a seccomp filter on all threads:
                 the POSIX backend's reads of the swap files; run it with backend "posix")
  eio-write      from the optimizer step of STEP on, every pwrite(2) fails with EIO (same, for writes)
  fsize-step     at the optimizer step of STEP the file-size limit (ulimit -f) drops to 1 MiB: every swap
                 write past it fails with EFBIG (a disk that is full for this job)
  fsize-save     the same, just before the checkpoint saved after STEP
  kill9-step     SIGKILL DELAY_S seconds into STEP's forward
  delete-swap    the swap files are unlinked before STEP's forward (the data lives on in the open files)
  truncate-swap  the parameter swap file is truncated to 0 bytes before STEP's forward
  no-memlock     from the start: mlock and io_uring buffer registration refused with ENOMEM, as a small
                 ulimit -l refuses them (the pool runs unlocked, io_uring without fixed buffers)
  no-uring       from the start: io_uring_setup refused with EPERM, as container runtimes do (posix fallback)
  hold           not a fault: before STEP's forward, create ./holding and wait (up to 5 minutes) for ./release,
                 so that a test can run a second job while this one surely holds its swap space
  none           no fault

The filters are installed with seccomp (x86_64 and aarch64); they cannot be removed, which is the point:
the job must end with a clear error, not limp on.
"""

import ctypes
import errno
import os
import platform
import resource
import signal
import struct
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

ARCH = {
    "x86_64": (
        0xC000003E,
        {"pread64": 17, "pwrite64": 18, "mlock": 149, "mlock2": 325, "io_uring_setup": 425, "io_uring_register": 427},
    ),
    "aarch64": (
        0xC00000B7,
        {"pread64": 67, "pwrite64": 68, "mlock": 228, "mlock2": 284, "io_uring_setup": 425, "io_uring_register": 427},
    ),
}
IORING_REGISTER_BUFFERS = 0


def seccomp_refuse(rules):
    """Make syscalls fail: rules are (name, errno, opcode or None); with an opcode only calls whose second
    argument is that opcode fail. Applied to every thread of the process (TSYNC)."""
    arch, numbers = ARCH[platform.machine()]

    def insn(code, jt, jf, k):
        return struct.pack("HBBI", code, jt, jf, k)

    allow = insn(0x06, 0, 0, 0x7FFF0000)
    prog = [insn(0x20, 0, 0, 4), insn(0x15, 1, 0, arch), allow]  # another arch: allow
    for name, err, opcode in rules:
        prog.append(insn(0x20, 0, 0, 0))  # A = syscall number
        if opcode is None:
            prog += [insn(0x15, 0, 1, numbers[name]), insn(0x06, 0, 0, 0x00050000 | err)]
        else:
            prog += [
                insn(0x15, 0, 3, numbers[name]),
                insn(0x20, 0, 0, 24),  # A = low half of args[1]
                insn(0x15, 0, 1, opcode),
                insn(0x06, 0, 0, 0x00050000 | err),
            ]
    prog.append(allow)
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(code) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, prog): every thread, the engine's included.
    nr = 317 if platform.machine() == "x86_64" else 277
    if libc.syscall(nr, 1, 1, ctypes.byref(fprog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


def swap_files(args):
    root = args[args.index("--nvme-path") + 1] if "--nvme-path" in args else None
    found = []
    for dirpath, _, files in os.walk(root or "."):
        found += [os.path.join(dirpath, f) for f in files if f.endswith(".swp")]
    return found


def main():
    sep = sys.argv.index("--")
    faults, step = set(sys.argv[1].split("+")), int(sys.argv[2])
    delay = float(sys.argv[3]) if sep > 3 else 0.0
    train_args = sys.argv[sep + 1 :]
    if "no-memlock" in faults:
        seccomp_refuse(
            [
                ("mlock", errno.ENOMEM, None),
                ("mlock2", errno.ENOMEM, None),
                ("io_uring_register", errno.ENOMEM, IORING_REGISTER_BUFFERS),
            ]
        )
    if "no-uring" in faults:
        seccomp_refuse([("io_uring_setup", errno.EPERM, None)])

    from aidaptiv_ds import cli
    from aidaptiv_ds.job import checkpoints, train

    def at_forward(i):
        if i != step:
            return
        if "eio-read" in faults:
            seccomp_refuse([("pread64", errno.EIO, None)])
        elif "kill9-step" in faults:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        elif "delete-swap" in faults:
            for path in swap_files(train_args):
                os.unlink(path)
        elif "hold" in faults:
            open("holding", "w").close()
            deadline = time.time() + 300
            while not os.path.exists("release") and time.time() < deadline:
                time.sleep(0.05)
        elif "truncate-swap" in faults:
            for path in swap_files(train_args):
                if path.endswith("params.swp"):
                    os.truncate(path, 0)

    def at_step(i):
        if i != step:
            return
        if "eio-write" in faults:
            seccomp_refuse([("pwrite64", errno.EIO, None)])
        elif "fsize-step" in faults:
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    build = train.Run.build

    def build_with_faults(self):
        build(self)
        engine, counts = self.engine, {"forward": 0, "step": 0}
        forward, step_fn = engine.forward, engine.step

        def faulty_forward(*a, **k):
            at_forward(counts["forward"])
            counts["forward"] += 1
            return forward(*a, **k)

        def faulty_step(*a, **k):
            at_step(counts["step"])
            counts["step"] += 1
            return step_fn(*a, **k)

        engine.forward, engine.step = faulty_forward, faulty_step

    save = checkpoints.RunCheckpoints.save

    def save_with_faults(self, at, position, losses, save_dir=None):
        if "fsize-save" in faults and at == step + 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return save(self, at, position, losses, save_dir)

    train.Run.build, checkpoints.RunCheckpoints.save = build_with_faults, save_with_faults
    return cli.main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main())
