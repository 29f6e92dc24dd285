"""Where a dataset lives: a local directory or a URL of object storage, through fsspec.

Local paths (and ``file://``) keep plain OS I/O: ``pread``, atomic rename, fsync. Any other
``scheme://`` location (``s3://``, ``gs://``, ``az://``, ``https://``) goes through the fsspec
filesystem of its scheme (s3fs, gcsfs, adlfs, HTTP): the ecosystem's common layer, so
credentials and endpoints come the usual way (the environment, the client's own config files,
``storage_options`` given to the calls below), and mimo never sees, prints or stores a secret.

Every remote call runs under ``retried``: transient faults (timeouts, 5xx, throttling, a
connection reset, a body shorter than asked for) are retried with exponential backoff, counted
in ``RETRIES`` and logged; what still fails raises ``StorageError`` naming the URL and what to
do. For S3 the client's own retry loops (botocore's and s3fs's, which nest: a 503 could cost 25
requests) are turned off, so one policy decides and every retry is counted; other clients
(gcsfs, adlfs, HTTP) keep theirs, and ours catch what they pass on.
"""

from __future__ import annotations

import datetime
import errno
import functools
import io
import os
import posixpath
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import IO, Any

ATTEMPTS = 6                      # tries of one remote call, the first included
BACKOFF_S = 0.2                   # first wait; doubled per retry (jittered), at most MAX_WAIT_S
MAX_WAIT_S = 8.0
THREADS = 8                       # look-ups in flight at once where each object is looked up
# HTTP(S): seconds to connect, and between two chunks of a reply, before a try fails (aiohttp's
# own default waits 5 minutes in silence on a server that accepts and never answers); S3's
# client (botocore) waits 60 s for each
HTTP_TIMEOUT_S = 60.0
RETRIES: Counter[str] = Counter()  # retried calls by cause, in this process
_RETRIES_LOCK = threading.Lock()


class StorageError(OSError):
    """A remote read or write that failed after every retry (or whose credentials were
    refused): exit status 1, the data's (a training start-up's config phase included)."""

    exit_code = 1


class ShortRead(OSError):
    """Fewer bytes than asked for arrived (a connection cut mid-body)."""


class ShortObject(StorageError):
    """The object ends before the bytes asked for: it was cut short or replaced, which no
    retry mends."""


class RangesIgnored(StorageError):
    """The server sent more than the byte range asked for: it ignores HTTP ``Range``."""


class LocationError(ValueError):
    """A location that cannot be what was meant: a URL with one slash after its scheme, a
    scheme that no installed storage client serves."""


# Errors that no retry mends: the object or bucket is missing or too short, access is denied,
# a bad call.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
              ValueError, TypeError, KeyError, NotImplementedError, ShortObject, RangesIgnored)


# botocore's errors for credentials that are absent or incomplete: no retry finds them
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError")
# object stores' schemes, whose URL's path is a bucket and a key prefix (an empty part in it is
# a mistake: ``s3://bucket//prefix``)
_BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2")
# a scheme, one slash, then no second one: ``s3:/bucket/prefix`` (a drive letter is one letter)
_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)(.*)$")


def is_remote(location: str) -> bool:
    """Whether ``location`` is a URL served by fsspec (not a local path or ``file://``)."""
    scheme, found, _ = location.partition("://")
    return bool(found) and scheme not in ("", "file")


def mistyped_url(location: str) -> str | None:
    """The URL ``location`` was meant to be where it lacks a slash (``s3:/b/p``, a scheme
    that fsspec knows), else None."""
    found = _ONE_SLASH.match(location)
    if not found or found[1].lower() == "file":
        return None
    import fsspec
    return f"{found[1]}://{found[2]}" if found[1].lower() in fsspec.available_protocols() \
        else None


def local_path(location: str) -> str:
    """A local location as an OS path (``file://`` stripped); LocationError for a URL that
    lacks a slash (it would be a local folder named ``s3:``)."""
    meant = mistyped_url(location)
    if meant is not None:
        raise LocationError(f"{location}: a URL with one slash after its scheme? write "
                            f"{meant} (or ./{location} for a local folder of that name)")
    return location[len("file://"):] if location.startswith("file://") else location


