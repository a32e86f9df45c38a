"""Placement on a Ray cluster: the config, the actors, the run on Ray, its rollout and weight sync."""
