"""loraplex operator: packs LoRAExperiments onto hot engine pods (kopf).

Importing the package registers no kopf handlers, so its helpers (manifests, metrics)
import without side effects; kopf runs `loraplex_operator.handlers` (the chart's
`kopf run -m`), which registers them all.
"""

__version__ = "0.1.0"
