"""The jobs users run: ``aidaptiv-ds train`` and ``aidaptiv-ds export``, and their parts.

``train`` is the recipe (prepare, build, train, close); ``args`` its flags and exit codes; ``rank_env`` a
rank's environment (single process, SLURM, the swap folder); ``checkpoints`` resuming and RNG state;
``train_plan`` the fit check before launch; ``data``, ``lr_schedule``, ``evaluation``, ``record_files``,
``lora``, ``wandb_env``; ``export`` writes a checkpoint's model as a Hugging Face folder, with the config
and tokenizer files ``model_files`` writes or copies.
"""
