"""Real checkpoints: InternVL (-hf: InternVL3-1B / 2B / 8B, InternViT-300M and a Qwen2 LM),
loaded from safetensors (`load`), run by one pure forward (`model`) in TransformerLens
layout (`params`), fed as the reference processor feeds them (`processor`, `encode`);
its learned position table and pixel shuffle in `positions`. `jaxmech.load(DIR)` opens
one."""
