"""Every error mimo_train raises on purpose, in one module at the bottom of the package.

Each carries the exit status its command documents (``mimo_train.cli``): 1 when data failed a
check (a damaged checkpoint, a sample, a peer that died), 2 for usage or configuration. A
message names the key, file, rank or step involved and says what to do.
"""

from __future__ import annotations


class MimoTrainError(Exception):
    """Base of the errors below; ``exit_code`` is the process's exit status for it."""
    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class TrainConfigError(MimoTrainError, ValueError):
    """A training config that cannot run; the message names the key and what to do."""


class EncoderBuildError(MimoTrainError, ValueError):
    """An encoder config that cannot produce the preprocessor's token counts."""


class CheckpointError(MimoTrainError, RuntimeError):
    """A checkpoint that cannot be used here; the message says why and what to do.
    ``damaged``: its data failed a check (exit status 1), else it does not fit the run (2);
    then ``what`` is wrong with it and ``earlier`` names the newest earlier readable one ("":
    none), for a command whose advice is not training's."""

    def __init__(self, message: str, damaged: bool = False, what: str = "",
                 earlier: str = ""):
        super().__init__(message, 1 if damaged else 2)
        self.what, self.earlier = what, earlier


class IntegrityError(MimoTrainError, RuntimeError):
    """Checkpoint files that do not match the manifest (or no manifest); the message names each
    one."""
    exit_code = 1


class StartupError(MimoTrainError, RuntimeError):
    """Set-up failed on at least one rank; the message gathers every rank's reason. ``phase``:
    the start-up phase (``data`` failures and errors with exit status 1 exit 1, others 2)."""

    def __init__(self, message: str, phase: str, exit_code: int | None = None):
        super().__init__(message, exit_code or (1 if phase == "data" else 2))
        self.phase = phase


class RunError(MimoTrainError, RuntimeError):
    """Training stopped in the middle of the run: the message names the rank, the step and the
    cause (``runtime.console.run_failure``); printed once in the job. ``peer_lost``: this rank
    only lost a peer that left the job; ``details``: a bug's traceback, printed after it."""
    exit_code = 1
    peer_lost = False
    details = ""


class ExportError(MimoTrainError, RuntimeError):
    """An export that cannot be done; exit status 1 (the checkpoint's data) or 2 (usage)."""


class GenerateError(MimoTrainError, RuntimeError):
    """A generation that cannot run; exit status 1 (a media check, a damaged export, a changed
    base) or 2 (usage)."""
