"""Recipes: whole pipelines over the library, importable from any Dask client.

``grpo.run(client, cfg, run_dir)`` trains (or resumes) a run; ``replay.run(client, cfg, archive,
out_dir)`` trains again from a run's archive. ``pipelines/`` holds the short scripts that submit them.
"""
