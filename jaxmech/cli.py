"""absl flags shared by the entry points: one flag per config field, plus aliases.

Every config field becomes a string flag (`--n_pair_labels=5`, `--lr=3e-4`,
`--layernorm=true`); its text is parsed and validated by `jaxmech.sweep`, so the error
for a bad value names the field and its allowed range.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from jaxmech import outdir, sizing
from jaxmech.config import SWEEPABLE, Config, ConfigError, field_default
from jaxmech.data.datasets.questions import PROTOCOLS
from jaxmech.data.datasets.questions import SOURCES as QUESTION_SOURCES
from jaxmech.models.hub import PLACES
from jaxmech.presets import preset_config
from jaxmech.sweep import ALIASES, expand, run_grid, seeds_until, until_cap

__all__ = [
    "check_run_flags",
    "define_config_flags",
    "define_run_flags",
    "enable_compilation_cache",
    "preset_config",
    "run_main",
    "setup_runtime",
    "specs_from_flags",
    "train_from_flags",
    "until_from_flags",
]


def define_config_flags(sweep: bool) -> None:
    """Defines `--FIELD` for every config field (and the aliases) on absl's FLAGS."""
    for name in Config.field_names():
        if name == "seed":
            continue  # seeds are --seeds / --first_seed
        extra = " (a spec: a:b, a:b:step or a,b,c)" if sweep and name in SWEEPABLE else ""
        help_ = f"config field (default {field_default(name)!r}){extra}"
        flags.DEFINE_string(name, None, help_)
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
    """What every entry point does first: quiet Orbax's INFO lines, the CPU devices
    (`sizing.cpu_devices`), enable the cache.

    The device count can only be set before JAX's backends start; when a caller (a test,
    a notebook) already ran JAX, its devices stay as they are.
    """
    import jax

    logging.set_verbosity(logging.WARNING)
    n = sizing.cpu_devices()
    if n is not None:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # backends already started: keep the caller's devices
            pass
    enable_compilation_cache()


# Errors a user can cause (bad input, a damaged or busy folder, a full disk): they are
# reported as one message, not a traceback. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError)


def user_error_names() -> tuple[type, ...]:
    """USER_ERRORS plus the library's own (imported late: cli must stay light)."""
    from jaxmech.outdir import FolderLockedError, SweepMismatchError
    from jaxmech.saves import SaveError
    from jaxmech.sweep import OtherProcessError

    errors = (SaveError, FolderLockedError, SweepMismatchError, OtherProcessError)
    return (*USER_ERRORS, *errors)


def run_main(main) -> None:
    """`absl.app.run(main)`, with a user's error printed once, as the last line.

    A flag error (`app.UsageError`) keeps absl's usage message. The library's errors and
    ValueError / OSError print `error: MESSAGE` on stderr and exit with status 1, after
    stdout is flushed, so that the message is what the user sees last.
    """

    def guarded(argv):
        try:
            return main(argv)
        except app.UsageError:
            raise
        except user_error_names() as e:
            sys.stdout.flush()
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)

    app.run(guarded)


