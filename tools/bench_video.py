"""Benchmark the encoder rank's video path against transformers' own, on the same clips and
sampling, in the same run. Prints the clips, each stage's milliseconds a clip, and samples/s per
path and worker count with mimo / transformers.

Clips are written at start into a temporary folder with PyAV by the corpus's clip maker
(``make_video_clips.encode``): zooms into scikit-image photos, h264 (libx264) in mp4,
``--clips`` of them lasting ``--seconds``, their sizes, frame rates and GOPs (keyframe
interval) cycled from ``--sizes``, ``--rates`` and ``--gops``. Both paths sample ``--fps``
frames a second as ``Qwen2VLVideoProcessor`` does (``do_sample_frames=True``) with the same
min/max frames and min/max pixels (``VideoConfig``'s defaults otherwise), and end with the
float32 ``pixel_values_videos`` the encoder gets:

- mimo: read the clip's bytes → ``decode_video`` (only the sampled frames, skipping the
  non-reference frames between them and seeking to the
  keyframe before each when that skips decoding) → ``video_encoder_inputs`` (uint8 patches,
  ``video_grid_thw``) in the DataLoader; ``normalize_video_pixels`` in the main process, on
  ``--device`` (the encoder's). The clip metadata it needs (frames, fps, size) is the build's
  probe, stored in the dataset's index: it is computed before timing;
- transformers (the baseline): ``Qwen2VLVideoProcessor(do_sample_frames=True)`` called on the
  clips' paths in the DataLoader, so that it loads them itself (``fetch_videos`` →
  ``transformers.video_utils.load_video`` with its frame sampler), the float result moved to
  ``--device`` in the main process. Its ``fetch_videos`` picks torchcodec, else torchvision's
  decoder (removed in torchvision 0.26); ``load_video``'s own default is PyAV, which this
  bench uses when installed (else torchvision's, else torchcodec): the output says which.

First, untimed, each clip goes through both paths once: their ``video_grid_thw`` must be equal
(else the bench stops) and the pixels are compared; the frames each path decodes are counted
(``av.open`` wrapped) against the clip's length; each stage is timed alone in one process
(mimo: decode, uint8 patches, normalize; transformers: ``load_video``, the processor on the
frames it loaded). Then each path runs through a
``torch.utils.data.DataLoader`` over ``--samples`` samples (the clips cycled), ``--batch-size``
clips a batch, with each of ``--workers`` (0 and 2), ``--repeat`` times interleaved; each run
first iterates an untimed epoch of one batch a worker (worker start-up; the workers persist
through the repeats), then the timed one.
The workers are started with ``spawn`` (``--start-method``): forked after PyAV has decoded
in the main process (the check, the 0-worker runs), workers decoding with PyAV hang (FFmpeg's
decoder threads; PyAV decodes with ``thread_count=0``), mimo's and transformers' paths alike.
Prints medians: samples/s per path and worker count, and mimo / transformers at the same
worker count (target >= 2x). Torch runs one thread per process.

    python tools/bench_video.py [--clips 4] [--seconds 10] [--sizes 320x240 480x270 640x360] \\
        [--rates 24 30] [--gops 48 120 250] [--fps 2] [--samples 16] [--batch-size 2] \\
        [--workers 0 2] [--repeat 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import av
import numpy as np
import torch
import torch.utils.data
from transformers import Qwen2VLVideoProcessor
from transformers.utils import is_av_available
from transformers.utils.import_utils import is_torchcodec_usable
from transformers.video_utils import is_torchvision_video_decoding_available, load_video

import make_video_clips
from mimo_data.modalities.video import (
    VideoConfig, decode_video, normalize_video_pixels, probe_video, sample_indices,
    video_encoder_inputs)

PHOTOS = ("astronaut", "coffee", "rocket", "hubble_deep_field", "chelsea")


# --- clips -------------------------------------------------------------------------------

def make_clips(folder: str, args: argparse.Namespace) -> list[str]:
    paths = []
    for i in range(args.clips):
        width, height = (int(v) for v in args.sizes[i % len(args.sizes)].split("x"))
        path = os.path.join(folder, f"clip{i}.mp4")
        make_video_clips.encode(make_video_clips.Spec(
            name=f"clip{i}", photo=PHOTOS[i % len(PHOTOS)], motion="zoom", muxer="mp4",
            encoder="libx264", fps=args.rates[i % len(args.rates)], seconds=args.seconds,
            width=width, height=height, gop=args.gops[i % len(args.gops)]), path)
        paths.append(path)
    return paths


# --- the two paths -----------------------------------------------------------------------

def transformers_backend() -> tuple[str, str]:
    """The ``load_video`` backend the baseline uses, and a note on the processor's choice."""
    if is_torchcodec_usable("video"):
        note = "the processor's own choice, torchcodec, is usable"
    elif is_torchvision_video_decoding_available():
        note = "the processor's own choice would be torchvision's decoder (torchcodec missing)"
    else:
        note = ("the processor's own choice, torchcodec, is not installed and its fallback, "
                "torchvision's decoder, is gone in torchvision >= 0.26")
    if is_av_available():
        return "pyav", note
    if is_torchvision_video_decoding_available():
        return "torchvision", note
    return "torchcodec", note


