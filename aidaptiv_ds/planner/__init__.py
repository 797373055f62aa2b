"""The planner: before a launch, whether a job fits, how fast it will run, and the config to run it with.

``aidaptiv-ds plan`` (:mod:`.command`) puts together the model's shape (:mod:`.shapes`), the bytes each
backend needs where (:mod:`.memory`), this machine's measured rates (:mod:`.rates`), the step-time bound
(:mod:`.predict`) and the table or JSON (:mod:`.render`). Nothing here imports DeepSpeed, and torch only
inside the probes, so ``aidaptiv-ds train`` (its launch guard) and the sweep (predicted OOM) use it too.
"""