def canonical(location: str) -> str:
    """One spelling of the place ``location`` names, to compare two: a local path resolved
    (links, ``..``, a trailing slash); a URL with its scheme's usual name, lower case, and
    its path's slashes collapsed (``S3://b//ds/`` and ``s3://b/ds`` are one)."""
    if not is_remote(location):
        return os.path.realpath(local_path(location))
    scheme, _, rest = location.partition("://")
    scheme = {"gcs": "gs", "s3a": "s3"}.get(scheme.lower(), scheme.lower())
    return f"{scheme}://{re.sub('/+', '/', rest).strip('/')}"


def check_scheme(location: str) -> None:
    """LocationError where no installed fsspec client serves the scheme of the URL
    ``location`` (an unknown scheme, or its client not installed), or where an object
    store's URL has an empty part (``s3://bucket//prefix``, a ``$BUCKET/$PREFIX`` joined
    with a slash too many: the store keeps the key so, another place), before any call."""
    import fsspec
    protocol, _, rest = location.partition("://")
    path = re.split(r"[?#]|::", rest, maxsplit=1)[0]        # not a query's or a chained URL's
    if protocol.lower() in _BUCKETED and "//" in path:
        raise LocationError(f"{location}: an empty part (//) after the bucket: an object store "
                            "keeps it in the key, a place other than the one meant; write "
                            f"{protocol}://{re.sub('/+', '/', path)}{rest[len(path):]}")
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        lower = protocol.lower() in fsspec.available_protocols() and protocol.lower()
        raise LocationError(f"{location}: no storage client knows the scheme {protocol}:// "
                            + (f"(schemes are lower case: {lower}://)" if lower else
                               "(s3://, gs://, az://, https:// ... ): check the URL")) from None
    except ImportError as exc:
        raise LocationError(f"{location}: {protocol}:// needs a client that is not installed "
                            f"here ({exc})") from None


def join(location: str, *names: str) -> str:
    return posixpath.join(location, *names) if is_remote(location) else \
        os.path.join(local_path(location), *names)


def name_of(location: str) -> str:
    """The last component of ``location`` (a dataset's name)."""
    return posixpath.basename(location.rstrip("/")) if is_remote(location) else \
        os.path.basename(os.path.abspath(local_path(location)))


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of an HTTP client's reply error (aiohttp's), or of the one it wraps."""
    for error in (exc, exc.__cause__):
        status = getattr(error, "status", None)
        if isinstance(status, int) and type(error).__module__.split(".")[0] == "aiohttp":
            return status
    return None


def _said(exc: BaseException) -> str:
    """What ``exc`` says: an HTTP reply's status and reason alone (not the client's whole
    request), a timeout's (whose text is empty) that no answer came in time."""
    status = _http_status(exc)
    if status is not None:
        reason = getattr(exc, "message", None) or getattr(exc.__cause__, "message", "")
        return f"HTTP {status} {reason}".rstrip()
    if not str(exc).strip() and "Timeout" in type(exc).__name__:
        return "no answer in time"
    return str(exc).rstrip(".")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT):
        return False
    status = _http_status(exc)
    if status is not None:          # a server error, throttling or a request timeout
        return status >= 500 and status != 501 or status in (408, 429)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSYS:
        return False                # s3fs's 501 Not Implemented: no S3 store there
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    # client libraries' own error types (aiohttp, botocore, urllib3, requests)
    return type(exc).__module__.split(".")[0] in ("aiohttp", "botocore", "aiobotocore",
                                                  "urllib3", "requests", "asyncio")


