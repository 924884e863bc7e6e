"""Our schedulers inside vLLM: ``scheduler.TwinserveScheduler`` is a ``--scheduler-cls`` for vLLM 0.32 that runs a
twinserve Scheduler plugin (chosen by the project's Hydra overrides) on vLLM's own queues and KV cache manager.

Only ``scheduler`` imports vLLM; ``plugin`` (the Hydra side) and ``support`` (the version range and the refused
features) are plain Python, importable from the project's venv. docs/serving.md says what is mirrored and what not.
"""