class _Processor(Qwen2VLVideoProcessor):
    """transformers' processor, its ``fetch_videos`` with ``load_video``'s ``backend`` set."""

    backend = "pyav"

    def fetch_videos(self, video_url_or_urls, sample_indices_fn=None):
        if isinstance(video_url_or_urls, list):
            return list(zip(*[self.fetch_videos(x, sample_indices_fn=sample_indices_fn)
                              for x in video_url_or_urls]))
        with warnings.catch_warnings():       # torchvision's deprecation notice, if used
            warnings.simplefilter("ignore")
            return load_video(video_url_or_urls, backend=self.backend,
                              sample_indices_fn=sample_indices_fn)


def processor_for(cfg: VideoConfig, backend: str) -> _Processor:
    processor = _Processor(
        patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
        min_frames=cfg.min_frames, max_frames=cfg.max_frames,
        cap_pixels_per_frame=cfg.cap_pixels_per_frame, max_video_tokens=cfg.max_video_tokens,
        image_mean=list(cfg.mean), image_std=list(cfg.std), fps=cfg.fps, do_sample_frames=True)
    processor.backend = backend
    return processor


class MimoClips(torch.utils.data.Dataset):
    """The encoder rank's work in a data worker: bytes → sampled frames."""

    def __init__(self, paths: list[str], items: list[dict], samples: int, cfg: VideoConfig):
        self.paths, self.items, self.samples, self.cfg = paths, items, samples, cfg

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> np.ndarray:
        clip = index % len(self.paths)
        with open(self.paths[clip], "rb") as handle:
            data = handle.read()
        return decode_video(data, self.items[clip], self.cfg)


class MimoCollate:
    """Sampled frames → uint8 patches and grids (in the data worker)."""

    def __init__(self, cfg: VideoConfig):
        self.cfg = cfg

    def __call__(self, videos: list[np.ndarray]) -> dict[str, torch.Tensor]:
        return video_encoder_inputs(videos, self.cfg)


class ClipPaths(torch.utils.data.Dataset):
    def __init__(self, paths: list[str], samples: int):
        self.paths, self.samples = paths, samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> str:
        return self.paths[index % len(self.paths)]


class ProcessorCollate:
    """transformers' processor on a batch of paths: it loads, samples and processes them."""

    def __init__(self, processor: _Processor):
        self.processor = processor

    def __call__(self, paths: list[str]) -> dict[str, torch.Tensor]:
        out = self.processor(videos=paths, return_tensors="pt")
        return {"pixel_values_videos": out["pixel_values_videos"],
                "video_grid_thw": out["video_grid_thw"]}


