"""The checks of ``mimo-inspect report`` and their limits (see ``report``'s docstring).

Light on purpose: the CLI builds its flags from ``CHECKS`` before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """Limits of the report's checks (see ``mimo_data.inspect.report``)."""
    max_zero_trained_fraction: float = 0.0
    max_dropped_fraction: float = 0.0
    max_truncated_fraction: float = 0.0
    max_empty_answer_turns_fraction: float = 0.0
    max_reasoning_dropped_fraction: float = 1.0         # reported, off by default
    max_unclosed_think_fraction: float = 0.0
    max_trailing_turns_fraction: float = 1.0            # reported, off by default
    max_template_failures: int = 0
    max_marker_mismatches: int = 0
    max_placeholder_mismatches: int = 0
    max_index_mismatches: int = 0
    max_loss_mask_coverage_failures: int = 0
    min_trained_token_fraction: float = 0.0
    max_skipped_records_fraction: float = 0.0


# check name -> (threshold field, kind, what is counted)
CHECKS = {
    "zero_trained": ("max_zero_trained_fraction", "fraction", "samples with no trained token"),
    "dropped": ("max_dropped_fraction", "fraction", "samples dropped by the preprocessor"),
    "truncated": ("max_truncated_fraction", "fraction",
                  "samples with turns removed to fit seq_length"),
    "empty_answer_turns": ("max_empty_answer_turns_fraction", "fraction",
                           "samples training an empty answer (its end of turn alone) beside "
                           "answers with text"),
    "reasoning_dropped": ("max_reasoning_dropped_fraction", "fraction",
                          "samples whose earlier answers' reasoning the chat template leaves "
                          "out while it writes later ones' (Qwen3's, Qwen3.5's, as at "
                          "inference: the turns after the last user query keep theirs)"),
    "unclosed_think": ("max_unclosed_think_fraction", "fraction",
                       "samples training an answer whose <think> has no </think> after it "
                       "(no template takes it apart: the model learns to open a think block "
                       "it never closes)"),
    "trailing_turns": ("max_trailing_turns_fraction", "fraction",
                       "samples ending on turns after their last answer (a user's, a tool's): "
                       "context that trains nothing, often a final answer lost in conversion"),
    "template_failures": ("max_template_failures", "count",
                          "samples the chat template cannot render or round-trip"),
    "marker_mismatches": ("max_marker_mismatches", "count",
                          "samples whose media markers disagree with their media"),
    "placeholder_mismatches": ("max_placeholder_mismatches", "count",
                               "samples whose placeholder tokens disagree with metadata counts"),
    "index_mismatches": ("max_index_mismatches", "count",
                         "samples whose media disagree with samples.parquet"),
    "loss_mask_coverage": ("max_loss_mask_coverage_failures", "count",
                           "samples whose trained tokens leave out assistant content or take "
                           "in user/system content"),
}
