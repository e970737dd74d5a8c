"""Synthetic image-caption tasks: vocabularies, the 1D, 2D and three-object generators,
and the grouped validation-set layout they share (`grouped`); `tasks` registers them."""
