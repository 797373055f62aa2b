"""The jobs users run: ``aidaptiv-ds train`` and ``aidaptiv-ds export``, and their parts.

``train`` is the recipe (prepare, build, train, close) over ``settings`` (its typed settings), ``failures``
(failure classes, exit codes, naming a lost peer), ``engine_report`` (what it says of the engine it built) and
``moe`` (a mixture's load-balancing loss); ``rank_env`` a rank's environment (single process, SLURM, the swap
folder); ``checkpoints`` resuming, saving and RNG state;
``run_config`` the DeepSpeed config a run gets; ``step_monitor`` the per-step series; ``train_plan`` the
fit check before launch; ``data``, ``lr_schedule``, ``evaluation``, ``record_files``,
``lora``, ``wandb_env``; ``export`` writes a checkpoint's model as a Hugging Face folder, with the config
and tokenizer files ``model_files`` writes or copies.
"""
