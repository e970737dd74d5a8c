"""Real checkpoints: LLaVA-1.5 (CLIP ViT with a learned position table, a two-layer
projector, a Llama LM), loaded from safetensors (`load`), run by one pure forward
(`model`) in TransformerLens layout (`params`), fed as the reference processor feeds it
(`processor`). `jaxmech.load(DIR)` opens one."""
