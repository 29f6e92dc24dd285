"""Benchmark the loader reading a dataset from object storage against reading it locally, and
against webdataset streaming the same tars from the same store, in the same run. Prints
samples/s and GET requests per sample of each pipeline, and the ratios bucket / local and
bucket / webdataset.

The sample corpus replicated to ``--samples`` (8 shards: 4 MB each at 400) is uploaded with its
``.mimo-cache/`` to a bucket of a local S3 server (``tools/object_store.py``: moto behind a
proxy that adds ``--latency-ms`` to every request once the upload is done; it runs in a child
process, so that its Python does not compete for the bench's GIL). Layout
``language=dp1;image=dp1;audio=dp1``:

- encoder rank (images, rank 1): ``build_loader`` decoding media, over the local directory and
  over the ``s3://`` URL (tables cached in a temporary folder), ``--workers`` 0 and 2;
- language rank (rank 0, metadata only), local and ``s3://``; it works in-process whatever
  ``num_workers`` (loader.py, "Workers"), so it is run once per repeat;
- webdataset remote (the baseline): ``webdataset`` streaming the tars from the same server with
  the same latency, one presigned HTTP GET URL per tar (boto3 ``generate_presigned_url``) read
  by webdataset's own ``curl`` opener, through the same full Preprocessor and Collator as
  bench_loader's plain pipeline (the encoder rank's work), ``--workers`` 0 and 2.

The ``s3://`` DataSource is opened before timing; its first open (tables downloaded, the token
table computed) is timed apart, as is a second open with the tables cached. Prints medians of
``--repeat`` interleaved runs: samples/s, GET requests per sample of each remote pipeline (the
server's count, worker processes included; other requests per run beside), and the ratios
encoder bucket / local (target >= 0.8), language bucket / local (target >= 0.5), encoder
bucket / webdataset remote (target >= 1) and language bucket / webdataset remote (target >= 1).
Torch runs one thread per process.

    python tools/bench_remote.py [--samples 400] [--repeat 2] [--latency-ms 20] [--workers 0 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.utils.data

from bench_loader import ENCODER_RANK, LANGUAGE_RANK, LAYOUT, _as_is, _Plain
from mimo_data.loading.loader import DataSource, build_loader
from mimo_data.preprocess.preprocessor import Preprocessor
from replicate_corpus import replicated_dataset

BUCKET = "bench-remote"


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """The child process: a LocalS3 answering ``(command, value)`` messages with its request
    counts until ``stop``."""
    from object_store import LocalS3

    with LocalS3() as s3:
        s3.make_bucket(BUCKET)
        conn.send((s3.endpoint_url, s3.storage_options))
        while True:
            command, value = conn.recv()
            if command == "stop":
                break
            if command == "latency":
                s3.latency_s = value
            elif command == "reset":
                s3.reset_counters()
            conn.send(dict(s3.requests))


class _Store:
    """A LocalS3 in a child process, with a bucket ``BUCKET``."""

    def __init__(self) -> None:
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(child,), daemon=True)
        self._process.start()
        self.endpoint_url, self.storage_options = self._conn.recv()

    def _ask(self, command: str, value: Any = None) -> dict[str, int]:
        self._conn.send((command, value))
        return self._conn.recv()

    def set_latency(self, seconds: float) -> None:
        self._ask("latency", seconds)

    def reset(self) -> None:
        self._ask("reset")

    def requests(self) -> tuple[int, int]:
        """(GET requests, other requests) since the last reset."""
        counts = self._ask("requests")
        return counts.get("GET", 0), sum(counts.values()) - counts.get("GET", 0)

    def close(self) -> None:
        self._conn.send(("stop", None))
        self._process.join(30)


class _PlainRemote(_Plain):
    """bench_loader's plain pipeline over tar URLs (webdataset opens http ones with curl)."""

    def __init__(self, urls: list[str], preprocessor: Preprocessor, micro_batch_size: int):
        self.urls = urls
        self.preprocessor = preprocessor
        self.micro_batch_size = micro_batch_size


