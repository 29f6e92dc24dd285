"""The local S3 proxy of tools/object_store.py: it relays requests, counts them, injects faults."""

from __future__ import annotations

import http.client
import os
from urllib.parse import urlsplit

import boto3
import fsspec
import pytest

from tools.object_store import Faults, LocalS3

BUCKET = "test-object-store"  # moto's state is process-wide: a name no other test uses


@pytest.fixture(scope="module", autouse=True)
def bucket(local_s3) -> None:
    local_s3.make_bucket(BUCKET)


def _get(s3: LocalS3, key: str) -> http.client.HTTPResponse:
    """A raw GET of a presigned URL through the proxy."""
    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    url = urlsplit(client.generate_presigned_url("get_object",
                                                 Params={"Bucket": BUCKET, "Key": key}))
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    conn.request("GET", f"{url.path}?{url.query}")
    return conn.getresponse()


def test_put_and_ranged_read(s3: LocalS3) -> None:
    fs = fsspec.filesystem("s3", **s3.storage_options)
    data = os.urandom(50_000)
    fs.pipe(f"{BUCKET}/ranged.bin", data)
    s3.reset_counters()
    assert fs.cat_file(f"{BUCKET}/ranged.bin", start=1000, end=21_000) == data[1000:21_000]
    assert s3.requests["GET"] == 1
    assert not s3.injected


def test_injected_503(s3: LocalS3) -> None:
    s3.faults = Faults(rate=1.0, kinds=("503",))
    resp = _get(s3, "missing.bin")
    assert resp.status == 503
    assert b"<Code>SlowDown</Code>" in resp.read()
    assert s3.injected == {"503": 1}
    assert s3.requests["GET"] == 1


def test_truncated_body(s3: LocalS3) -> None:
    fs = fsspec.filesystem("s3", **s3.storage_options)
    fs.pipe(f"{BUCKET}/truncated.bin", os.urandom(100_000))
    s3.faults = Faults(rate=1.0, kinds=("truncate",))
    resp = _get(s3, "truncated.bin")
    assert resp.status == 200
    assert resp.getheader("Content-Length") == "100000"
    with pytest.raises(http.client.IncompleteRead) as err:
        resp.read()
    assert len(err.value.partial) == 50_000
    assert s3.injected == {"truncate": 1}