def define_run_flags(default_out: str, default_seeds: int) -> None:
    """The flags shared by the training entry points (train, sweep)."""
    flags.DEFINE_string(
        "preset",
        None,
        "a named protocol (jaxmech.presets) as the base config (its overrides; flags "
        "override it). Names: python -m experiments.protocol_study --list",
    )
    flags.DEFINE_integer("seeds", default_seeds, "seeds (models) per grid point")
    flags.DEFINE_integer("first_seed", 0, "seed of the first model of each grid point")
    flags.DEFINE_string("out", default_out, "results folder")
    flags.DEFINE_bool("overwrite", False, "replace an existing results folder")
    flags.DEFINE_integer("chunk_size", None, "models per compiled call (default: by backend)")
    flags.DEFINE_integer("save_every", None, "steps between saves (default eval_every)")
    flags.DEFINE_bool("distributed", False, "one sweep over several processes "
                      "(jax.distributed.initialize(): a TPU pod slice, SLURM and Open MPI "
                      "find their peers; elsewhere give the three flags below)")  # fmt: skip
    flags.DEFINE_string("coordinator_address", None, "with --distributed: HOST:PORT of "
                        "process 0's coordinator (default $JAX_COORDINATOR_ADDRESS)")  # fmt: skip
    flags.DEFINE_integer("num_processes", None, "with --distributed: processes in the run "
                         "(default $JAX_NUM_PROCESSES)")  # fmt: skip
    flags.DEFINE_integer("process_id", None, "with --distributed: this process's index, "
                         "0 .. num_processes - 1; 0 writes --out (default $JAX_PROCESS_ID)")  # fmt: skip
    flags.DEFINE_integer("seeds_until", None, "train seeds in chunks until at least N models "
                         "pass --pass_rule (one grid point; the rule is written to OUT/"
                         "selection.json before training, and reports take the passing models)")  # fmt: skip
    flags.DEFINE_integer("max_seeds", None, "with --seeds_until: most seeds tried (default 4 N); "
                         "a rerun may raise it (the models trained are kept)")  # fmt: skip
    flags.DEFINE_string("pass_rule", None, "with --seeds_until: METRIC>=VALUE a model must reach "
                        "(default: the family's progress metric >= 0.9; the toy VLM's "
                        "unseen_min_acc, unseen-pair accuracy on every relation)")  # fmt: skip


def grid_from_flags(FLAGS, single_values: bool):
    """The sweep grid the parsed flags ask for; raises ConfigError (naming the flag or
    field) on bad input, before any compute. `single_values` refuses lists and ranges
    (experiments.train)."""
    specs = specs_from_flags(FLAGS)
    if single_values:
        for name, text in specs.items():
            if "," in text or ":" in text:
                raise ConfigError(
                    f"--{name}={text!r}: experiments.train takes single values; "
                    "use experiments.sweep for several"
                )
    seeds = FLAGS.seeds
    if FLAGS.seeds_until is not None:  # the grid holds the cap's seeds; run_grid stops early
        if FLAGS["seeds"].present:
            raise ConfigError("--seeds and --seeds_until: give one (with --seeds_until the cap "
                              "on seeds tried is --max_seeds)")  # fmt: skip
        seeds = until_cap(FLAGS.seeds_until, FLAGS.max_seeds)
    return expand(preset_config(FLAGS.preset), specs, seeds, FLAGS.first_seed)


def until_from_flags(FLAGS, grid):
    """`--seeds_until` (with `--max_seeds`, `--pass_rule`) as a `sweep.Until` for
    `grid`, or None; ConfigError naming the flag."""
    if FLAGS.seeds_until is None:
        for name in ("max_seeds", "pass_rule"):
            if getattr(FLAGS, name) is not None:
                raise ConfigError(f"--{name} is read with --seeds_until only")
        return None
    return seeds_until(grid, FLAGS.seeds_until, FLAGS.max_seeds, FLAGS.pass_rule)


def check_run_flags(FLAGS) -> None:
    """Refuses a bad --chunk_size, --save_every or --out before any compute."""
    for name in ("chunk_size", "save_every"):
        value = getattr(FLAGS, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name}={value}: allowed an integer >= 1 (or leave it out)")
    outdir.check_usable(FLAGS.out)


# `--distributed`'s explicit peers: flag name -> the environment variable it falls back to
DISTRIBUTED_FLAGS = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


def _flag_or_env(FLAGS, name: str):
    value = getattr(FLAGS, name)
    if value is not None:
        return value
    text = os.environ.get(DISTRIBUTED_FLAGS[name], "").strip()
    if not text or name == "coordinator_address":
        return text or None
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"--{name}: ${DISTRIBUTED_FLAGS[name]}={text!r} is not an integer"
        ) from None


