"""A photograph as a checkpoint's processor reads it, for every checkpoint family: uint8
RGB (`read_image`), the normalisation as a table of every uint8 level's value per
channel (`pixel_table`, `fused_pixel_table`: the reference's two ways of computing it),
and patches kept as uint8 levels until the device decodes them (`decode_pixels`,
`decoded`: a quarter of the bytes held while a report's questions wait for their
chunk)."""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def read_image(image) -> np.ndarray:
    """uint8 [H, W, 3] RGB of a path, a PIL image or an array ([H, W, 3] uint8, or floats
    in [0, 1])."""
    if isinstance(image, (str, os.PathLike)):
        if not os.path.exists(image):
            raise ValueError(f"image = {str(image)!r}: no such file")
        with Image.open(image) as im:
            return np.asarray(im.convert("RGB"))
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    x = np.asarray(image)
    if x.ndim != 3 or x.shape[-1] != 3:
        raise ValueError(f"image: shape {x.shape}, expected [H, W, 3]")
    if x.dtype != np.uint8:
        if x.min() < 0 or x.max() > 1:
            raise ValueError("image: float values outside [0, 1]")
        x = np.rint(x * 255).astype(np.uint8)
    return x


def pixel_table(mean, std) -> np.ndarray:
    """float32 [3, 256]: each channel's normalised value of every uint8 level, computed
    as the reference does (rescale in float64, cast, then (x - mean) / std in float32),
    so a patch's values are `table[channel, code]` exactly (`decode_pixels`)."""
    v = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)[:, None]
    return np.ascontiguousarray(
        ((v - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).T
    )


def fused_pixel_table(mean, std) -> np.ndarray:
    """float32 [3, 256]: the value of every uint8 level as the reference's torchvision
    image processors compute it, rescale and normalise fused in float32: (level - 255
    mean) / (255 std), mean and std taken to float32 first (LLaVA's and InternVL's
    default processors; Qwen's rescales first: `pixel_table`)."""
    mean = np.asarray(mean, np.float32) * np.float32(255)
    std = np.asarray(std, np.float32) * np.float32(255)
    return (np.arange(256, dtype=np.float32)[None] - mean[:, None]) / std[:, None]


def decode_pixels(codes_BxPxF, table_3x256, features_per_channel: int):
    """float32 [B, P, F] the normalised values of uint8 codes whose features run channel
    by channel (`features_per_channel` each), in or outside jit."""
    import jax.numpy as jnp

    F = codes_BxPxF.shape[-1]
    channel_F = jnp.arange(F) // features_per_channel
    return jnp.asarray(table_3x256)[channel_F, jnp.asarray(codes_BxPxF).astype(jnp.int32)]


def decoded(inputs, field: str, table_3x256, features_per_channel: int):
    """`inputs` (a NamedTuple) with its pixels `field` decoded (`decode_pixels`) where
    they are uint8 codes (a view's rendered batches), else as they are: what every
    checkpoint view's forward does first."""
    x = getattr(inputs, field)
    if x.dtype != np.uint8:
        return inputs
    return inputs._replace(**{field: decode_pixels(x, table_3x256, features_per_channel)})


def normalise(levels_uint8, mean, std) -> np.ndarray:
    """float32 values of uint8 `levels` [..., F] whose features run channel by channel."""
    x = np.ascontiguousarray(levels_uint8)
    per_channel = x.shape[-1] // 3
    return pixel_table(mean, std)[np.arange(x.shape[-1]) // per_channel, x]
