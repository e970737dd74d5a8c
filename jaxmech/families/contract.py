"""The two kinds of model family, and what each must offer (`families.registry` holds the
one list of them; `jaxmech.model.Model` is the handle a user holds).

Every family has one forward with named intervention points:

  forward(params, inputs, *, edits=None, capture=(), config) -> (out, aux)
                              one model's forward; `edits` a `models.edits.Edits`;
                              `capture` a collection of site names (True: every site),
                              the sites `aux` must hold whole
  sites(config, params) -> names
                              every site the forward names (what `Edits.replace` /
                              `add` and `capture` accept), in order

A **trained** family (`TrainedFamily`) is trained by `train` / `sweep`:

  init_params(config, key) -> params        a plain pytree of arrays (one model)
  loss(params, batch, tables, settings, config) -> []
                                            the training loss on one task batch
  evaluate(params, evals, tables, settings, config) -> {metric: []}
  metrics(config) -> names                  the metrics curves.csv / results.csv keep
  task_kinds                                the task kinds whose batches `loss` reads
  progress_metric                           what the sweep's progress lines count
  complete_params(params_K, config)         stacked params of an older folder, completed
  reports                                   the reports written for it (by folder name)
  config                                    its config class (a `config.ModelConfig`)
  vlm_view(config) -> VLMView               VLM families: what the paper 003 / 004
                                            methods may ask of them; None otherwise

A **checkpoint** family (`CheckpointFamily`) is loaded from a Hugging Face folder:

  checkpoint_types                          the config.json `model_type`s it reads
  read_config(folder) -> config             the architecture alone, no weights read
  load(folder, dtype=, place=) -> (config, params)
  init_params(config, key, dtype) -> params random params of a config (tests, benches)
  view(folder, config, grid, size, video=False, wording="jaxmech") -> VLMView
                                            the folder's processor feeding drawn scenes;
                                            its `n_lm_blocks` / `vit_blocks` answer from
                                            the config (params may be None: checked
                                            before the weights are read)
  processor(folder, config) -> processor    the reference's resize, normalisation,
                                            tokenizer and chat template
  encode(processor, images, questions) -> encoded   (`encoded.inputs`: forward's)
  tokenizer(processor) -> tokenizer         (`decode([id])`)
  next_token(config, params, encoded) -> [B, V] log-probabilities after each prompt
  generate(config, params, encoded, *, max_new_tokens, ...) -> Generation
                                            greedy generation with a key / value cache
                                            (`models.generate.generate` with the
                                            family's `decoding` bound; None: not offered)
  describe(config) -> str                   one line for logs (variant, size)
  trainable(params) -> spec                 the parameters a fine-tune trains by
                                            default (a `train_only` pattern spec)
  stored_leaves(config, names) -> {name: (leaf path, transform) or None}
                                            where each stored tensor goes in the params
                                            (the key map; None: nowhere)
  answer_turn(question, answer) -> (prompt, turn)
                                            the chat template's one-image prompt and the
                                            assistant's turn after it (None: not offered)
  encode_text_first(processor, images, questions) -> encoded
                                            a message whose text comes before its image,
                                            as the chat template renders it (None: not
                                            checked against the reference)
  stand_in                                  None, or a `StandIn`: the benches' random
                                            configs of the family's real layout
  reports                                   the reports that run on it

Behaviour switches without a trained parameter live in `params["static"]` (they travel
with the params; `registry.trainable` leaves them out of norms).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from jaxmech.config import ModelConfig

# the paper 003 / 004 reports: written against the VLM view, for any family that has one
VLM_REPORTS = (
    "patching",
    "spatial_ids",
    "steering",
    "diagnostics",
    "counterfactuals",
    "temporal_ids",
    "arbitrary_steering",
)


def contract_forward(model_forward, params, inputs, *, edits=None, capture=(), config):
    """The contract's `forward` (module docstring) of a loaded family whose model's is
    `model_forward(params, inputs, edits, *, config, capture, ...)` (its further keywords,
    `rows`, `resume`, `last_row`, left at their defaults): a family's `FAMILY.forward`
    is `functools.partial(contract_forward, model.forward)`."""
    return model_forward(params, inputs, edits, config=config, capture=capture)


class TrainedFamily(NamedTuple):
    """One trained model family's functions (module docstring)."""

    name: str
    init_params: Callable
    loss: Callable | None
    evaluate: Callable | None
    metrics: Callable
    task_kinds: tuple[str, ...]
    progress_metric: str | None = None
    complete_params: Callable = lambda params_K, config: params_K
    reports: tuple[str, ...] = ()
    vlm_view: Callable | None = None
    config: type | None = ModelConfig
    forward: Callable | None = None
    sites: Callable | None = None

    kind = "trained"


class StandIn(NamedTuple):
    """A checkpoint family's random stand-ins of its real layout, for the benches
    (`jaxmech.bench`): `configs` {"bench": small, "real": a real model's size}, each
    (config_of(special ids) -> config, picture size); `tokenizer(folder) -> special
    ids` writing a word-level tokenizer (and a processor config) there; `write(folder,
    log=)` writing a whole random checkpoint folder of the real size (None: no
    real-size check); `real_name` the real model it stands in for (for logs);
    `reference_script` the script (a path from the repository's root, a source
    checkout's) that runs the reference's forward on a folder of this layout for
    `bench --real_size --reference` ("": none)."""

    configs: dict
    tokenizer: Callable
    write: Callable | None = None
    real_name: str = ""
    reference_script: str = ""


class CheckpointFamily(NamedTuple):
    """One checkpoint (loaded) model family's functions (module docstring)."""

    name: str
    checkpoint_types: tuple[str, ...]
    read_config: Callable
    load: Callable
    init_params: Callable
    view: Callable
    processor: Callable
    encode: Callable
    tokenizer: Callable
    next_token: Callable
    describe: Callable
    trainable: Callable
    forward: Callable
    sites: Callable
    stand_in: StandIn | None = None
    reports: tuple[str, ...] = VLM_REPORTS
    generate: Callable | None = None
    # the authors' steered layers per model of this family (`adversarial_steering.sh`'s
    # CONFIG): (model_type, LM blocks, LM width) -> (their name, Hub name, (first, last))
    authors_windows: tuple = ()
    # (report, wording): the view wording (`view(..., wording=)`) a report asks for under
    # the authors' protocol where their script for it words its prompt its own way
    authors_wordings: tuple = ()
    stored_leaves: Callable | None = None
    # the authors' ID fine-tune's assistant turn and occlusion prompt (module docstring)
    answer_turn: Callable | None = None
    encode_text_first: Callable | None = None

    kind = "checkpoint"

    @property
    def config(self) -> Any:
        return None  # loaded, not trained: no training config class
