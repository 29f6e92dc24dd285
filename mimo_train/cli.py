"""``mimo-train`` / ``torchrun --nproc-per-node N -m mimo_train --config CFG [key=value ...]``.

Exit codes (of each rank; torchrun itself exits non-zero when any rank does):

- 0: trained to ``train.steps`` (or ``train.exit_interval``);
- 1: a check or the data failed: the shards do not suit the layout (start-up ``data`` phase),
  a damaged or partial checkpoint, more steps skipped for non-finite values than
  ``train.max_skipped_steps``, or training itself raised (with its traceback);
- 2: usage or config error: a bad option, key or value, a missing input path, a layout that
  does not fit the world, a checkpoint saved for another model or global batch size;
- 128 + the signal's number (143 SIGTERM, 138 SIGUSR1): stopped by one of
  ``train.exit_signals`` after a step, the checkpoint of that step saved (with
  ``checkpoint.dir``); run the same command again to resume; 130 for a Ctrl-C that is not one
  of them: stopped at once, no checkpoint saved.

A start-up failure is printed once, by rank 0, naming the ranks that failed; every rank exits.
Nothing heavy is imported before the arguments are parsed: ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time

from mimo_data.arguments import Parser, user_path
from mimo_data.hub import cache_only
from mimo_data.stdout import quiet_when_stdout_closes
from mimo_train.runtime import console, launcher
from mimo_train.errors import RunError, StartupError, TrainConfigError


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="mimo-train", description="Train a MIMO model (megatron-core MimoModel) on shards "
        "from mimo-shard build; run one process per rank under torchrun.",
        epilog="Exit codes: 0 done, 1 a check or the data failed (or more non-finite steps "
        "than train.max_skipped_steps), 2 usage or config error, 128 + N stopped by signal N "
        "(train.exit_signals) with a checkpoint, 130 Ctrl-C without one. "
        "Relative paths in the YAML are taken from its folder, those in overrides from the "
        "current directory.")
    parser.add_argument("--config", type=user_path, metavar="YAML",
                        help="training config YAML (see mimo_train/config/ and "
                        "configs/train/)")
    parser.add_argument("--preprocessing-for", type=user_path, metavar="VLM",
                        help="print the preprocessing config YAML that writes images (and "
                        "videos) as the whole VLM at this directory (its config.json, or a "
                        "cached hub name) expects, and exit")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="config overrides, values parsed as YAML, e.g. train.steps=50 "
                        "checkpoint.dir=runs/x")
    parser.add_argument("--records", type=user_path, metavar="JSONL",
                        help="write every train and eval record as JSON lines here (rank 0), "
                        "each as it is read; a run that resumes a checkpoint appends")
    return parser


@quiet_when_stdout_closes
def main(argv=None) -> int:
    cache_only()
    parser = _parser()
    args = parser.parse_intermixed_args(argv)     # overrides before or after the options
    try:
        console.quiet_third_party()     # imports torch: a Ctrl-C there is one line too
        return _main(args, parser)
    except KeyboardInterrupt:
        # a terminal's Ctrl-C reaches every rank: one line, from rank 0, and no traceback
        if console.rank() == 0:
            print(f"{console.PREFIX}interrupted (SIGINT): stopped without saving a "
                  "checkpoint; a rerun resumes from the last one saved, where there is one, "
                  "else starts over (with SIGINT in train.exit_signals a run saves one first)",
                  file=sys.stderr, flush=True)
        return 128 + signal.SIGINT


def _main(args, parser: argparse.ArgumentParser) -> int:
    if args.preprocessing_for:
        given = [*(["--config"] if args.config else []), *(["--records"] if args.records
                                                          else []), *args.overrides]
        if given:               # none of them changes what it prints
            parser.error(f"--preprocessing-for prints the model's preprocessing config and "
                         f"takes nothing else ({' '.join(given)} given): edit the YAML it "
                         "prints (seq_length, ...), then train with --config")
        return _print_preprocessing(args.preprocessing_for)
    if not args.config:
        parser.error("--config is required (or --preprocessing-for)")
    if (why := launcher.unjoined_tasks()) is not None:
        if os.environ.get("SLURM_PROCID", "0") == "0":      # said once, not by every task
            print(f"{console.PREFIX}{why}", file=sys.stderr)
        return 2
    try:
        # here, not at the top: --help, usage errors and a Ctrl-C while it loads (pyarrow,
        # numpy, PyAV, Pillow) stay quick and one line
        from mimo_train.config import TrainConfig
        cfg = TrainConfig.load(args.config, args.overrides)
        from mimo_train.plan import check_training, resolve
        plan = resolve(cfg)             # what the run builds, from the checkpoints it names
        check_training(plan)
    except TrainConfigError as error:
        return console.fail_before_setup("config", error)
    start = time.perf_counter()
    from mimo_train.runtime import distributed
    from mimo_train.training.trainer import train
    console.say(f"{console.PREFIX}torch and megatron-core loaded "
                f"({time.perf_counter() - start:.1f} s)")
    from mimo_train.runtime.preemption import StartupSignal, before_training
    try:
        with before_training(cfg.train.exit_signals):
            trainer = train(plan, args.records, launcher.started())
        if trainer.failure:             # too many skipped steps (components/anomalies.py)
            console.torchrun_error_file(trainer.failure)    # every rank: the same failure
            return 1
        if trainer.stopped_by:          # preempted: checkpoint saved (runtime/preemption.py)
            return 128 + trainer.stopped_by
    except StartupSignal as stopped:    # every rank got it (torchrun, Slurm): one line
        if cfg.checkpoint.dir:          # this run's claim, where rank 0 took one: released
            from mimo_train.components.checkpoint import unclaim
            unclaim(cfg.checkpoint.dir)
        if console.rank() == 0:
            print(f"{console.PREFIX}{signal.Signals(stopped.number).name} during start-up: "
                  "stopped before training, nothing saved; a rerun resumes the last "
                  "checkpoint saved, where there is one, else starts over", file=sys.stderr,
                  flush=True)
        return 128 + stopped.number
    except StartupError as error:
        return console.report_failure(error)
    except RunError as error:
        return console.report_run_failure(error)
    finally:
        distributed.destroy()
    return 0


def _print_preprocessing(path: str) -> int:
    import yaml

    from mimo_train.families.registry import preprocessing_for
    if os.path.basename(path) == "config.json" and os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))     # its folder, as plan --model takes it
    try:
        data = preprocessing_for(path, "--preprocessing-for")
    except TrainConfigError as error:
        print(f"{console.PREFIX}{error}", file=sys.stderr)
        return 2
    from mimo_data.preprocess.config import PreprocessConfig
    seq_length = PreprocessConfig.seq_length          # mimo's default, written out to be seen
    data = {key: value for key, value in data.items() if key != "modalities"} | {
        "seq_length": seq_length, "modalities": data["modalities"]}
    print(f"# The preprocessing config for {path} (mimo-train --preprocessing-for). seq_length "
          f"{seq_length} is mimo's default: set it to your samples' length (longer ones are "
          "dropped; mimo-inspect report counts them).")
    print(_modalities_note(data))
    image = PreprocessConfig.from_dict(data).modalities.get("image")
    if image is not None and image.policy == "dynamic" and image.max_pixels:
        side = image.patch_size * image.merge_size
        tokens = image.max_pixels // (side * side)
        if tokens > seq_length:
            print(f"# image: max_pixels {image.max_pixels} is up to {tokens} tokens an image, "
                  f"more than seq_length {seq_length}: a sample with such an image is dropped "
                  f"as too long; lower max_pixels (e.g. {seq_length // 2 * side * side}, "
                  f"{seq_length // 2} tokens at the most) or raise seq_length.")
    video = data["modalities"].get("video") or {}
    if video and not video.get("cap_pixels_per_frame"):
        print("# video: " + (
            "max_pixels bounds the pixels of the whole sampled clip, as transformers' Qwen3-VL "
            "processor has it (a 1080p minute at 2 fps is ~11k tokens); cap_pixels_per_frame: "
            "true also holds each frame to max_video_tokens' pixels, as qwen-vl-utils does"
            if video.get("sampling") == "qwen3_vl" else
            "each frame keeps up to max_pixels, as transformers' processor has it (a 1080p "
            "minute at 2 fps is ~160k tokens); cap_pixels_per_frame: true holds a clip to "
            "max_video_tokens, as qwen-vl-utils does") + "; mimo-inspect report counts the "
            "tokens.")
    print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _modalities_note(data: dict) -> str:
    """The header's line on the modalities: those the model's tower takes (the config's), and
    whether another one may be added (its own encoder module) or its chat template writes no
    marker for it (every sample with it dropped)."""
    from mimo_data.modalities import MARKERS
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_data.preprocess.tokenizer_loading import load_tokenizer
    from mimo_data.preprocess.chat_render import ChatRenderer
    config = PreprocessConfig.from_dict(data)
    tokenizer = load_tokenizer(config)
    try:
        unwritten = ChatRenderer(config, tokenizer).unwritten_modalities()
    except ValueError:           # a template mimo cannot render at all: start-up says why
        unwritten = []
    takes = list(data["modalities"])
    # a video goes through the whole VLM's tower only: one without video takes none
    others = [m for m in MARKERS if m not in (*takes, "video")]
    addable = [m for m in others if m not in unwritten]
    dropped = [m for m in others if m in unwritten]
    note = f"# The model takes {' and '.join(takes)} (its own tower) and text" + (
        "." if "video" in takes else ", no video.")
    if "video" in takes and "image" in takes:
        note += (" The tower serves the clips too: the layout gives video to its module "
                 "(e.g. 'image=dp1,video;language=dp1').")
    if addable:
        note += (f" Adding {' or '.join(addable)} needs an encoder module of its own "
                 "(model.encoders, the layout).")
    if dropped:
        note += (f" Its chat template writes no {' or '.join(MARKERS[m] for m in dropped)}: "
                 f"with modalities.{' or modalities.'.join(dropped)} added, every such sample "
                 "would be dropped (template_mismatch), so mimo-train refuses it unless a "
                 "chat_template that writes it is given (and an encoder module serves it).")
    return note


def run() -> None:
    """The ``mimo-train`` command: ``main`` and exit with its status. The interpreter's exit then
    skips its last garbage collection over every object of torch, transformers and
    megatron-core (``gc.freeze``; seconds per rank, for nothing: the process ends)."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
