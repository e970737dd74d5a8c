"""Real checkpoints: Qwen2-VL and Qwen2.5-VL, loaded from safetensors (`load`), run by one
pure forward (`model`) in TransformerLens layout (`params`), fed as the reference
processor feeds them (`processor`, `positions`). `jaxmech.load_checkpoint(DIR)` opens one."""
