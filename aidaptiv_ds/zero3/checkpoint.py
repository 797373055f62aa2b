"""Checkpoints of the swapped state (placeholder until implemented)."""


def save(engine, runtime, save_dir, tag):
    raise NotImplementedError("aidaptiv checkpoints are not implemented yet")


def load(engine, runtime, load_dir, tag, load_optimizer_states=True):
    raise NotImplementedError("aidaptiv checkpoints are not implemented yet")
