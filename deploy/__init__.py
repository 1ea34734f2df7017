"""Deployment recipes: deploy/cluster.py (replicas behind HAProxy) and its config template."""
