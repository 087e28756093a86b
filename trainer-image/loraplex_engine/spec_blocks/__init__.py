"""The experiment spec's blocks that have their own module (spec.py composes them): the
algorithm, checkpoint, client (a model its Tinker client trains), plug-in and tracking
blocks."""
