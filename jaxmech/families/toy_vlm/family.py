"""The toy autoregressive VLM as a trained family (`families.contract.TrainedFamily`)."""

from __future__ import annotations

from jaxmech.families.contract import VLM_REPORTS, TrainedFamily
from jaxmech.families.toy_vlm import evaluate as evaluate_answers
from jaxmech.families.toy_vlm import loss as answer
from jaxmech.families.toy_vlm import model
from jaxmech.families.toy_vlm.checks import edit_names
from jaxmech.families.toy_vlm.config import ToyVLMConfig
from jaxmech.families.toy_vlm.view import toy_view


def forward(params, inputs, *, edits=None, capture=(), config=None):
    """The family contract's forward: a `data.tasks.scenes.SceneBatch` -> (logits [B, V] at
    the `?`, the sites `capture` names; True: every site). Any capture computes the
    last LM block for every row, so the captured sites are whole."""
    del config
    logits, aux = model.forward(
        params, inputs.labels_BxL, inputs.colours_BxL, inputs.facings_BxL,
        inputs.question_BxQ, edits=edits, capture=bool(capture),
    )  # fmt: skip
    return logits, {k: v for k, v in aux.items() if capture is True or k in capture}


FAMILY = TrainedFamily(
    name="toy_vlm",
    init_params=model.init_params,
    loss=answer.answer_loss,
    evaluate=evaluate_answers.evaluate_scenes,
    metrics=evaluate_answers.metric_names,
    task_kinds=("scenes", "video"),
    progress_metric="unseen_min_acc",
    reports=VLM_REPORTS + ("vit_terms", "id_loss"),
    vlm_view=toy_view,
    config=ToyVLMConfig,
    forward=forward,
    sites=lambda config, params: edit_names(params),
)
