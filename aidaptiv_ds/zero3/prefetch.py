"""Layer-group prefetch: while group g computes, groups g+1 .. g+depth are being read.

ZeRO-3's parameter coordinator calls ``fetch_sub_module(module, forward)`` before every module runs (in
forward, in backward, and in activation-checkpoint recomputation). We wrap that call: the module's layer
group tells where the pass is, and the pass direction (forward, or backward between ZeRO-3's backward
prologue and epilogue) tells which groups come next. DeepSpeed's own NVMe prefetch, which queues single
partitions and can queue one twice, is switched off.
"""

from __future__ import annotations

from aidaptiv_ds.zero3 import compat


class LayerGroupPrefetcher:
    def __init__(self, runtime, module):
        self.runtime = runtime
        self.cache = runtime.param_swapper.cache
        plan = getattr(runtime, "plan", None)  # the plan may lower the configured depth to fit the budget
        self.depth = plan.prefetch_depth if plan is not None else runtime.cfg.prefetch_depth
        self.current = None  # the layer group of the last module fetched
        records = runtime.param_swapper.records
        self.module_group = {}
        for m in module.modules():
            for p in m.parameters():  # the first partition of the subtree we hold decides
                rec = records.get(getattr(p, "ds_id", None))
                if rec is not None and rec.group is not None:
                    self.module_group[id(m)] = rec.group.index
                    break

    def attach(self, coordinator) -> None:
        compat.disable_deepspeed_nvme_prefetch(coordinator)
        original = coordinator.fetch_sub_module

        def fetch_sub_module(current_submodule, forward=True):
            self.on_fetch(current_submodule, forward)
            return original(current_submodule, forward)

        coordinator.fetch_sub_module = fetch_sub_module

    def window(self, g: int):
        groups = self.cache.groups
        step = -1 if self.runtime.phase == "backward" else 1
        return [groups[i] for i in (g + k * step for k in range(self.depth + 1)) if 0 <= i < len(groups)]

    def on_fetch(self, module, forward) -> None:
        g = self.module_group.get(id(module))
        if g is None or not self.cache.planned:
            return
        if g != self.current and self.runtime.phase == "backward":
            # The backward's peak builds up group by group (its activations freed, gradients made): give
            # the heap's holes back as each group starts (SwapRuntime.release_heap).
            self.runtime.release_heap()
        self.current = g
        self.cache.prefetch(self.window(g))

    def start_of_pass(self) -> None:
        """After the optimizer step: start reading the first groups of the next forward."""
        if self.cache.planned and self.cache.groups:
            self.cache.prefetch(self.cache.groups[: self.depth + 1])