def distributed_args(FLAGS) -> dict | None:
    """`jax.distributed.initialize`'s arguments from `--distributed` and its three flags
    (or their environment variables): None without --distributed, {} to let JAX find its
    peers (TPU pods, SLURM, Open MPI), else all three, checked. ValueError naming the flag,
    before any compute or connection."""
    if not FLAGS.distributed:
        named = [n for n in DISTRIBUTED_FLAGS if getattr(FLAGS, n) is not None]
        if named:
            raise ValueError(f"--{named[0]} is read with --distributed only")
        return None
    given = {n: _flag_or_env(FLAGS, n) for n in DISTRIBUTED_FLAGS}
    if all(v is None for v in given.values()):
        return {}
    missing = [n for n, v in given.items() if v is None]
    if missing:
        raise ValueError(
            f"--distributed with {', '.join('--' + n for n in given if n not in missing)}: "
            f"also give --{missing[0]} (or ${DISTRIBUTED_FLAGS[missing[0]]}); a process "
            "needs the coordinator, the process count and its own id"
        )
    host, _, port = given["coordinator_address"].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator_address={given['coordinator_address']!r}: expected "
                         "HOST:PORT (process 0's host, a free port), e.g. 10.0.0.2:1234")  # fmt: skip
    n, i = given["num_processes"], given["process_id"]
    if n < 1:
        raise ValueError(f"--num_processes={n}: allowed an integer >= 1")
    if not 0 <= i < n:
        raise ValueError(f"--process_id={i}: allowed 0 .. {n - 1} (--num_processes={n})")
    return given


def start_distributed(args: dict | None) -> None:
    """Joins the processes of a multi-process run (`distributed_args`); waits for all of
    them. Must come before JAX computes anything (its backends start with the peers)."""
    if args is None:
        return
    import jax

    # CPU processes exchange arrays through gloo: JAX's default, set so that a changed
    # default does not change what the localhost tests check
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**args)
    except ValueError as e:  # JAX's cluster detection found nothing to join
        if args:
            raise
        raise ValueError(
            f"--distributed: JAX found no peers ({e}); outside a TPU pod, SLURM or Open MPI "
            "give --coordinator_address, --num_processes and --process_id"
        ) from None


def train_from_flags(FLAGS, single_values: bool, usage_error) -> tuple:
    """Body of experiments.train / experiments.sweep: parse, then train (resumably).

    Bad input raises `usage_error` before any compute (`grid_from_flags`), and before
    `--distributed` joins its peers. Returns (grid, run_grid's result) for the caller to
    report where the result's "writer" is true (one process of a multi-process run)
    (`jaxmech.reports.summary.report_run`): flags never load a report.
    """
    setup_runtime()
    try:
        grid = grid_from_flags(FLAGS, single_values)
        until = until_from_flags(FLAGS, grid)
        check_run_flags(FLAGS)
        peers = distributed_args(FLAGS)
    except (ConfigError, ValueError) as e:
        raise usage_error(str(e)) from None
    start_distributed(peers)
    out = run_grid(
        grid,
        FLAGS.out,
        overwrite=FLAGS.overwrite,
        chunk_size=FLAGS.chunk_size,
        save_every=FLAGS.save_every,
        until=until,
    )
    return grid, out


