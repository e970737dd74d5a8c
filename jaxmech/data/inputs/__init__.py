"""The checkpoint input pipeline: pixels, prompts, the reference's resize, drawn
pictures and image twins (what a loaded VLM is shown)."""
