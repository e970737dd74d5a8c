"""Shares one persistent XLA compilation cache between the tests and the CLI subprocesses
they start, so each distinct program is compiled once per test session."""

import os
import tempfile

_CACHE = os.environ.get("JAXMECH_CACHE_DIR") or tempfile.mkdtemp(prefix="jaxmech-test-xla-")
os.environ["JAXMECH_CACHE_DIR"] = _CACHE

from jaxmech.cli import enable_compilation_cache  # noqa: E402

enable_compilation_cache()