def define_checkpoint_flags(own_out: bool = True) -> None:
    """The flags of a paper 003 / 004 report run on a real checkpoint (`--checkpoint`
    beside `--run`; `checkpoint_options` reads them). `own_out` False: the entry point
    defines `--out` itself, and takes no `--layers`."""
    flags.DEFINE_string("checkpoint", None, "a real checkpoint (instead of --run): a folder, "
                        "or a Hub name ORG/NAME[@REVISION] (pip install 'jaxmech[hub]'; the "
                        "Hugging Face cache, HF_HUB_OFFLINE honoured); several, comma-"
                        "separated: each report, then the median over them")  # fmt: skip
    if own_out:
        flags.DEFINE_string("out", None, "results folder of a --checkpoint report (default "
                            "runs/checkpoints/NAME)")  # fmt: skip
        flags.DEFINE_string("layers", None, "LM layers studied, as the authors index them "
                            "(layer L: the residual after L blocks, hidden_states[L]), e.g. "
                            "6:16 (both ends included) or 3,5 (default: every one)")  # fmt: skip
    flags.DEFINE_string("grid", "4x4", "the scenes' grid, ROWSxCOLS")
    flags.DEFINE_integer("size", None, "drawn pictures' side in pixels (default: the "
                         "family's: Qwen2-VL / 2.5-VL 448, Qwen3-VL 512, LLaVA-1.5 336, "
                         "InternVL3 its 448 px tile)")  # fmt: skip
    flags.DEFINE_integer("questions", None, "questions asked: drawn pair questions per "
                         "relation (default 64), or at most this many of a dataset's "
                         "(default: every one; COCO-Spatial's 100)")  # fmt: skip
    flags.DEFINE_enum("questions_from", "drawn", ["drawn", *QUESTION_SOURCES], "the questions: "
                      "drawn scenes, or a dataset read from --data (README: where each is "
                      "published)")  # fmt: skip
    flags.DEFINE_string("data", None, "the dataset's folder, for --questions_from, or its "
                        "Hub dataset ORG/NAME[@REVISION] where it has one (cvbench: "
                        "nyu-visionx/CV-Bench)")  # fmt: skip
    flags.DEFINE_integer("question_seed", None, "seed of the questions' scenes and of a "
                         "dataset's sample (default 0; a dataset's sample under "
                         "--protocol=authors: 42, the authors' random.seed(42))")  # fmt: skip
    flags.DEFINE_integer("batch", None, "questions per compiled call (default: the most "
                         "that fit in --memory, by XLA's memory analysis)")  # fmt: skip
    flags.DEFINE_string("memory", None, "memory budget: GB (8), a fraction (0.3) or percent "
                        "(30%) of the machine's (default: the smaller of 40% and what is "
                        "available now less 1 GB)")  # fmt: skip
    flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "the params' dtype")
    flags.DEFINE_enum("place", "auto", list(PLACES), "the weights on one device, each matrix "
                      "split over every device (shard), or auto: sharded where they do not "
                      "fit one device's memory (jaxmech.load's place)")  # fmt: skip
    flags.DEFINE_enum("protocol", "jaxmech", list(PROTOCOLS), "whose protocol a checkpoint's "
                      "tables follow: the papers' authors' scripts or jaxmech's (BUILD_NOTES: "
                      "the difference table)")  # fmt: skip
    flags.DEFINE_bool("per_block", False, "counterfactual table: also mirror the ViT's "
                      "positions in one block at a time (2 rows per ViT block: 64 more "
                      "conditions at Qwen2-VL's 32 blocks)")  # fmt: skip


def parse_layers(text: str | None):
    """`--layers` as a tuple of ints ("6:16" is 6..16, both ends included as in the
    authors' `seq 6 16`; "3,5" is 3 and 5), or None."""
    if not text:
        return None
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":"))
            return tuple(range(lo, hi + 1))
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--layers = {text!r}: expected START:END or a comma list") from None


def checkpoint_options(FLAGS) -> dict:
    """`common.open_checkpoint`'s keyword arguments from the checkpoint flags; a Hub
    dataset's `--data` resolved to its cached folder (`hub_names.dataset_folder`)."""
    from jaxmech.hub_names import dataset_folder

    try:
        grid = tuple(int(x) for x in FLAGS.grid.lower().split("x"))
    except ValueError:
        grid = ()
    if len(grid) != 2 or min(grid) < 1:
        raise ValueError(f"--grid = {FLAGS.grid!r}: expected ROWSxCOLS, e.g. 4x4")
    layers = parse_layers(FLAGS.layers) if "layers" in FLAGS else None
    return dict(grid=grid, size=FLAGS.size, questions=FLAGS.questions,
                seed=FLAGS.question_seed, layers=layers, batch=FLAGS.batch,
                dtype=FLAGS.dtype, place=FLAGS.place, memory=FLAGS.memory,
                protocol=FLAGS.protocol, questions_from=FLAGS.questions_from,
                data=dataset_folder(FLAGS.questions_from, FLAGS.data),
                per_block=FLAGS.per_block)  # fmt: skip
