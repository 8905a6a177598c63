"""The search for a plan: the user's pins, the planner that composes memory, speed and features,
the layout search and ranking, the plan's assembly, and re-planning after a failed start.
"""
