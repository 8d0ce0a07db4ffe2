"""A local stand-in for the Hugging Face hub's file endpoints, for tests of `kvl prepare`.

Owns: a real HTTP server (127.0.0.1, random port) serving one directory as repo `repo_id` at one
commit, the way huggingface_hub's hf_hub_download talks to the hub:
HEAD/GET `/{repo_id}/resolve/{revision}/{filename}` with X-Repo-Commit, ETag, Content-Length,
Accept-Ranges and `Range: bytes=a-b` -> 206 + Content-Range; missing files and unknown revisions
answer 404 with the hub's X-Error-Code header. It can cut one transfer of a file off mid-body
(once) to exercise download resumption, and it records every request.
Does not own: anything in kvl/; nothing here is used outside tests.
"""
from __future__ import annotations

import hashlib
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class RequestLog:
    method: str
    path: str
    range: str | None


@dataclass
class HubStandin:
    root: Path
    repo_id: str
    commit: str
    aliases: tuple[str, ...] = ("main",)
    # file name -> number of body bytes after which the first full GET of it is cut off
    cut_once: dict[str, int] = field(default_factory=dict)
    requests: list[RequestLog] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._etags: dict[str, str] = {}
        handler = self._handler_class()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubStandin:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HubStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def etag(self, path: Path) -> str:
        key = str(path)
        with self._lock:
            if key not in self._etags:
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        digest.update(chunk)
                self._etags[key] = digest.hexdigest()
            return self._etags[key]

    def gets_of(self, filename: str) -> list[RequestLog]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + filename)]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # keep test output clean
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _error(self, status: int, code: str, message: str) -> None:
                data = message.encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _serve(self, body: bool) -> None:
                path = urllib.parse.urlsplit(self.path).path
                with hub._lock:
                    hub.requests.append(RequestLog(self.command, path, self.headers.get("Range")))
                m = _RESOLVE.match(path)
                if not m or urllib.parse.unquote(m["repo"]) != hub.repo_id:
                    self._error(404, "RepoNotFound", "Repository not found")
                    return
                rev = urllib.parse.unquote(m["rev"])
                if rev != hub.commit and rev not in hub.aliases:
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                    return
                filename = urllib.parse.unquote(m["file"])
                file = (hub.root / filename).resolve()
                if hub.root.resolve() not in file.parents or not file.is_file():
                    self._error(404, "EntryNotFound", f"{filename} does not exist at {rev}")
                    return
                size = file.stat().st_size
                start, end = 0, size - 1
                status = 200
                wanted = self.headers.get("Range")
                if wanted:
                    rm = _RANGE.match(wanted.strip())
                    if not rm or int(rm[1]) >= max(size, 1):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    start = int(rm[1])
                    end = min(int(rm[2]), size - 1) if rm[2] else size - 1
                    status = 206
                length = max(end - start + 1, 0)
                self.send_response(status)
                self.send_header("X-Repo-Commit", hub.commit)
                self.send_header("ETag", f'"{hub.etag(file)}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(length))
                self.send_header("Content-Type", "application/octet-stream")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if not body:
                    return
                cut_at = None
                with hub._lock:
                    if status == 200 and filename in hub.cut_once:
                        cut_at = hub.cut_once.pop(filename)
                with open(file, "rb") as f:
                    f.seek(start)
                    remaining = length if cut_at is None else min(cut_at, length)
                    while remaining > 0:
                        chunk = f.read(min(remaining, 1 << 20))
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        remaining -= len(chunk)
                if cut_at is not None:
                    # Drop the connection mid-body, as a flaky network would.
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)

        return Handler
