"""One policy update for many adapters: the step, losses and advantage estimators, the per-adapter
optimiser, LR schedules, training strategies.
"""
