"""Engines: model replicas that serve generation requests."""
