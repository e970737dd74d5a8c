"""absl flags shared by the entry points: one flag per config field, plus aliases.

Every config field becomes a string flag (`--n_pair_labels=5`, `--lr=3e-4`,
`--layernorm=true`); its text is parsed and validated by `jaxmech.sweep`, so the error
for a bad value names the field and its allowed range.
"""

from __future__ import annotations

import os

from absl import flags, logging

from jaxmech.config import SWEEPABLE, Config
from jaxmech.sweep import ALIASES


def define_config_flags(sweep: bool) -> None:
    """Defines `--FIELD` for every config field (and the aliases) on absl's FLAGS."""
    defaults = Config().flat()
    for name in Config.field_names():
        if name == "seed":
            continue  # seeds are --seeds / --first_seed
        extra = " (a spec: a:b, a:b:step or a,b,c)" if sweep and name in SWEEPABLE else ""
        flags.DEFINE_string(name, None, f"config field (default {defaults[name]!r}){extra}")
    for alias, name in ALIASES.items():
        flags.DEFINE_string(alias, None, f"alias of --{name}")


def specs_from_flags(FLAGS) -> dict[str, str]:
    """{field: text} for the config flags the user set."""
    names = [n for n in Config.field_names() if n != "seed"] + list(ALIASES)
    specs = {n: getattr(FLAGS, n) for n in names if getattr(FLAGS, n) is not None}
    for alias, name in ALIASES.items():
        if alias in specs and name in specs:
            raise ValueError(f"--{alias} and --{name} name the same field; give one")
    return specs


def enable_compilation_cache() -> str | None:
    """Persistent XLA compilation cache, so a repeated command skips recompiling.

    Folder: $JAXMECH_CACHE_DIR (empty disables it), default ~/.cache/jaxmech/xla.
    Compiling a training program takes 10-30 s on a 2-core CPU; a cache hit ~1-2 s.
    """
    import jax

    cache = os.environ.get("JAXMECH_CACHE_DIR", os.path.expanduser("~/.cache/jaxmech/xla"))
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cache or None


def setup_runtime() -> None:
    """What every entry point does first: quiet Orbax's INFO lines, enable the cache."""
    logging.set_verbosity(logging.WARNING)
    enable_compilation_cache()
