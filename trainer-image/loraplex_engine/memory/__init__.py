"""How much fits: the planner, the capacity plan, the fake-tensor tracker."""
