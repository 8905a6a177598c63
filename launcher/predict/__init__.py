"""Pure predictions and decisions: the budget and performance models, the planner, capacity, and
what measurements teach them.
"""
