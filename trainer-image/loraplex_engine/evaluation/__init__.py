"""spec.eval: an experiment's eval set, its rows in the tick and its numbers
(docs/evaluation.md)."""
