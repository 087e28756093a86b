"""loraplex operator: packs LoRAExperiments onto hot engine pods (kopf)."""

__version__ = "0.1.0"
