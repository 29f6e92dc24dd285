"""What a run builds, resolved once per process, and what mimo refuses to train.

- ``run_plan``: ``resolve(cfg, preprocess) -> RunPlan``, the frozen plan of a training config
  (layout, language model, encoder modules, parts, each module's settings); every config
  check that needs no process group (``check_training``: what only a run that trains
  refuses, not an export or a plan of its saved config).
- ``rules``: the refusals over a model's facts, a layout and a run's settings, read by
  ``resolve`` and by the layout advisor alike.
- ``parts``: the part grammar of ``model.freeze`` / ``model.lora`` (``Part.parse``) and the
  check that a key names the layout's modules.
- ``language``, ``encoders``: the language model's and each encoder module's settings.
"""

from mimo_train.plan.run_plan import Adapted, ModulePlan, RunPlan, check_training, resolve

__all__ = ["Adapted", "ModulePlan", "RunPlan", "check_training", "resolve"]