def retried[T](what: str, call: Callable[[], T], attempts: int | None = None,
               endpoint: Callable[[], str] | None = None) -> T:
    """``call()``, tried ``attempts`` times (``ATTEMPTS``) on transient faults; StorageError
    naming ``what`` when it keeps failing, the permanent error itself at once; ``endpoint``
    (``endpoint_of``, asked on failure alone) said where the credentials or the endpoint may
    be at fault."""
    attempts = attempts or ATTEMPTS

    def at() -> str:
        named = endpoint() if endpoint is not None else ""
        return f" (endpoint {named})" if named else ""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:         # classified just below
            if isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc):
                # a misspelt storage option: the client takes it only at its first request
                raise LocationError(f"{what}: the storage client takes no such option ({exc}): "
                                    "check the storage options' keys (s3: endpoint_url, key, "
                                    "secret, client_kwargs, config_kwargs, ...)") from None
            if type(exc).__name__ == "ProfileNotFound":
                raise StorageError(f"{what}: {exc}: check AWS_PROFILE (or the profile of "
                                   "storage_options)") from exc
            if _http_status(exc) in (401, 403):
                raise StorageError(
                    f"{what}: access denied ({_said(exc)}): the server refuses this URL (a "
                    "signed URL expired, or it wants credentials: give the headers it asks "
                    "for as the storage options' client_kwargs: {headers: {...}})") from exc
            if isinstance(exc, PermissionError) or type(exc).__name__ in _NO_CREDENTIALS:
                said = {"NoCredentialsError": "no credentials found",
                        "PartialCredentialsError": "incomplete credentials"}.get(
                            type(exc).__name__, "access denied")
                raise StorageError(
                    f"{what}{at()}: {said} ({type(exc).__name__}: {exc}). " +
                    ("Check" if said == "access denied" else "Give") +
                    " the credentials (the environment's variables, e.g. AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, the client's config files, or, for mimo-train, "
                    "data.storage_options)" + (" and that they may use this bucket"
                                               if said == "access denied" else "")) from exc
            if not _transient(exc):
                if _http_status(exc) is not None:       # 400, 405, 416 ...: said short
                    raise StorageError(f"{what}: {_said(exc)} from the server") from exc
                raise
            if attempt == attempts:
                raise StorageError(
                    f"{what}{at()}: failed {attempts} times, last with {type(exc).__name__}: "
                    f"{_said(exc)}. Check the endpoint, the credentials and the network"
                    ) from exc
            with _RETRIES_LOCK:
                RETRIES[type(exc).__name__] += 1
            wait = min(BACKOFF_S * 2 ** (attempt - 1), MAX_WAIT_S) * (0.5 + random.random())
            # one write per line: print writes the text and its newline apart, which the
            # reader's threads then interleave
            sys.stderr.write(f"mimo: {what}: {type(exc).__name__} ({_said(exc)}); retry {attempt} "
                             f"of {attempts - 1} in {wait:.1f}s\n")
            sys.stderr.flush()
            time.sleep(wait)
    raise AssertionError("unreachable")


def endpoint_of(location: str, options: dict) -> str:
    """The S3 endpoint requests to ``location`` go to, as its storage ``options``, the
    environment or the AWS config file's profile give it (botocore's order), else AWS's own;
    "" for other stores."""
    if location.partition("://")[0] not in ("s3", "s3a"):
        return ""
    given = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
        "endpoint_url")
    if given:
        return str(given)
    try:        # botocore's own lookup: the environment, then the config file's profile
        from botocore.configprovider import ConfiguredEndpointProvider
        from botocore.session import Session
        session = Session(profile=options.get("profile"))
        if session.get_config_variable("ignore_configured_endpoint_urls"):
            return "AWS's own: the configured endpoints are ignored " \
                "(ignore_configured_endpoint_urls)"
        given = ConfiguredEndpointProvider(session.full_config, session.get_scoped_config(),
                                           "s3").provide()
    except Exception:           # (a profile that is not there, say): unknown
        return "AWS's own, unless the environment or an AWS config file sets one"
    return str(given) if given else "AWS's own: no endpoint_url given"


def bucket_missing(location: str, options: dict | None,
                   error: FileNotFoundError | None = None) -> str:
    """Why a request to ``location`` found no bucket, naming the endpoint: S3's NoSuchBucket
    (or, without ``error``, a bucket found missing) as a bucket that does not exist there, a
    bare 404 (an endpoint that is no S3 store: a web server, another port) as that."""
    cause = error.__cause__ or error.__context__ if error is not None else None
    code = (getattr(cause, "response", None) or {}).get("Error", {}).get("Code")
    endpoint = endpoint_of(location, options or {})
    if error is None or code in (None, "NoSuchBucket"):
        return f"its bucket does not exist at the endpoint {endpoint}"
    return (f"the endpoint {endpoint} answers {code} {error.strerror or error} without S3's "
            "NoSuchBucket: is it an S3 store? (endpoint_url, AWS_ENDPOINT_URL_S3 or the AWS "
            "profile's endpoint say where requests go)")


