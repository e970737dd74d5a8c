"""Synthetic image-caption data: vocabularies and the 1D left/right generator."""
