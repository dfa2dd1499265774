"""Ops Planner: planned maintenance with advance notice and a deadline (Twine §2.5)."""