def _presigned(store: _Store, prefix: str, dataset: str) -> list[str]:
    """Presigned GET URLs of the dataset's tars in the bucket (moto's objects are private)."""
    import boto3

    client = boto3.client("s3", endpoint_url=store.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    return [client.generate_presigned_url("get_object", ExpiresIn=24 * 3600,
                                          Params={"Bucket": BUCKET, "Key": f"{prefix}/{name}"})
            for name in sorted(os.listdir(dataset)) if name.endswith(".tar")]


def _run(batches, store: _Store) -> tuple[float, int, int, int, int]:
    """(seconds, samples timed, samples in all, GET requests, other requests) to exhaust
    ``batches``: the first micro-batch is not timed (it pays for worker start-up in every
    pipeline alike), but its requests count."""
    store.reset()
    iterator = iter(batches)
    _, metadata = next(iterator)
    first = len(metadata["keys"])
    start = time.perf_counter()
    samples = 0
    for _, metadata in iterator:
        samples += len(metadata["keys"])
    seconds = time.perf_counter() - start
    return (seconds, samples, first + samples, *store.requests())


def _open(store: _Store, what: str, open_source) -> DataSource:
    store.reset()
    start = time.perf_counter()
    source = open_source()
    gets, others = store.requests()
    print(f"{what}: {time.perf_counter() - start:.2f} s, {gets} GET and {others} other "
          "requests", flush=True)
    return source


def bench(dataset: str, config: str, store: _Store, latency_s: float, micro: int,
          global_batch: int, workers: list[int], repeat: int, cache: str) -> None:
    prefix = os.path.basename(dataset)
    url = f"s3://{BUCKET}/{prefix}"
    urls = _presigned(store, prefix, dataset)
    store.set_latency(latency_s)
    local = _open(store, "open local DataSource", lambda: DataSource(dataset, config))
    remote = _open(store, "open s3:// DataSource, first (tables downloaded)",
                   lambda: DataSource(url, config, cache_dir=cache,
                                      storage_options=store.storage_options))
    _open(store, "open s3:// DataSource, again (tables cached)",
          lambda: DataSource(url, config, cache_dir=cache, storage_options=store.storage_options))
    plain_preprocessor = Preprocessor(local.config, text=local.metadata.text)

    def rank_loader(source: DataSource, rank: int, count: int):
        loader = build_loader(source, None, LAYOUT, rank, 3, global_batch, micro, seed=0,
                              num_workers=count)
        assert loader is not None                   # both ranks need data
        return loader

    runs: dict[tuple[str, str], list[tuple[float, int, int, int, int]]] = {}
    for _ in range(repeat):
        for count in workers:
            plain = torch.utils.data.DataLoader(_PlainRemote(urls, plain_preprocessor, micro),
                                                batch_size=None, num_workers=count,
                                                collate_fn=_as_is)
            runs.setdefault(("webdataset, bucket", str(count)), []).append(_run(plain, store))
            del plain
            for where, source in (("local", local), ("bucket", remote)):
                loader = rank_loader(source, ENCODER_RANK, count)
                runs.setdefault((f"encoder rank, {where}", str(count)), []).append(
                    _run(loader, store))
                loader.close()
        for where, source in (("local", local), ("bucket", remote)):
            loader = rank_loader(source, LANGUAGE_RANK, 0)
            runs.setdefault((f"language rank, {where}", "-"), []).append(_run(loader, store))

    print(f"\n{len(local.readers[0])} samples, layout {LAYOUT}, global batch {global_batch}, "
          f"micro batch {micro}, {latency_s * 1000:g} ms per request; medians of {repeat} runs "
          "(language ranks work in-process: workers -)")
    print(f"{'pipeline':24s} {'workers':>7s} {'samples/s':>10s} {'GET/sample':>11s} "
          f"{'other requests':>14s}")
    rates: dict[tuple[str, str], float] = {}
    for (name, label), results in sorted(runs.items(), key=lambda item: (item[0][1],
                                                                          item[0][0])):
        rate = statistics.median(r[1] / r[0] for r in results)
        gets = statistics.median(r[3] / r[2] for r in results)
        others = statistics.median(r[4] for r in results)
        rates[(name, label)] = rate
        bucket = "bucket" in name
        print(f"{name:24s} {label:>7s} {rate:10.1f} {f'{gets:.3f}' if bucket else '-':>11s} "
              f"{f'{others:g}' if bucket else '-':>14s}")
    language = rates[("language rank, bucket", "-")]
    print(f"language bucket / local {language / rates[('language rank, local', '-')]:.2f}x "
          "(target >= 0.5)")
    for label in map(str, workers):
        encoder = rates[("encoder rank, bucket", label)]
        plain_rate = rates[("webdataset, bucket", label)]
        print(f"{label} workers: encoder bucket / local "
              f"{encoder / rates[('encoder rank, local', label)]:.2f}x (target >= 0.8), "
              f"encoder bucket / webdataset remote {encoder / plain_rate:.2f}x (target >= 1), "
              f"language bucket / webdataset remote {language / plain_rate:.1f}x (target >= 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)      # as in a DataLoader worker: one process is one core
    began = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_remote_")
    store = _Store()
    try:
        dataset = replicated_dataset(args.corpus, args.samples, work, shards=8)
        import fsspec

        start = time.perf_counter()
        fs = fsspec.filesystem("s3", **store.storage_options)
        fs.put(dataset, f"{BUCKET}/{os.path.basename(dataset)}", recursive=True)
        uploaded = fs.find(f"{BUCKET}/{os.path.basename(dataset)}")
        print(f"uploaded {len(uploaded)} files in {time.perf_counter() - start:.1f} s: "
              + ", ".join(sorted(name.rsplit("/", 1)[1] for name in uploaded
                                 if not name.endswith(".tar"))) + " and the tars",
              flush=True)
        bench(dataset, args.config, store, args.latency_ms / 1000, args.micro_batch_size,
              args.global_batch_size, args.workers, args.repeat,
              os.path.join(work, "bucket-cache"))
    finally:
        store.close()
        shutil.rmtree(work)
    print(f"wall time {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
