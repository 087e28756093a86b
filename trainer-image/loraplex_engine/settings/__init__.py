"""The engine's configuration as typed objects: one definition per setting, from which
the `serve`/`run` flags, the ``LORAPLEX_*`` variables, their help and the worker ranks'
argv are all generated (settings/cli.py). Light on purpose: no torch, so a bad flag is
reported before the heavy imports."""
