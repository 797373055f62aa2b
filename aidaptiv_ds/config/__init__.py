"""The ``"aidaptiv"`` block of a DeepSpeed config, from what the user wrote to what DeepSpeed runs.

``schema`` (the block as written: pydantic models and the parsers of sizes and budgets), ``host`` (this
node: ranks per node, a rank's budget, and the check that it fits the node's RAM and memlock limit, which
``aidaptiv_ds.engine.machine`` reads), ``settings`` (the frozen resolved settings every layer below receives,
and the one auto-chunk rule), ``translate`` (into ZeRO-3's own settings), ``resolve`` (validation with every
problem at once, and the one resolution per config), and ``ds_config`` (the parts of a DeepSpeed config the
block depends on).
"""
