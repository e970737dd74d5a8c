"""Sweeps: a grid of models from command-line specs, trained resumably into one results
folder. One idea per module:

- `spec`: parse field values (`a:b`, `a:b:step`, `x,y,z`) and expand a `Grid` of models;
- `init_from`: fine-tune starts (`InitFrom`: a finished run's params instead of a fresh
  init) and their checks, before any compute;
- `until`: `--seeds_until`, seeds trained until enough models pass a rule fixed before
  training, and the selection it writes;
- `record`: the sweep's identity (`identity`: what `sweep.json` records) and how a
  folder differs from it (`sweep_difference`);
- `runs`: `run_grid`, chunked resumable training (saves, lock, staging folder);
- `folder`: opening a sweep's folder (new, resumed, finished, reopened by a raised cap);
- `reuse`: a finished `--seeds_until` run's models kept when its cap is raised;
- `processes`: several processes, process 0 the only one that reads and writes.

The names below are what the rest of jaxmech, the entry points and the tests import from
`jaxmech.sweep`.
"""

from jaxmech.outdir import SweepMismatchError
from jaxmech.sweep.init_from import InitFrom, check_init_from, params_fingerprint
from jaxmech.sweep.processes import OtherProcessError
from jaxmech.sweep.record import default_chunk_size, identity, sweep_difference
from jaxmech.sweep.runs import run_grid
from jaxmech.sweep.spec import ALIASES, Grid, coerce, expand, finite_steps, parse_spec
from jaxmech.sweep.until import PassRule, Until, read_selection, seeds_until, until_cap

__all__ = [
    "ALIASES",
    "Grid",
    "InitFrom",
    "OtherProcessError",
    "PassRule",
    "SweepMismatchError",
    "Until",
    "check_init_from",
    "coerce",
    "default_chunk_size",
    "expand",
    "finite_steps",
    "identity",
    "params_fingerprint",
    "parse_spec",
    "read_selection",
    "run_grid",
    "seeds_until",
    "sweep_difference",
    "until_cap",
]
