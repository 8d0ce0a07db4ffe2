"""`kvl prepare DST`: download the pinned checkpoint and pack it, with about one shard of scratch.

Owns: reaching the hub (huggingface_hub; HF_ENDPOINT honoured, fail fast when unreachable), fetching
the small files and every shard's safetensors header (HTTP range requests) so the pack layout is
known up front, then downloading one shard at a time into DST/.download (hf_hub_download resumes a
partial file), packing what it holds and deleting it, and finally checking the pack.
Does not own: the packing itself (kvl/pack.py) or the format (kvl/packfmt.py); the full health
check after packing belongs to kvl doctor (see `post_pack_check`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path

import kvl
from kvl import packfmt
from kvl.errors import UserError
from kvl.pack import InventorySource, pack_checkpoint

DEFAULT_ENDPOINT = "https://huggingface.co"
INDEX_NAME = "model.safetensors.index.json"
SCRATCH_DIR = ".download"
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0
# A transfer cut off mid-file is resumed from the partial file this many times before giving up.
DOWNLOAD_ATTEMPTS = 4
MAX_HEADER_BYTES = 100 << 20


def endpoint() -> str:
    """The hub endpoint, read at call time (huggingface_hub reads HF_ENDPOINT only at import)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _unreachable(base: str, exc: Exception) -> UserError:
    return UserError(f"cannot reach {base} (HF_ENDPOINT): {exc.__class__.__name__}: {exc}; check your "
                     "connection or set HF_ENDPOINT")


class Hub:
    """The few hub calls prepare needs, all against one endpoint/repo/revision."""

    def __init__(self, repo: str, revision: str, base: str) -> None:
        self.repo = repo
        self.revision = revision
        self.base = base
        self.commit: str | None = None

    def url(self, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo, filename, revision=self.revision, endpoint=self.base)

    def _request(self, method: str, filename: str, headers: dict[str, str] | None = None):
        import requests
        from huggingface_hub.utils import build_hf_headers, get_session

        all_headers = build_hf_headers()
        all_headers.update(headers or {})
        all_headers["Accept-Encoding"] = "identity"
        try:
            # One attempt with short timeouts: an offline machine must fail at once, not after
            # huggingface_hub's exponential back-off.
            return get_session().request(method, self.url(filename), headers=all_headers,
                                         timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
                                         allow_redirects=True)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise _unreachable(self.base, exc) from None

    def _check(self, response, filename: str) -> None:
        if response.status_code in (200, 206):
            return
        code = response.headers.get("X-Error-Code", "")
        if code == "RevisionNotFound":
            raise UserError(f"revision {self.revision} of {self.repo} does not exist on {self.base}; "
                            f"use --revision {kvl.PINNED_REVISION}")
        if code in ("RepoNotFound", "GatedRepo") or response.status_code in (401, 403):
            raise UserError(f"{self.repo} is not accessible on {self.base} (HTTP {response.status_code}"
                            f"{', ' + code if code else ''}); check HF_ENDPOINT and your access token")
        if response.status_code == 404:
            raise UserError(f"{filename} is missing from {self.repo} at {self.revision} on {self.base}")
        raise UserError(f"{self.base} answered HTTP {response.status_code} for {filename}; try again later")

    def probe(self) -> str:
        """HEAD config.json: proves the endpoint answers and learns the commit hash."""
        response = self._request("HEAD", "config.json")
        self._check(response, "config.json")
        commit = response.headers.get("X-Repo-Commit")
        if not commit or not re.fullmatch(r"[0-9a-f]{40}", commit):
            commit = self.revision if re.fullmatch(r"[0-9a-f]{40}", self.revision) else None
        if commit is None:
            raise UserError(f"{self.base} did not say which commit {self.revision} is; pass a full "
                            "40-hex --revision")
        self.commit = commit
        return commit

    def exists(self, filename: str) -> bool:
        response = self._request("HEAD", filename)
        if response.status_code == 404 and response.headers.get("X-Error-Code") == "EntryNotFound":
            return False
        self._check(response, filename)
        return True

    def range(self, filename: str, start: int, length: int) -> bytes:
        response = self._request("GET", filename, {"Range": f"bytes={start}-{start + length - 1}"})
        self._check(response, filename)
        data = response.content
        if response.status_code == 200:  # server ignored Range
            data = data[start:start + length]
        if len(data) != length:
            raise UserError(f"{filename}: expected {length} bytes at offset {start}, got {len(data)}; "
                            "the file on the hub is truncated or the transfer failed — try again")
        return data

    def safetensors_header(self, filename: str) -> dict:
        (n,) = struct.unpack("<Q", self.range(filename, 0, 8))
        if n > MAX_HEADER_BYTES:
            raise UserError(f"{filename}: header length {n} is implausible; the file is not safetensors")
        try:
            return json.loads(self.range(filename, 8, n))
        except ValueError as exc:
            raise UserError(f"{filename}: unreadable safetensors header ({exc})") from None

    def download(self, filename: str, scratch: Path) -> Path:
        """hf_hub_download into scratch; a cut-off transfer resumes from the partial file."""
        import requests
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

        last: Exception | None = None
        for attempt in range(DOWNLOAD_ATTEMPTS):
            try:
                return Path(hf_hub_download(self.repo, filename, revision=self.commit or self.revision,
                                            local_dir=scratch, endpoint=self.base,
                                            etag_timeout=READ_TIMEOUT_S))
            except EntryNotFoundError:
                raise UserError(f"{filename} is missing from {self.repo} at {self.revision}") from None
            except LocalEntryNotFoundError as exc:
                raise _unreachable(self.base, exc) from None
            except HfHubHTTPError as exc:
                raise UserError(f"downloading {filename} failed: {exc}") from None
            except (requests.RequestException, OSError) as exc:
                last = exc
                print(f"kvl prepare: transfer of {filename} interrupted ({exc.__class__.__name__}); "
                      f"resuming (attempt {attempt + 2}/{DOWNLOAD_ATTEMPTS})", file=sys.stderr)
        raise UserError(f"downloading {filename} failed {DOWNLOAD_ATTEMPTS} times ({last}); rerun kvl "
                        "prepare to resume")


