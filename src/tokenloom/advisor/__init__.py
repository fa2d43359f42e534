"""Advice for whoever runs the engine: the capacity planner and the diagnosis of a running server or a bench run."""