def _ranges_ignored(read: str) -> RangesIgnored:
    """The error of a ``read`` (what was asked, what came) from a server ignoring ranges."""
    return RangesIgnored(f"{read}: the server ignores byte ranges (HTTP Range), which a "
                         "dataset read in place needs; serve it with one that honours them "
                         "(nginx, Apache, an object store), or copy the dataset here")


def _error_code(exc: BaseException | None) -> str | None:
    """The S3 error code of a botocore ClientError (None for anything else)."""
    response = getattr(exc, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _etag(written: object) -> str | None:
    """The ETag of what a write returned (s3fs: the PutObject response), None where none."""
    etag = written.get("ETag") if isinstance(written, dict) else None
    return etag if isinstance(etag, str) else None


class Remote:
    """The fsspec filesystem of one remote location, made on first use in each process
    (fsspec's async clients do not survive ``fork``; DataLoader workers make their own)."""

    def __init__(self, location: str, storage_options: dict | None = None):
        self.protocol = location.partition("://")[0]
        self.location = location
        self.options = dict(storage_options or {})
        self._fs: Any = None
        self._pid: int | None = None

    @property
    def fs(self) -> Any:
        if self._pid != os.getpid():
            import fsspec                # only remote datasets pay for the import
            check_scheme(self.location)
            options = {"skip_instance_cache": True, "use_listings_cache": False, **self.options}
            s3 = self.protocol in ("s3", "s3a")
            if s3:                       # botocore's retries off: ``retried`` does them all
                options["config_kwargs"] = {
                    "retries": {"total_max_attempts": 1, "mode": "standard"},
                    **options.get("config_kwargs", {})}
            if self.protocol in ("http", "https"):
                import aiohttp
                options["client_kwargs"] = {
                    "timeout": aiohttp.ClientTimeout(total=None, sock_connect=HTTP_TIMEOUT_S,
                                                     sock_read=HTTP_TIMEOUT_S),
                    **options.get("client_kwargs", {})}
            self._fs = fsspec.filesystem(self.protocol, **options)
            if s3:
                self._fs.retries = 1     # s3fs's own retry loop too (a class attribute)
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict:
        return {"protocol": self.protocol, "location": self.location, "options": self.options,
                "_fs": None, "_pid": None}

    def retried[T](self, what: str, call: Callable[[], T]) -> T:
        """``retried``, its failures naming this store's endpoint."""
        return retried(what, call,
                       endpoint=lambda: endpoint_of(self.location, self.options))

    def read(self, url: str) -> bytes:
        return self.retried(f"reading {url}", lambda: self.fs.cat_file(url))

    def read_range(self, url: str, start: int, size: int) -> bytes:
        """Bytes ``[start, start + size)`` of ``url``: exactly ``size`` of them, or an error."""
        def call() -> bytes:
            try:
                data = self.fs.cat_file(url, start=start, end=start + size)
                if len(data) > size:
                    raise _ranges_ignored(f"reading {url} bytes {start}-{start + size}: "
                                          f"{len(data)} bytes arrived for {size}")
                if len(data) != size:
                    raise ShortRead(f"{len(data)} of {size} bytes arrived")
            except Exception as exc:   # short, or past the end (416): is the object itself?
                if isinstance(exc, _PERMANENT) or not (isinstance(exc, OSError)
                                                       or _http_status(exc) == 416):
                    raise
                try:
                    held = self.fs.info(url).get("size")
                except Exception:       # the look-up failed too: the read's fault stands
                    raise exc from None
                if held is not None and held < start + size:
                    raise ShortObject(f"{url} holds {held} bytes, not the {start + size} or more "
                                      "its dataset's index says: it was cut short or "
                                      "replaced") from None
                raise
            return data
        return self.retried(f"reading {url} bytes {start}-{start + size}", call)

    def check_ranges(self, url: str, size: int | None = None) -> None:
        """``RangesIgnored`` where the HTTP(S) server of ``url`` (``size`` bytes, where known:
        no look-up) ignores byte ranges, found with one ranged request whose reply is not read
        when it is the whole object (as ``read_range`` would read it, a whole tar, before
        saying so); a store's URL: none."""
        if self.protocol not in ("http", "https"):
            return

        def call() -> None:
            with self.fs.open(url, "rb", block_size=1, cache_type="none", size=size) as f:
                f.seek(1)
                f.read(1)
        try:
            self.retried(f"reading {url} bytes 1-2", call)
        except ValueError as error:       # fsspec's HTTPFile: "doesn't appear to support
            if "range" not in str(error):   # range requests"
                raise
            raise _ranges_ignored(f"reading {url} bytes 1-2: the whole object came") from None

    def entries(self, url: str, names: list[str]) -> dict[str, dict]:
        """fsspec's entry (``size``, the store's ETag or time of writing, ...) of each of
        ``names`` (paths relative to ``url``, in folders below it too) that is there: one
        listing of each folder holding some, or, where listing is not to be had (HTTP lists
        nothing reliably; credentials may read objects but not list them), one HEAD each,
        ``THREADS`` at a time."""
        if self.protocol not in ("http", "https"):
            found: dict[str, dict] = {}
            for folder in sorted({posixpath.dirname(name) for name in names}):
                where = join(url, folder) if folder else url
                listed = self.retried(f"listing {where}", functools.partial(self._listed, where))
                if listed is None:              # listing denied: look each one up instead
                    break
                found.update({posixpath.join(folder, base): entry
                              for base, entry in listed.items()})
            else:
                return {name: found[name] for name in names if name in found}

        def head(name: str) -> tuple[str, dict | None]:
            def call() -> dict | None:
                try:
                    return self._info(join(url, name))
                except PermissionError:     # S3 answers 403 for an absent key to those who
                    return None             # may not list: absent or unreadable, either way
            return name, self.retried(f"looking up {join(url, name)}", call)
        with ThreadPoolExecutor(THREADS) as pool:
            return {name: info for name, info in pool.map(head, names) if info is not None}

    def _listed(self, url: str) -> dict[str, dict] | None:
        """``{name: entry}`` of the files directly under ``url``; None where the credentials
        may not list it."""
        try:
            return {posixpath.basename(entry["name"].rstrip("/")): entry
                    for entry in self.fs.ls(url, detail=True) if entry["type"] == "file"}
        except FileNotFoundError:
            return {}
        except PermissionError:
            return None

    def _info(self, url: str) -> dict | None:
        """``url``'s info (one HEAD), None where it is not there. fsspec's HTTP reports every
        failure as FileNotFoundError: there only a 404 or 410 reply is absence, anything else
        is raised as the fault it is (retried)."""
        try:
            return self.fs.info(url)
        except FileNotFoundError as exc:
            if self.protocol in ("http", "https") and \
                    getattr(exc.__cause__, "status", None) not in (404, 410):
                cause = exc.__cause__
                if isinstance(cause, Exception) and _http_status(cause) is not None:
                    raise cause from None   # the reply's error, classified: 403 said, 5xx retried
                raise ConnectionError(f"{url}: {exc.__cause__!r}") from exc
            return None

    def exists(self, url: str) -> bool:
        return self.retried(f"looking up {url}", lambda: self._info(url) is not None)

    def written(self, url: str) -> tuple[float | None, str | None]:
        """When ``url`` was last written, by the store's clock (seconds since the epoch), and
        its ETag, both of one look (fsspec's ``info``); None for either where it is not there
        or its store does not say."""
        def call() -> tuple[float | None, str | None]:
            try:
                info = self.fs.info(url)
            except (FileNotFoundError, IsADirectoryError):
                return None, None
            stamp = info.get("LastModified")      # s3fs's; other stores through ``modified``
            try:
                when = (stamp if isinstance(stamp, datetime.datetime) else
                        self.fs.modified(url)).timestamp()
            except NotImplementedError:
                return None, info.get("ETag")
            return when, info.get("ETag")
        return self.retried(f"looking up {url}", call)

    def names(self, url: str) -> list[str]:
        """Names directly under ``url`` (files and prefixes); [] when there are none."""
        def call() -> list[str]:
            try:
                return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(url, detail=False)]
            except FileNotFoundError:
                return []
        return self.retried(f"listing {url}", call)

    def put(self, path: str, url: str) -> None:
        """Upload the local file ``path`` to ``url`` (one object: readers see all or none)."""
        self.retried(f"writing {url}", lambda: self.fs.put_file(path, url))

    def write(self, url: str, data: bytes) -> str | None:
        """Write ``url``: its ETag where the store says it (S3), else None."""
        return _etag(self.retried(f"writing {url}", lambda: self.fs.pipe_file(url, data)))

    def create(self, url: str, data: bytes) -> str | None:
        """Write ``url`` only where nothing is there (S3's conditional write, If-None-Match):
        None where something was, else its ETag ("" where the store does not say). A client
        without fsspec's ``mode`` (an s3fs or botocore older than conditional writes) writes
        it anyway: the caller looks first."""
        def call() -> str | None:
            try:
                return _etag(self.fs.pipe_file(url, data, mode="create")) or ""
            except FileExistsError:
                return None
            except OSError as exc:      # a 412 without the Condition s3fs reads it by
                if _error_code(exc.__cause__) == "PreconditionFailed":
                    return None
                raise
            except Exception as exc:
                if not ((isinstance(exc, TypeError) and "mode" in str(exc)) or
                        type(exc).__name__ == "ParamValidationError"):
                    raise
                return _etag(self.fs.pipe_file(url, data)) or ""
        return self.retried(f"writing {url}", call)

    def replace(self, url: str, data: bytes, etag: str) -> str | None:
        """Write ``url`` only where it is still the object whose ETag is ``etag`` (S3's
        conditional write, If-Match): its new ETag ("" where the store does not say); None
        where it was written again or removed since (a retried write of the caller's own that
        had landed reads so too). NotImplementedError where the store or its client takes no
        such condition (nothing written)."""
        def call() -> str | None:
            try:
                return _etag(self.fs.pipe_file(url, data, IfMatch=etag)) or ""
            except FileNotFoundError:
                return None
            except OSError as exc:
                code = _error_code(exc.__cause__)
                if code == "PreconditionFailed":
                    return None
                if code == "NotImplemented":
                    raise NotImplementedError(f"{url}: the store takes no If-Match") from None
                raise
            except Exception as exc:     # a client without the parameter
                if (isinstance(exc, TypeError) and "IfMatch" in str(exc)) or \
                        type(exc).__name__ == "ParamValidationError":
                    raise NotImplementedError(f"{url}: the client takes no If-Match") from None
                raise
        return self.retried(f"writing {url}", call)

    def remove(self, url: str, recursive: bool = False) -> None:
        def call() -> None:
            try:
                self.fs.rm(url, recursive=recursive)
            except FileNotFoundError:
                pass
        self.retried(f"removing {url}", call)

    def move(self, url: str, to: str) -> None:
        """Move the object ``url`` to ``to`` (in an object store a copy made by the store,
        then the removal)."""
        self.retried(f"moving {url} to {to}", lambda: self.fs.mv(url, to))

    def fetch(self, url: str, path: str) -> None:
        """Download ``url`` to the local ``path`` atomically."""
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            self.retried(f"reading {url}", lambda: self.fs.get_file(url, tmp))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


