"""The contract every layer may import and that imports none of them: the
LoRAExperiment spec (spec/experiment.py) and its blocks, the schema helpers, the API's
types and errors, the engine service protocols (spec/service.py, spec/training_service.py).
No torch, no concern of the engine: see layers.py."""
