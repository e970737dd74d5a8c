"""What every report shares, by idea, gathered under one name for the report modules:

* `subjects`: what a report studies (`LoadedRun`) and what it asks of it (a trained
  run's or a checkpoint's subject);
* `runs`: checking and opening results folders (`check_run`, `open_run`), model groups;
* `checkpoints`: opening a checkpoint (`open_checkpoint`) through `jaxmech.load`;
* `questions`: the paper 003 / 004 reports' questions, sites and chunking, asked of
  the subject (`view_of`, `question_specs`, `relation_questions`, `steered_sites`, ...);
* `driver`: the one report driver (`Report`, `analyse`, `analyse_subject`,
  `report_main`) and `declared` refusals;
* `tables`: CSV / JSON writing, spreads and intervals, ablation tables.
"""

from jaxmech.reports.batches import QuestionBatch, joined  # noqa: F401
from jaxmech.reports.checkpoints import open_checkpoint  # noqa: F401
from jaxmech.reports.driver import (  # noqa: F401
    Report,
    across_checkpoints,
    analyse,
    analyse_loaded,
    analyse_subject,
    checkpoints_main,
    compiled_call,
    declared,
    needs_depth,
    open_report,
    plots_dir,
    report_main,
    report_parts,
    take_models,
)
from jaxmech.reports.questions import (  # noqa: F401
    chunk_progress,
    id_labels,
    log_estimate,
    probe_rows,
    protocol_of,
    question_batches,
    question_specs,
    relation_questions,
    rows_per_call,
    steered_sites,
    steering_examples,
    table_store,
    take_examples,
    view_of,
)
from jaxmech.reports.runs import (  # noqa: F401
    GENERALISING,
    check_run,
    check_runs,
    excluded_lines,
    is_diverged,
    load_config,
    model_groups,
    open_run,
    setting_text,
)
from jaxmech.reports.subjects import (  # noqa: F401
    EXAMPLE_SETS,
    EXAMPLE_WORDS,
    EXAMPLES,
    CheckpointSubject,
    LoadedRun,
    TrainedSubject,
    eval_specs,
    subset,
)
from jaxmech.reports.tables import (  # noqa: F401
    COMPACT,
    WIDE,
    TableStyle,
    ablation_rows,
    ablation_summary,
    cell_interval,
    fmt_ci,
    fmt_interval,
    fmt_question_ci,
    fmt_spread,
    print_ablation_summary,
    question_ci,
    spread,
    write_csv,
    write_json,
)