_SECRET_WORDS = ("secret", "key", "token", "password", "credential", "sas", "signature")


def version(entry: dict) -> str | None:
    """What fsspec's ``entry`` of an object (a listing's or a lookup's) says changes when the
    object is written again: its ETag where the store gives one, else its time of writing;
    None where it says neither."""
    etag = entry.get("ETag") or entry.get("etag")
    if etag:
        return f"etag {str(etag).strip(chr(34))}"
    for key in ("LastModified", "Last-Modified", "mtime", "updated", "last_modified"):
        when = entry.get(key)
        if isinstance(when, datetime.datetime):
            return f"written {when.timestamp()}"
        if when is not None:
            return f"written {when}"
    return None


def local_version(stat: os.stat_result) -> str:
    """What changes when a local file (``stat``: its ``os.stat``) is written again: its time
    of writing, in nanoseconds (``version`` of a local file)."""
    return f"mtime_ns {stat.st_mtime_ns}"


def look_up(root: str, names: list[str], remote: Remote | None
            ) -> dict[str, tuple[int | None, str | None]]:
    """``{name: (bytes, version)}`` of those of ``names`` (paths relative to ``root``, a local
    folder, or a location of ``remote``) that are there (None: the store does not say): a
    ``stat`` each of local files, the listing of a remote folder (``Remote.entries``)."""
    if remote is not None:
        return {name: (entry.get("size"), version(entry))
                for name, entry in remote.entries(root, names).items()}
    found: dict[str, tuple[int | None, str | None]] = {}
    folder = local_path(root)
    for name in names:
        try:
            stat = os.stat(os.path.join(folder, name))
        except FileNotFoundError:
            continue
        found[name] = (stat.st_size, local_version(stat))
    return found


