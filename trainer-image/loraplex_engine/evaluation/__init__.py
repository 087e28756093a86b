"""spec.eval: an experiment's eval set and its rows in the tick (docs/evaluation.md); the
block itself and its numbers are spec/eval.py's and spec/eval_scores.py's."""
