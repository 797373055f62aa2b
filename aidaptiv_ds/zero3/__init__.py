"""The ZeRO-3 binding: everything that reaches into DeepSpeed lives here (tests/unit/test_package_seams.py)."""

from aidaptiv_ds.config import translate as _config
from aidaptiv_ds.zero3 import compat as _compat

# The translation bounds the reduce bucket further when training runs on the CPU, which only this package may
# ask DeepSpeed: registered on import, before any config is resolved in a process that trains (the start-up
# hook imports this package with deepspeed, and every path to a translation goes through it).
_config.set_host_probe(_compat.training_on_host)
