"""Plug-ins the platform installs in the engine's image (not tenants): reward functions
(entry-point group ``loraplex.rewards``) and environments (``loraplex.environments``, or an
installed skyrl-gym environment id).

Plug-in code never runs in the engine's process: each experiment that names one gets a
worker process of its own (environments/worker.py: it runs the environments too), and
every call to it has a wall-clock bound (host.py). Kept free of imports.
"""
