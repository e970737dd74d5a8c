"""Analyses: pure functions of (params, inputs) built on the one forward pass."""