def mimo_finish(cfg: VideoConfig, device: torch.device) -> Callable:
    def finish(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return normalize_video_pixels(batch["pixel_values_videos"].to(device), cfg)
    return finish


def transformers_finish(device: torch.device) -> Callable:
    def finish(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["pixel_values_videos"].to(device)
    return finish


# --- checks ------------------------------------------------------------------------------

class _Counting:
    """An opened container whose ``decode`` counts the frames it yields."""

    counts = {"frames": 0, "seeks": 0}

    def __init__(self, container: Any):
        self._container = container

    def __enter__(self) -> _Counting:
        return self

    def __exit__(self, *exc: object) -> None:
        self._container.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._container, name)

    def seek(self, *args: Any, **kwargs: Any) -> Any:
        _Counting.counts["seeks"] += 1
        return self._container.seek(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for frame in self._container.decode(*args, **kwargs):
            _Counting.counts["frames"] += 1
            yield frame

    def demux(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for packet in self._container.demux(*args, **kwargs):
            yield _CountingPacket(packet)


class _CountingPacket:
    """A demuxed packet whose ``decode`` counts the frames it yields (frames the decoder
    skips are not decoded, hence not counted)."""

    def __init__(self, packet: Any):
        self._packet = packet

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)

    def decode(self) -> Iterator[Any]:
        for frame in self._packet.decode():
            _Counting.counts["frames"] += 1
            yield frame


def counted(run: Callable[[], Any]) -> tuple[Any, int, int]:
    """``run()`` with ``av.open`` wrapped: its result, frames decoded, seeks."""
    real = av.open
    av.open = lambda *a, **k: _Counting(real(*a, **k))  # type: ignore[assignment]
    _Counting.counts.update(frames=0, seeks=0)
    try:
        result = run()
    finally:
        av.open = real
    return result, _Counting.counts["frames"], _Counting.counts["seeks"]


def check(paths: list[str], items: list[dict], cfg: VideoConfig, processor: Any) -> None:
    """Both paths on each clip, once: equal grids (else stop), pixels compared, frames
    decoded counted."""
    print(f"{'clip':10s} {'size':>8s} {'fps':>3s} {'GOP':>4s} {'frames':>6s} {'sampled':>7s} "
          f"{'grid (t,h,w)':>13s}  frames decoded mimo / transformers (seeks)  pixels")
    for path, item in zip(paths, items):
        gop = item["gop"]
        def ours(path: str = path, item: dict = item) -> tuple[torch.Tensor, torch.Tensor]:
            with open(path, "rb") as handle:
                data = handle.read()
            inputs = video_encoder_inputs([decode_video(data, item, cfg)], cfg)
            return normalize_video_pixels(inputs["pixel_values_videos"], cfg), \
                inputs["video_grid_thw"]

        (pixels, grid), our_frames, our_seeks = counted(ours)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs, their_frames, their_seeks = counted(
                functools.partial(processor, videos=[path], return_tensors="pt",
                                  return_metadata=True))
        indices = sample_indices(item["frames"], item["fps"], cfg)
        their_indices = list(theirs["video_metadata"][0].frames_indices)
        if not torch.equal(grid, theirs["video_grid_thw"]) or their_indices != indices:
            raise SystemExit(f"{os.path.basename(path)}: mimo's grid {grid.tolist()} / frames "
                             f"{indices} differ from transformers' "
                             f"{theirs['video_grid_thw'].tolist()} / {their_indices}: not the "
                             "same work, no comparison")
        reference = theirs["pixel_values_videos"]
        same = ("equal" if torch.equal(pixels, reference) else
                f"differ: max |diff| {(pixels - reference).abs().max().item():.3g}")
        print(f"{os.path.basename(path):10s} {item['width']:>4d}x{item['height']:<3d} "
              f"{item['fps']:3.0f} {gop:4d} {item['frames']:6d} {len(indices):7d} "
              f"{str(tuple(grid[0].tolist())):>13s}  {our_frames:5d} ({our_seeks:2d}) / "
              f"{their_frames:5d} ({their_seeks:d})  (last sampled frame {indices[-1]})"
              f"  {same}")


# --- timing ------------------------------------------------------------------------------

def stages(paths: list[str], items: list[dict], cfg: VideoConfig, processor: Any,
           device: torch.device, rounds: int = 2) -> None:
    """Per-clip milliseconds of each stage, one process (best of ``rounds``, summed over the
    clips): where the time goes, not the comparison."""
    def best(run: Callable, *args: Any, **kwargs: Any) -> tuple[float, Any]:
        times, result = [], None
        for _ in range(rounds):
            start = time.perf_counter()
            result = run(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times), result

    totals = dict.fromkeys(("mimo decode", "mimo patches", "mimo normalize", "hf load_video",
                            "hf processor"), 0.0)
    sampler = functools.partial(processor.sample_frames, fps=cfg.fps)
    for path, item in zip(paths, items):
        with open(path, "rb") as handle:
            data = handle.read()
        seconds, frames = best(decode_video, data, item, cfg)
        totals["mimo decode"] += seconds
        seconds, inputs = best(video_encoder_inputs, [frames], cfg)
        totals["mimo patches"] += seconds
        pixels = inputs["pixel_values_videos"].to(device)
        totals["mimo normalize"] += best(normalize_video_pixels, pixels, cfg)[0]
        seconds, (loaded, _) = best(load_video, path, backend=processor.backend,
                                    sample_indices_fn=sampler)
        totals["hf load_video"] += seconds
        totals["hf processor"] += best(processor, videos=[loaded], do_sample_frames=False,
                                       return_tensors="pt")[0]
    print(f"stages, ms a clip (one process, best of {rounds}): " + ", ".join(
        f"{name} {1000 * value / len(paths):.0f}" for name, value in totals.items()))


def _rate(loader: torch.utils.data.DataLoader, finish: Callable, samples: int,
          device: torch.device, warm_up: bool) -> float:
    """Seconds to run ``samples`` samples through ``loader`` (its workers persistent), ``finish``
    applied to each batch; ``warm_up``: after an untimed epoch of a batch a worker (worker
    start-up)."""
    dataset = loader.dataset
    if warm_up:
        dataset.samples = loader.batch_size * max(1, loader.num_workers)
        for batch in loader:
            finish(batch)
    dataset.samples = samples
    start = time.perf_counter()
    count = 0
    for batch in loader:
        finish(batch)
        count += len(batch["video_grid_thw"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    assert count == samples
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--sizes", nargs="+", default=["320x240", "480x270", "640x360"])
    parser.add_argument("--rates", type=int, nargs="+", default=[24, 30])
    parser.add_argument("--gops", type=int, nargs="+", default=[48, 120, 250])
    parser.add_argument("--fps", type=float, default=VideoConfig.fps,
                        help="frames sampled a second (both paths)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the encoder's: where the float step runs")
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "forkserver", "fork"],
                        help="DataLoader workers' (fork hangs: see the module's docstring)")
    args = parser.parse_args()
    torch.set_num_threads(1)      # as in a DataLoader worker: one process is one core
    cfg = VideoConfig(fps=args.fps)
    device = torch.device(args.device)
    backend, note = transformers_backend()
    processor = processor_for(cfg, backend)
    work = tempfile.mkdtemp(prefix="bench_video_")
    try:
        start = time.perf_counter()
        paths = make_clips(work, args)
        items = []
        for i, path in enumerate(paths):
            with open(path, "rb") as handle:
                items.append({**probe_video(handle.read(), "header"),
                              "gop": args.gops[i % len(args.gops)]})
        megabytes = sum(os.path.getsize(p) for p in paths) / 1e6
        print(f"{len(paths)} h264 clips of {args.seconds:g} s ({megabytes:.1f} MB) made in "
              f"{time.perf_counter() - start:.0f} s; sampling {cfg.fps:g} frames/s, "
              f"min/max pixels {cfg.min_pixels}/{cfg.max_pixels}")
        print(f"transformers: Qwen2VLVideoProcessor(do_sample_frames=True) on the clip paths, "
              f"load_video(backend={backend!r}) ({note})")
        check(paths, items, cfg, processor)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stages(paths, items, cfg, processor, device)

        pipelines: dict[str, Callable[[int], tuple[torch.utils.data.DataLoader, Callable]]] = {
            "mimo": lambda workers: (torch.utils.data.DataLoader(
                MimoClips(paths, items, args.samples, cfg), batch_size=args.batch_size,
                num_workers=workers, collate_fn=MimoCollate(cfg), **spawn(workers)),
                mimo_finish(cfg, device)),
            "transformers": lambda workers: (torch.utils.data.DataLoader(
                ClipPaths(paths, args.samples), batch_size=args.batch_size,
                num_workers=workers, collate_fn=ProcessorCollate(processor), **spawn(workers)),
                transformers_finish(device)),
        }
        def spawn(workers: int) -> dict[str, Any]:
            return ({"multiprocessing_context": args.start_method, "persistent_workers": True}
                    if workers else {})

        runs: dict[tuple[str, int], list[float]] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaders = {}          # persistent workers: started once, for every repeat
            for _ in range(args.repeat):
                for workers in args.workers:
                    for name, make in pipelines.items():
                        first = (name, workers) not in loaders
                        if first:
                            loaders[(name, workers)] = make(workers)
                        loader, finish = loaders[(name, workers)]
                        runs.setdefault((name, workers), []).append(
                            _rate(loader, finish, args.samples, device, first))
            del loaders
        print(f"{args.samples} samples a run ({len(paths)} clips cycled), batch "
              f"{args.batch_size}, after a warm-up epoch, normalize/transfer on {device}; "
              f"medians of {args.repeat} interleaved runs")
        print(f"{'path':13s} {'workers':>7s} {'samples/s':>10s} {'vs transformers':>16s}  "
              "target")
        rates = {key: statistics.median(args.samples / t for t in results)
                 for key, results in runs.items()}
        for workers in args.workers:
            baseline = rates[("transformers", workers)]
            for name in pipelines:
                rate = rates[(name, workers)]
                target = ">= 2x" if name == "mimo" else ""
                print(f"{name:13s} {workers:7d} {rate:10.2f} {rate / baseline:15.2f}x  {target}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
