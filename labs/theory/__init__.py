"""Pure formulas (no torch): parameters, memory, FLOPs, communication, bubbles, the planner."""
