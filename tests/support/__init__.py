"""The suite's support code, imported by the tests (``from support.runs import step``): launching
jobs (``launch``: forked ranks, torchrun, fresh interpreters), training runs and parity
(``runs``), whole-VLM checks (``vlm_runs``), planted loss spikes (``anomaly_runs``). No test
module imports another; what two tests share lives here or in ``conftest.py``.
"""
