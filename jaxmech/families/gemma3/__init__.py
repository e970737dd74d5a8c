"""Gemma-3 (`Gemma3ForConditionalGeneration`, model_type gemma3) as a checkpoint family:
SigLIP, the pooling projector and the Gemma-3 LM with sliding-window and global layers.
`family.FAMILY` is what the registry holds."""
