"""Llama-3.2-Vision (`model_type` mllama): a tiled ViT with gated tile embeddings, a
linear projector, and a Llama LM that reads the image through gated cross-attention
layers (the image never enters the token sequence)."""
