"""`loraplex-engine run`: experiments from manifests on one local engine."""