def rewritten(shards: list[dict], found: dict[str, tuple[int | None, str | None]]
              ) -> list[str]:
    """The names of an index's ``shards`` (each with its ``name`` and, where recorded, the
    ``version`` it was indexed at) that ``found`` (``look_up``) holds at another version: tars
    written again since (a copy too); none where either version is unknown."""
    return [shard["name"] for shard in shards if None not in (
        then := shard.get("version"), now := found.get(shard["name"], (None, None))[1])
        and then != now]


def redacted(options: Any) -> Any:
    """``options`` with the value of every secret-looking key (``key``, ``secret``,
    ``token``...) replaced: what may be written into a checkpoint or a log."""
    if isinstance(options, dict):
        return {name: "<redacted>" if any(word in str(name).lower() for word in _SECRET_WORDS)
                else redacted(value) for name, value in options.items()}
    if isinstance(options, list):
        return [redacted(value) for value in options]
    return options


def bucket_absence(location: str, storage_options: dict | None = None
                   ) -> FileNotFoundError | None:
    """Where S3 says the bucket of the S3 URL ``location`` is not there, its answer (for
    ``bucket_missing``: S3's NoSuchBucket, or an endpoint's bare 404); None for any other
    location, and where the bucket is there or the look-up fails (credentials that may read
    a prefix but not the bucket's head)."""
    scheme, _, path = location.partition("://")
    if scheme not in ("s3", "s3a"):
        return None
    top = f"{scheme}://{path.split('/')[0]}"
    remote = Remote(top, storage_options)

    def look() -> FileNotFoundError | None:
        try:
            remote.fs.info(top)
        except FileNotFoundError:       # a HEAD's 404 is bare: a listing's says NoSuchBucket
            try:
                remote.fs.ls(location)
            except FileNotFoundError as error:
                return error
        return None
    try:
        return remote.retried(f"looking up {top}", look)
    except Exception:        # (StorageError, a client's own): no answer, so no claim
        return None


def read_bytes(location: str, storage_options: dict | None = None) -> bytes:
    """The whole file at ``location``."""
    if is_remote(location):
        return Remote(location, storage_options).read(location)
    with open(local_path(location), "rb") as handle:
        return handle.read()


def exists(location: str, storage_options: dict | None = None) -> bool:
    if is_remote(location):
        return Remote(location, storage_options).exists(location)
    return os.path.exists(local_path(location))


@contextmanager
def local_copy(location: str, storage_options: dict | None = None) -> Iterator[str]:
    """A local path holding ``location``'s bytes: the file itself when local, else a
    temporary download removed on exit."""
    if not is_remote(location):
        yield local_path(location)
        return
    folder = tempfile.mkdtemp(prefix="mimo-")
    try:
        path = os.path.join(folder, name_of(location))
        Remote(location, storage_options).fetch(location, path)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def readable(location: str, storage_options: dict | None = None) -> str | IO[bytes]:
    """What pyarrow opens for ``location``: a local path itself, a remote file's bytes in
    memory (for the files of a dataset's own: samples.parquet, the index, a report)."""
    return io.BytesIO(read_bytes(location, storage_options)) if is_remote(location) else \
        local_path(location)