class _ShardDownloads:
    """pack.ShardHooks: download a shard just before it is read, delete it once packed."""

    def __init__(self, hub: Hub, scratch: Path, source: InventorySource, keep: bool) -> None:
        self.hub = hub
        self.scratch = scratch
        self.source = source
        self.keep = keep

    def acquire(self, shard: str) -> None:
        print(f"kvl prepare: downloading {shard}", file=sys.stderr)
        self.hub.download(shard, self.scratch)

    def release(self, shard: str) -> None:
        self.source.release(shard)
        if not self.keep:
            (self.scratch / shard).unlink(missing_ok=True)


def build_source(hub: Hub, scratch: Path) -> InventorySource:
    """Small files downloaded, shard headers fetched by range: the whole inventory, no shard data."""
    scratch.mkdir(parents=True, exist_ok=True)
    hub.download("config.json", scratch)
    hub.download(INDEX_NAME, scratch)
    assets: dict[str, bytes] = {}
    for name in packfmt.ASSET_FILES:
        if name == "config.json" or hub.exists(name):
            assets[name] = hub.download(name, scratch).read_bytes()
    try:
        weight_map = json.loads((scratch / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("empty weight_map")
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{INDEX_NAME} from the hub is unreadable ({exc})") from None
    shards = sorted(set(weight_map.values()))
    headers = {shard: hub.safetensors_header(shard) for shard in shards}
    inventory: dict[str, tuple[str, tuple[int, ...], str | None]] = {}
    for name, shard in weight_map.items():
        meta = headers[shard].get(name)
        if not isinstance(meta, dict):
            raise UserError(f"{shard} does not contain {name}, which {INDEX_NAME} puts there")
        inventory[name] = (meta["dtype"], tuple(meta["shape"]), shard)
    config_text = assets["config.json"].decode("utf-8")
    return InventorySource(scratch, config_text, assets, inventory, hub.commit)


def post_pack_check(dst: Path, ram_budget_mib: int | None) -> None:
    """Hook for the final health check. Today: full structural validation of the pack. The owner of
    kvl/doctor.py will extend this to the doctor's checks (RAM plan against ram_budget_mib)."""
    packfmt.verify(dst)


def prepare(dst: Path, *, revision: str = kvl.PINNED_REVISION, keep_download: bool = False,
            ram_budget_mib: int | None = None, progress: bool = True) -> Path:
    dst = Path(dst)
    if (dst / packfmt.COMPLETE_FILE).is_file() and not (dst / packfmt.JOURNAL_DIR).exists():
        post_pack_check(dst, ram_budget_mib)
        print(f"kvl prepare: {dst} already holds a complete pack", file=sys.stderr)
        return dst
    base = endpoint()
    hub = Hub(kvl.PINNED_REPO, revision, base)
    commit = hub.probe()
    # Asking for another revision explicitly is the consent that --allow-revision gives kvl pack.
    allow_revision = commit != kvl.PINNED_REVISION
    if allow_revision:
        print(f"kvl prepare: warning: revision {revision} ({commit}) is not the pinned "
              f"{kvl.PINNED_REVISION}; kvl was verified only against the pinned one", file=sys.stderr)
    scratch = dst / SCRATCH_DIR
    dst.mkdir(parents=True, exist_ok=True)
    source = build_source(hub, scratch)
    hooks = _ShardDownloads(hub, scratch, source, keep_download)
    pack_checkpoint(source, dst, allow_revision=allow_revision, progress=progress, shard_hooks=hooks)
    post_pack_check(dst, ram_budget_mib)
    if not keep_download:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"kvl prepare: ready: {dst}", file=sys.stderr)
    return dst


def parse_size_mib(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 6000, 6000MiB, 8GiB)")
    value = float(m[1])
    unit = (m[2] or "m")[0]
    factor = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}[unit]
    return int(value * factor)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dst", metavar="DST", help="runtime directory to create")
    parser.add_argument("--revision", default=kvl.PINNED_REVISION,
                        help=f"hub revision (default: the pinned {kvl.PINNED_REVISION})")
    parser.add_argument("--keep-download", action="store_true",
                        help="keep the downloaded files in DST/.download (needs ~33 GB more disk)")
    parser.add_argument("--ram-budget", type=parse_size_mib, metavar="SIZE",
                        help="RAM budget for the final check (MiB, or with a unit: 8GiB)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    prepare(Path(args.dst), revision=args.revision, keep_download=args.keep_download,
            ram_budget_mib=args.ram_budget, progress=not args.quiet)
    return 0
