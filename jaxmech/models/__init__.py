"""Models: explicit-parameter attention, interventions as data, the dual encoder."""
