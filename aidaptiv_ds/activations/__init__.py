"""TODO wing docstring: activations."""
