"""Replicas of the whole engine behind a router: Ray Serve deployments and prefix-aware routing."""
