"""Thin absl entry points; the logic lives in jaxmech."""
