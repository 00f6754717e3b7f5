"""Recipes: plain functions that run pipeline stages in order, driven by a YAML config."""
