"""The layout advisor of ``mimo-inspect plan --model MODEL --gpus N`` (docs/inspect.md, "The
layout advisor"): every layout of the model's modules on N GPUs, with and without the
distributed optimizer and activation recompute, its memory per rank (``planning.memory``) and
its predicted step time from the dataset's per-step work (the token table, read by
``mimo_data.inspect.workload``; FLOPs from ``planning.flops``), ranked; those that do not fit
are dropped, and the top few say why (memory per rank, bottleneck module, idle fraction).
Nothing the trainer refuses is proposed: every candidate passes the trainer's own rules
(``mimo_train.plan.rules``).

- ``inputs``: the request's GPU, the model (read as the trainer resolves it), the work;
- ``candidates``: the layouts and settings tried, and their order;
- ``cost``: a candidate's step time, idle fraction and memory per rank;
- ``report``: the answer as JSON and text;
- ``advise``: the command (``advise``, ``run_advisor``).
"""

from mimo_train.planning.advisor.advise import advise, run_advisor
from mimo_train.planning.advisor.candidates import layouts, rank, settings_of
from mimo_train.planning.advisor.cost import Advisor, Candidate, Result
from mimo_train.planning.advisor.inputs import GPU, Model, Work, gpu, read_model, read_work

__all__ = ["GPU", "Advisor", "Candidate", "Model", "Result", "Work", "advise", "gpu",
           "layouts", "rank", "read_model", "read_work", "run_advisor", "settings_of"]
