"""The operator's API types (Kueue's ``apis/``): typed models of the ``EnginePool`` spec
and of both kinds' statuses, from which ``scripts/gen_crds.py`` generates the CRDs'
schemas (``make crds``), and through which the operator reads pools and writes statuses.

A field's type, bounds, default, description and CEL rules are stated once, here; the
CRD (the API server's validation and defaulting) and the operator's reading of a pool
both follow from it. The ``LoRAExperiment`` spec lives with the engine
(``loraplex_engine/spec/experiment.py``), which validates it without a cluster.
"""
